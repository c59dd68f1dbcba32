/* thread_per_row -- backward, accumulating ops (average pooling), channels-first, no input in more
 * than two windows along W (the host checks): each work-item writes one input row (plane, t, h),
 * left to right, each element once.
 *
 * The row's inputs are pooled by the outputs ot in [ot_start, ot_end), oh in [oh_start, oh_end)
 * and, along W, by one output column ow or, where neighbouring windows overlap, by ow and ow + 1.
 * An accumulating op's gradient reaches every input of a window alike, so walking the columns in
 * order, the run of inputs only ow pools all get one value -- the sum over (ot, oh) of ow's terms,
 * computed once and stored along the run (contiguous stores) -- and the inputs ow shares with
 * ow + 1 get both columns' terms.  Every sum starts from 0 and adds its terms in the order the
 * gather variants do (ot, oh, then ow), so the results are bit-identical to theirs.
 * Launch: ceil(N_PLANES * IN_T * IN_H / block_size_x) groups of block_size_x. */
#if OP_SELECTS
#error "thread_per_row backward is for accumulating ops (the host refuses it for max pooling)"
#endif
#define IN_ROWS ((index_t)N_PLANES * IN_T * IN_H)
/* The share of output (ot, oh, ow)'s gradient that each input of its window receives. */
#define SHARE(ot, oh, ow) OP_GRADIENT_SHARE(LOAD(grad_out, OUT_OFFSET(plane, ot, oh, ow)), window_area(ot, oh, ow))
KERNEL void pool_backward(const GLOBAL scalar_t* RESTRICT grad_out, INDICES_IN GLOBAL scalar_t* RESTRICT grad_in PLANES_PARAM)
{
    const index_t row = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
#if PARTIAL_LAST_GROUP
    if (row >= IN_ROWS)
        return;
#endif
    const index_t h = row % IN_H, t = row / IN_H % IN_T, plane = row / ((index_t)IN_H * IN_T);
    const index_t ot_start = WINDOW_START(t, OUT_T, IN_T);
    const index_t ot_end = ot_start + INVERSE_COUNT(T, ot_start, WINDOW_END(t, OUT_T, IN_T));
    const index_t oh_start = WINDOW_START(h, OUT_H, IN_H);
    const index_t oh_end = oh_start + INVERSE_COUNT(H, oh_start, WINDOW_END(h, OUT_H, IN_H));
    const index_t base = IN_OFFSET(plane, t, h, 0);
    index_t w = 0;
    for (index_t ow = 0; ow < OUT_W; ++ow) {
        const index_t window_end = W_WINDOW_END(ow);
        const index_t run_end = ow + 1 < OUT_W && W_WINDOW_START(ow + 1) < window_end ? W_WINDOW_START(ow + 1) : window_end;
        acc_t run_value = (acc_t)0;
        for (index_t ot = ot_start; ot < ot_end; ++ot)
            for (index_t oh = oh_start; oh < oh_end; ++oh)
                run_value += SHARE(ot, oh, ow);
        for (; w < run_end; ++w)
            STORE(grad_in, base + w, run_value);
        for (; w < window_end; ++w) { /* pooled by ow and ow + 1 */
            acc_t sum = (acc_t)0;
            for (index_t ot = ot_start; ot < ot_end; ++ot)
                for (index_t oh = oh_start; oh < oh_end; ++oh) {
                    sum += SHARE(ot, oh, ow);
                    sum += SHARE(ot, oh, ow + 1);
                }
            STORE(grad_in, base + w, sum);
        }
    }
}
