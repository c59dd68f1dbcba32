/* reduction.h -- reducing windows through the operator (operators.h): what the forward kernels share.
 *
 *   out[o] = OP_FINISH(OP_COMBINE over the elements x of window(o) of OP_MAP(x), area(o))
 *   selecting ops also: indices[o] = the position of the element of window(o) that no element
 *   beats, ties going to the first in row-major window order (or the last, OP_TIE_TO_LATER).
 *
 * A reduction is a running value and, for selecting ops, the plane position of the element it
 * holds (-1 while empty).  Elements are added one at a time (reduce_step) in increasing position
 * order; partial results of disjoint parts are combined in any order (reduce_merge).
 *
 * The helpers that map elements or call those that do take the op's run-time arguments last
 * (OP_PARAMS, passed on as OP_ARGS: operators.h), as do the kernels after the plane count; the
 * macros that map or finish (STEP_PARTIAL, STORE_RESULT) name them where they are expanded.
 */

typedef struct {
    acc_t value;
    index_t position; /* selecting ops: plane position of `value`; -1 while empty */
} reduction_t;

DEVICE_FN reduction_t reduce_init(void)
{
    reduction_t r;
    r.value = OP_IDENTITY;
    r.position = -1;
    return r;
}

/* The reduction of the one element `value` at plane position `position`. */
DEVICE_FN reduction_t reduce_first(acc_t value, index_t position OP_PARAMS)
{
    reduction_t r;
    r.value = OP_MAP(value);
    r.position = position;
    return r;
}

#if OP_SELECTS
/* Does an element of value x, met after the element of value `held`, take its place?  It does if it
 * beats it, or ties it where ties go to the later position. */
#define LATER_WINS(x, held) (OP_BEATS(x, held) | (OP_TIE_TO_LATER(x) & !OP_BEATS(held, x)))
#endif

/* Add one element.  Every caller visits a window in increasing position order, so for a selecting
 * op the position rule needs no comparison of positions: a branch-free test that CPU compilers
 * vectorise across work-items. */
DEVICE_FN void reduce_step(reduction_t* r, acc_t value, index_t position OP_PARAMS)
{
#if OP_SELECTS
    const acc_t x = OP_MAP(value);
    const int wins = (r->position < 0) | LATER_WINS(x, r->value);
    r->value = wins ? x : r->value;
    r->position = wins ? position : r->position;
#else
    (void)position;
    r->value = OP_COMBINE(r->value, OP_MAP(value));
#endif
}

/* Add the element `value` at `position` of a box tap (windows.h): `inside` tells a real element
 * from a repeat of the window's last element past its end.  A selecting op skips the repeat -- it
 * comes after later positions of the window, where a tie going to the later position would take
 * it back; an accumulating op combines the identity instead. */
DEVICE_FN void reduce_box_tap(reduction_t* r, acc_t value, index_t position, int inside OP_PARAMS)
{
#if OP_SELECTS
    const acc_t x = OP_MAP(value);
    const int wins = inside & LATER_WINS(x, r->value);
    r->value = wins ? x : r->value;
    r->position = wins ? position : r->position;
#else
    (void)position;
    r->value = OP_COMBINE(r->value, inside ? OP_MAP(value) : OP_IDENTITY);
#endif
}

/* Combine the partial results of two disjoint parts of a window, in any order.  Selecting: the
 * winner, or on a tie the earlier position (the later one where OP_TIE_TO_LATER). */
DEVICE_FN reduction_t reduce_merge(reduction_t a, reduction_t b)
{
#if OP_SELECTS
    if (b.position >= 0
        && (a.position < 0 || OP_BEATS(b.value, a.value)
            || (!OP_BEATS(a.value, b.value) && (OP_TIE_TO_LATER(b.value) ? b.position > a.position : b.position < a.position))))
        a = b;
#else
    a.value = OP_COMBINE(a.value, b.value);
#endif
    return a;
}

/* Partial results kept apart as a value and (selecting ops only, declared with IF_SELECTING) a
 * position, in two variables or two arrays: the row and plane variants keep them so.  The
 * position slot is not touched by accumulating ops, so it need not exist for them. */
#if OP_SELECTS
#define STORE_PARTIAL(value_slot, position_slot, r) ((value_slot) = (r).value, (position_slot) = (r).position)
#define PARTIAL(value_slot, position_slot) partial_of(value_slot, position_slot)
/* reduce_step on a partial that holds an element already. */
#define STEP_PARTIAL(value_slot, position_slot, value, position)            \
    do {                                                                    \
        const acc_t x_ = OP_MAP(value);                                     \
        const int wins_ = LATER_WINS(x_, value_slot);                       \
        (value_slot) = wins_ ? x_ : (value_slot);                           \
        (position_slot) = wins_ ? (position) : (position_slot);             \
    } while (0)
#else
#define STORE_PARTIAL(value_slot, position_slot, r) ((value_slot) = (r).value)
#define PARTIAL(value_slot, position_slot) partial_of(value_slot, -1)
#define STEP_PARTIAL(value_slot, position_slot, value, position) \
    ((value_slot) = OP_COMBINE(value_slot, OP_MAP(value)))
#endif

/* The position rule after the fact.  Partials that combine values only (OP_COMBINE) are the vector
 * code CPU compilers make best, and leave a selecting op's reduction `r` without its position.  A
 * second visit of the elements in increasing position order, POSITION_STEP(r, element, at) at each,
 * finds it: the first element that r's value does not beat, or the last where ties go to the later
 * position.  Accumulating ops have no position: their visit is of no elements (POSITION_PASS_LENGTH). */
#define POSITION_PASS_LENGTH(n) (OP_SELECTS ? (n) : 0)
#if OP_SELECTS
#define POSITION_STEP(r, element, at)                                                                        \
    ((r).position = (!OP_BEATS((r).value, OP_MAP(element)) & (((r).position < 0) | OP_TIE_TO_LATER((r).value))) \
                        ? (at)                                                                               \
                        : (r).position)
#else
#define POSITION_STEP(r, element, at) ((void)0)
#endif

DEVICE_FN reduction_t partial_of(acc_t value, index_t position)
{
    reduction_t r;
    r.value = value;
    r.position = position;
    return r;
}

/* The forward kernels' last parameter for selecting ops: the indices they write. */
#define INDICES_OUT IF_SELECTING(, GLOBAL int64_t_* RESTRICT indices)

/* Write output `offset` of (ot, oh, ow) from its finished reduction. */
#define STORE_RESULT(offset, r, ot, oh, ow)                                         \
    do {                                                                            \
        STORE(out, offset, OP_FINISH((r).value, window_area(ot, oh, ow)));          \
        IF_SELECTING(indices[offset] = (int64_t_)(r).position;)                     \
    } while (0)

/* ---------------------------------------------------------------- one window by its runs
 * With one output column, every window row spans its whole input row, so in channels-first memory
 * the rows of a window follow each other: its (t) slabs are single runs of window_h * IN_W elements
 * (global pooling: one run per plane), long enough for row_lanes to pay. */
#define CONTIGUOUS_WINDOW_ROWS (OUT_W == 1 && !CHANNELS_LAST)

/* The runs of one window that reduce_window_rows visits: its rows first_row, first_row + row_step,
 * ... (a row is one (t, h) pair), or with first_row = 0, row_step = 1 and CONTIGUOUS_WINDOW_ROWS
 * its whole (t) slabs.  Run `run` starts at plane position RUN_POSITION(run). */
#define WINDOW_RUNS                                                                                       \
    const index_t t_start = T_WINDOW_START(ot), t_end = T_WINDOW_END(ot);                                 \
    const index_t h_start = H_WINDOW_START(oh), h_end = H_WINDOW_END(oh);                                 \
    const index_t w_start = W_WINDOW_START(ow), w_end = W_WINDOW_END(ow);                                 \
    const index_t window_h = h_end - h_start;                                                             \
    const int slab_runs = CONTIGUOUS_WINDOW_ROWS && first_row == 0 && row_step == 1;                      \
    const index_t runs = slab_runs ? t_end - t_start : (t_end - t_start) * window_h;                      \
    const index_t run_length = slab_runs ? window_h * IN_W : w_end - w_start;                             \
    const index_t plane_base = PLANE_BASE(plane, IN_PLANE_SIZE)
#define RUN_POSITION(run)                                                                                 \
    (slab_runs ? PLANE_POSITION(t_start + (run), h_start, 0, IN_H, IN_W)                                  \
               : PLANE_POSITION(t_start + (run) / window_h, h_start + (run) % window_h, w_start, IN_H, IN_W))
#define RUN_ELEMENT(position, j) LOAD(in, plane_base + ((position) + (j)) * ELEMENT_STEP)

/* Reduce output (ot, oh, ow) of `plane` over the runs above.
 *
 * row_lanes > 1 keeps row_lanes independent partial values along each run (lane k takes elements
 * k, k + row_lanes, ...), so the steps no longer wait on each other and CPU compilers turn the lanes
 * into vector operations.  The lanes combine values only; a selecting op then finds its position in
 * a second pass: the first element, in window order, that the combined value does not beat (the
 * last, where ties go to the later position) -- the position rule without tracking positions in the
 * hot loop. */
DEVICE_FN reduction_t reduce_window_rows(const GLOBAL scalar_t* RESTRICT in, index_t plane, index_t ot,
                                         index_t oh, index_t ow, index_t first_row, index_t row_step OP_PARAMS)
{
    WINDOW_RUNS;
    reduction_t r = reduce_init();
#if row_lanes > 1
    acc_t lanes[row_lanes];
    for (int k = 0; k < row_lanes; ++k)
        lanes[k] = OP_IDENTITY;
#endif
    for (index_t run = first_row; run < runs; run += row_step) {
        const index_t position = RUN_POSITION(run);
        index_t j = 0;
#if row_lanes > 1
        for (; j + row_lanes <= run_length; j += row_lanes)
            for (int k = 0; k < row_lanes; ++k)
                lanes[k] = OP_COMBINE(lanes[k], OP_MAP(RUN_ELEMENT(position, j + k)));
#endif
        for (; j < run_length; ++j)
            reduce_step(&r, RUN_ELEMENT(position, j), position + j OP_ARGS);
    }
#if row_lanes > 1
    acc_t combined = r.value;
    for (int k = 0; k < row_lanes; ++k)
        combined = OP_COMBINE(combined, lanes[k]);
#if OP_SELECTS
    const int to_later = OP_TIE_TO_LATER(combined);
    r = reduce_init();
    for (index_t run = first_row; run < runs; run += row_step) {
        const index_t position = RUN_POSITION(run);
        for (index_t j = 0; j < run_length; ++j) {
            const acc_t x = OP_MAP(RUN_ELEMENT(position, j));
            if (!OP_BEATS(combined, x)) {
                r = partial_of(x, position + j);
                if (!to_later)
                    return r;
            }
        }
    }
#else
    r.value = combined;
#endif
#endif
    return r;
}

/* ---------------------------------------------------------------- one small window by its box
 * Small windows (every window inside a box of MAX_WINDOW_T x MAX_WINDOW_H x MAX_WINDOW_W, at most
 * SMALL_BOX_LIMIT elements) are reduced by fully unrolled straight-line code over that box, with
 * the running result in plain scalars: the form that CPU compilers vectorise across work-items (PoCL
 * leaves the general run loops above scalar even when their trip counts are constants).  Along an
 * axis whose windows differ in size, a box tap past the window's end is clamped to its last element
 * (a load that is always in bounds), which reduce_box_tap masks where the op needs it. */
#define SMALL_WINDOW (MAX_WINDOW_T * MAX_WINDOW_H * MAX_WINDOW_W <= SMALL_BOX_LIMIT)
#if SMALL_WINDOW
DEVICE_FN reduction_t reduce_small_window(const GLOBAL scalar_t* RESTRICT in, index_t plane, index_t ot,
                                          index_t oh, index_t ow OP_PARAMS)
{
    const index_t t_start = T_WINDOW_START(ot), t_end = T_WINDOW_END(ot);
    const index_t h_start = H_WINDOW_START(oh), h_end = H_WINDOW_END(oh);
    const index_t w_start = W_WINDOW_START(ow), w_end = W_WINDOW_END(ow);
    const index_t plane_base = PLANE_BASE(plane, IN_PLANE_SIZE);
    const index_t corner = PLANE_POSITION(t_start, h_start, w_start, IN_H, IN_W);
    reduction_t r = reduce_first(LOAD(in, plane_base + corner * ELEMENT_STEP), corner OP_ARGS);
#pragma unroll
    for (int k = 1; k < MAX_WINDOW_T * MAX_WINDOW_H * MAX_WINDOW_W; ++k) {
        const int kt = k / (MAX_WINDOW_H * MAX_WINDOW_W), kh = k / MAX_WINDOW_W % MAX_WINDOW_H, kw = k % MAX_WINDOW_W;
        const index_t p = PLANE_POSITION(BOX_TAP(t_start, t_end, kt, UNIFORM_T), BOX_TAP(h_start, h_end, kh, UNIFORM_H),
                                         BOX_TAP(w_start, w_end, kw, UNIFORM_W), IN_H, IN_W);
        const int inside = IN_WINDOW(t_start, t_end, kt, UNIFORM_T) & IN_WINDOW(h_start, h_end, kh, UNIFORM_H)
                         & IN_WINDOW(w_start, w_end, kw, UNIFORM_W);
        reduce_box_tap(&r, LOAD(in, plane_base + p * ELEMENT_STEP), p, inside OP_ARGS);
    }
    return r;
}
#endif

/* ---------------------------------------------------------------- one contiguous run by lanes
 * The global-pooling variant global_planes reduces contiguous runs of a channels-first plane (a
 * whole plane, or one work-item's part of it) in straight-line code: run_lanes independent partial
 * results, lane k taking elements k, k + run_lanes, ... (in increasing order, so a selecting op's
 * lane keeps its first winner, branch-free), so that no step waits on the one before and each step
 * is one contiguous load of run_lanes elements, which CPU compilers turn into vector operations.
 * The lanes are merged in order (reduce_merge's position rule), then the run's last elements that
 * fill no whole step are added one at a time. */
#if run_lanes > 0
DEVICE_FN reduction_t reduce_run(const GLOBAL scalar_t* RESTRICT in, index_t plane_base, index_t position,
                                 index_t length OP_PARAMS)
{
    reduction_t r = reduce_init();
    index_t j = 0;
    if (length >= run_lanes) {
        acc_t lane_value[run_lanes];
        IF_SELECTING(index_t lane_position[run_lanes];)
#pragma unroll
        for (int k = 0; k < run_lanes; ++k)
            STORE_PARTIAL(lane_value[k], lane_position[k], reduce_first(LOAD(in, plane_base + position + k), position + k OP_ARGS));
        for (j = run_lanes; j + run_lanes <= length; j += run_lanes)
#pragma unroll
            for (int k = 0; k < run_lanes; ++k)
                STEP_PARTIAL(lane_value[k], lane_position[k], LOAD(in, plane_base + position + j + k), position + j + k);
#pragma unroll
        for (int k = 0; k < run_lanes; ++k)
            r = reduce_merge(r, PARTIAL(lane_value[k], lane_position[k]));
    }
    for (; j < length; ++j)
        reduce_step(&r, LOAD(in, plane_base + position + j), position + j OP_ARGS);
    return r;
}
#endif
