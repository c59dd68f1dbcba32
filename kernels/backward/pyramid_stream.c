/* pyramid_stream -- multi-level backward: a work-item per plane, neighbours on neighbouring planes.  It
 * sums the average levels' terms once per cell (private memory, levels in order), then writes its
 * plane in memory order, each input gradient once: its cell's sum, plus a max level's gradient where
 * the level's index is this input (level_terms, pyramid.h).
 * Launch: ceil(N_PLANES / block_size_x) groups of block_size_x. */
KERNEL void pool_backward(const GLOBAL scalar_t* RESTRICT grad_out, INDICES_IN GLOBAL scalar_t* RESTRICT grad_in PLANES_PARAM)
{
    const index_t plane = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (plane >= N_PLANES)
        return;
    CELL_GRADIENTS(plane);
    FOR_EACH_INPUT_ROW(t, h, row_cells)
        for (int cw = 0; cw < N_CELLS_W; ++cw)
            for (index_t w = cuts_w[cw]; w < cuts_w[cw + 1]; ++w) {
                acc_t sum = cell_grad[row_cells + cw];
                MAX_LEVEL_TERMS(sum, plane, t, h, w);
                STORE(grad_in, IN_OFFSET(plane, t, h, w), sum);
            }
}
