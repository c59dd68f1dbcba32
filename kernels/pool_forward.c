/* pool_forward.c -- adaptive pooling forward, every rank, every variant.
 *
 * Host defines: N_PLANES, IN_T, IN_H, IN_W, OUT_T, OUT_H, OUT_W (see windows.h), POOL_AVG, one of
 * VARIANT_THREAD_PER_OUTPUT / VARIANT_BLOCK_PER_ROW / VARIANT_SMEM_TILED and that variant's tuning
 * parameters (lower-case, as Kernel Tuner names them).
 *
 * The reduction over a window is spelled through REDUCE_* macros so that every variant reads as
 * "visit the window, then finish":  out[o] = (1 / area(o)) * sum over the window of in.
 */

#if POOL_AVG
#define REDUCE_INIT(acc) acc_t acc = (acc_t)0
#define REDUCE_STEP(acc, value) acc += (value)
#define REDUCE_MERGE(acc, other) acc += (other)
#define REDUCE_FINISH(acc, area) ((acc) / (acc_t)(area))
#else
#error "pool_forward.c: no POOL_* op define given"
#endif

/* Reduce output (ot, oh, ow) of the plane starting at `in`, visiting window rows
 * first_row, first_row + row_step, ... (a row is one (t, h) pair of the window).
 * With first_row = 0, row_step = 1 this is the whole window. */
DEVICE_FN acc_t reduce_window_rows(const GLOBAL scalar_t* RESTRICT in, index_t ot, index_t oh, index_t ow,
                                   int first_row, int row_step)
{
    const index_t t_start = WINDOW_START(ot, IN_T, OUT_T), t_end = WINDOW_END(ot, IN_T, OUT_T);
    const index_t h_start = WINDOW_START(oh, IN_H, OUT_H), h_end = WINDOW_END(oh, IN_H, OUT_H);
    const index_t w_start = WINDOW_START(ow, IN_W, OUT_W), w_end = WINDOW_END(ow, IN_W, OUT_W);
    const int window_h = (int)(h_end - h_start);
    const int window_rows = (int)(t_end - t_start) * window_h;
    REDUCE_INIT(acc);
    for (int row = first_row; row < window_rows; row += row_step) {
        const index_t t = t_start + row / window_h;
        const index_t h = h_start + row % window_h;
        const GLOBAL scalar_t* in_row = in + IN_OFFSET(t, h, 0);
        for (index_t w = w_start; w < w_end; ++w)
            REDUCE_STEP(acc, LOAD(in_row, w));
    }
    return acc;
}

DEVICE_FN index_t window_area(index_t ot, index_t oh, index_t ow)
{
    return (WINDOW_END(ot, IN_T, OUT_T) - WINDOW_START(ot, IN_T, OUT_T))
         * (WINDOW_END(oh, IN_H, OUT_H) - WINDOW_START(oh, IN_H, OUT_H))
         * (WINDOW_END(ow, IN_W, OUT_W) - WINDOW_START(ow, IN_W, OUT_W));
}

#if VARIANT_THREAD_PER_OUTPUT
/* Each work-item computes outputs_per_thread outputs, block_size_x apart, so that neighbouring
 * work-items always write neighbouring outputs.  Launch: ceil(OUT_NUMEL / (block_size_x *
 * outputs_per_thread)) groups of block_size_x. */
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out)
{
    const index_t first = (index_t)GROUP_ID * (block_size_x * outputs_per_thread) + LOCAL_ID_X;
    for (int k = 0; k < outputs_per_thread; ++k) {
        const index_t o = first + (index_t)k * block_size_x;
        if (o >= OUT_NUMEL)
            return;
        const index_t ow = o % OUT_W;
        const index_t oh = (o / OUT_W) % OUT_H;
        const index_t ot = (o / ((index_t)OUT_W * OUT_H)) % OUT_T;
        const index_t plane = o / OUT_PLANE_SIZE;
        const acc_t acc = reduce_window_rows(in + plane * IN_PLANE_SIZE, ot, oh, ow, 0, 1);
        STORE(out, o, REDUCE_FINISH(acc, window_area(ot, oh, ow)));
    }
}
#endif

#if VARIANT_BLOCK_PER_ROW
/* One work-group per output row (plane, ot, oh): the OUT_W outputs of the row are shared among
 * block_size_x / threads_per_output lane groups, and the threads_per_output lanes of a group split
 * the window's rows, then combine their partial results by a tree reduction in local memory.
 * Large windows (global pooling) get many lanes; small ones get threads_per_output = 1.
 * Launch: N_PLANES * OUT_T * OUT_H groups of block_size_x. */
#define LANE_GROUPS (block_size_x / threads_per_output)
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out)
{
    const index_t row = GROUP_ID;
    const index_t oh = row % OUT_H;
    const index_t ot = (row / OUT_H) % OUT_T;
    const index_t plane = row / ((index_t)OUT_H * OUT_T);
    const GLOBAL scalar_t* plane_in = in + plane * IN_PLANE_SIZE;
    const int lane = LOCAL_ID_X % threads_per_output;
    const int lane_group = LOCAL_ID_X / threads_per_output;
#if threads_per_output > 1
    LOCAL_MEM acc_t partial[block_size_x];
#endif
    /* Every work-item runs the same number of iterations, so the barriers below are uniform. */
    for (index_t ow0 = 0; ow0 < OUT_W; ow0 += LANE_GROUPS) {
        const index_t ow = ow0 + lane_group;
        acc_t acc = (acc_t)0;
        if (ow < OUT_W)
            acc = reduce_window_rows(plane_in, ot, oh, ow, lane, threads_per_output);
#if threads_per_output > 1
        partial[LOCAL_ID_X] = acc;
        BARRIER();
        for (int stride = threads_per_output / 2; stride > 0; stride /= 2) {
            if (lane < stride)
                REDUCE_MERGE(partial[LOCAL_ID_X], partial[LOCAL_ID_X + stride]);
            BARRIER();
        }
        acc = partial[LOCAL_ID_X];
        BARRIER(); /* partial[] is reused by the next iteration */
#endif
        if (lane == 0 && ow < OUT_W)
            STORE(out, OUT_OFFSET(plane, ot, oh, ow), REDUCE_FINISH(acc, window_area(ot, oh, ow)));
    }
}
#endif

#if VARIANT_SMEM_TILED
/* A work-group computes a tile of TILE_H x TILE_W outputs of one (plane, ot) slice.  It first
 * stages the input rectangle that the tile's windows cover into local memory -- overlapping
 * windows then read global memory once -- and then each work-item reduces tile_y x tile_x outputs
 * from local memory.  STAGE_T/H/W (host-computed) bound the staged extent over all tiles.
 * Launch: N_PLANES * OUT_T * TILES_H * TILES_W groups of block_size_x x block_size_y. */
#define TILE_W (block_size_x * tile_x)
#define TILE_H (block_size_y * tile_y)
#define TILES_W ((OUT_W + TILE_W - 1) / TILE_W)
#define TILES_H ((OUT_H + TILE_H - 1) / TILE_H)
#define STAGE_SIZE (STAGE_T * STAGE_H * STAGE_W)
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out)
{
    LOCAL_MEM acc_t stage[STAGE_SIZE];
    const index_t tile = GROUP_ID;
    const index_t oh0 = (tile / TILES_W) % TILES_H * TILE_H;
    const index_t ow0 = tile % TILES_W * TILE_W;
    const index_t ot = (tile / ((index_t)TILES_W * TILES_H)) % OUT_T;
    const index_t plane = tile / ((index_t)TILES_W * TILES_H * OUT_T);
    const index_t oh_last = (oh0 + TILE_H < OUT_H ? oh0 + TILE_H : OUT_H) - 1;
    const index_t ow_last = (ow0 + TILE_W < OUT_W ? ow0 + TILE_W : OUT_W) - 1;

    /* The staged rectangle: the union of the tile's windows. */
    const index_t t_start = WINDOW_START(ot, IN_T, OUT_T), t_end = WINDOW_END(ot, IN_T, OUT_T);
    const index_t h_start = WINDOW_START(oh0, IN_H, OUT_H), h_end = WINDOW_END(oh_last, IN_H, OUT_H);
    const index_t w_start = WINDOW_START(ow0, IN_W, OUT_W), w_end = WINDOW_END(ow_last, IN_W, OUT_W);
    const GLOBAL scalar_t* plane_in = in + plane * IN_PLANE_SIZE;
    const int thread = LOCAL_ID_Y * block_size_x + LOCAL_ID_X;
    for (int i = thread; i < STAGE_SIZE; i += block_size_x * block_size_y) {
        const index_t st = i / (STAGE_H * STAGE_W), sh = i / STAGE_W % STAGE_H, sw = i % STAGE_W;
        if (st < t_end - t_start && sh < h_end - h_start && sw < w_end - w_start)
            stage[i] = LOAD(plane_in, IN_OFFSET(t_start + st, h_start + sh, w_start + sw));
    }
    BARRIER();

    for (int ty = 0; ty < tile_y; ++ty) {
        const index_t oh = oh0 + LOCAL_ID_Y + ty * block_size_y;
        for (int tx = 0; tx < tile_x; ++tx) {
            const index_t ow = ow0 + LOCAL_ID_X + tx * block_size_x;
            if (oh >= OUT_H || ow >= OUT_W)
                continue;
            const index_t h0 = WINDOW_START(oh, IN_H, OUT_H) - h_start, h1 = WINDOW_END(oh, IN_H, OUT_H) - h_start;
            const index_t w0 = WINDOW_START(ow, IN_W, OUT_W) - w_start, w1 = WINDOW_END(ow, IN_W, OUT_W) - w_start;
            REDUCE_INIT(acc);
            for (index_t st = 0; st < t_end - t_start; ++st)
                for (index_t sh = h0; sh < h1; ++sh)
                    for (index_t sw = w0; sw < w1; ++sw)
                        REDUCE_STEP(acc, stage[(st * STAGE_H + sh) * STAGE_W + sw]);
            STORE(out, OUT_OFFSET(plane, ot, oh, ow), REDUCE_FINISH(acc, window_area(ot, oh, ow)));
        }
    }
}
#endif
