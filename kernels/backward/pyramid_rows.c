/* pyramid_rows -- multi-level backward, channels-first: a work-item per plane, neighbours on
 * neighbouring planes.  It sums the average levels' terms once per cell (levels in order, as
 * pyramid_stream), then writes its plane in memory order, one row of cells at a time: every
 * input row of a row of cells is the same row of cell values (or, where every level has one column,
 * one value), so its stores are contiguous runs that CPU compilers vectorise.  Last, for each max level in order, it adds the level's terms at every
 * input an output chose, once (at the input's first chooser): the sums in the order of
 * pyramid_stream's gathers, so both give the same bits; the plane is this work-item's alone, so
 * the additions are deterministic.  An index outside the plane, or outside its output's window,
 * adds nothing (as no gather would find it).
 * Launch: ceil(N_PLANES / block_size_x) groups of block_size_x. */
KERNEL void pool_backward(const GLOBAL scalar_t* RESTRICT grad_out, INDICES_IN GLOBAL scalar_t* RESTRICT grad_in PLANES_PARAM)
{
    const index_t plane = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (plane >= N_PLANES)
        return;
    CELL_GRADIENTS(plane);
    const index_t plane_base = PLANE_BASE(plane, IN_PLANE_SIZE);
    for (int ct = 0; ct < N_CELLS_T; ++ct)
        for (int ch = 0; ch < N_CELLS_H; ++ch)
            for (index_t t = cuts_t[ct]; t < cuts_t[ct + 1]; ++t) {
#if N_CELLS_W == 1
                /* the row of cells is one cell: one run per t */
                const acc_t grad = cell_grad[ct * N_CELLS_H + ch];
                const index_t start = plane_base + PLANE_POSITION(t, cuts_h[ch], 0, IN_H, IN_W);
                for (index_t j = 0; j < (cuts_h[ch + 1] - cuts_h[ch]) * IN_W; ++j)
                    STORE(grad_in, start + j, grad);
#else
                /* every input row of the row of cells is the same: its cells' values spread along W */
                acc_t row_grad[IN_W];
                for (int cw = 0; cw < N_CELLS_W; ++cw)
                    for (index_t w = cuts_w[cw]; w < cuts_w[cw + 1]; ++w)
                        row_grad[w] = cell_grad[(ct * N_CELLS_H + ch) * N_CELLS_W + cw];
                for (index_t h = cuts_h[ch]; h < cuts_h[ch + 1]; ++h) {
                    const index_t row = plane_base + PLANE_POSITION(t, h, 0, IN_H, IN_W);
                    for (index_t w = 0; w < IN_W; ++w)
                        STORE(grad_in, row + w, row_grad[w]);
                }
#endif
            }
    WRITE_CHOSEN_INPUTS(plane, plane_base, cell_grad);
}
