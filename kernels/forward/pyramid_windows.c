/* pyramid_windows -- multi-level forward without cells: a work-item per output of any level reduces
 * its whole window (the levels pooled one by one, in one launch); neighbouring work-items write
 * neighbouring outputs of the values buffer.  Legal for every problem, however fine its cells.
 * Launch: ceil(N_PLANES * VALUES_PER_PLANE / block_size_x) groups of block_size_x. */
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_OUT PLANES_PARAM)
{
    const index_t o = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (o >= (index_t)N_PLANES * VALUES_PER_PLANE)
        return;
    int l = 0;
    for (int k = 1; k < N_LEVELS; ++k)
        l = o >= (index_t)N_PLANES * level_value_base[k] ? k : l;
    const index_t OT = level_out_t[l], OH = level_out_h[l], OW = level_out_w[l];
    index_t plane, ot, oh, ow;
    COORDS_OF(o - (index_t)N_PLANES * level_value_base[l], plane, ot, oh, ow, OT, OH, OW);
    const index_t t_start = WINDOW_START(ot, IN_T, OT), t_end = WINDOW_END(ot, IN_T, OT);
    const index_t h_start = WINDOW_START(oh, IN_H, OH), h_end = WINDOW_END(oh, IN_H, OH);
    const index_t w_start = WINDOW_START(ow, IN_W, OW), w_end = WINDOW_END(ow, IN_W, OW);
    const index_t plane_base = PLANE_BASE(plane, IN_PLANE_SIZE);
    cell_t c = cell_init();
    for (index_t t = t_start; t < t_end; ++t)
        for (index_t h = h_start; h < h_end; ++h)
            for (index_t w = w_start; w < w_end; ++w) {
                const index_t position = PLANE_POSITION(t, h, w, IN_H, IN_W);
                cell_step(&c, LOAD(in, plane_base + position * ELEMENT_STEP), position);
            }
    const index_t area = (t_end - t_start) * (h_end - h_start) * (w_end - w_start);
    STORE_LEVEL_RESULT(l, plane, PLANE_POSITION(ot, oh, ow, OH, OW), c, area);
}
