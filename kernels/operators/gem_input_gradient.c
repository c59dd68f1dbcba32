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
 * Where a plane's inputs fill whole work-groups (channels-first; host define GROUPS_PER_PLANE, the
 * work-groups of one plane, else 0) the plane is the same for every work-item of a group, and so are
 * its coefficients; where that plane has few outputs (MASKED_SHARE) each input adds up all of them,
 * each masked by whether its window holds the input.  Those loads are uniform and the masks compares,
 * which CPU compilers vectorise, where the inverse-window gather loads from per-work-item addresses
 * (a vector gather per tap).  The outputs come in the gather's ascending order and the others add +0,
 * so the share has the gather's bits.
 * Elsewhere, where every inverse window fits a box of at most SMALL_BOX_LIMIT outputs the gather is unrolled
 * straight-line code over the box (a repeat past a shorter inverse window's end adds +0), otherwise
 * loops, which vanish along axes whose windows do not overlap.  The work-items are branch-free, so
 * CPU compilers vectorise them: where the grid can run past the last input (host define
 * PARTIAL_LAST_GROUP: one sample's inputs do not fill whole work-groups), a work-item past the end
 * computes the last input again, adds nothing to the terms and stores nothing.
 * The host may run the pass on a slab of whole planes (channels-last: whole samples): first_input is
 * the slab's first input in memory, n_planes the slab's planes, coefficients and p_terms the slab's
 * own; in and grad_in stay the whole arrays, so their buffers are the same for every slab.
 * Launch: ceil(IN_NUMEL / (block_size_x * items_per_thread)) groups of block_size_x. */
#define INVERSE_BOX_T MAX_INVERSE_WINDOW_T
#define INVERSE_BOX_H MAX_INVERSE_WINDOW_H
#define INVERSE_BOX_W MAX_INVERSE_WINDOW_W
#define SMALL_INVERSE_WINDOW (INVERSE_BOX_T * INVERSE_BOX_H * INVERSE_BOX_W <= SMALL_BOX_LIMIT)
#define MASKED_SHARE_LIMIT 16
#define MASKED_SHARE (GROUPS_PER_PLANE > 0 && OUT_T * OUT_H * OUT_W <= MASKED_SHARE_LIMIT)
#define FIRST_INPUT_PARAM , const int64_t_ first_input

#if MASKED_SHARE
/* The sum of the coefficients of the outputs whose windows hold input (t, h, w) of `plane`: every
 * output of the plane, masked. */
DEVICE_FN acc_t gathered_share(const GLOBAL acc_t* RESTRICT coefficients, index_t plane, index_t t, index_t h,
                               index_t w)
{
    acc_t share = (acc_t)0;
#pragma unroll
    for (int k = 0; k < OUT_T * OUT_H * OUT_W; ++k) {
        const int ot = k / (OUT_H * OUT_W), oh = k / OUT_W % OUT_H, ow = k % OUT_W;
        const int holds = WINDOW_HOLDS(t, ot, OUT_T, T_WINDOW_START, T_WINDOW_END)
                        & WINDOW_HOLDS(h, oh, OUT_H, H_WINDOW_START, H_WINDOW_END)
                        & WINDOW_HOLDS(w, ow, OUT_W, W_WINDOW_START, W_WINDOW_END);
        const acc_t coefficient = coefficients[OUT_OFFSET(plane, ot, oh, ow)];
        share += holds ? coefficient : (acc_t)0;
    }
    return share;
}
#else
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
#endif

#if GROUPS_PER_PLANE > 0
/* The plane and coordinates of the k-th input of this work-item where a plane's inputs fill whole
 * work-groups: the plane is the group's (the compiler sees it the same for the whole group), the
 * coordinates from the position within the plane.  Written with divisions and subtractions rather
 * than IN_COORDS's remainders: the two remainders by IN_H and IN_W are alike, and the compiler
 * packs such a pair into one two-lane vector instruction, after which it no longer vectorises the
 * work-items. */
DEVICE_FN void in_plane_coords(int k, index_t* plane, index_t* t, index_t* h, index_t* w)
{
    const int position = (int)(GROUP_ID % GROUPS_PER_PLANE) * (block_size_x * items_per_thread) + (int)LOCAL_ID_X
                       + k * block_size_x;
    const int row = position / IN_W;
    *plane = (index_t)GROUP_ID / GROUPS_PER_PLANE;
    *w = position - row * IN_W;
#if IN_T == 1
    *t = 0;
    *h = row;
#else
    const int slice = row / IN_H;
    *t = slice;
    *h = row - slice * IN_H;
#endif
}
#endif

KERNEL void gem_input_gradient(const GLOBAL scalar_t* RESTRICT in, const GLOBAL acc_t* RESTRICT coefficients,
                               GLOBAL scalar_t* RESTRICT grad_in, GLOBAL acc_t* RESTRICT p_terms PLANES_PARAM GEM_PARAMS
                               FIRST_INPUT_PARAM)
{
    in += first_input;
    grad_in += first_input;
    LOCAL_MEM acc_t partial[block_size_x];
    const index_t first = (index_t)GROUP_ID * (block_size_x * items_per_thread) + LOCAL_ID_X;
    acc_t term = (acc_t)0;
    for (int k = 0; k < items_per_thread; ++k) {
        const index_t wanted = first + (index_t)k * block_size_x;
        const int inside = !PARTIAL_LAST_GROUP || wanted < IN_NUMEL;
        const index_t i = inside ? wanted : IN_NUMEL - 1;
        index_t plane, t, h, w;
#if GROUPS_PER_PLANE > 0
        in_plane_coords(k, &plane, &t, &h, &w);
#else
        IN_COORDS(i, plane, t, h, w);
#endif
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
