/* global_blocks -- forward, global pooling (every output size 1), either layout, shaped for GPUs:
 * a team of threads_per_plane work-items reduces each plane, a work-group holding
 * PLANES_PER_GROUP teams side by side.
 *
 * Member m of a plane's team takes the plane's positions m, m + threads_per_plane, ... so that at
 * every step the team reads neighbouring positions: one contiguous run of a channels-first plane.
 * In channels-last memory neighbouring planes are neighbouring channels, so there the teams are
 * interleaved instead -- work-item i is slot i % PLANES_PER_GROUP of member i / PLANES_PER_GROUP --
 * and at every step a work-group reads PLANES_PER_GROUP neighbouring channels of each position.
 * Each member keeps `accumulators` independent partial results (partial a taking the member's
 * steps a, a + accumulators, ..., each in increasing position order, so each keeps its first
 * winner): that many loads in flight, none waiting on the one before.  A member merges its
 * partials in order, then the team's partials meet in local memory and are merged by a tree,
 * halving the active members each round (reduce_merge's position rule holds in any order).
 * Every work-item runs the same rounds, so the barriers are uniform.
 * Launch: ceil(N_PLANES / PLANES_PER_GROUP) groups of block_size_x. */
#define PLANES_PER_GROUP (block_size_x / threads_per_plane)
#if CHANNELS_LAST
#define TEAM_SLOT (LOCAL_ID_X % PLANES_PER_GROUP)
#define TEAM_MEMBER (LOCAL_ID_X / PLANES_PER_GROUP)
/* Local-memory distance between neighbouring members of one team. */
#define MEMBER_STRIDE PLANES_PER_GROUP
#else
#define TEAM_SLOT (LOCAL_ID_X / threads_per_plane)
#define TEAM_MEMBER (LOCAL_ID_X % threads_per_plane)
#define MEMBER_STRIDE 1
#endif
/* Elements one member's step of `accumulators` loads covers; a member looks at most one step past
 * its plane's end (at most 8192 positions), within the 32-bit index's margin (OVERSHOOT_MARGIN). */
#define MEMBER_STEP ((index_t)threads_per_plane * accumulators)

/* One member's share of a plane: positions member, member + threads_per_plane, ... */
DEVICE_FN reduction_t reduce_member(const GLOBAL scalar_t* RESTRICT in, index_t plane_base, index_t member)
{
    reduction_t partial[accumulators];
#pragma unroll
    for (int a = 0; a < accumulators; ++a)
        partial[a] = reduce_init();
    index_t position = member;
    for (; position + (accumulators - 1) * (index_t)threads_per_plane < IN_PLANE_SIZE; position += MEMBER_STEP)
#pragma unroll
        for (int a = 0; a < accumulators; ++a) {
            const index_t p = position + (index_t)a * threads_per_plane;
            reduce_step(&partial[a], LOAD(in, plane_base + p * ELEMENT_STEP), p);
        }
    /* The last positions, fewer than a whole step: partial a takes the a-th, after all its others. */
#pragma unroll
    for (int a = 0; a < accumulators - 1; ++a) {
        const index_t p = position + (index_t)a * threads_per_plane;
        if (p < IN_PLANE_SIZE)
            reduce_step(&partial[a], LOAD(in, plane_base + p * ELEMENT_STEP), p);
    }
    reduction_t r = partial[0];
#pragma unroll
    for (int a = 1; a < accumulators; ++a)
        r = reduce_merge(r, partial[a]);
    return r;
}

KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_OUT PLANES_PARAM)
{
#if threads_per_plane > 1
    LOCAL_MEM acc_t partial_value[block_size_x];
    IF_SELECTING(LOCAL_MEM index_t partial_position[block_size_x];)
#endif
    const int member = TEAM_MEMBER;
    const index_t plane = (index_t)GROUP_ID * PLANES_PER_GROUP + TEAM_SLOT;
    reduction_t r = reduce_init();
    if (plane < N_PLANES)
        r = reduce_member(in, PLANE_BASE(plane, IN_PLANE_SIZE), member);
#if threads_per_plane > 1
    STORE_PARTIAL(partial_value[LOCAL_ID_X], partial_position[LOCAL_ID_X], r);
    BARRIER();
#pragma unroll
    for (int width = threads_per_plane / 2; width > 0; width /= 2) {
        if (member < width) {
            const int other = LOCAL_ID_X + width * MEMBER_STRIDE;
            r = reduce_merge(r, PARTIAL(partial_value[other], partial_position[other]));
            STORE_PARTIAL(partial_value[LOCAL_ID_X], partial_position[LOCAL_ID_X], r);
        }
        BARRIER();
    }
#endif
    if (member == 0 && plane < N_PLANES)
        STORE_RESULT(plane, r, 0, 0, 0);
}
