/* global_planes -- forward, global pooling (every output size 1), channels-first: each output
 * reduces one whole contiguous plane.
 *
 * split work-items share a plane, each reducing one contiguous part of it (reduce_run: run_lanes
 * independent lanes, contiguous loads), and neighbouring groups of split work-items take
 * neighbouring planes; a work-item takes planes_per_item planes, one work-group's worth of planes
 * apart.  With split > 1 the parts' partial results meet in local memory and the plane's first
 * work-item merges them in part order (selecting ops: reduce_merge's position rule).  Every
 * work-item runs the same iterations, so the barriers are uniform.
 * Launch: ceil(N_PLANES / (PLANES_PER_GROUP * planes_per_item)) groups of block_size_x. */
#define PLANES_PER_GROUP (block_size_x / split)
/* The elements of each part: the plane's share per work-item, rounded up to whole lane steps. */
#define PART_SIZE ((IN_PLANE_SIZE + split * run_lanes - 1) / (split * run_lanes) * run_lanes)
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_OUT PLANES_PARAM OP_PARAMS)
{
#if split > 1
    LOCAL_MEM acc_t partial_value[block_size_x];
    IF_SELECTING(LOCAL_MEM index_t partial_position[block_size_x];)
#endif
    const int part = LOCAL_ID_X % split;
    const index_t part_start = (index_t)part * PART_SIZE;
    const index_t part_end = part_start + PART_SIZE < IN_PLANE_SIZE ? part_start + PART_SIZE : IN_PLANE_SIZE;
    for (int k = 0; k < planes_per_item; ++k) {
        const index_t plane = ((index_t)GROUP_ID * planes_per_item + k) * PLANES_PER_GROUP + LOCAL_ID_X / split;
        reduction_t r = reduce_init();
        if (plane < N_PLANES && part_start < part_end)
            r = reduce_run(in, PLANE_BASE(plane, IN_PLANE_SIZE), part_start, part_end - part_start OP_ARGS);
#if split > 1
        STORE_PARTIAL(partial_value[LOCAL_ID_X], partial_position[LOCAL_ID_X], r);
        BARRIER();
        if (part == 0)
            for (int j = 1; j < split; ++j)
                r = reduce_merge(r, PARTIAL(partial_value[LOCAL_ID_X + j], partial_position[LOCAL_ID_X + j]));
        BARRIER(); /* the partials are rewritten by the next plane */
#endif
        if (part == 0 && plane < N_PLANES)
            STORE_RESULT(plane, r, 0, 0, 0);
    }
}
