/* gem_windows -- forward, GeM pooling (kernels/operators/gem.h), any problem and either layout: each
 * work-item maps and sums one whole window, row by row, with row_lanes independent partial sums
 * along each window row (so the steps do not wait on each other), then takes the mean's p-th root.
 * Neighbouring work-items write neighbouring outputs.
 * Launch: ceil(OUT_NUMEL / block_size_x) groups of block_size_x. */
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out PLANES_PARAM GEM_PARAMS)
{
    const index_t o = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (o >= OUT_NUMEL)
        return;
    index_t plane, ot, oh, ow;
    OUT_COORDS(o, plane, ot, oh, ow);
    const box_t box = window_box(ot, oh, ow);
    const index_t base = PLANE_BASE(plane, IN_PLANE_SIZE);
    const index_t length = box.w_end - box.w_start;
    acc_t lanes[row_lanes];
    for (int k = 0; k < row_lanes; ++k)
        lanes[k] = (acc_t)0;
    acc_t sum = (acc_t)0;
    for (index_t t = box.t_start; t < box.t_end; ++t)
        for (index_t h = box.h_start; h < box.h_end; ++h) {
            const index_t row = base + PLANE_POSITION(t, h, box.w_start, IN_H, IN_W) * ELEMENT_STEP;
            index_t j = 0;
            for (; j + row_lanes <= length; j += row_lanes)
                for (int k = 0; k < row_lanes; ++k)
                    lanes[k] += gem_power(LOAD(in, row + (j + k) * ELEMENT_STEP), p, eps);
            for (; j < length; ++j)
                sum += gem_power(LOAD(in, row + j * ELEMENT_STEP), p, eps);
        }
    for (int k = 0; k < row_lanes; ++k)
        sum += lanes[k];
    STORE(out, o, gem_root(sum, window_area(ot, oh, ow), p));
}
