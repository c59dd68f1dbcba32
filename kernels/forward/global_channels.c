/* global_channels -- forward, global pooling (every output size 1), channels-last: each output
 * reduces one channel of one batch entry over every position, elements N_CHANNELS apart.
 *
 * Work-item (n, c) reduces channel c of batch entry n, so neighbouring work-items read neighbouring
 * channels.  It keeps PARTIALS independent partial results in plain variables (reduction.h's
 * partial slots), partial a taking positions a, a + PARTIALS, ... (each visited in increasing order,
 * so each keeps its first winner), so that no step waits on the one before; they are merged in
 * order at the end (reduce_merge's position rule).  The work-group takes the steps together, a
 * barrier after each: no data is shared, but CPU runtimes then run each step for all the group's
 * work-items at once -- vector code over contiguous channels -- where otherwise a work-item would
 * walk its whole plane alone, N_CHANNELS elements apart.  Every work-item must reach the barriers,
 * so those past the last plane reduce the last plane again and store nothing.
 * Launch: ceil(N_PLANES / block_size_x) groups of block_size_x. */
#define PARTIALS (accumulators < IN_PLANE_SIZE ? accumulators : IN_PLANE_SIZE)
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_OUT PLANES_PARAM)
{
    const index_t item = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    const index_t plane = item < N_PLANES ? item : N_PLANES - 1;
    const index_t plane_base = PLANE_BASE(plane, IN_PLANE_SIZE);
    acc_t partial_value[PARTIALS];
    IF_SELECTING(index_t partial_position[PARTIALS];)
#pragma unroll
    for (int a = 0; a < PARTIALS; ++a)
        STORE_PARTIAL(partial_value[a], partial_position[a], reduce_first(LOAD(in, plane_base + a * ELEMENT_STEP), a));
    for (index_t p = PARTIALS; p < IN_PLANE_SIZE; p += PARTIALS) {
#pragma unroll
        for (int a = 0; a < PARTIALS; ++a)
            if (IN_PLANE_SIZE % PARTIALS == 0 || p + a < IN_PLANE_SIZE)
                STEP_PARTIAL(partial_value[a], partial_position[a], LOAD(in, plane_base + (p + a) * ELEMENT_STEP), p + a);
        BARRIER();
    }
    reduction_t r = reduce_init();
#pragma unroll
    for (int a = 0; a < PARTIALS; ++a)
        r = reduce_merge(r, PARTIAL(partial_value[a], partial_position[a]));
    if (item < N_PLANES)
        STORE_RESULT(plane, r, 0, 0, 0);
}
