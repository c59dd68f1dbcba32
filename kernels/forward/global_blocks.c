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
 * halving the active members each round (reduce_merge's position rule holds in any order).  With
 * warp_shuffle, the rounds whose partners are fewer than WARP_WIDTH lanes apart exchange within the
 * warp instead (gpu.h): the same pairs merged in the same order, so the same bits.  Every
 * work-item runs the same rounds, so the barriers are uniform.
 *
 * With vector_width > 1 (channels-first, planes a multiple of vector_width long) a member's unit
 * is a vector of that many neighbouring positions, read with one load, instead of one position:
 * a plane then starts on a vector boundary whenever the input does, and the kernel tests the input
 * (vectors_aligned) and reads one position at a time where it does not (an offset view, say).
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
/* Units (of unit_size positions) one member's step of `accumulators` loads covers; a member's unit
 * index looks at most one step past its plane's end (at most 8192 units), within the 32-bit
 * index's margin (OVERSHOOT_MARGIN). */
#define MEMBER_STEP ((index_t)threads_per_plane * accumulators)

/* Add unit `unit` of a plane (its positions unit * unit_size ...) to `partial`: a vector of
 * vector_width positions, or where unit_size is 1 one position. */
DEVICE_FN void reduce_unit(reduction_t* partial, const GLOBAL scalar_t* RESTRICT in, index_t plane_base,
                           index_t unit, int unit_size)
{
#if vector_width > 1
    if (unit_size > 1) {
        acc_t x[vector_width];
        load_vector(in, plane_base / vector_width + unit, x);
#pragma unroll
        for (int k = 0; k < vector_width; ++k)
            reduce_step(partial, x[k], unit * vector_width + k);
        return;
    }
#endif
    reduce_step(partial, LOAD(in, plane_base + unit * ELEMENT_STEP), unit);
}

/* One member's share of a plane read in units of unit_size positions: units member,
 * member + threads_per_plane, ... */
DEVICE_FN reduction_t reduce_member(const GLOBAL scalar_t* RESTRICT in, index_t plane_base, index_t member,
                                    int unit_size)
{
    const index_t units = IN_PLANE_SIZE / unit_size;
    reduction_t partial[accumulators];
#pragma unroll
    for (int a = 0; a < accumulators; ++a)
        partial[a] = reduce_init();
    index_t unit = member;
    for (; unit + (accumulators - 1) * (index_t)threads_per_plane < units; unit += MEMBER_STEP)
#pragma unroll
        for (int a = 0; a < accumulators; ++a)
            reduce_unit(&partial[a], in, plane_base, unit + (index_t)a * threads_per_plane, unit_size);
    /* The last units, fewer than a whole step: partial a takes the a-th, after all its others. */
#pragma unroll
    for (int a = 0; a < accumulators - 1; ++a) {
        const index_t u = unit + (index_t)a * threads_per_plane;
        if (u < units)
            reduce_unit(&partial[a], in, plane_base, u, unit_size);
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
    if (plane < N_PLANES) {
        const index_t plane_base = PLANE_BASE(plane, IN_PLANE_SIZE);
#if vector_width > 1
        r = vectors_aligned(in) ? reduce_member(in, plane_base, member, vector_width)
                                : reduce_member(in, plane_base, member, 1);
#else
        r = reduce_member(in, plane_base, member, 1);
#endif
    }
#if threads_per_plane > 1
    STORE_PARTIAL(partial_value[LOCAL_ID_X], partial_position[LOCAL_ID_X], r);
    BARRIER();
#pragma unroll
    for (int width = threads_per_plane / 2; width > 0; width /= 2) {
        const int distance = width * MEMBER_STRIDE;
        if (warp_shuffle && distance < WARP_WIDTH) {
            r = reduce_merge(r, warp_shuffle_down(r, distance, partial_value IF_SELECTING(, partial_position)));
        } else {
            if (member < width) {
                const int other = LOCAL_ID_X + distance;
                r = reduce_merge(r, PARTIAL(partial_value[other], partial_position[other]));
                STORE_PARTIAL(partial_value[LOCAL_ID_X], partial_position[LOCAL_ID_X], r);
            }
            BARRIER();
        }
    }
#endif
    if (member == 0 && plane < N_PLANES)
        STORE_RESULT(plane, r, 0, 0, 0);
}
