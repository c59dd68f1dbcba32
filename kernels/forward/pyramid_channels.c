/* pyramid_channels -- multi-level forward (pyramid.h), channels-last: a work-item reduces
 * channels_per_item neighbouring channels (planes) of one batch entry.  It reads the positions in
 * memory order, and at each position its channels are one contiguous run, which the compiler turns
 * into vector loads: each channel's element steps that channel's lane of the position's cell
 * (private memory, channels_per_item lanes per cell).  Then each channel's plane is finished from
 * its cells as pyramid_stream finishes one.  channels_per_item divides N_CHANNELS, so a work-item's
 * channels never straddle two batch entries.
 * Launch: ceil(N_PLANES / channels_per_item / block_size_x) groups of block_size_x. */
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_OUT PLANES_PARAM)
{
    const index_t item = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (item >= N_PLANES / channels_per_item)
        return;
    const index_t first_plane = item * channels_per_item;
    const index_t base = PLANE_BASE(first_plane, IN_PLANE_SIZE);
    PARTS(, lane, N_CELLS * channels_per_item)
    for (int k = 0; k < N_CELLS * channels_per_item; ++k)
        PUT_PART(lane, k, cell_init());
    FOR_EACH_INPUT_ROW(t, h, row_cells)
        for (int cw = 0; cw < N_CELLS_W; ++cw) {
            const index_t lanes = (row_cells + cw) * channels_per_item;
            for (index_t w = cuts_w[cw]; w < cuts_w[cw + 1]; ++w) {
                const index_t position = PLANE_POSITION(t, h, w, IN_H, IN_W);
#pragma unroll
                for (int c = 0; c < channels_per_item; ++c) {
                    cell_t lane_;
                    GET_PART(lane, lanes + c, lane_);
                    cell_step(&lane_, LOAD(in, base + position * ELEMENT_STEP + c), position);
                    PUT_PART(lane, lanes + c, lane_);
                }
            }
        }
    for (int c = 0; c < channels_per_item; ++c) {
        CELL_ARRAYS()
        for (int k = 0; k < N_CELLS; ++k) {
            cell_t cell_;
            GET_PART(lane, k * channels_per_item + c, cell_);
            PUT_CELL(k, cell_);
        }
        const index_t plane = first_plane + c;
        FINISH_PLANE(plane);
    }
}
