/* pyramid_cells -- multi-level forward (pyramid.h): a work-group per plane reduces the plane's cells
 * into local memory, each cell once, work-item j taking cells j, j + block_size_x, ...; then the
 * work-items finish every output of every level from the cells of its window.  The input is read
 * once for all the levels.
 * Launch: N_PLANES groups of block_size_x. */
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_OUT PLANES_PARAM)
{
    CELL_ARRAYS(LOCAL_MEM)
    const index_t plane = (index_t)GROUP_ID;
    const index_t plane_base = PLANE_BASE(plane, IN_PLANE_SIZE);
    for (int k = LOCAL_ID_X; k < N_CELLS; k += block_size_x) {
        const int ct = k / (N_CELLS_H * N_CELLS_W), ch = k / N_CELLS_W % N_CELLS_H, cw = k % N_CELLS_W;
        cell_t c = cell_init();
        for (index_t t = cuts_t[ct]; t < cuts_t[ct + 1]; ++t)
            for (index_t h = cuts_h[ch]; h < cuts_h[ch + 1]; ++h)
                for (index_t w = cuts_w[cw]; w < cuts_w[cw + 1]; ++w) {
                    const index_t position = PLANE_POSITION(t, h, w, IN_H, IN_W);
                    cell_step(&c, LOAD(in, plane_base + position * ELEMENT_STEP), position);
                }
        PUT_CELL(k, c);
    }
    BARRIER();
    for (int q = LOCAL_ID_X; q < VALUES_PER_PLANE; q += block_size_x) {
        const int l = level_of(q);
        COMBINE_AND_STORE(l, plane, q - level_value_base[l]);
    }
}
