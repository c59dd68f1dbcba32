/* channels_vector -- forward, channels-last only: a work-item computes vector_width neighbouring
 * channels of one output position, so every load and store of its inner loop touches vector_width
 * contiguous elements (vectorised on CPUs, coalesced on GPUs).
 * Launch: ceil(N * OUT_PLANE_SIZE * CHANNEL_BLOCKS / block_size_x) groups of block_size_x. */
#define CHANNEL_BLOCKS ((N_CHANNELS + vector_width - 1) / vector_width)
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_OUT PLANES_PARAM OP_PARAMS)
{
    const index_t item = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (item >= (index_t)(N_PLANES / N_CHANNELS) * OUT_PLANE_SIZE * CHANNEL_BLOCKS)
        return;
    const index_t c0 = item % CHANNEL_BLOCKS * vector_width;
    const index_t position = item / CHANNEL_BLOCKS; /* n * OUT_PLANE_SIZE + (ot, oh, ow) */
    const index_t ow = position % OUT_W, oh = position / OUT_W % OUT_H, ot = position / ((index_t)OUT_W * OUT_H) % OUT_T;
    const index_t n = position / OUT_PLANE_SIZE;
    const index_t in_base = n * IN_PLANE_SIZE * N_CHANNELS + c0;
    const index_t out_base = position * N_CHANNELS + c0;
    const box_t window = window_box(ot, oh, ow);
    reduction_t r[vector_width];
    for (int k = 0; k < vector_width; ++k)
        r[k] = reduce_init();
    for (index_t t = window.t_start; t < window.t_end; ++t)
        for (index_t h = window.h_start; h < window.h_end; ++h)
            for (index_t w = window.w_start; w < window.w_end; ++w) {
                const index_t pos = PLANE_POSITION(t, h, w, IN_H, IN_W);
                for (int k = 0; k < vector_width; ++k)
                    if (N_CHANNELS % vector_width == 0 || c0 + k < N_CHANNELS)
                        reduce_step(&r[k], LOAD(in, in_base + pos * N_CHANNELS + k), pos OP_ARGS);
            }
    for (int k = 0; k < vector_width; ++k)
        if (N_CHANNELS % vector_width == 0 || c0 + k < N_CHANNELS)
            STORE_RESULT(out_base + k, r[k], ot, oh, ow);
}
