/* pyramid_rows -- multi-level forward (pyramid.h), channels-first: a work-item per plane reads it once
 * in memory order, one row of cells (the inputs between two cuts along T and along H) at a time.
 *
 * In channels-first memory a row of cells is one contiguous run per t.  Element j of a run goes to
 * lane j % ROW_LANES, and the lanes step together on contiguous loads, which CPU compilers turn
 * into vector operations within the work-item.  With lanes as wide as an input row (ROW_LANES =
 * IN_W) lane w holds input column w of the row of cells, and at its end the lanes combine into its
 * cells along W; where every level has one column (N_CELLS_W = 1) the row of cells is one cell and
 * the lanes are cell_lanes wide.  Then every output of every level from the cells of its window.
 *
 * The lanes combine values only (and avgmax's sums).  A selecting op then finds each cell's
 * position in a second pass over the cell, which is still in cache (FIND_POSITION, pyramid.h) --
 * the position rule without positions in the hot loop.
 * Launch: ceil(N_PLANES / block_size_x) groups of block_size_x. */
#if N_CELLS_W == 1
#define ROW_LANES cell_lanes
#define CELL_COLUMNS(cw, first, end) const int first = 0, end = ROW_LANES
#else
#define ROW_LANES IN_W
#define CELL_COLUMNS(cw, first, end) const int first = (int)cuts_w[cw], end = (int)cuts_w[(cw) + 1]
#endif

/* Lanes: the running values (and avgmax's sums) of the elements of each lane. */
#define LANES()                                     \
    acc_t lane_value[ROW_LANES];                    \
    IF_ALSO_MEAN(acc_t lane_sum[ROW_LANES];)

/* Add the element at plane position `position` to lane k. */
#define LANE_STEP(k, position)                                                          \
    do {                                                                                \
        const acc_t x_ = LOAD(in, plane_base + (position) * ELEMENT_STEP);              \
        lane_value[k] = OP_COMBINE(lane_value[k], OP_MAP(x_));                          \
        IF_ALSO_MEAN(lane_sum[k] += x_;)                                                \
    } while (0)


/* Combine lanes [first, end) into cell cw of the row of cells (ct, ch). */
#define MERGE_LANES(cw, first, end)                                             \
    {                                                                           \
        cell_t c_ = cell_init();                                                \
        PARTIALS_LOOP                                                           \
        for (int k = first; k < end; ++k) {                                     \
            c_.r.value = OP_COMBINE(c_.r.value, lane_value[k]);                 \
            IF_ALSO_MEAN(c_.sum += lane_sum[k];)                                \
        }                                                                       \
        FIND_POSITION(c_, in, plane_base, ct, ch, cw);                          \
        PUT_CELL((ct * N_CELLS_H + ch) * N_CELLS_W + (cw), c_);                 \
    }

KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_OUT PLANES_PARAM)
{
    const index_t plane = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (plane >= N_PLANES)
        return;
    CELL_ARRAYS()
    LANES()
    const index_t plane_base = PLANE_BASE(plane, IN_PLANE_SIZE);
    for (int ct = 0; ct < N_CELLS_T; ++ct)
        for (int ch = 0; ch < N_CELLS_H; ++ch) {
            PARTIALS_LOOP
            for (int k = 0; k < ROW_LANES; ++k) {
                lane_value[k] = OP_IDENTITY;
                IF_ALSO_MEAN(lane_sum[k] = (acc_t)0;)
            }
            const index_t run_length = (index_t)(cuts_h[ch + 1] - cuts_h[ch]) * IN_W;
            for (index_t t = cuts_t[ct]; t < cuts_t[ct + 1]; ++t) {
                const index_t start = PLANE_POSITION(t, cuts_h[ch], 0, IN_H, IN_W);
                index_t j = 0;
                for (; j + ROW_LANES <= run_length; j += ROW_LANES)
                    PARTIALS_LOOP
                    for (int k = 0; k < ROW_LANES; ++k)
                        LANE_STEP(k, start + j + k);
                PARTIALS_LOOP
                for (int k = 0; j + k < run_length; ++k)
                    LANE_STEP(k, start + j + k);
            }
#if defined(CELLS_W) && N_CELLS_W > 1 && STRAIGHT_LINE_PARTIALS
            CELLS_W(MERGE_LANES)
#else
            for (int cw = 0; cw < N_CELLS_W; ++cw) {
                CELL_COLUMNS(cw, first, end);
                MERGE_LANES(cw, first, end)
            }
#endif
        }
    FINISH_PLANE(plane);
}
