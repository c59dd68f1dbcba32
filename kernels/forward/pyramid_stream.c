/* pyramid_stream -- multi-level forward (pyramid.h): a work-item per plane, neighbours on neighbouring
 * planes, reads its plane once in memory order, row by row, adding each row's runs into the cells
 * of that row (private memory); then it finishes every output of every level from the cells of its
 * window.
 * Launch: ceil(N_PLANES / block_size_x) groups of block_size_x. */
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_OUT PLANES_PARAM)
{
    const index_t plane = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (plane >= N_PLANES)
        return;
    CELL_ARRAYS()
    for (int k = 0; k < N_CELLS; ++k)
        PUT_CELL(k, cell_init());
    const index_t plane_base = PLANE_BASE(plane, IN_PLANE_SIZE);
    FOR_EACH_INPUT_ROW(t, h, row_cells)
        for (int cw = 0; cw < N_CELLS_W; ++cw) {
            cell_t c;
            GET_CELL(row_cells + cw, c);
            for (index_t w = cuts_w[cw]; w < cuts_w[cw + 1]; ++w) {
                const index_t position = PLANE_POSITION(t, h, w, IN_H, IN_W);
                cell_step(&c, LOAD(in, plane_base + position * ELEMENT_STEP), position);
            }
            PUT_CELL(row_cells + cw, c);
        }
    FINISH_PLANE(plane);
}
