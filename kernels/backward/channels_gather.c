/* channels_gather -- backward gather, channels-last only: a work-item takes channels_per_item
 * neighbouring channels of a tile of rows_per_item neighbouring rows (along H) by
 * positions_per_item neighbouring input positions (along W) of one batch entry.
 *
 * An input's gradient depends only on the outputs whose windows cover it, and neighbouring inputs
 * inside the same windows share them: so a position whose covering outputs along W are those of
 * the position before it in the tile stores that position's sums again, and a row whose covering
 * outputs along H are those of the row before it copies that row's stored values, instead of
 * summing again.  Each covering output's window area is found once for all the item's channels;
 * the channels are the inner loop, so every load of grad_out (and of a selecting op's indices) and
 * every store of grad_in is one contiguous run, which CPU compilers turn into vector code.  Each
 * channel sums the terms of its outputs in the loops' order (ot, oh, ow), from +0, exactly as
 * thread_per_input does: the same bits as every other backward variant (the share is still the
 * gradient divided by the area, per channel and term).  Neighbouring work-items take neighbouring
 * channel runs of one tile, then the next tile along W, then along H.  Where channels_per_item does
 * not divide N_CHANNELS the last channel run is masked; where positions_per_item (rows_per_item)
 * does not divide IN_W (IN_H) the last tile of a row (column) is narrower (shorter).
 * Launch: ceil(N * IN_T * H_RUNS * W_RUNS * CHANNEL_RUNS / block_size_x) groups of block_size_x. */
#define CHANNEL_RUNS ((N_CHANNELS + channels_per_item - 1) / channels_per_item)
#define WHOLE_RUNS (N_CHANNELS % channels_per_item == 0)
#define W_RUNS ((IN_W + positions_per_item - 1) / positions_per_item)
#define H_RUNS ((IN_H + rows_per_item - 1) / rows_per_item)
KERNEL void pool_backward(const GLOBAL scalar_t* RESTRICT grad_out, INDICES_IN GLOBAL scalar_t* RESTRICT grad_in PLANES_PARAM)
{
    const index_t item = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (item >= (index_t)(N_PLANES / N_CHANNELS) * IN_T * H_RUNS * W_RUNS * CHANNEL_RUNS)
        return;
    const index_t c0 = item % CHANNEL_RUNS * channels_per_item;
    const index_t tile = item / CHANNEL_RUNS; /* ((n * IN_T + t) * H_RUNS + h run) * W_RUNS + w run */
    const index_t w0 = tile % W_RUNS * positions_per_item;
    const index_t w_end = w0 + positions_per_item < IN_W ? w0 + positions_per_item : IN_W;
    const index_t h0 = tile / W_RUNS % H_RUNS * rows_per_item;
    const index_t h_end = h0 + rows_per_item < IN_H ? h0 + rows_per_item : IN_H;
    const index_t slice = tile / ((index_t)W_RUNS * H_RUNS); /* n * IN_T + t */
    const index_t t = slice % IN_T, n = slice / IN_T;
    const index_t ot_start = WINDOW_START(t, OUT_T, IN_T), ot_end = WINDOW_END(t, OUT_T, IN_T);
    const index_t out_sample = n * OUT_PLANE_SIZE * N_CHANNELS + c0;
    const index_t row_stride = (index_t)IN_W * N_CHANNELS;
    acc_t sum[channels_per_item];
    for (index_t h = h0; h < h_end; ++h) {
        const index_t oh_start = WINDOW_START(h, OUT_H, IN_H), oh_end = WINDOW_END(h, OUT_H, IN_H);
        const index_t row_first = (n * IN_PLANE_SIZE + (t * IN_H + h) * IN_W) * N_CHANNELS + c0;
        /* (a selecting op's gradient reaches one position per window: no position shares another's) */
        const bool same_rows = !OP_SELECTS && h > h0 && oh_start == WINDOW_START(h - 1, OUT_H, IN_H)
                               && oh_end == WINDOW_END(h - 1, OUT_H, IN_H);
        if (same_rows) {
            for (index_t w = w0; w < w_end; ++w) {
                /* every load before any store, so that both are contiguous runs (vector code) */
#pragma unroll
                for (int k = 0; k < channels_per_item; ++k)
                    sum[k] = (WHOLE_RUNS || c0 + k < N_CHANNELS)
                                 ? LOAD(grad_in, row_first - row_stride + w * N_CHANNELS + k) : (acc_t)0;
#pragma unroll
                for (int k = 0; k < channels_per_item; ++k)
                    if (WHOLE_RUNS || c0 + k < N_CHANNELS)
                        STORE(grad_in, row_first + w * N_CHANNELS + k, sum[k]);
            }
            continue;
        }
        for (index_t w = w0; w < w_end; ++w) {
            const index_t position = (t * IN_H + h) * IN_W + w;
            const index_t ow_start = WINDOW_START(w, OUT_W, IN_W), ow_end = WINDOW_END(w, OUT_W, IN_W);
            const bool same_outputs = !OP_SELECTS && w > w0 && ow_start == WINDOW_START(w - 1, OUT_W, IN_W)
                                      && ow_end == WINDOW_END(w - 1, OUT_W, IN_W);
            if (!same_outputs) {
#pragma unroll
                for (int k = 0; k < channels_per_item; ++k)
                    sum[k] = (acc_t)0;
                for (index_t ot = ot_start; ot < ot_start + INVERSE_COUNT(T, ot_start, ot_end); ++ot)
                    for (index_t oh = oh_start; oh < oh_start + INVERSE_COUNT(H, oh_start, oh_end); ++oh)
                        for (index_t ow = ow_start; ow < ow_start + INVERSE_COUNT(W, ow_start, ow_end); ++ow) {
                            const index_t area = window_area(ot, oh, ow);
                            const index_t o = out_sample + PLANE_POSITION(ot, oh, ow, OUT_H, OUT_W) * N_CHANNELS;
#pragma unroll
                            for (int k = 0; k < channels_per_item; ++k)
                                if (WHOLE_RUNS || c0 + k < N_CHANNELS)
                                    sum[k] += REACHES(indices[o + k], position)
                                                  ? OP_GRADIENT_SHARE(LOAD(grad_out, o + k), area) : (acc_t)0;
                        }
            }
#pragma unroll
            for (int k = 0; k < channels_per_item; ++k)
                if (WHOLE_RUNS || c0 + k < N_CHANNELS)
                    STORE(grad_in, row_first + w * N_CHANNELS + k, sum[k]);
        }
    }
}
