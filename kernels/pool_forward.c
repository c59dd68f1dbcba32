/* pool_forward.c -- adaptive pooling forward: every rank, op, layout and variant.
 *
 * Host defines: the shape (N_PLANES, N_CHANNELS, IN_T/H/W, OUT_T/H/W; see windows.h), CHANNELS_LAST,
 * the op (POOL_AVG or POOL_MAX), one VARIANT_* and that variant's tuning parameters (lower-case,
 * as Kernel Tuner names them).
 *
 *   avg:  out[o] = (1 / area(o)) * sum over window(o) of in
 *   max:  out[o] = max over window(o) of in, indices[o] = its position in the plane; NaN wins,
 *         ties and all -inf windows keep the first position in row-major window order.
 */

/* ---------------------------------------------------------------- the reduction */
typedef struct {
    acc_t value;
    index_t position; /* max: plane position of `value`; -1 before the first element */
} reduction_t;

DEVICE_FN reduction_t reduce_init(void)
{
    reduction_t r;
    r.value = (acc_t)0; /* max: replaced by the first element, since position < 0 */
    r.position = -1;
    return r;
}

#if POOL_MAX
/* Does (value, position) come before `r` in the max order?  Larger wins, NaN beats numbers,
 * equal values (or two NaNs) go to the earlier position. */
DEVICE_FN int max_precedes(acc_t value, index_t position, reduction_t r)
{
    if (r.position < 0)
        return 1;
    if (IS_NAN(value))
        return !IS_NAN(r.value) || position < r.position;
    if (IS_NAN(r.value))
        return 0;
    return value > r.value || (value == r.value && position < r.position);
}
#endif

#if POOL_MAX
/* Does `value`, visited after the element holding `best`, take over as the maximum?  Larger wins
 * and a NaN beats numbers; an equal value (or a second NaN) never does, which keeps the first
 * position.  Branch-free, so CPU compilers vectorise it. */
DEVICE_FN int max_takes_over(acc_t value, acc_t best)
{
    return (IS_NAN(value) & !IS_NAN(best)) | (value > best);
}
#endif

/* Add one element.  Every caller visits a window in increasing position order, so an element that
 * only ties the running maximum (or is a second NaN) never wins, and max_precedes reduces to a
 * branch-free test that CPU compilers vectorise across work-items. */
DEVICE_FN void reduce_step(reduction_t* r, acc_t value, index_t position)
{
#if POOL_AVG
    (void)position;
    r->value += value;
#else
    const int wins = (r->position < 0) | max_takes_over(value, r->value);
    r->value = wins ? value : r->value;
    r->position = wins ? position : r->position;
#endif
}

DEVICE_FN reduction_t reduce_merge(reduction_t a, reduction_t b)
{
#if POOL_AVG
    a.value += b.value;
#else
    if (b.position >= 0 && max_precedes(b.value, b.position, a))
        a = b;
#endif
    return a;
}

/* Write output `offset` of (ot, oh, ow) from its finished reduction. */
#if POOL_AVG
#define STORE_RESULT(offset, r, ot, oh, ow) STORE(out, offset, (r).value / (acc_t)window_area(ot, oh, ow))
#define INDICES_PARAM
#else
#define STORE_RESULT(offset, r, ot, oh, ow) \
    do { STORE(out, offset, (r).value); indices[offset] = (int64_t_)(r).position; } while (0)
#define INDICES_PARAM , GLOBAL int64_t_* RESTRICT indices
#endif

/* With one output column, every window row spans its whole input row, so in channels-first memory
 * the rows of a window follow each other: its (t) slabs are single runs of window_h * IN_W elements
 * (global pooling: one run per plane), long enough for row_lanes to pay. */
#define CONTIGUOUS_WINDOW_ROWS (OUT_W == 1 && !CHANNELS_LAST)

#if POOL_MAX
/* The larger of m and v where a NaN wins and stays: the value-only maximum of the two-pass max. */
DEVICE_FN acc_t max_or_nan(acc_t m, acc_t v)
{
    return (v > m || IS_NAN(v)) ? v : m;
}
#endif

/* The runs of one window that reduce_window_rows visits: its rows first_row, first_row + row_step,
 * ... (a row is one (t, h) pair), or with first_row = 0, row_step = 1 and CONTIGUOUS_WINDOW_ROWS
 * its whole (t) slabs.  Run `run` starts at plane position RUN_POSITION(run). */
#define WINDOW_RUNS                                                                                       \
    const index_t t_start = T_WINDOW_START(ot), t_end = T_WINDOW_END(ot);                                 \
    const index_t h_start = H_WINDOW_START(oh), h_end = H_WINDOW_END(oh);                                 \
    const index_t w_start = W_WINDOW_START(ow), w_end = W_WINDOW_END(ow);                                 \
    const index_t window_h = h_end - h_start;                                                             \
    const int slab_runs = CONTIGUOUS_WINDOW_ROWS && first_row == 0 && row_step == 1;                      \
    const index_t runs = slab_runs ? t_end - t_start : (t_end - t_start) * window_h;                      \
    const index_t run_length = slab_runs ? window_h * IN_W : w_end - w_start;                             \
    const index_t plane_base = PLANE_BASE(plane, IN_PLANE_SIZE)
#define RUN_POSITION(run)                                                                                 \
    (slab_runs ? PLANE_POSITION(t_start + (run), h_start, 0, IN_H, IN_W)                                  \
               : PLANE_POSITION(t_start + (run) / window_h, h_start + (run) % window_h, w_start, IN_H, IN_W))
#define RUN_ELEMENT(position, j) LOAD(in, plane_base + ((position) + (j)) * ELEMENT_STEP)

/* Reduce output (ot, oh, ow) of `plane` over the runs above.
 *
 * row_lanes > 1 keeps row_lanes independent partial results along each run (lane k takes elements
 * k, k + row_lanes, ...), so the steps no longer wait on each other and CPU compilers turn the lanes
 * into vector operations.  Average pooling sums into the lanes.  Max pooling takes two passes: the
 * maximum over value-only lanes (a NaN wins), then the first position, in window order, holding
 * it (or holding a NaN) -- the first-position rule without tracking positions in the hot loop. */
DEVICE_FN reduction_t reduce_window_rows(const GLOBAL scalar_t* RESTRICT in, index_t plane, index_t ot,
                                         index_t oh, index_t ow, index_t first_row, index_t row_step)
{
    WINDOW_RUNS;
    reduction_t r = reduce_init();
#if row_lanes > 1 && POOL_MAX
    if (first_row >= runs)
        return r;
    const acc_t first = RUN_ELEMENT(RUN_POSITION(first_row), 0);
    acc_t lanes[row_lanes];
    for (int k = 0; k < row_lanes; ++k)
        lanes[k] = first;
#elif row_lanes > 1
    acc_t lanes[row_lanes];
    for (int k = 0; k < row_lanes; ++k)
        lanes[k] = (acc_t)0;
#endif
    for (index_t run = first_row; run < runs; run += row_step) {
        const index_t position = RUN_POSITION(run);
        index_t j = 0;
#if row_lanes > 1
        for (; j + row_lanes <= run_length; j += row_lanes)
            for (int k = 0; k < row_lanes; ++k)
#if POOL_MAX
                lanes[k] = max_or_nan(lanes[k], RUN_ELEMENT(position, j + k));
#else
                lanes[k] += RUN_ELEMENT(position, j + k);
#endif
#endif
        for (; j < run_length; ++j)
            reduce_step(&r, RUN_ELEMENT(position, j), position + j);
    }
#if row_lanes > 1 && POOL_MAX
    acc_t best = r.position < 0 ? first : r.value;
    for (int k = 0; k < row_lanes; ++k)
        best = max_or_nan(best, lanes[k]);
    for (index_t run = first_row; run < runs; run += row_step) {
        const index_t position = RUN_POSITION(run);
        for (index_t j = 0; j < run_length; ++j) {
            const acc_t value = RUN_ELEMENT(position, j);
            if (value == best || (IS_NAN(value) && IS_NAN(best))) {
                r.value = value;
                r.position = position + j;
                return r;
            }
        }
    }
#elif row_lanes > 1
    for (int k = 0; k < row_lanes; ++k)
        r.value += lanes[k];
#endif
    return r;
}

/* Small windows (every window inside a box of MAX_WINDOW_T x MAX_WINDOW_H x MAX_WINDOW_W, at most
 * SMALL_BOX_LIMIT elements) are reduced by fully unrolled straight-line code over that box, with
 * the running result in plain scalars: the form that CPU compilers vectorise across work-items (PoCL
 * leaves the general run loops above scalar even when their trip counts are constants).  Along an
 * axis whose windows differ in size, a box tap past the window's end is clamped to its last element
 * (a load that is always in bounds): average pooling masks it out, and max pooling needs no mask,
 * since a repeat of an element visited just before it never takes over (the reduce_step rule). */
#define SMALL_WINDOW (MAX_WINDOW_T * MAX_WINDOW_H * MAX_WINDOW_W <= SMALL_BOX_LIMIT)
#if SMALL_WINDOW
DEVICE_FN reduction_t reduce_small_window(const GLOBAL scalar_t* RESTRICT in, index_t plane, index_t ot,
                                          index_t oh, index_t ow)
{
    const index_t t_start = T_WINDOW_START(ot), t_end = T_WINDOW_END(ot);
    const index_t h_start = H_WINDOW_START(oh), h_end = H_WINDOW_END(oh);
    const index_t w_start = W_WINDOW_START(ow), w_end = W_WINDOW_END(ow);
    const index_t plane_base = PLANE_BASE(plane, IN_PLANE_SIZE);
    const index_t corner = PLANE_POSITION(t_start, h_start, w_start, IN_H, IN_W);
    reduction_t r;
    r.value = LOAD(in, plane_base + corner * ELEMENT_STEP);
    r.position = corner;
#pragma unroll
    for (int k = 1; k < MAX_WINDOW_T * MAX_WINDOW_H * MAX_WINDOW_W; ++k) {
        const int kt = k / (MAX_WINDOW_H * MAX_WINDOW_W), kh = k / MAX_WINDOW_W % MAX_WINDOW_H, kw = k % MAX_WINDOW_W;
        const index_t p = PLANE_POSITION(BOX_TAP(t_start, t_end, kt, UNIFORM_T), BOX_TAP(h_start, h_end, kh, UNIFORM_H),
                                         BOX_TAP(w_start, w_end, kw, UNIFORM_W), IN_H, IN_W);
        const acc_t v = LOAD(in, plane_base + p * ELEMENT_STEP);
#if POOL_AVG
        const int inside = IN_WINDOW(t_start, t_end, kt, UNIFORM_T) & IN_WINDOW(h_start, h_end, kh, UNIFORM_H)
                         & IN_WINDOW(w_start, w_end, kw, UNIFORM_W);
        reduce_step(&r, inside ? v : (acc_t)0, p);
#else
        reduce_step(&r, v, p);
#endif
    }
    return r;
}
#endif

#if VARIANT_THREAD_PER_OUTPUT
/* Each work-item computes outputs_per_thread outputs, block_size_x apart in memory order, so that
 * neighbouring work-items always write neighbouring outputs (in channels-last memory they are
 * neighbouring channels, which also read neighbouring inputs).  The bounds check is compiled in only
 * when the grid runs past the last output (host define PARTIAL_LAST_GROUP): branch-free
 * work-items vectorise on CPUs.
 * Launch: ceil(OUT_NUMEL / (block_size_x * outputs_per_thread)) groups of block_size_x. */
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_PARAM)
{
    const index_t first = (index_t)GROUP_ID * (block_size_x * outputs_per_thread) + LOCAL_ID_X;
    for (int k = 0; k < outputs_per_thread; ++k) {
        const index_t o = first + (index_t)k * block_size_x;
#if PARTIAL_LAST_GROUP
        if (o >= OUT_NUMEL)
            return;
#endif
        index_t plane, ot, oh, ow;
        OUT_COORDS(o, plane, ot, oh, ow);
#if SMALL_WINDOW && row_lanes == 1
        const reduction_t r = reduce_small_window(in, plane, ot, oh, ow);
#else
        const reduction_t r = reduce_window_rows(in, plane, ot, oh, ow, 0, 1);
#endif
        STORE_RESULT(o, r, ot, oh, ow);
    }
}
#endif

#if VARIANT_THREAD_PER_ROW
/* The separable form, channels-first: each work-item computes one output row (plane, ot, oh).  It
 * reduces the input rows of the row's window column by column into a private row of column
 * partials -- a loop over whole input rows, contiguous and of constant length, which CPU compilers
 * vectorise within the work-item, without the scalar tails of windows' edges -- then each output
 * reduces its window's columns.  Max: a column partial is the column's first maximum (its rows
 * visited in order), and the window's first maximum in row-major order is the earliest of its
 * columns' first maxima, which reduce_merge picks.  The host bounds the private row's size; the
 * row loops stay loops ("unroll 1": vectorising does not need unrolling, and GPU compilers would
 * otherwise try to keep the whole row in registers).
 * Launch: ceil(N_PLANES * OUT_T * OUT_H / block_size_x) groups of block_size_x. */
#define OUT_ROWS ((index_t)N_PLANES * OUT_T * OUT_H)
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_PARAM)
{
    const index_t row = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
#if PARTIAL_LAST_GROUP
    if (row >= OUT_ROWS)
        return;
#endif
    const index_t oh = row % OUT_H, ot = row / OUT_H % OUT_T, plane = row / ((index_t)OUT_H * OUT_T);
    const index_t t_start = T_WINDOW_START(ot), h_start = H_WINDOW_START(oh);
    const index_t window_h = H_WINDOW_END(oh) - h_start;
    const index_t window_rows = (T_WINDOW_END(ot) - t_start) * window_h;
    const index_t plane_base = PLANE_BASE(plane, IN_PLANE_SIZE);
    acc_t column_value[IN_W];
#if POOL_MAX
    index_t column_position[IN_W];
#endif
    const index_t first_row = PLANE_POSITION(t_start, h_start, 0, IN_H, IN_W);
#pragma unroll 1
    for (int w = 0; w < IN_W; ++w) {
        column_value[w] = LOAD(in, plane_base + first_row + w);
#if POOL_MAX
        column_position[w] = first_row + w;
#endif
    }
    for (index_t k = 1; k < window_rows; ++k) {
        const index_t input_row = PLANE_POSITION(t_start + k / window_h, h_start + k % window_h, 0, IN_H, IN_W);
#pragma unroll 1
        for (int w = 0; w < IN_W; ++w) {
            const acc_t value = LOAD(in, plane_base + input_row + w);
#if POOL_AVG
            column_value[w] += value;
#else
            const int wins = max_takes_over(value, column_value[w]);
            column_value[w] = wins ? value : column_value[w];
            column_position[w] = wins ? input_row + w : column_position[w];
#endif
        }
    }
    for (index_t ow = 0; ow < OUT_W; ++ow) {
#if unrolled_columns
#if POOL_MAX
#error "unrolled_columns is for average pooling (the host refuses it for max pooling)"
#endif
        /* Average pooling over a window at most MAX_WINDOW_W columns wide: one straight-line sum
         * over that many partials, the taps past the window's end masked to 0 (never read), in
         * the loop's order from 0, so bit-identical to it.  A per-output loop of varying length
         * leaves CPU compilers scalar code; this form they turn into vector loads.  Faster on
         * some shapes and slower on others (README, Kernel variants), so it is tuned. */
        const index_t w_start = W_WINDOW_START(ow), w_end = W_WINDOW_END(ow);
        reduction_t sum = reduce_init();
#pragma unroll
        for (int k = 0; k < MAX_WINDOW_W; ++k)
            sum.value += IN_WINDOW(w_start, w_end, k, UNIFORM_W) ? column_value[w_start + k] : (acc_t)0;
        STORE_RESULT(OUT_OFFSET(plane, ot, oh, ow), sum, ot, oh, ow);
#else
        reduction_t r = reduce_init();
        for (index_t w = W_WINDOW_START(ow); w < W_WINDOW_END(ow); ++w) {
            reduction_t column = reduce_init();
            column.value = column_value[w];
#if POOL_MAX
            column.position = column_position[w];
#endif
            r = reduce_merge(r, column);
        }
        STORE_RESULT(OUT_OFFSET(plane, ot, oh, ow), r, ot, oh, ow);
#endif
    }
}
#endif

#if VARIANT_PLANE_REDUCE
/* Global pooling (every output size 1, channels-first: each output reduces one whole contiguous
 * plane): a work-group per plane.  Work-item j takes plane elements j, j + block_size_x, ... so
 * neighbouring work-items load neighbouring elements -- contiguous vector loads once CPU compilers
 * vectorise across work-items, with one accumulator per work-item kept in a vector register --
 * then work-item 0 merges the partial results in work-item order (max: the full first-position
 * rule, since the partials' positions interleave).  Needs block_size_x <= IN_PLANE_SIZE.
 * Launch: N_PLANES groups of block_size_x. */
#define FULL_CHUNKS (IN_PLANE_SIZE / block_size_x)
#define TAIL_ELEMENTS (IN_PLANE_SIZE % block_size_x)
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_PARAM)
{
    LOCAL_MEM acc_t partial_value[block_size_x];
#if POOL_MAX
    LOCAL_MEM index_t partial_position[block_size_x];
#endif
    const index_t plane = GROUP_ID;
    const index_t plane_base = PLANE_BASE(plane, IN_PLANE_SIZE);
    reduction_t r = reduce_init();
#pragma unroll
    for (int chunk = 0; chunk < FULL_CHUNKS; ++chunk) {
        const index_t position = (index_t)chunk * block_size_x + LOCAL_ID_X;
        reduce_step(&r, LOAD(in, plane_base + position), position);
    }
    if (TAIL_ELEMENTS != 0 && LOCAL_ID_X < TAIL_ELEMENTS) {
        const index_t position = (index_t)FULL_CHUNKS * block_size_x + LOCAL_ID_X;
        reduce_step(&r, LOAD(in, plane_base + position), position);
    }
    partial_value[LOCAL_ID_X] = r.value;
#if POOL_MAX
    partial_position[LOCAL_ID_X] = r.position;
#endif
    BARRIER();
    if (LOCAL_ID_X == 0) {
        for (int k = 1; k < block_size_x; ++k) {
            reduction_t partial;
            partial.value = partial_value[k];
#if POOL_MAX
            partial.position = partial_position[k];
#endif
            r = reduce_merge(r, partial);
        }
        STORE_RESULT(plane, r, 0, 0, 0);
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
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_PARAM)
{
    const index_t row = GROUP_ID;
    const index_t oh = row % OUT_H;
    const index_t ot = row / OUT_H % OUT_T;
    const index_t plane = row / ((index_t)OUT_H * OUT_T);
    const int lane = LOCAL_ID_X % threads_per_output;
    const int lane_group = LOCAL_ID_X / threads_per_output;
#if threads_per_output > 1
    LOCAL_MEM reduction_t partial[block_size_x];
#endif
    /* Every work-item runs the same number of iterations, so the barriers below are uniform. */
    for (index_t ow0 = 0; ow0 < OUT_W; ow0 += LANE_GROUPS) {
        const index_t ow = ow0 + lane_group;
        reduction_t r = reduce_init();
        if (ow < OUT_W)
            r = reduce_window_rows(in, plane, ot, oh, ow, lane, threads_per_output);
#if threads_per_output > 1
        partial[LOCAL_ID_X] = r;
        BARRIER();
        for (int stride = threads_per_output / 2; stride > 0; stride /= 2) {
            if (lane < stride)
                partial[LOCAL_ID_X] = reduce_merge(partial[LOCAL_ID_X], partial[LOCAL_ID_X + stride]);
            BARRIER();
        }
        r = partial[LOCAL_ID_X];
        BARRIER(); /* partial[] is reused by the next iteration */
#endif
        if (lane == 0 && ow < OUT_W)
            STORE_RESULT(OUT_OFFSET(plane, ot, oh, ow), r, ot, oh, ow);
    }
}
#endif

#if VARIANT_SMEM_TILED
/* Tiles of outputs (tiles.h): the stage holds the input box under the tile's windows, so
 * overlapping windows read global memory once; each work-item then reduces its outputs from it. */
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_PARAM)
{
    LOCAL_MEM acc_t stage[STAGE_SIZE];
    const tile_t tile = tile_of_group(GROUP_ID);
    const index_t plane = tile.plane, ot = tile.t;
    const index_t t_start = T_WINDOW_START(ot), t_end = T_WINDOW_END(ot);
    const index_t h_start = H_WINDOW_START(tile.h0), h_end = H_WINDOW_END(tile.h_last);
    const index_t w_start = W_WINDOW_START(tile.w0), w_end = W_WINDOW_END(tile.w_last);
    for (int s = TILE_THREAD; s < STAGE_SIZE; s += TILE_THREADS) {
        STAGE_COORDS(s, st, sh, sw);
        if (st < t_end - t_start && sh < h_end - h_start && sw < w_end - w_start)
            stage[s] = LOAD(in, IN_OFFSET(plane, t_start + st, h_start + sh, w_start + sw));
    }
    BARRIER();

    for (int ty = 0; ty < tile_y; ++ty) {
        const index_t oh = TILE_ROW(tile, ty);
        for (int tx = 0; tx < tile_x; ++tx) {
            const index_t ow = TILE_COL(tile, tx);
            if (oh >= OUT_H || ow >= OUT_W)
                continue;
            const index_t h0 = H_WINDOW_START(oh), h1 = H_WINDOW_END(oh);
            const index_t w0 = W_WINDOW_START(ow), w1 = W_WINDOW_END(ow);
            reduction_t r = reduce_init();
            for (index_t t = t_start; t < t_end; ++t)
                for (index_t h = h0; h < h1; ++h)
                    for (index_t w = w0; w < w1; ++w)
                        reduce_step(&r, stage[STAGE_SLOT(t - t_start, h - h_start, w - w_start)],
                                    PLANE_POSITION(t, h, w, IN_H, IN_W));
            STORE_RESULT(OUT_OFFSET(plane, ot, oh, ow), r, ot, oh, ow);
        }
    }
}
#endif

#if VARIANT_CHANNELS_VECTOR
/* Channels-last only: a work-item computes vector_width neighbouring channels of one output
 * position, so every load and store of its inner loop touches vector_width contiguous elements
 * (vectorised on CPUs, coalesced on GPUs).
 * Launch: ceil(N * OUT_PLANE_SIZE * CHANNEL_BLOCKS / block_size_x) groups of block_size_x. */
#define CHANNEL_BLOCKS ((N_CHANNELS + vector_width - 1) / vector_width)
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_PARAM)
{
    const index_t item = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (item >= (index_t)(N_PLANES / N_CHANNELS) * OUT_PLANE_SIZE * CHANNEL_BLOCKS)
        return;
    const index_t c0 = item % CHANNEL_BLOCKS * vector_width;
    const index_t position = item / CHANNEL_BLOCKS; /* n * OUT_PLANE_SIZE + (ot, oh, ow) */
    const index_t ow = position % OUT_W, oh = position / OUT_W % OUT_H, ot = position / ((index_t)OUT_W * OUT_H) % OUT_T;
    const index_t n = position / OUT_PLANE_SIZE;
    const index_t in_base = n * IN_PLANE_SIZE * N_CHANNELS + c0;
    const index_t out_base = position * N_CHANNELS + c0;
    const index_t t0 = T_WINDOW_START(ot), t1 = T_WINDOW_END(ot);
    const index_t h0 = H_WINDOW_START(oh), h1 = H_WINDOW_END(oh);
    const index_t w0 = W_WINDOW_START(ow), w1 = W_WINDOW_END(ow);
    reduction_t r[vector_width];
    for (int k = 0; k < vector_width; ++k)
        r[k] = reduce_init();
    for (index_t t = t0; t < t1; ++t)
        for (index_t h = h0; h < h1; ++h)
            for (index_t w = w0; w < w1; ++w) {
                const index_t pos = PLANE_POSITION(t, h, w, IN_H, IN_W);
                for (int k = 0; k < vector_width; ++k)
                    if (N_CHANNELS % vector_width == 0 || c0 + k < N_CHANNELS)
                        reduce_step(&r[k], LOAD(in, in_base + pos * N_CHANNELS + k), pos);
            }
    for (int k = 0; k < vector_width; ++k)
        if (N_CHANNELS % vector_width == 0 || c0 + k < N_CHANNELS)
            STORE_RESULT(out_base + k, r[k], ot, oh, ow);
}
#endif
