/* global_channels -- forward, global pooling (every output size 1), channels-last: each output
 * reduces one channel of one batch entry over every position, elements N_CHANNELS apart.
 *
 * Work-item (n, c) reduces channel c of batch entry n, so neighbouring work-items read neighbouring
 * channels -- contiguous loads once CPU compilers vectorise across work-items.  It keeps
 * accumulators independent partial results, partial a taking positions a, a + accumulators, ...
 * (each visited in increasing order, so each keeps its first winner), so that no step waits on
 * the one before; they are merged in order at the end (reduce_merge's position rule).
 * Launch: ceil(N_PLANES / block_size_x) groups of block_size_x. */
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_OUT)
{
    const index_t plane = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
#if PARTIAL_LAST_GROUP
    if (plane >= N_PLANES)
        return;
#endif
    const index_t plane_base = PLANE_BASE(plane, IN_PLANE_SIZE);
    reduction_t partial[accumulators];
#pragma unroll
    for (int a = 0; a < accumulators; ++a)
        partial[a] = reduce_init();
    for (index_t p = 0; p < IN_PLANE_SIZE; p += accumulators)
#pragma unroll
        for (int a = 0; a < accumulators; ++a)
            if (IN_PLANE_SIZE % accumulators == 0 || p + a < IN_PLANE_SIZE)
                reduce_step(&partial[a], LOAD(in, plane_base + (p + a) * ELEMENT_STEP), p + a);
    reduction_t r = partial[0];
#pragma unroll
    for (int a = 1; a < accumulators; ++a)
        r = reduce_merge(r, partial[a]);
    STORE_RESULT(plane, r, 0, 0, 0);
}
