/* channels_gather -- backward gather, channels-last only: a work-item takes channels_per_item
 * neighbouring channels of a run of positions_per_item neighbouring input positions along W (one
 * row of one batch entry).
 *
 * The row's inverse windows along T and H (windows.h) are found once for the whole run, the W ones
 * once per position, and each covering output's window area once for all the item's channels, not
 * once per channel; the channels are the inner loop, so every load of grad_out (and of a selecting
 * op's indices) and every store of grad_in is one contiguous run, which CPU compilers turn into
 * vector code, and neighbouring positions of a run read mostly the same outputs.  Each channel sums
 * the terms of its outputs in the loops' order (ot, oh, ow), from +0, exactly as thread_per_input
 * does: the same bits as every other backward variant (the share is still the gradient divided by
 * the area, per channel).  Neighbouring work-items take neighbouring channel runs of one position
 * run, then the next run of the row.  Where channels_per_item does not divide N_CHANNELS the last
 * channel run is masked; where positions_per_item does not divide IN_W the last run of a row is
 * shorter.
 * Launch: ceil(N * IN_T * IN_H * W_RUNS * CHANNEL_RUNS / block_size_x) groups of block_size_x. */
#define CHANNEL_RUNS ((N_CHANNELS + channels_per_item - 1) / channels_per_item)
#define WHOLE_RUNS (N_CHANNELS % channels_per_item == 0)
#define W_RUNS ((IN_W + positions_per_item - 1) / positions_per_item)
KERNEL void pool_backward(const GLOBAL scalar_t* RESTRICT grad_out, INDICES_IN GLOBAL scalar_t* RESTRICT grad_in PLANES_PARAM)
{
    const index_t item = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (item >= (index_t)(N_PLANES / N_CHANNELS) * IN_T * IN_H * W_RUNS * CHANNEL_RUNS)
        return;
    const index_t c0 = item % CHANNEL_RUNS * channels_per_item;
    const index_t run = item / CHANNEL_RUNS; /* (n * IN_T + t) * IN_H + h) * W_RUNS + w run */
    const index_t w0 = run % W_RUNS * positions_per_item;
    const index_t row = run / W_RUNS; /* (n * IN_T + t) * IN_H + h */
    const index_t h = row % IN_H, t = row / IN_H % IN_T, n = row / ((index_t)IN_H * IN_T);
    const index_t ot_start = WINDOW_START(t, OUT_T, IN_T), ot_end = WINDOW_END(t, OUT_T, IN_T);
    const index_t oh_start = WINDOW_START(h, OUT_H, IN_H), oh_end = WINDOW_END(h, OUT_H, IN_H);
    const index_t out_sample = n * OUT_PLANE_SIZE * N_CHANNELS + c0;
    for (index_t w = w0; w < w0 + positions_per_item && w < IN_W; ++w) {
        const index_t position = (t * IN_H + h) * IN_W + w;
        const index_t ow_start = WINDOW_START(w, OUT_W, IN_W), ow_end = WINDOW_END(w, OUT_W, IN_W);
        acc_t sum[channels_per_item];
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
        const index_t i = (n * IN_PLANE_SIZE + position) * N_CHANNELS + c0;
#pragma unroll
        for (int k = 0; k < channels_per_item; ++k)
            if (WHOLE_RUNS || c0 + k < N_CHANNELS)
                STORE(grad_in, i + k, sum[k]);
    }
}
