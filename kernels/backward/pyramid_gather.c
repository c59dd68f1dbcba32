/* pyramid_gather -- multi-level backward: each work-item writes one input gradient once, the sum of
 * the terms of every level's outputs whose windows hold the input (level_terms, pyramid.h), level
 * after level in order.  No atomics; bit-identical across runs.
 * Launch: ceil(IN_NUMEL / block_size_x) groups of block_size_x. */
KERNEL void pool_backward(const GLOBAL scalar_t* RESTRICT grad_out, INDICES_IN GLOBAL scalar_t* RESTRICT grad_in PLANES_PARAM)
{
    const index_t i = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (i >= IN_NUMEL)
        return;
    index_t plane, t, h, w;
    IN_COORDS(i, plane, t, h, w);
    const index_t position = PLANE_POSITION(t, h, w, IN_H, IN_W);
    acc_t sum = (acc_t)0;
    for (int l = 0; l < N_LEVELS; ++l)
        sum += LEVEL_TERMS(l, plane, t, h, w, position);
    STORE(grad_in, i, sum);
}
