/* pyramid_cells -- multi-level backward by cells: a work-group per plane.  Every input of a cell lies
 * in the same windows of every level, so it gets the same average-level terms: the work-items first
 * sum them once per cell into local memory (levels in order), then write the plane row by row, each
 * input gradient once: its cell's sum, plus a max level's gradient where the level's index is this
 * input (level_terms, pyramid.h).
 * Launch: N_PLANES groups of block_size_x. */
DEVICE_FN int cell_of(TABLE_PARAM(cuts), int cells, index_t x)
{
    int k = 0;
    while (k + 1 < cells && cuts[k + 1] <= x)
        ++k;
    return k;
}

KERNEL void pool_backward(const GLOBAL scalar_t* RESTRICT grad_out, INDICES_IN GLOBAL scalar_t* RESTRICT grad_in PLANES_PARAM)
{
    LOCAL_MEM acc_t cell_grad[N_CELLS];
    const index_t plane = (index_t)GROUP_ID;
    for (int k = LOCAL_ID_X; k < N_CELLS; k += block_size_x) {
        const int ct = k / (N_CELLS_H * N_CELLS_W), ch = k / N_CELLS_W % N_CELLS_H, cw = k % N_CELLS_W;
        const index_t t = cuts_t[ct], h = cuts_h[ch], w = cuts_w[cw];
        acc_t sum = (acc_t)0;
        for (int l = 0; l < N_LEVELS; ++l)
            if (IS_MEAN_LEVEL(l))
                sum += LEVEL_TERMS(l, plane, t, h, w, PLANE_POSITION(t, h, w, IN_H, IN_W));
        cell_grad[k] = sum;
    }
    BARRIER();
    for (int row = LOCAL_ID_X; row < IN_T * IN_H; row += block_size_x) {
        const index_t t = row / IN_H, h = row % IN_H;
        const int row_cells = (cell_of(cuts_t, N_CELLS_T, t) * N_CELLS_H + cell_of(cuts_h, N_CELLS_H, h)) * N_CELLS_W;
        for (int cw = 0; cw < N_CELLS_W; ++cw) {
            const acc_t cell_sum = cell_grad[row_cells + cw];
            for (index_t w = cuts_w[cw]; w < cuts_w[cw + 1]; ++w) {
                acc_t sum = cell_sum;
                MAX_LEVEL_TERMS(sum, plane, t, h, w);
                STORE(grad_in, IN_OFFSET(plane, t, h, w), sum);
            }
        }
    }
}
