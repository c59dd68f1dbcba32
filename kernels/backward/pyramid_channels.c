/* pyramid_channels -- multi-level backward, channels-last: a work-item takes channels_per_item
 * neighbouring channels (planes) of one batch entry.  For each channel it sums the average levels'
 * terms once per cell (CELL_GRADIENTS, as pyramid_stream does), kept as a lane per channel and
 * cell; then it writes its channels position by position in memory order, each position's channels
 * one contiguous run of stores: the cell's lane plus, where levels select, their terms at that
 * input in level order (the gathers' order: the same bits as every other backward variant).
 * channels_per_item divides N_CHANNELS, so a work-item's channels never straddle two batch entries.
 * Launch: ceil(N_PLANES / channels_per_item / block_size_x) groups of block_size_x. */
KERNEL void pool_backward(const GLOBAL scalar_t* RESTRICT grad_out, INDICES_IN GLOBAL scalar_t* RESTRICT grad_in PLANES_PARAM)
{
    const index_t item = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (item >= N_PLANES / channels_per_item)
        return;
    const index_t first_plane = item * channels_per_item;
    const index_t base = PLANE_BASE(first_plane, IN_PLANE_SIZE);
    acc_t lane_grad[N_CELLS * channels_per_item];
    for (int c = 0; c < channels_per_item; ++c) {
        const index_t plane = first_plane + c;
        CELL_GRADIENTS(plane);
        for (int k = 0; k < N_CELLS; ++k)
            lane_grad[k * channels_per_item + c] = cell_grad[k];
    }
    FOR_EACH_INPUT_ROW(t, h, row_cells)
        for (int cw = 0; cw < N_CELLS_W; ++cw) {
            const index_t lanes = (row_cells + cw) * channels_per_item;
            for (index_t w = cuts_w[cw]; w < cuts_w[cw + 1]; ++w) {
                const index_t position = PLANE_POSITION(t, h, w, IN_H, IN_W);
#pragma unroll
                for (int c = 0; c < channels_per_item; ++c) {
                    acc_t sum = lane_grad[lanes + c];
                    MAX_LEVEL_TERMS(sum, first_plane + c, t, h, w);
                    STORE(grad_in, base + position * ELEMENT_STEP + c, sum);
                }
            }
        }
}
