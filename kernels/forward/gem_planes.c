/* gem_planes -- forward, GeM pooling (kernels/operators/gem.h), global pooling (every output size 1)
 * in channels-first memory: a work-item maps and sums one whole contiguous plane in run_lanes
 * independent partial sums (lane k takes elements k, k + run_lanes, ...: one contiguous load of
 * run_lanes elements per step, which CPU compilers turn into vector operations), neighbouring
 * work-items taking neighbouring planes.  Work-items are branch-free (CPU compilers vectorise across
 * them) except where the grid can run past the last plane (host define PARTIAL_LAST_GROUP).
 * Launch: ceil(N_PLANES / block_size_x) groups of block_size_x. */
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out PLANES_PARAM GEM_PARAMS)
{
    const index_t plane = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (PARTIAL_LAST_GROUP && plane >= N_PLANES)
        return;
    const index_t base = PLANE_BASE(plane, IN_PLANE_SIZE);
    index_t j = 0;
    acc_t sum = (acc_t)0;
#if GEM_VECTORS && run_lanes % 8 == 0
    /* The lanes eight at a time in vector loads and arithmetic (gem.h's load8 and gem_power8, the
     * scalar map's bits), which converts float16 eight values per instruction where the scalar
     * conversion is a dozen integer operations a value; added up in lane order as below. */
    float8 lanes[run_lanes / 8];
#pragma unroll
    for (int k = 0; k < run_lanes / 8; ++k)
        lanes[k] = (float8)0.0f;
    for (; j + run_lanes <= IN_PLANE_SIZE; j += run_lanes)
#pragma unroll
        for (int k = 0; k < run_lanes / 8; ++k)
            lanes[k] += gem_power8(load8(in, base + j + 8 * k), p, eps);
#pragma unroll
    for (int k = 0; k < run_lanes / 8; ++k)
        sum = add_in_order8(sum, lanes[k]);
#else
    acc_t lanes[run_lanes];
    for (int k = 0; k < run_lanes; ++k)
        lanes[k] = (acc_t)0;
    for (; j + run_lanes <= IN_PLANE_SIZE; j += run_lanes)
        for (int k = 0; k < run_lanes; ++k)
            lanes[k] += gem_power(LOAD(in, base + j + k), p, eps);
    for (int k = 0; k < run_lanes; ++k)
        sum += lanes[k];
#endif
    for (; j < IN_PLANE_SIZE; ++j)
        sum += gem_power(LOAD(in, base + j), p, eps);
    STORE(out, plane, gem_root(sum, IN_PLANE_SIZE, p));
}
