/* pyramid_cells -- multi-level backward by cells: a work-group per plane.  Every input of a cell lies
 * in the same windows of every level, so it gets the same average-level terms: the work-items first
 * sum them once per cell into local memory (levels in order), then write the plane, work-item w
 * column w, each input gradient once: its cell's sum, plus a max level's gradient where the level's
 * index is this input (level_terms, pyramid.h).
 * Launch: N_PLANES groups of block_size_x. */
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
    /* Work-item w writes column w, rows in order: neighbouring work-items write neighbouring inputs. */
    for (int w = LOCAL_ID_X; w < IN_W; w += block_size_x) {
        const int cw = cell_of(cuts_w, N_CELLS_W, w);
        FOR_EACH_INPUT_ROW(t, h, row_cells) {
            acc_t sum = cell_grad[row_cells + cw];
            MAX_LEVEL_TERMS(sum, plane, t, h, w);
            STORE(grad_in, IN_OFFSET(plane, t, h, w), sum);
        }
    }
}
