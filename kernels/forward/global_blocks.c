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
 *
 * With split > 1 (a few huge planes) each plane is cut into `split` parts of neighbouring units,
 * each reduced by its own team in its own work-group, so that a few planes still fill the device:
 * the part's result goes to slot plane * split + part of the scratch buffer, and a second pass
 * (COMBINE_PASS, the same arguments) merges each plane's slots in part order -- a fixed order, so
 * the same bits on every run; the parts are disjoint runs of increasing positions, so reduce_merge
 * keeps the position rule.  The scratch holds the slots' positions (selecting ops), then their
 * values, each array padded to an even count so that the values start 8-byte aligned.
 * Launch: ceil(N_PLANES / PLANES_PER_GROUP) * split groups of block_size_x; the second pass
 * ceil(N_PLANES / block_size_x) groups of block_size_x, a work-item per plane. */
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

#if split > 1
#define SCRATCH_PARAM , GLOBAL int64_t_* RESTRICT scratch
/* The scratch slots (above): PARTIAL_POSITIONS[slot] (selecting ops), PARTIAL_VALUES[slot]. */
#define SLOTS_PADDED (((index_t)N_PLANES * split + 1) / 2 * 2)
#define PARTIAL_POSITIONS ((GLOBAL index_t*)scratch)
#define PARTIAL_VALUES ((GLOBAL acc_t*)(PARTIAL_POSITIONS + (OP_SELECTS ? SLOTS_PADDED : 0)))
#else
#define SCRATCH_PARAM
#endif

/* Add unit `unit` of a plane (its positions unit * unit_size ...) to `partial`: a vector of
 * vector_width positions, or where unit_size is 1 one position. */
DEVICE_FN void reduce_unit(reduction_t* partial, const GLOBAL scalar_t* RESTRICT in, index_t plane_base,
                           index_t unit, int unit_size OP_PARAMS)
{
#if vector_width > 1
    if (unit_size > 1) {
        acc_t x[vector_width];
        load_vector(in, plane_base / vector_width + unit, x);
#pragma unroll
        for (int k = 0; k < vector_width; ++k)
            reduce_step(partial, x[k], unit * vector_width + k OP_ARGS);
        return;
    }
#endif
    reduce_step(partial, LOAD(in, plane_base + unit * ELEMENT_STEP), unit OP_ARGS);
}

/* One member's share of part `part` of a plane read in units of unit_size positions: of the part's
 * units first, first + 1, ... (the plane's units cut into `split` runs of equal length, the last
 * shorter), the units first + member, first + member + threads_per_plane, ... */
DEVICE_FN reduction_t reduce_member(const GLOBAL scalar_t* RESTRICT in, index_t plane_base, index_t part,
                                    index_t member, int unit_size OP_PARAMS)
{
    const index_t plane_units = IN_PLANE_SIZE / unit_size;
    const index_t part_units = (plane_units + split - 1) / split;
    const index_t first = part * part_units;
    const index_t units = first + part_units < plane_units ? first + part_units : plane_units;
    reduction_t partial[accumulators];
#pragma unroll
    for (int a = 0; a < accumulators; ++a)
        partial[a] = reduce_init();
    index_t unit = first + member;
    for (; unit + (accumulators - 1) * (index_t)threads_per_plane < units; unit += MEMBER_STEP)
#pragma unroll
        for (int a = 0; a < accumulators; ++a)
            reduce_unit(&partial[a], in, plane_base, unit + (index_t)a * threads_per_plane, unit_size OP_ARGS);
    /* The last units, fewer than a whole step: partial a takes the a-th, after all its others. */
#pragma unroll
    for (int a = 0; a < accumulators - 1; ++a) {
        const index_t u = unit + (index_t)a * threads_per_plane;
        if (u < units)
            reduce_unit(&partial[a], in, plane_base, u, unit_size OP_ARGS);
    }
    reduction_t r = partial[0];
#pragma unroll
    for (int a = 1; a < accumulators; ++a)
        r = reduce_merge(r, partial[a]);
    return r;
}

#if COMBINE_PASS
/* The second pass: each plane's result from its parts' slots, merged in part order. */
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_OUT SCRATCH_PARAM
                         PLANES_PARAM OP_PARAMS)
{
    const index_t plane = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (plane >= N_PLANES)
        return;
    reduction_t r = reduce_init();
    for (int part = 0; part < split; ++part) {
        const index_t slot = plane * split + part;
        r = reduce_merge(r, PARTIAL(PARTIAL_VALUES[slot], PARTIAL_POSITIONS[slot]));
    }
    STORE_RESULT(plane, r, 0, 0, 0);
}
#else
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_OUT SCRATCH_PARAM
                         PLANES_PARAM OP_PARAMS)
{
#if threads_per_plane > 1
    LOCAL_MEM acc_t partial_value[block_size_x];
    IF_SELECTING(LOCAL_MEM index_t partial_position[block_size_x];)
#endif
    const int member = TEAM_MEMBER;
    const index_t part = (index_t)GROUP_ID % split;
    const index_t plane = (index_t)GROUP_ID / split * PLANES_PER_GROUP + TEAM_SLOT;
    reduction_t r = reduce_init();
    if (plane < N_PLANES) {
        const index_t plane_base = PLANE_BASE(plane, IN_PLANE_SIZE);
#if vector_width > 1
        r = vectors_aligned(in) ? reduce_member(in, plane_base, part, member, vector_width OP_ARGS)
                                : reduce_member(in, plane_base, part, member, 1 OP_ARGS);
#else
        r = reduce_member(in, plane_base, part, member, 1 OP_ARGS);
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
    if (member == 0 && plane < N_PLANES) {
#if split > 1
        const index_t slot = plane * split + part;
        STORE_PARTIAL(PARTIAL_VALUES[slot], PARTIAL_POSITIONS[slot], r);
#else
        STORE_RESULT(plane, r, 0, 0, 0);
#endif
    }
}
#endif
