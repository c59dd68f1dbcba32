/* thread_per_input -- backward gather: each work-item computes inputs_per_thread input gradients,
 * block_size_x apart in memory order, each the sum of the terms of the outputs whose windows hold it
 * (its inverse windows [first, end) along each axis, windows.h).
 *
 * When every inverse window fits a box of at most SMALL_BOX_LIMIT outputs (windows.h), the gather
 * is unrolled straight-line code over that box, otherwise loops (which vanish along axes whose
 * windows do not overlap).  Branch-free work-items vectorise on CPUs, so only where the grid can run
 * past the last input (host define PARTIAL_LAST_GROUP: one sample's inputs do not fill whole
 * work-groups, pool_tuner/variants.py) is there a bounds check, and only in the last work-group:
 * the condition is the same for a whole group, so compilers keep the other groups' code
 * branch-free.
 * Launch: ceil(IN_NUMEL / (block_size_x * inputs_per_thread)) groups of block_size_x. */
#define INVERSE_BOX_T MAX_INVERSE_WINDOW_T
#define INVERSE_BOX_H MAX_INVERSE_WINDOW_H
#define INVERSE_BOX_W MAX_INVERSE_WINDOW_W
#define SMALL_INVERSE_WINDOW (INVERSE_BOX_T * INVERSE_BOX_H * INVERSE_BOX_W <= SMALL_BOX_LIMIT)
KERNEL void pool_backward(const GLOBAL scalar_t* RESTRICT grad_out, INDICES_IN GLOBAL scalar_t* RESTRICT grad_in PLANES_PARAM)
{
    const index_t first = (index_t)GROUP_ID * (block_size_x * inputs_per_thread) + LOCAL_ID_X;
    const int whole_group = !PARTIAL_LAST_GROUP || (GROUP_ID + 1) * (block_size_x * inputs_per_thread) <= IN_NUMEL;
    for (int k = 0; k < inputs_per_thread; ++k) {
        const index_t i = first + (index_t)k * block_size_x;
        if (!whole_group && i >= IN_NUMEL)
            return;
        index_t plane, t, h, w;
        IN_COORDS(i, plane, t, h, w);
        const index_t position = PLANE_POSITION(t, h, w, IN_H, IN_W);
        const index_t ot_start = WINDOW_START(t, OUT_T, IN_T), ot_end = WINDOW_END(t, OUT_T, IN_T);
        const index_t oh_start = WINDOW_START(h, OUT_H, IN_H), oh_end = WINDOW_END(h, OUT_H, IN_H);
        const index_t ow_start = WINDOW_START(w, OUT_W, IN_W), ow_end = WINDOW_END(w, OUT_W, IN_W);
        acc_t sum = (acc_t)0;
#if SMALL_INVERSE_WINDOW
        /* Straight-line code over the box, in the loops' order; a repeat adds +0, which leaves every
         * sum bit-identical to the loops' (a sum that starts at +0 never becomes -0). */
#pragma unroll
        for (int k = 0; k < INVERSE_BOX_T * INVERSE_BOX_H * INVERSE_BOX_W; ++k) {
            const int kt = k / (INVERSE_BOX_H * INVERSE_BOX_W), kh = k / INVERSE_BOX_W % INVERSE_BOX_H, kw = k % INVERSE_BOX_W;
            const index_t ot = BOX_TAP(ot_start, ot_end, kt, INVERSE_BOX_T == 1),
                          oh = BOX_TAP(oh_start, oh_end, kh, INVERSE_BOX_H == 1),
                          ow = BOX_TAP(ow_start, ow_end, kw, INVERSE_BOX_W == 1);
            const index_t o = OUT_OFFSET(plane, ot, oh, ow);
            const acc_t term = GRADIENT_TERM(LOAD(grad_out, o), o, ot, oh, ow, position);
            const int real = IN_WINDOW(ot_start, ot_end, kt, INVERSE_BOX_T == 1)
                           & IN_WINDOW(oh_start, oh_end, kh, INVERSE_BOX_H == 1)
                           & IN_WINDOW(ow_start, ow_end, kw, INVERSE_BOX_W == 1);
            sum += real ? term : (acc_t)0;
        }
#else
        for (index_t ot = ot_start; ot < ot_start + INVERSE_COUNT(T, ot_start, ot_end); ++ot)
            for (index_t oh = oh_start; oh < oh_start + INVERSE_COUNT(H, oh_start, oh_end); ++oh)
                for (index_t ow = ow_start; ow < ow_start + INVERSE_COUNT(W, ow_start, ow_end); ++ow) {
                    const index_t o = OUT_OFFSET(plane, ot, oh, ow);
                    sum += GRADIENT_TERM(LOAD(grad_out, o), o, ot, oh, ow, position);
                }
#endif
        STORE(grad_in, i, sum);
    }
}
