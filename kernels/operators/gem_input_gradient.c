/* gem_input_gradient -- GeM's backward in one pass over the input: the gradient of the input and the
 * input terms of the gradient of p, no input-sized temporary.
 *
 * With xc = max(x, eps), m_o = mean of xc^p over window o and y_o = m_o^(1/p), the host has computed
 * each output's coefficient (output-sized, in the output's memory order)
 *
 *   coefficients[o] = dL/dy_o * y_o^(1-p) / (p * area_o)      (= dL/dm_o / area_o)
 *
 * and each input gathers those of the outputs whose windows hold it (its inverse windows, windows.h),
 * share_i = sum over those o of coefficients[o], in a fixed order:
 *
 *   grad_in[i] = share_i * p * xc_i^(p-1)   where x_i >= eps, else 0 (clamp(min=eps)'s gradient)
 *   dL/dp      = sum over o of dL/dy_o * dy_o/dp, whose input part sum_i share_i * xc_i^p * ln(xc_i)
 *                each work-group adds up for its inputs into p_terms[group], in work-item order, for
 *                the host to add up in group order (deterministic: no atomics).
 *
 * Where every inverse window fits a box of at most SMALL_BOX_LIMIT outputs the gather is unrolled
 * straight-line code over the box (a repeat past a shorter inverse window's end adds +0), otherwise
 * loops, which vanish along axes whose windows do not overlap.  The work-items are branch-free, so
 * CPU compilers vectorise them: where the grid can run past the last input (host define
 * PARTIAL_LAST_GROUP: one sample's inputs do not fill whole work-groups), a work-item past the end
 * computes the last input again, adds nothing to the terms and stores nothing.
 * Launch: ceil(IN_NUMEL / (block_size_x * items_per_thread)) groups of block_size_x. */
#define INVERSE_BOX_T MAX_INVERSE_WINDOW_T
#define INVERSE_BOX_H MAX_INVERSE_WINDOW_H
#define INVERSE_BOX_W MAX_INVERSE_WINDOW_W
#define SMALL_INVERSE_WINDOW (INVERSE_BOX_T * INVERSE_BOX_H * INVERSE_BOX_W <= SMALL_BOX_LIMIT)

/* The sum of the coefficients of the outputs whose windows hold input (t, h, w) of `plane`. */
DEVICE_FN acc_t gathered_share(const GLOBAL acc_t* RESTRICT coefficients, index_t plane, index_t t, index_t h,
                               index_t w)
{
    const index_t ot_start = WINDOW_START(t, OUT_T, IN_T), ot_end = WINDOW_END(t, OUT_T, IN_T);
    const index_t oh_start = WINDOW_START(h, OUT_H, IN_H), oh_end = WINDOW_END(h, OUT_H, IN_H);
    const index_t ow_start = WINDOW_START(w, OUT_W, IN_W), ow_end = WINDOW_END(w, OUT_W, IN_W);
    acc_t share = (acc_t)0;
#if SMALL_INVERSE_WINDOW
#pragma unroll
    for (int k = 0; k < INVERSE_BOX_T * INVERSE_BOX_H * INVERSE_BOX_W; ++k) {
        const int kt = k / (INVERSE_BOX_H * INVERSE_BOX_W), kh = k / INVERSE_BOX_W % INVERSE_BOX_H, kw = k % INVERSE_BOX_W;
        const index_t ot = BOX_TAP(ot_start, ot_end, kt, INVERSE_BOX_T == 1),
                      oh = BOX_TAP(oh_start, oh_end, kh, INVERSE_BOX_H == 1),
                      ow = BOX_TAP(ow_start, ow_end, kw, INVERSE_BOX_W == 1);
        const acc_t coefficient = coefficients[OUT_OFFSET(plane, ot, oh, ow)];
        const int real = IN_WINDOW(ot_start, ot_end, kt, INVERSE_BOX_T == 1)
                       & IN_WINDOW(oh_start, oh_end, kh, INVERSE_BOX_H == 1)
                       & IN_WINDOW(ow_start, ow_end, kw, INVERSE_BOX_W == 1);
        share += real ? coefficient : (acc_t)0;
    }
#else
    for (index_t ot = ot_start; ot < ot_start + INVERSE_COUNT(T, ot_start, ot_end); ++ot)
        for (index_t oh = oh_start; oh < oh_start + INVERSE_COUNT(H, oh_start, oh_end); ++oh)
            for (index_t ow = ow_start; ow < ow_start + INVERSE_COUNT(W, ow_start, ow_end); ++ow)
                share += coefficients[OUT_OFFSET(plane, ot, oh, ow)];
#endif
    return share;
}

KERNEL void gem_input_gradient(const GLOBAL scalar_t* RESTRICT in, const GLOBAL acc_t* RESTRICT coefficients,
                               GLOBAL scalar_t* RESTRICT grad_in, GLOBAL acc_t* RESTRICT p_terms PLANES_PARAM GEM_PARAMS)
{
    LOCAL_MEM acc_t partial[block_size_x];
    const index_t first = (index_t)GROUP_ID * (block_size_x * items_per_thread) + LOCAL_ID_X;
    acc_t term = (acc_t)0;
    for (int k = 0; k < items_per_thread; ++k) {
        const index_t wanted = first + (index_t)k * block_size_x;
        const int inside = !PARTIAL_LAST_GROUP || wanted < IN_NUMEL;
        const index_t i = inside ? wanted : IN_NUMEL - 1;
        index_t plane, t, h, w;
        IN_COORDS(i, plane, t, h, w);
        const acc_t share = gathered_share(coefficients, plane, t, h, w);
        const acc_t x = LOAD(in, i);
        const acc_t c = x < eps ? eps : x;
        const acc_t power = gem_power(x, p, eps);
        if (inside)
            STORE(grad_in, i, x >= eps ? share * p * power / c : (acc_t)0);
        term += inside ? share * power * gem_log(c) : (acc_t)0;
    }
    partial[LOCAL_ID_X] = term;
    BARRIER();
    if (LOCAL_ID_X == 0) {
        acc_t sum = (acc_t)0;
        for (int k = 0; k < block_size_x; ++k)
            sum += partial[k];
        p_terms[GROUP_ID] = sum;
    }
}
