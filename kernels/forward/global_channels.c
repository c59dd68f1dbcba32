/* global_channels -- forward, global pooling (every output size 1), channels-last: each output
 * reduces one channel of one batch entry over every position, elements N_CHANNELS apart.
 *
 * Work-item i reduces channels_per_item neighbouring channels of one batch entry (channels_per_item
 * divides N_CHANNELS, so they never straddle two entries): at every position it loads them as one
 * contiguous run, which the compiler turns into vector loads and adds.  Each channel keeps PARTIALS
 * independent partial values, partial a taking positions a, a + PARTIALS, ..., so that no step
 * waits on the one before; they are combined in order at the end.  The partials are values only,
 * for every op: a selecting op (max) then finds each channel's position in a second pass over its
 * elements, still in cache -- the first element the combined value does not beat, or the last
 * where ties go to the later position (reduction.h's position rule) -- so that the hot loop is
 * the same vector code as an accumulating op's, with no positions to carry.
 * With one channel per work-item the work-group takes the steps together, a barrier after each: no
 * data is shared, but CPU runtimes then run each step for all the group's work-items at once --
 * vector code across work-items over contiguous channels.  Work-items past the last channel run
 * reduce the last one again (every work-item must reach the barriers) and store nothing.
 * Launch: ceil(N_PLANES / channels_per_item / block_size_x) groups of block_size_x. */
#define PARTIALS (accumulators < IN_PLANE_SIZE ? accumulators : IN_PLANE_SIZE)
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_OUT PLANES_PARAM OP_PARAMS)
{
    const index_t items = N_PLANES / channels_per_item;
    const index_t item = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    const index_t first_plane = (item < items ? item : items - 1) * channels_per_item;
    const index_t base = PLANE_BASE(first_plane, IN_PLANE_SIZE);
    acc_t partial[channels_per_item][PARTIALS];
#pragma unroll
    for (int a = 0; a < PARTIALS; ++a)
#pragma unroll
        for (int c = 0; c < channels_per_item; ++c)
            partial[c][a] = OP_MAP(LOAD(in, base + a * ELEMENT_STEP + c));
    for (index_t p = PARTIALS; p < IN_PLANE_SIZE; p += PARTIALS) {
#pragma unroll
        for (int a = 0; a < PARTIALS; ++a)
            if (IN_PLANE_SIZE % PARTIALS == 0 || p + a < IN_PLANE_SIZE)
#pragma unroll
                for (int c = 0; c < channels_per_item; ++c)
                    partial[c][a] = OP_COMBINE(partial[c][a], OP_MAP(LOAD(in, base + (p + a) * ELEMENT_STEP + c)));
#if channels_per_item == 1
        BARRIER();
#endif
    }
    reduction_t r[channels_per_item];
#pragma unroll
    for (int c = 0; c < channels_per_item; ++c) {
        r[c] = reduce_init();
#pragma unroll
        for (int a = 0; a < PARTIALS; ++a)
            r[c].value = OP_COMBINE(r[c].value, partial[c][a]);
    }
    for (index_t p = 0; p < POSITION_PASS_LENGTH(IN_PLANE_SIZE); ++p)
#pragma unroll
        for (int c = 0; c < channels_per_item; ++c)
            POSITION_STEP(r[c], LOAD(in, base + p * ELEMENT_STEP + c), p);
#pragma unroll
    for (int c = 0; c < channels_per_item; ++c)
        if (item < items)
            STORE_RESULT(first_plane + c, r[c], 0, 0, 0);
}
