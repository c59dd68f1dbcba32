/* pyramid.h -- multi-level pooling (pool_tuner/pyramid.py): the level tables, and the cells that the
 * pyramid kernels reduce once and combine into every level's windows.
 *
 * A multi-level op pools one input to N_LEVELS output sizes (levels) at once.  Its values are one
 * buffer, level after level: level l's outputs of every plane start at N_PLANES * level_value_base[l]
 * and are laid out as that level pooled alone (contiguous or channels-last); a max level's indices
 * likewise from N_PLANES * level_index_base[l] of the index buffer, which holds the max levels only.
 * An average level of a selecting op (avgmax: the max operator with ALSO_MEAN) takes its mean from
 * the sums kept beside the maximum.
 *
 * The cut-point method: along each axis the window bounds of every level cut the input into cells
 * (cuts_<axis>[k] .. cuts_<axis>[k + 1]); every window of every level is a box of whole cells,
 * window_first_cell_<axis>[..] .. window_end_cell_<axis>[..].  A cell reduces like a window
 * (reduction.h); the cells of a window combine with reduce_merge, whose position rule is the
 * window's: the result is the window's own.
 *
 * The shared headers (windows.h, reduction.h) are built with the first level as their output size;
 * these kernels read only their memory layout and their reductions, and the tables below for every
 * level.  Constant tables and the two differences of language below are declared here rather
 * than in prelude.h so that the single-level kernels' sources, which identify their tuning
 * records, stay as they are. */

#ifdef __OPENCL_VERSION__
#define TABLE(name) __constant int64_t_ name[]
#define TABLE_PARAM(name) __constant int64_t_* name
#else
#define TABLE(name) static __constant__ __attribute__((unused)) int64_t_ name[]
#define TABLE_PARAM(name) const int64_t_* name
#endif

/* A work-item's many partial results as plain scalars in straight-line code (the constant window
 * list below): what CPU compilers, PoCL's among them, vectorise and keep in registers, where a
 * GPU's registers would spill.  For the same reason a loop over such an array (PARTIALS_LOOP before
 * it) is left to the compiler in OpenCL, and kept a loop over local memory in CUDA. */
#ifdef __OPENCL_VERSION__
#define STRAIGHT_LINE_PARTIALS 1
#define PARTIALS_LOOP
#else
#define STRAIGHT_LINE_PARTIALS 0
#define PARTIALS_LOOP _Pragma("unroll 1")
#endif

TABLE(level_out_t) = LEVEL_OUT_T;
TABLE(level_out_h) = LEVEL_OUT_H;
TABLE(level_out_w) = LEVEL_OUT_W;
TABLE(level_value_base) = LEVEL_VALUE_BASE;
TABLE(level_index_base) = LEVEL_INDEX_BASE;
TABLE(level_is_mean) = LEVEL_IS_MEAN;

/* Outputs per plane of level l. */
#define LEVEL_SIZE(l) ((index_t)level_out_t[l] * level_out_h[l] * level_out_w[l])

/* Memory offset of output q (its position within its plane) of level l in `plane`, in a buffer
 * whose level l starts at N_PLANES * base. */
#define LEVEL_OFFSET(base, l, plane, q) \
    ((index_t)N_PLANES * (base) + PLANE_BASE(plane, LEVEL_SIZE(l)) + (index_t)(q) * ELEMENT_STEP)

/* The level of output q of a plane, counting every level's outputs in turn (q < VALUES_PER_PLANE). */
DEVICE_FN int level_of(index_t q)
{
    int level = 0;
    for (int l = 1; l < N_LEVELS; ++l)
        level = q >= level_value_base[l] ? l : level;
    return level;
}

/* ---------------------------------------------------------------- a reduction with its mean
 * A cell or window reduction: the op's (reduction.h) and, for a selecting op with ALSO_MEAN, the
 * plain sum beside it, which the average levels finish. */
typedef struct {
    reduction_t r;
#if ALSO_MEAN
    acc_t sum;
#endif
} cell_t;

DEVICE_FN cell_t cell_init(void)
{
    cell_t c;
    c.r = reduce_init();
#if ALSO_MEAN
    c.sum = (acc_t)0;
#endif
    return c;
}

/* Add the element `value` at plane position `position` (in increasing position order). */
DEVICE_FN void cell_step(cell_t* c, acc_t value, index_t position)
{
    reduce_step(&c->r, value, position);
#if ALSO_MEAN
    c->sum += value;
#endif
}

/* Combine the reductions of two disjoint boxes, in any order. */
DEVICE_FN cell_t cell_merge(cell_t a, cell_t b)
{
    a.r = reduce_merge(a.r, b.r);
#if ALSO_MEAN
    a.sum += b.sum;
#endif
    return a;
}

/* Is level l an average (its output the mean of its window, its gradient shared by the window)?
 * Every level of an accumulating op (avg), none of a selecting op but avgmax's average level. */
#if ALSO_MEAN
#define IS_MEAN_LEVEL(l) level_is_mean[l]
#define CELL_SUM(c) (c).sum
#else
#define IS_MEAN_LEVEL(l) (!OP_SELECTS)
#define CELL_SUM(c) (c).r.value
#endif

/* Write output q of level l in `plane` from the reduction `c` of its window of `area` elements:
 * an average level's mean, or the op's result (and a selecting op's index). */
#define STORE_LEVEL_RESULT(l, plane, q, c, area)                                                        \
    do {                                                                                                \
        const index_t value_at_ = LEVEL_OFFSET(level_value_base[l], l, plane, q);                       \
        if (IS_MEAN_LEVEL(l)) {                                                                         \
            STORE(out, value_at_, CELL_SUM(c) / (acc_t)(area));                                         \
        } else {                                                                                        \
            STORE(out, value_at_, OP_FINISH((c).r.value, area));                                        \
            IF_SELECTING(indices[LEVEL_OFFSET(level_index_base[l], l, plane, q)] = (int64_t_)(c).r.position;) \
        }                                                                                               \
    } while (0)

/* ---------------------------------------------------------------- cells (the cell variants) */
#ifdef CUTS_W
TABLE(cuts_t) = CUTS_T;
TABLE(cuts_h) = CUTS_H;
TABLE(cuts_w) = CUTS_W;
TABLE(window_first_cell_t) = WINDOW_FIRST_CELL_T;
TABLE(window_first_cell_h) = WINDOW_FIRST_CELL_H;
TABLE(window_first_cell_w) = WINDOW_FIRST_CELL_W;
TABLE(window_end_cell_t) = WINDOW_END_CELL_T;
TABLE(window_end_cell_h) = WINDOW_END_CELL_H;
TABLE(window_end_cell_w) = WINDOW_END_CELL_W;
TABLE(level_window_base_t) = LEVEL_WINDOW_BASE_T;
TABLE(level_window_base_h) = LEVEL_WINDOW_BASE_H;
TABLE(level_window_base_w) = LEVEL_WINDOW_BASE_W;

#define N_CELLS (N_CELLS_T * N_CELLS_H * N_CELLS_W)

/* A plane's input rows (t, h) in memory order, the statement that follows run for each, with
 * `row_cells` the number of the first cell of the row of cells that holds the row (that row's cell
 * cw is row_cells + cw): the cell rows along T and H advance as t and h pass their cuts. */
#define FOR_EACH_INPUT_ROW(t, h, row_cells)                                                          \
    for (index_t t = 0, ct_ = 0; t < IN_T; ++t, ct_ += t == cuts_t[ct_ + 1])                        \
        for (index_t h = 0, ch_ = 0, row_cells = ct_ * N_CELLS_H * N_CELLS_W; h < IN_H;              \
             ++h, ch_ += h == cuts_h[ch_ + 1], row_cells = (ct_ * N_CELLS_H + ch_) * N_CELLS_W)

/* The cells of output q (within its level's plane) of level l: [*_first, *_end) along each axis,
 * and the window's area from their cuts. */
#define WINDOW_CELLS(l, q)                                                                              \
    const index_t ow_ = (q) % level_out_w[l], oh_ = (q) / level_out_w[l] % level_out_h[l];              \
    const index_t ot_ = (q) / (level_out_w[l] * level_out_h[l]);                                        \
    const int t_first = (int)window_first_cell_t[level_window_base_t[l] + ot_];                         \
    const int t_end = (int)window_end_cell_t[level_window_base_t[l] + ot_];                             \
    const int h_first = (int)window_first_cell_h[level_window_base_h[l] + oh_];                         \
    const int h_end = (int)window_end_cell_h[level_window_base_h[l] + oh_];                             \
    const int w_first = (int)window_first_cell_w[level_window_base_w[l] + ow_];                         \
    const int w_end = (int)window_end_cell_w[level_window_base_w[l] + ow_];                             \
    const index_t area = (index_t)(cuts_t[t_end] - cuts_t[t_first]) * (cuts_h[h_end] - cuts_h[h_first]) \
                       * (cuts_w[w_end] - cuts_w[w_first])

/* Partial reductions as arrays of their parts (local or private memory): `name`_value, a selecting
 * op's `name`_position and ALSO_MEAN's `name`_sum, declared with PARTS(qualifier, name, count). */
#if ALSO_MEAN
#define IF_ALSO_MEAN(...) __VA_ARGS__
#else
#define IF_ALSO_MEAN(...)
#endif
#define PARTS(qualifier, name, count)                           \
    qualifier acc_t name##_value[count];                        \
    IF_SELECTING(qualifier index_t name##_position[count];)     \
    IF_ALSO_MEAN(qualifier acc_t name##_sum[count];)
#define PUT_PART(name, k, c)                                    \
    do {                                                        \
        name##_value[k] = (c).r.value;                          \
        IF_SELECTING(name##_position[k] = (c).r.position;)      \
        IF_ALSO_MEAN(name##_sum[k] = (c).sum;)                  \
    } while (0)
#if OP_SELECTS
#define PART_POSITION(name, k) name##_position[k]
#else
#define PART_POSITION(name, k) ((index_t)-1)
#endif
#define GET_PART(name, k, c)                                    \
    do {                                                        \
        (c).r.value = name##_value[k];                          \
        (c).r.position = PART_POSITION(name, k);                \
        IF_ALSO_MEAN((c).sum = name##_sum[k];)                  \
    } while (0)
#define CELL_ARRAYS(qualifier) PARTS(qualifier, cell, N_CELLS)
#define PUT_CELL(k, c) PUT_PART(cell, k, c)
#define GET_CELL(k, c) GET_PART(cell, k, c)

#if OP_SELECTS
/* The position of the cell (ct, ch, cw) whose elements combine to `value`: the first element in
 * position order that `value` does not beat, or the last where ties go to the later position.
 * Every element is visited (no early exit), so the search is a min over its runs (a max where ties
 * go to the later position, a copy of its own), which CPU compilers vectorise.  The runs: where
 * every level has one column, the cell's rows (one run per t), else each row's part of the cell.
 * pyramid_rows finds its cells' positions so, after reducing their values alone. */
#define HELD_POSITIONS(start, length)                                                                   \
    for (index_t j = 0; j < (length); ++j) {                                                           \
        const index_t position = (start) + j;                                                           \
        const int held = !OP_BEATS(value, OP_MAP(LOAD(in, plane_base + position * ELEMENT_STEP)));     \
        const index_t candidate = held ? position : none;                                               \
        found = (to_later ? candidate > found : candidate < found) ? candidate : found;                 \
    }
DEVICE_FN index_t position_in_cell(const GLOBAL scalar_t* RESTRICT in, index_t plane_base, int ct, int ch, int cw,
                                   acc_t value, const int to_later)
{
    const index_t none = to_later ? -1 : IN_PLANE_SIZE;
    index_t found = none;
    for (index_t t = cuts_t[ct]; t < cuts_t[ct + 1]; ++t) {
#if N_CELLS_W == 1
        (void)cw;
        HELD_POSITIONS(PLANE_POSITION(t, cuts_h[ch], 0, IN_H, IN_W), (cuts_h[ch + 1] - cuts_h[ch]) * IN_W)
#else
        for (index_t h = cuts_h[ch]; h < cuts_h[ch + 1]; ++h)
            HELD_POSITIONS(PLANE_POSITION(t, h, cuts_w[cw], IN_H, IN_W), cuts_w[cw + 1] - cuts_w[cw])
#endif
    }
    return found;
}
/* The two orders get their own copies of the search, each one reduction. */
#define FIND_POSITION(c, in, plane_base, ct, ch, cw)                                                                   \
    ((c).r.position = OP_TIE_TO_LATER((c).r.value) ? position_in_cell(in, plane_base, ct, ch, cw, (c).r.value, 1) \
                                                   : position_in_cell(in, plane_base, ct, ch, cw, (c).r.value, 0))
#else
#define FIND_POSITION(c, in, plane_base, ct, ch, cw) ((void)0)
#endif

/* Combine the cells [t_first, t_end) x [h_first, h_end) x [w_first, w_end) of a window, in cell
 * order, and write them as output q of level l. */
#define COMBINE_CELLS_AND_STORE(l, plane, q, t_first, t_end, h_first, h_end, w_first, w_end, area) \
    do {                                                                                    \
        cell_t window_ = cell_init();                                                       \
        for (int ct = t_first; ct < t_end; ++ct)                                            \
            for (int ch = h_first; ch < h_end; ++ch)                                        \
                for (int cw = w_first; cw < w_end; ++cw) {                                  \
                    cell_t c_;                                                              \
                    GET_CELL((ct * N_CELLS_H + ch) * N_CELLS_W + cw, c_);                   \
                    window_ = cell_merge(window_, c_);                                      \
                }                                                                           \
        STORE_LEVEL_RESULT(l, plane, q, window_, area);                                     \
    } while (0)

/* Combine the cells of output q of level l, read from the tables, and write it. */
#define COMBINE_AND_STORE(l, plane, q)                                                      \
    do {                                                                                    \
        WINDOW_CELLS(l, q);                                                                 \
        COMBINE_CELLS_AND_STORE(l, plane, q, t_first, t_end, h_first, h_end, w_first, w_end, area); \
    } while (0)

/* Finish every output of every level of `plane` from its cells, in one work-item.  Where the
 * windows come as a list of constants (LEVEL_WINDOWS: level, output, first and end cell per axis,
 * area) and the compiler keeps straight-line partials (STRAIGHT_LINE_PARTIALS, above), each is
 * combined in straight-line code with constant cell numbers; otherwise from the tables. */
#if defined(LEVEL_WINDOWS) && STRAIGHT_LINE_PARTIALS
#define COMBINE_CONSTANT_WINDOW(l, q, t_first, t_end, h_first, h_end, w_first, w_end, area)  \
    COMBINE_CELLS_AND_STORE(l, plane, q, t_first, t_end, h_first, h_end, w_first, w_end, area);
#define FINISH_PLANE(plane) LEVEL_WINDOWS(COMBINE_CONSTANT_WINDOW)
#else
#define FINISH_PLANE(plane)                                                                 \
    for (int q = 0; q < VALUES_PER_PLANE; ++q) {                                            \
        const int l = level_of(q);                                                          \
        COMBINE_AND_STORE(l, plane, q - level_value_base[l]);                               \
    }
#endif
#endif

/* ---------------------------------------------------------------- gradients (backward programs)
 * The terms of level l in the gradient of the input (t, h, w) at plane position `position` of
 * `plane`: every output of the level whose window holds the input (its inverse windows, windows.h)
 * contributes its share (an average level) or, where its index is this input, its gradient (a max
 * level), outputs in row-major order.  `first_chooser` receives the first output of a max level
 * whose index is this input (-1 for none). */
#ifdef INDICES_IN
DEVICE_FN acc_t level_terms_chosen(const GLOBAL scalar_t* RESTRICT grad_out, INDICES_IN int l, index_t plane,
                                   index_t t, index_t h, index_t w, index_t position, index_t* first_chooser PLANES_PARAM)
{
    *first_chooser = -1;
    const index_t OT = level_out_t[l], OH = level_out_h[l], OW = level_out_w[l];
    acc_t sum = (acc_t)0;
    if (OT * OH * OW == 0)
        return sum;
    const index_t ot_start = WINDOW_START(t, OT, IN_T), ot_end = WINDOW_END(t, OT, IN_T);
    const index_t oh_start = WINDOW_START(h, OH, IN_H), oh_end = WINDOW_END(h, OH, IN_H);
    const index_t ow_start = WINDOW_START(w, OW, IN_W), ow_end = WINDOW_END(w, OW, IN_W);
    for (index_t ot = ot_start; ot < ot_end; ++ot)
        for (index_t oh = oh_start; oh < oh_end; ++oh)
            for (index_t ow = ow_start; ow < ow_end; ++ow) {
                const index_t q = PLANE_POSITION(ot, oh, ow, OH, OW);
                const acc_t grad = LOAD(grad_out, LEVEL_OFFSET(level_value_base[l], l, plane, q));
                if (IS_MEAN_LEVEL(l)) {
                    const index_t area = (WINDOW_END(ot, IN_T, OT) - WINDOW_START(ot, IN_T, OT))
                                       * (WINDOW_END(oh, IN_H, OH) - WINDOW_START(oh, IN_H, OH))
                                       * (WINDOW_END(ow, IN_W, OW) - WINDOW_START(ow, IN_W, OW));
                    sum += grad / (acc_t)area;
                } else {
                    IF_SELECTING(const int chosen = indices[LEVEL_OFFSET(level_index_base[l], l, plane, q)] == (int64_t_)position;
                                 *first_chooser = chosen && *first_chooser < 0 ? q : *first_chooser;
                                 sum += chosen ? grad : (acc_t)0;)
                }
            }
    return sum;
}
DEVICE_FN acc_t level_terms(const GLOBAL scalar_t* RESTRICT grad_out, INDICES_IN int l, index_t plane, index_t t,
                            index_t h, index_t w, index_t position PLANES_PARAM)
{
    index_t first_chooser;
    return level_terms_chosen(grad_out, IF_SELECTING(indices,) l, plane, t, h, w, position, &first_chooser, n_planes);
}
#define LEVEL_TERMS(l, plane, t, h, w, position) \
    level_terms(grad_out, IF_SELECTING(indices,) l, plane, t, h, w, position, n_planes)

/* The terms of every max level (in level order) in the gradient of input (t, h, w): none for an
 * op without max levels. */
/* The cell along one axis that holds coordinate x. */
DEVICE_FN int cell_of(TABLE_PARAM(axis_cuts), int n_cells, index_t x)
{
    int k = 0;
    while (k + 1 < n_cells && axis_cuts[k + 1] <= x)
        ++k;
    return k;
}

#if OP_SELECTS
/* Write, once each, the inputs of `plane` that outputs of max levels chose (after the plane was
 * written from its cells): at an input's first chooser in the first max level that chose it, its
 * cell's sum plus every max level's terms in level order -- what MAX_LEVEL_TERMS adds, in its
 * order.  An index outside the plane, or outside its output's window, writes nothing (as no gather
 * would find it). */
#define WRITE_CHOSEN_INPUTS(plane, plane_base, cell_grad)                                            \
    for (int l = 0; l < N_LEVELS; ++l)                                                               \
        if (!IS_MEAN_LEVEL(l))                                                                       \
            for (index_t q = 0; q < LEVEL_SIZE(l); ++q) {                                            \
                const int64_t_ chosen = indices[LEVEL_OFFSET(level_index_base[l], l, plane, q)];     \
                if (chosen < 0 || chosen >= IN_PLANE_SIZE)                                           \
                    continue;                                                                        \
                const index_t position = (index_t)chosen;                                            \
                const index_t t = position / (IN_H * IN_W), h = position / IN_W % IN_H, w = position % IN_W; \
                acc_t sum = cell_grad[(cell_of(cuts_t, N_CELLS_T, t) * N_CELLS_H + cell_of(cuts_h, N_CELLS_H, h)) \
                                      * N_CELLS_W + cell_of(cuts_w, N_CELLS_W, w)];                  \
                int writer = 1;                                                                      \
                for (int m = 0; m < N_LEVELS && writer; ++m)                                         \
                    if (!IS_MEAN_LEVEL(m)) {                                                         \
                        index_t first_chooser;                                                       \
                        sum += level_terms_chosen(grad_out, indices, m, plane, t, h, w, position, &first_chooser, \
                                                  n_planes);                                         \
                        writer = m < l ? first_chooser < 0 : m > l || first_chooser == q;            \
                    }                                                                                \
                if (writer)                                                                          \
                    STORE(grad_in, plane_base + position, sum);                                      \
            }
#else
#define WRITE_CHOSEN_INPUTS(plane, plane_base, cell_grad) ((void)0)
#endif

#if OP_SELECTS
#define MAX_LEVEL_TERMS(sum, plane, t, h, w)                                        \
    do {                                                                            \
        const index_t position_ = PLANE_POSITION(t, h, w, IN_H, IN_W);             \
        for (int l_ = 0; l_ < N_LEVELS; ++l_)                                       \
            if (!IS_MEAN_LEVEL(l_))                                                 \
                sum += LEVEL_TERMS(l_, plane, t, h, w, position_);                  \
    } while (0)
#else
#define MAX_LEVEL_TERMS(sum, plane, t, h, w) ((void)0)
#endif

#ifdef CUTS_W
/* The average levels' terms of every cell of `plane`, in one work-item: cell_grad[k] is the sum over
 * the average levels, in order, of each level's terms at the cell (level_terms at its first
 * input; every input of a cell has the same windows).  Where the windows come as a list of
 * constants (LEVEL_WINDOWS) and straight-line partials suit the compiler, each window instead adds
 * its share to its cells in straight-line code, a level's shares summed apart and then added to
 * the cells' sums: the same additions in the same order, so the same bits. */
#if defined(LEVEL_WINDOWS) && STRAIGHT_LINE_PARTIALS
#define ADD_WINDOW_SHARE(l, q, t_first, t_end, h_first, h_end, w_first, w_end, area)                   \
    if (IS_MEAN_LEVEL(l)) {                                                                         \
        if ((l) != level_) {                                                                        \
            ADD_LEVEL_TERMS();                                                                      \
            level_ = (l);                                                                           \
        }                                                                                           \
        const acc_t share_ = LOAD(grad_out, LEVEL_OFFSET(level_value_base[l], l, plane, q)) / (acc_t)(area); \
        for (int ct = t_first; ct < t_end; ++ct)                                                    \
            for (int ch = h_first; ch < h_end; ++ch)                                                \
                for (int cw = w_first; cw < w_end; ++cw)                                            \
                    level_grad_[(ct * N_CELLS_H + ch) * N_CELLS_W + cw] += share_;                  \
    }
#define ADD_LEVEL_TERMS()                                                                           \
    for (int k = 0; k < N_CELLS; ++k) {                                                             \
        cell_grad[k] += level_grad_[k];                                                             \
        level_grad_[k] = (acc_t)0;                                                                  \
    }
#define CELL_GRADIENTS(plane)                                                                       \
    acc_t cell_grad[N_CELLS], level_grad_[N_CELLS];                                                 \
    for (int k = 0; k < N_CELLS; ++k)                                                               \
        cell_grad[k] = level_grad_[k] = (acc_t)0;                                                   \
    int level_ = -1;                                                                                \
    LEVEL_WINDOWS(ADD_WINDOW_SHARE)                                                                 \
    ADD_LEVEL_TERMS()
#else
#define CELL_GRADIENTS(plane)                                                                       \
    acc_t cell_grad[N_CELLS];                                                                       \
    for (int k = 0; k < N_CELLS; ++k) {                                                             \
        const int ct = k / (N_CELLS_H * N_CELLS_W), ch = k / N_CELLS_W % N_CELLS_H, cw = k % N_CELLS_W; \
        const index_t t = cuts_t[ct], h = cuts_h[ch], w = cuts_w[cw];                               \
        acc_t sum = (acc_t)0;                                                                       \
        for (int l = 0; l < N_LEVELS; ++l)                                                          \
            if (IS_MEAN_LEVEL(l))                                                                   \
                sum += LEVEL_TERMS(l, plane, t, h, w, PLANE_POSITION(t, h, w, IN_H, IN_W));         \
        cell_grad[k] = sum;                                                                         \
    }
#endif
#endif
#endif
