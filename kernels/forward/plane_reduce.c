/* plane_reduce -- forward, global pooling (every output size 1, channels-first: each output reduces
 * one whole contiguous plane): a work-group per plane.
 *
 * Work-item j takes plane elements j, j + block_size_x, ... so neighbouring work-items load
 * neighbouring elements -- contiguous vector loads once CPU compilers vectorise across work-items,
 * with one running result per work-item kept in a vector register -- then work-item 0 merges the
 * partial results in work-item order (selecting ops: the full position rule of reduce_merge, since
 * the partials' positions interleave).  Needs block_size_x <= IN_PLANE_SIZE.
 * Launch: N_PLANES groups of block_size_x. */
#define FULL_CHUNKS (IN_PLANE_SIZE / block_size_x)
#define TAIL_ELEMENTS (IN_PLANE_SIZE % block_size_x)
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_OUT PLANES_PARAM OP_PARAMS)
{
    LOCAL_MEM acc_t partial_value[block_size_x];
    IF_SELECTING(LOCAL_MEM index_t partial_position[block_size_x];)
    const index_t plane = GROUP_ID;
    const index_t plane_base = PLANE_BASE(plane, IN_PLANE_SIZE);
    reduction_t r = reduce_init();
#pragma unroll
    for (int chunk = 0; chunk < FULL_CHUNKS; ++chunk) {
        const index_t position = (index_t)chunk * block_size_x + LOCAL_ID_X;
        reduce_step(&r, LOAD(in, plane_base + position), position OP_ARGS);
    }
    if (TAIL_ELEMENTS != 0 && LOCAL_ID_X < TAIL_ELEMENTS) {
        const index_t position = (index_t)FULL_CHUNKS * block_size_x + LOCAL_ID_X;
        reduce_step(&r, LOAD(in, plane_base + position), position OP_ARGS);
    }
    STORE_PARTIAL(partial_value[LOCAL_ID_X], partial_position[LOCAL_ID_X], r);
    BARRIER();
    if (LOCAL_ID_X == 0) {
        for (int k = 1; k < block_size_x; ++k)
            r = reduce_merge(r, PARTIAL(partial_value[k], partial_position[k]));
        STORE_RESULT(plane, r, 0, 0, 0);
    }
}
