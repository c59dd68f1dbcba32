/* thread_per_row -- forward, the separable form, channels-first: each work-item computes one output
 * row (plane, ot, oh).
 *
 * It reduces the input rows of the row's window column by column into a private row of column
 * partials -- a loop over whole input rows, contiguous and of constant length, which CPU compilers
 * vectorise within the work-item, without the scalar tails of windows' edges -- then each output
 * reduces its window's columns.  Selecting ops: a column partial is the column's first winner (its
 * rows visited in order), and the window's first winner in row-major order is the earliest of its
 * columns' winners, which reduce_merge picks.  The host bounds the private row's size; the row loops
 * stay loops ("unroll 1": vectorising does not need unrolling, and GPU compilers would otherwise
 * try to keep the whole row in registers).
 * Launch: ceil(N_PLANES * OUT_T * OUT_H / block_size_x) groups of block_size_x. */
#if unrolled_columns && OP_SELECTS
#error "unrolled_columns is for accumulating ops (the host refuses it for max pooling)"
#endif
#define OUT_ROWS ((index_t)N_PLANES * OUT_T * OUT_H)
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_OUT PLANES_PARAM OP_PARAMS)
{
    const index_t row = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
#if PARTIAL_LAST_GROUP
    if (row >= OUT_ROWS)
        return;
#endif
    const index_t oh = row % OUT_H, ot = row / OUT_H % OUT_T, plane = row / ((index_t)OUT_H * OUT_T);
    const index_t t_start = T_WINDOW_START(ot), h_start = H_WINDOW_START(oh);
    const index_t window_h = H_WINDOW_END(oh) - h_start;
    const index_t window_rows = (T_WINDOW_END(ot) - t_start) * window_h;
    const index_t plane_base = PLANE_BASE(plane, IN_PLANE_SIZE);
    acc_t column_value[IN_W];
    IF_SELECTING(index_t column_position[IN_W];)
    const index_t first_row = PLANE_POSITION(t_start, h_start, 0, IN_H, IN_W);
#pragma unroll 1
    for (int w = 0; w < IN_W; ++w)
        STORE_PARTIAL(column_value[w], column_position[w], reduce_first(LOAD(in, plane_base + first_row + w), first_row + w OP_ARGS));
    for (index_t k = 1; k < window_rows; ++k) {
        const index_t input_row = PLANE_POSITION(t_start + k / window_h, h_start + k % window_h, 0, IN_H, IN_W);
#pragma unroll 1
        for (int w = 0; w < IN_W; ++w)
            STEP_PARTIAL(column_value[w], column_position[w], LOAD(in, plane_base + input_row + w), input_row + w);
    }
    for (index_t ow = 0; ow < OUT_W; ++ow) {
        const index_t w_start = W_WINDOW_START(ow), w_end = W_WINDOW_END(ow);
        reduction_t r = reduce_init();
#if unrolled_columns
        /* A window at most MAX_WINDOW_W columns wide: one straight-line combination of that many
         * partials, the taps past the window's end masked to the identity (never read), in the
         * loop's order from w_start, so bit-identical to it.  A per-output loop of varying length
         * leaves CPU compilers scalar code; this form they turn into vector loads.  Faster on some
         * shapes and slower on others (README, Kernel variants), so it is tuned. */
#pragma unroll
        for (int k = 0; k < MAX_WINDOW_W; ++k)
            r.value = OP_COMBINE(r.value, IN_WINDOW(w_start, w_end, k, UNIFORM_W) ? column_value[w_start + k] : OP_IDENTITY);
#else
        for (index_t w = w_start; w < w_end; ++w)
            r = reduce_merge(r, PARTIAL(column_value[w], column_position[w]));
#endif
        STORE_RESULT(OUT_OFFSET(plane, ot, oh, ow), r, ot, oh, ow);
    }
}
