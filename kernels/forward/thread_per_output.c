/* thread_per_output -- forward: each work-item reduces whole windows.
 *
 * Each work-item computes outputs_per_thread outputs, block_size_x apart in memory order, so that
 * neighbouring work-items always write neighbouring outputs (in channels-last memory they are
 * neighbouring channels, which also read neighbouring inputs).  A window that fits the small box is
 * reduced by unrolled straight-line code (reduce_small_window), others run by run
 * (reduce_window_rows, with row_lanes lanes).  Branch-free work-items vectorise on CPUs, so only
 * where the grid can run past the last output (host define PARTIAL_LAST_GROUP: one sample's outputs
 * do not fill whole work-groups, pool_tuner/variants.py) is there a bounds check, and only in the
 * last work-group: the condition is the same for a whole group, so compilers keep the other
 * groups' code branch-free.
 * Launch: ceil(OUT_NUMEL / (block_size_x * outputs_per_thread)) groups of block_size_x. */
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_OUT PLANES_PARAM OP_PARAMS)
{
    const index_t first = (index_t)GROUP_ID * (block_size_x * outputs_per_thread) + LOCAL_ID_X;
    const int whole_group = !PARTIAL_LAST_GROUP || (GROUP_ID + 1) * (block_size_x * outputs_per_thread) <= OUT_NUMEL;
    for (int k = 0; k < outputs_per_thread; ++k) {
        const index_t o = first + (index_t)k * block_size_x;
        if (!whole_group && o >= OUT_NUMEL)
            return;
        index_t plane, ot, oh, ow;
        OUT_COORDS(o, plane, ot, oh, ow);
#if SMALL_WINDOW && row_lanes == 1
        const reduction_t r = reduce_small_window(in, plane, ot, oh, ow OP_ARGS);
#else
        const reduction_t r = reduce_window_rows(in, plane, ot, oh, ow, 0, 1 OP_ARGS);
#endif
        STORE_RESULT(o, r, ot, oh, ow);
    }
}
