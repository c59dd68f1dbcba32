/* pool_backward.c -- adaptive pooling backward as a gather: every rank, op, layout and variant.
 *
 * Each work-item owns input gradients and sums the contributions of exactly the outputs whose
 * windows hold its input, found with the inverse window formula (windows.h).  No atomics: every
 * grad_in element is written once, by one work-item, in a fixed order -- results are
 * bit-identical across runs (PyTorch's CUDA backward passes scatter with atomics instead).
 *
 *   avg:  grad_in[i] = sum over outputs o with i in window(o) of grad_out[o] / area(o)
 *   max:  grad_in[i] = sum over outputs o with i in window(o) and indices[o] == i of grad_out[o]
 *
 * Host defines: as pool_forward.c (shape, CHANNELS_LAST, POOL_AVG or POOL_MAX, one VARIANT_* and
 * its tuning parameters).
 */

#if POOL_AVG
#define INDICES_PARAM
#else
#define INDICES_PARAM const GLOBAL int64_t_* RESTRICT indices,
#endif

/* Contribution of output (plane, ot, oh, ow), held at `offset`, to the input at plane position
 * `position`. */
#if POOL_AVG
#define CONTRIBUTION(grad, offset, ot, oh, ow, position) ((void)(position), (grad) / (acc_t)window_area(ot, oh, ow))
#else
#define CONTRIBUTION(grad, offset, ot, oh, ow, position) \
    (indices[offset] == (int64_t_)(position) ? (grad) : (acc_t)0)
#endif

#define INVERSE_BOX_T MAX_INVERSE_WINDOW_T
#define INVERSE_BOX_H MAX_INVERSE_WINDOW_H
#define INVERSE_BOX_W MAX_INVERSE_WINDOW_W
#define SMALL_INVERSE_WINDOW (INVERSE_BOX_T * INVERSE_BOX_H * INVERSE_BOX_W <= SMALL_BOX_LIMIT)

#if VARIANT_THREAD_PER_INPUT
/* Each work-item computes inputs_per_thread input gradients, block_size_x apart in memory order.
 * When every inverse window fits a box of at most SMALL_BOX_LIMIT outputs (windows.h), the gather
 * is unrolled straight-line code over that box, otherwise loops (which vanish along axes whose
 * windows do not overlap).  The host defines PARTIAL_LAST_GROUP when the grid runs past the last
 * input; without that bounds check the work-items are branch-free, which CPU compilers vectorise.
 * Launch: ceil(IN_NUMEL / (block_size_x * inputs_per_thread)) groups of block_size_x. */
KERNEL void pool_backward(const GLOBAL scalar_t* RESTRICT grad_out, INDICES_PARAM GLOBAL scalar_t* RESTRICT grad_in)
{
    const index_t first = (index_t)GROUP_ID * (block_size_x * inputs_per_thread) + LOCAL_ID_X;
    for (int k = 0; k < inputs_per_thread; ++k) {
        const index_t i = first + (index_t)k * block_size_x;
#if PARTIAL_LAST_GROUP
        if (i >= IN_NUMEL)
            return;
#endif
        index_t plane, t, h, w;
        IN_COORDS(i, plane, t, h, w);
        const index_t position = PLANE_POSITION(t, h, w, IN_H, IN_W);
        const index_t ot0 = WINDOW_START(t, OUT_T, IN_T), ot1 = WINDOW_END(t, OUT_T, IN_T);
        const index_t oh0 = WINDOW_START(h, OUT_H, IN_H), oh1 = WINDOW_END(h, OUT_H, IN_H);
        const index_t ow0 = WINDOW_START(w, OUT_W, IN_W), ow1 = WINDOW_END(w, OUT_W, IN_W);
        acc_t sum = (acc_t)0;
#if SMALL_INVERSE_WINDOW
        /* Straight-line code over the box, in the loops' order; a repeat adds +0, which leaves every
         * sum bit-identical to the loops' (a sum that starts at +0 never becomes -0). */
#pragma unroll
        for (int k = 0; k < INVERSE_BOX_T * INVERSE_BOX_H * INVERSE_BOX_W; ++k) {
            const int kt = k / (INVERSE_BOX_H * INVERSE_BOX_W), kh = k / INVERSE_BOX_W % INVERSE_BOX_H, kw = k % INVERSE_BOX_W;
            const index_t ot = BOX_TAP(ot0, ot1, kt, INVERSE_BOX_T == 1), oh = BOX_TAP(oh0, oh1, kh, INVERSE_BOX_H == 1),
                          ow = BOX_TAP(ow0, ow1, kw, INVERSE_BOX_W == 1);
            const index_t o = OUT_OFFSET(plane, ot, oh, ow);
            const acc_t term = CONTRIBUTION(LOAD(grad_out, o), o, ot, oh, ow, position);
            const int real = IN_WINDOW(ot0, ot1, kt, INVERSE_BOX_T == 1) & IN_WINDOW(oh0, oh1, kh, INVERSE_BOX_H == 1)
                           & IN_WINDOW(ow0, ow1, kw, INVERSE_BOX_W == 1);
            sum += real ? term : (acc_t)0;
        }
#else
        for (index_t ot = ot0; ot < ot0 + INVERSE_COUNT(T, ot0, ot1); ++ot)
            for (index_t oh = oh0; oh < oh0 + INVERSE_COUNT(H, oh0, oh1); ++oh)
                for (index_t ow = ow0; ow < ow0 + INVERSE_COUNT(W, ow0, ow1); ++ow) {
                    const index_t o = OUT_OFFSET(plane, ot, oh, ow);
                    sum += CONTRIBUTION(LOAD(grad_out, o), o, ot, oh, ow, position);
                }
#endif
        STORE(grad_in, i, sum);
    }
}
#endif

#if VARIANT_SMEM_TILED
/* Tiles of input gradients (tiles.h): the stage holds the gradients of every output whose window
 * touches the tile -- already divided by their window area (avg) or paired with their index
 * (max) -- and each work-item then gathers its inputs from it.  Pays off when windows overlap or
 * outputs outnumber inputs (upsampling). */
KERNEL void pool_backward(const GLOBAL scalar_t* RESTRICT grad_out, INDICES_PARAM GLOBAL scalar_t* RESTRICT grad_in)
{
    LOCAL_MEM acc_t stage[STAGE_SIZE];
#if POOL_MAX
    LOCAL_MEM int64_t_ stage_index[STAGE_SIZE];
#endif
    const tile_t tile = tile_of_group(GROUP_ID);
    const index_t plane = tile.plane, t = tile.t;
    const index_t ot_start = WINDOW_START(t, OUT_T, IN_T), ot_end = WINDOW_END(t, OUT_T, IN_T);
    const index_t oh_start = WINDOW_START(tile.h0, OUT_H, IN_H), oh_end = WINDOW_END(tile.h_last, OUT_H, IN_H);
    const index_t ow_start = WINDOW_START(tile.w0, OUT_W, IN_W), ow_end = WINDOW_END(tile.w_last, OUT_W, IN_W);
    for (int s = TILE_THREAD; s < STAGE_SIZE; s += TILE_THREADS) {
        STAGE_COORDS(s, st, sh, sw);
        if (st < ot_end - ot_start && sh < oh_end - oh_start && sw < ow_end - ow_start) {
            const index_t ot = ot_start + st, oh = oh_start + sh, ow = ow_start + sw;
            const index_t o = OUT_OFFSET(plane, ot, oh, ow);
#if POOL_AVG
            stage[s] = LOAD(grad_out, o) / (acc_t)window_area(ot, oh, ow);
#else
            stage[s] = LOAD(grad_out, o);
            stage_index[s] = indices[o];
#endif
        }
    }
    BARRIER();

    for (int ty = 0; ty < tile_y; ++ty) {
        const index_t h = TILE_ROW(tile, ty);
        for (int tx = 0; tx < tile_x; ++tx) {
            const index_t w = TILE_COL(tile, tx);
            if (h >= IN_H || w >= IN_W)
                continue;
            const index_t position = PLANE_POSITION(t, h, w, IN_H, IN_W);
            const index_t oh0 = WINDOW_START(h, OUT_H, IN_H), oh1 = WINDOW_END(h, OUT_H, IN_H);
            const index_t ow0 = WINDOW_START(w, OUT_W, IN_W), ow1 = WINDOW_END(w, OUT_W, IN_W);
            acc_t sum = (acc_t)0;
            for (index_t ot = ot_start; ot < ot_start + INVERSE_COUNT(T, ot_start, ot_end); ++ot)
                for (index_t oh = oh0; oh < oh0 + INVERSE_COUNT(H, oh0, oh1); ++oh)
                    for (index_t ow = ow0; ow < ow0 + INVERSE_COUNT(W, ow0, ow1); ++ow) {
                        const index_t s = STAGE_SLOT(ot - ot_start, oh - oh_start, ow - ow_start);
#if POOL_AVG
                        (void)position;
                        sum += stage[s];
#else
                        sum += stage_index[s] == (int64_t_)position ? stage[s] : (acc_t)0;
#endif
                    }
            STORE(grad_in, IN_OFFSET(plane, t, h, w), sum);
        }
    }
}
#endif

#if VARIANT_THREAD_PER_ROW
/* Average pooling, channels-first, no input in more than two windows along W (the host checks):
 * each work-item writes one input row (plane, t, h), left to right, each element once.  The
 * row's inputs are pooled by the outputs ot in [ot0, ot1), oh in [oh0, oh1) and, along W, by one
 * output column ow or, where neighbouring windows overlap, by ow and ow + 1.  Walking the columns
 * in order, the run of inputs only ow pools all get one value -- the sum over (ot, oh) of ow's
 * terms, computed once and stored along the run (contiguous stores) -- and the inputs ow shares
 * with ow + 1 get both columns' terms.  Every sum starts from 0 and adds its terms in the order
 * the gather variants do (ot, oh, then ow), so the results are bit-identical to theirs.
 * Launch: ceil(N_PLANES * IN_T * IN_H / block_size_x) groups of block_size_x. */
#define IN_ROWS ((index_t)N_PLANES * IN_T * IN_H)
#define ROW_TERM(ot, oh, ow) \
    CONTRIBUTION(LOAD(grad_out, OUT_OFFSET(plane, ot, oh, ow)), OUT_OFFSET(plane, ot, oh, ow), ot, oh, ow, 0)
KERNEL void pool_backward(const GLOBAL scalar_t* RESTRICT grad_out, INDICES_PARAM GLOBAL scalar_t* RESTRICT grad_in)
{
    const index_t row = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
#if PARTIAL_LAST_GROUP
    if (row >= IN_ROWS)
        return;
#endif
    const index_t h = row % IN_H, t = row / IN_H % IN_T, plane = row / ((index_t)IN_H * IN_T);
    const index_t ot0 = WINDOW_START(t, OUT_T, IN_T), ot1 = ot0 + INVERSE_COUNT(T, ot0, WINDOW_END(t, OUT_T, IN_T));
    const index_t oh0 = WINDOW_START(h, OUT_H, IN_H), oh1 = oh0 + INVERSE_COUNT(H, oh0, WINDOW_END(h, OUT_H, IN_H));
    const index_t base = IN_OFFSET(plane, t, h, 0);
    index_t w = 0;
    for (index_t ow = 0; ow < OUT_W; ++ow) {
        const index_t window_end = W_WINDOW_END(ow);
        const index_t run_end = ow + 1 < OUT_W && W_WINDOW_START(ow + 1) < window_end ? W_WINDOW_START(ow + 1) : window_end;
        acc_t run_value = (acc_t)0;
        for (index_t ot = ot0; ot < ot1; ++ot)
            for (index_t oh = oh0; oh < oh1; ++oh)
                run_value += ROW_TERM(ot, oh, ow);
        for (; w < run_end; ++w)
            STORE(grad_in, base + w, run_value);
        for (; w < window_end; ++w) { /* pooled by ow and ow + 1 */
            acc_t sum = (acc_t)0;
            for (index_t ot = ot0; ot < ot1; ++ot)
                for (index_t oh = oh0; oh < oh1; ++oh) {
                    sum += ROW_TERM(ot, oh, ow);
                    sum += ROW_TERM(ot, oh, ow + 1);
                }
            STORE(grad_in, base + w, sum);
        }
    }
}
#endif

#if VARIANT_PLANE_SCATTER
/* One work-item per plane scatters its outputs' gradients into its own input plane, outputs in
 * row-major order: every input receives its terms in the order the gather variants sum them, from
 * the same starting 0, so the results are bit-identical to theirs -- and no two work-items share an
 * element, so no atomics.  Each output's term (avg: gradient / area) is computed once rather than
 * once per input; the innermost loop walks a window row, contiguous in channels-first memory, which
 * CPU compilers vectorise.  The plane is accumulated in place, so the host allows it only where
 * storage and accumulator types agree (float32, float64).
 * Launch: ceil(N_PLANES / block_size_x) groups of block_size_x. */
KERNEL void pool_backward(const GLOBAL scalar_t* RESTRICT grad_out, INDICES_PARAM GLOBAL scalar_t* RESTRICT grad_in)
{
    const index_t plane = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (plane >= N_PLANES)
        return;
    const index_t base = PLANE_BASE(plane, IN_PLANE_SIZE);
    for (index_t p = 0; p < IN_PLANE_SIZE; ++p)
        grad_in[base + p * ELEMENT_STEP] = (acc_t)0;
    for (index_t ot = 0; ot < OUT_T; ++ot)
        for (index_t oh = 0; oh < OUT_H; ++oh)
            for (index_t ow = 0; ow < OUT_W; ++ow) {
                const index_t o = OUT_OFFSET(plane, ot, oh, ow);
#if POOL_AVG
                const acc_t term = LOAD(grad_out, o) / (acc_t)window_area(ot, oh, ow);
                const index_t w_start = W_WINDOW_START(ow), w_end = W_WINDOW_END(ow);
                for (index_t t = T_WINDOW_START(ot); t < T_WINDOW_END(ot); ++t)
                    for (index_t h = H_WINDOW_START(oh); h < H_WINDOW_END(oh); ++h) {
                        const index_t row = IN_OFFSET(plane, t, h, 0);
                        for (index_t w = w_start; w < w_end; ++w)
                            grad_in[row + w * ELEMENT_STEP] += term;
                    }
#else
                grad_in[base + (index_t)indices[o] * ELEMENT_STEP] += LOAD(grad_out, o);
#endif
            }
}
#endif
