/* pyramid_columns -- multi-level forward (pyramid.h), channels-first: a work-group per plane.  Work-item
 * w reduces input column w within each row of cells (rows in order, so neighbouring work-items read
 * neighbouring elements), into local memory; the work-items then combine each cell from its
 * columns, and finish every output of every level from the cells of its window.  The input is read
 * once for all the levels.
 * Launch: N_PLANES groups of block_size_x. */
#define N_CELL_ROWS (N_CELLS_T * N_CELLS_H)
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_OUT PLANES_PARAM)
{
    PARTS(LOCAL_MEM, column, N_CELL_ROWS * IN_W)
    CELL_ARRAYS(LOCAL_MEM)
    const index_t plane = (index_t)GROUP_ID;
    const index_t plane_base = PLANE_BASE(plane, IN_PLANE_SIZE);
    for (int w = LOCAL_ID_X; w < IN_W; w += block_size_x)
        for (int ct = 0; ct < N_CELLS_T; ++ct)
            for (int ch = 0; ch < N_CELLS_H; ++ch) {
                cell_t c = cell_init();
                for (index_t t = cuts_t[ct]; t < cuts_t[ct + 1]; ++t)
                    for (index_t h = cuts_h[ch]; h < cuts_h[ch + 1]; ++h) {
                        const index_t position = PLANE_POSITION(t, h, w, IN_H, IN_W);
                        cell_step(&c, LOAD(in, plane_base + position * ELEMENT_STEP), position);
                    }
                PUT_PART(column, (ct * N_CELLS_H + ch) * IN_W + w, c);
            }
    BARRIER();
    for (int k = LOCAL_ID_X; k < N_CELLS; k += block_size_x) {
        const int row = k / N_CELLS_W, cw = k % N_CELLS_W;
        cell_t c = cell_init();
        for (index_t w = cuts_w[cw]; w < cuts_w[cw + 1]; ++w) {
            cell_t column;
            GET_PART(column, row * IN_W + w, column);
            c = cell_merge(c, column);
        }
        PUT_CELL(k, c);
    }
    BARRIER();
    for (int q = LOCAL_ID_X; q < VALUES_PER_PLANE; q += block_size_x) {
        const int l = level_of(q);
        COMBINE_AND_STORE(l, plane, q - level_value_base[l]);
    }
}
