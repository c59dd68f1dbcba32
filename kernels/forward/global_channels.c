/* global_channels -- forward, global pooling (every output size 1), channels-last: each output
 * reduces one channel of one batch entry over every position, elements N_CHANNELS apart.
 *
 * Work-item i reduces channels_per_item neighbouring channels of one batch entry (channels_per_item
 * divides N_CHANNELS, so they never straddle two entries): at every position it loads them as one
 * contiguous run, which the compiler turns into vector loads and adds.  Each channel keeps PARTIALS
 * independent partial results (reduction.h's partial slots), partial a taking positions a,
 * a + PARTIALS, ... (each visited in increasing order, so each keeps its first winner), so that no
 * step waits on the one before; they are merged in order at the end (reduce_merge's position rule).
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
    acc_t partial_value[channels_per_item][PARTIALS];
    IF_SELECTING(index_t partial_position[channels_per_item][PARTIALS];)
#pragma unroll
    for (int a = 0; a < PARTIALS; ++a)
#pragma unroll
        for (int c = 0; c < channels_per_item; ++c)
            STORE_PARTIAL(partial_value[c][a], partial_position[c][a],
                          reduce_first(LOAD(in, base + a * ELEMENT_STEP + c), a OP_ARGS));
    for (index_t p = PARTIALS; p < IN_PLANE_SIZE; p += PARTIALS) {
#pragma unroll
        for (int a = 0; a < PARTIALS; ++a)
            if (IN_PLANE_SIZE % PARTIALS == 0 || p + a < IN_PLANE_SIZE)
#pragma unroll
                for (int c = 0; c < channels_per_item; ++c)
                    STEP_PARTIAL(partial_value[c][a], partial_position[c][a],
                                 LOAD(in, base + (p + a) * ELEMENT_STEP + c), p + a);
#if channels_per_item == 1
        BARRIER();
#endif
    }
#pragma unroll
    for (int c = 0; c < channels_per_item; ++c) {
        reduction_t r = reduce_init();
#pragma unroll
        for (int a = 0; a < PARTIALS; ++a)
            r = reduce_merge(r, PARTIAL(partial_value[c][a], partial_position[c][a]));
        if (item < items)
            STORE_RESULT(first_plane + c, r, 0, 0, 0);
    }
}
