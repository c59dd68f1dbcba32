/* gem_windows -- forward, GeM pooling (kernels/operators/gem.h), any problem and either layout: each
 * work-item maps and sums one whole window, then takes the mean's p-th root; neighbouring
 * work-items write neighbouring outputs.
 *
 * Windows that fit the small box (reduction.h's SMALL_WINDOW) are summed in unrolled straight-line
 * code over the box, taps past a shorter window's end clamped and masked (windows.h), which CPU
 * compilers vectorise across work-items.  Others run row by row, with row_lanes independent partial
 * sums along each row (lane k takes elements k, k + row_lanes, ...; a step past the row's end is
 * clamped and masked, so every step is the same straight-line code).  Work-items are branch-free
 * (CPU compilers vectorise across them) except where the grid can run past the last output (host
 * define PARTIAL_LAST_GROUP: one sample's outputs do not fill whole work-groups).
 * Launch: ceil(OUT_NUMEL / block_size_x) groups of block_size_x. */
/* The sum of max(x, eps)^p over `box` of the plane at memory offset `base`. */
DEVICE_FN acc_t window_power_sum(const GLOBAL scalar_t* RESTRICT in, index_t base, box_t box, acc_t p, acc_t eps)
{
    acc_t sum = (acc_t)0;
#if SMALL_WINDOW && row_lanes == 1
#pragma unroll
    for (int k = 0; k < MAX_WINDOW_T * MAX_WINDOW_H * MAX_WINDOW_W; ++k) {
        const int kt = k / (MAX_WINDOW_H * MAX_WINDOW_W), kh = k / MAX_WINDOW_W % MAX_WINDOW_H, kw = k % MAX_WINDOW_W;
        const index_t position = PLANE_POSITION(BOX_TAP(box.t_start, box.t_end, kt, UNIFORM_T),
                                                BOX_TAP(box.h_start, box.h_end, kh, UNIFORM_H),
                                                BOX_TAP(box.w_start, box.w_end, kw, UNIFORM_W), IN_H, IN_W);
        const int inside = IN_WINDOW(box.t_start, box.t_end, kt, UNIFORM_T)
                         & IN_WINDOW(box.h_start, box.h_end, kh, UNIFORM_H)
                         & IN_WINDOW(box.w_start, box.w_end, kw, UNIFORM_W);
        const acc_t power = gem_power(LOAD(in, base + position * ELEMENT_STEP), p, eps);
        sum += inside ? power : (acc_t)0;
    }
#else
    const index_t length = box.w_end - box.w_start;
    acc_t lanes[row_lanes];
    for (int k = 0; k < row_lanes; ++k)
        lanes[k] = (acc_t)0;
    for (index_t t = box.t_start; t < box.t_end; ++t)
        for (index_t h = box.h_start; h < box.h_end; ++h) {
            const index_t row = base + PLANE_POSITION(t, h, box.w_start, IN_H, IN_W) * ELEMENT_STEP;
            for (index_t j = 0; j < length; j += row_lanes)
                for (int k = 0; k < row_lanes; ++k) {
                    const index_t tap = j + k < length ? j + k : length - 1;
                    const acc_t power = gem_power(LOAD(in, row + tap * ELEMENT_STEP), p, eps);
                    lanes[k] += j + k < length ? power : (acc_t)0;
                }
        }
    for (int k = 0; k < row_lanes; ++k)
        sum += lanes[k];
#endif
    return sum;
}

KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out PLANES_PARAM GEM_PARAMS)
{
    const index_t o = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (PARTIAL_LAST_GROUP && o >= OUT_NUMEL)
        return;
    index_t plane, ot, oh, ow;
    OUT_COORDS(o, plane, ot, oh, ow);
    const box_t box = window_box(ot, oh, ow);
    const index_t base = PLANE_BASE(plane, IN_PLANE_SIZE);
    /* GeM's usual exponent 3 takes a copy of the sum of its own, in which the power folds to two
     * multiplications (p is the same for every work-item, so the branch is too). */
    acc_t sum;
    if (p == (acc_t)3)
        sum = window_power_sum(in, base, box, (acc_t)3, eps);
    else
        sum = window_power_sum(in, base, box, p, eps);
    STORE(out, o, gem_root(sum, window_area(ot, oh, ow), p));
}
