/* block_per_row -- forward: one work-group per output row (plane, ot, oh).
 *
 * The OUT_W outputs of the row are shared among block_size_x / threads_per_output lane groups, and
 * the threads_per_output lanes of a group split the window's rows, then combine their partial
 * results by a tree reduction in local memory.  Large windows (global pooling) get many lanes;
 * small ones get threads_per_output = 1.
 * Launch: N_PLANES * OUT_T * OUT_H groups of block_size_x. */
#define LANE_GROUPS (block_size_x / threads_per_output)
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_OUT PLANES_PARAM OP_PARAMS)
{
    const index_t row = GROUP_ID;
    const index_t oh = row % OUT_H;
    const index_t ot = row / OUT_H % OUT_T;
    const index_t plane = row / ((index_t)OUT_H * OUT_T);
    const int lane = LOCAL_ID_X % threads_per_output;
    const int lane_group = LOCAL_ID_X / threads_per_output;
#if threads_per_output > 1
    LOCAL_MEM reduction_t partial[block_size_x];
#endif
    /* Every work-item runs the same number of iterations, so the barriers below are uniform. */
    for (index_t ow0 = 0; ow0 < OUT_W; ow0 += LANE_GROUPS) {
        const index_t ow = ow0 + lane_group;
        reduction_t r = reduce_init();
        if (ow < OUT_W)
            r = reduce_window_rows(in, plane, ot, oh, ow, lane, threads_per_output OP_ARGS);
#if threads_per_output > 1
        partial[LOCAL_ID_X] = r;
        BARRIER();
        for (int stride = threads_per_output / 2; stride > 0; stride /= 2) {
            if (lane < stride)
                partial[LOCAL_ID_X] = reduce_merge(partial[LOCAL_ID_X], partial[LOCAL_ID_X + stride]);
            BARRIER();
        }
        r = partial[LOCAL_ID_X];
        BARRIER(); /* partial[] is reused by the next iteration */
#endif
        if (lane == 0 && ow < OUT_W)
            STORE_RESULT(OUT_OFFSET(plane, ot, oh, ow), r, ot, oh, ow);
    }
}
