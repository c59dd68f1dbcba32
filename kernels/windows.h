/* windows.h -- adaptive window bounds and element offsets, shared by every pooling template.
 *
 * Every input is seen as N_PLANES planes (batch x channels; a kernel argument, prelude.h) of
 * IN_T x IN_H x IN_W elements; 1d and 2d pooling are the cases IN_T = OUT_T = 1 (and IN_H = OUT_H
 * = 1 for 1d), so one template serves every rank and the compiler removes the size-1 loops.
 *
 * Output o of an axis with input size I and output size O pools input [start, end):
 *     start = floor(o * I / O),   end = ceil((o + 1) * I / O)
 * and input i is pooled by the outputs [floor(i * O / I), ceil((i + 1) * O / I)) -- the same
 * formulas with I and O swapped, which the gather backward kernels use.
 * Sizes are compile-time defines, so these divisions become multiply-shifts; the plane count is
 * never a divisor, so it costs nothing as a run-time value.
 */

#define WINDOW_START(o, I, O) ((index_t)(((index_t)(o) * (I)) / (O)))
#define WINDOW_END(o, I, O) ((index_t)((((index_t)(o) + 1) * (I) + (O) - 1) / (O)))

/* The forward windows of each axis.  When every window of an axis has the same size K and
 * consecutive windows start S apart (pool_tuner.fixed_pool_equivalent), the host defines
 * UNIFORM_<axis> with KERNEL_<axis> and STRIDE_<axis>: window loops then have a compile-time trip
 * count, which compilers unroll and vectorise. */
#if UNIFORM_T
#define T_WINDOW_START(o) ((index_t)(o) * STRIDE_T)
#define T_WINDOW_END(o) (T_WINDOW_START(o) + KERNEL_T)
#else
#define T_WINDOW_START(o) WINDOW_START(o, IN_T, OUT_T)
#define T_WINDOW_END(o) WINDOW_END(o, IN_T, OUT_T)
#endif
#if UNIFORM_H
#define H_WINDOW_START(o) ((index_t)(o) * STRIDE_H)
#define H_WINDOW_END(o) (H_WINDOW_START(o) + KERNEL_H)
#else
#define H_WINDOW_START(o) WINDOW_START(o, IN_H, OUT_H)
#define H_WINDOW_END(o) WINDOW_END(o, IN_H, OUT_H)
#endif
#if UNIFORM_W
#define W_WINDOW_START(o) ((index_t)(o) * STRIDE_W)
#define W_WINDOW_END(o) (W_WINDOW_START(o) + KERNEL_W)
#else
#define W_WINDOW_START(o) WINDOW_START(o, IN_W, OUT_W)
#define W_WINDOW_END(o) WINDOW_END(o, IN_W, OUT_W)
#endif

/* The outputs that pool input i of an axis are [first, last) = the inverse window (above).  The
 * host defines MAX_INVERSE_WINDOW_<axis>, the most outputs any input of the axis belongs to; when
 * it is 1 the windows do not overlap and every input has exactly one output, so the gather loops
 * get the compile-time trip count 1 and vanish (CPU compilers then vectorise across work-items). */
#define INVERSE_COUNT(axis, first, last) (MAX_INVERSE_WINDOW_##axis == 1 ? 1 : (last) - (first))

/* Boxes: a loop over every window of an axis can become straight-line code over a box of the
 * axis's longest window (MAX_WINDOW_<axis>, or MAX_INVERSE_WINDOW_<axis> for the inverse windows):
 * tap k of the window [start, end) is start + k, clamped to end - 1 past a shorter window's end
 * (a repeat, always in bounds), and IN_WINDOW tells the real taps from the repeats.  Along an axis
 * whose windows all have the box's size (EXACT) neither needs a comparison.  Kernels unroll boxes
 * of at most SMALL_BOX_LIMIT taps. */
#define SMALL_BOX_LIMIT 256
#define BOX_TAP(start, end, k, EXACT) ((EXACT) || (start) + (k) < (end) ? (start) + (k) : (end) - 1)
#define IN_WINDOW(start, end, k, EXACT) ((EXACT) || (start) + (k) < (end))

#define IN_PLANE_SIZE ((index_t)IN_T * IN_H * IN_W)
#define OUT_PLANE_SIZE ((index_t)OUT_T * OUT_H * OUT_W)
#define IN_NUMEL ((index_t)N_PLANES * IN_PLANE_SIZE)
#define OUT_NUMEL ((index_t)N_PLANES * OUT_PLANE_SIZE)

/* Position of element (t, h, w) within its plane, row-major: PyTorch's max-pooling index. */
#define PLANE_POSITION(t, h, w, H, W) ((((index_t)(t) * (H)) + (h)) * (W) + (w))

/* ---------------------------------------------------------------- memory layout
 * Logical planes are (batch, channel) pairs: plane = n * N_CHANNELS + c.  Channels-first memory
 * (N, C, T, H, W) keeps a plane contiguous; channels-last memory (N, T, H, W, C) interleaves the
 * planes of one batch entry, so neighbouring channels are neighbours in memory. */
#if CHANNELS_LAST
#define ELEMENT_STEP ((index_t)N_CHANNELS)
#define PLANE_BASE(plane, PLANE_SIZE) \
    ((index_t)(plane) / N_CHANNELS * (PLANE_SIZE) * N_CHANNELS + (index_t)(plane) % N_CHANNELS)
/* The plane and position of the element at memory offset `offset` of a (T, H, W) grid. */
#define COORDS_OF(offset, plane, t, h, w, T, H, W)                                 \
    do {                                                                           \
        const index_t rest_ = (offset) / N_CHANNELS;                              \
        w = rest_ % (W);                                                           \
        h = rest_ / (W) % (H);                                                     \
        t = rest_ / ((index_t)(W) * (H)) % (T);                                    \
        plane = rest_ / ((index_t)(W) * (H) * (T)) * N_CHANNELS + (offset) % N_CHANNELS; \
    } while (0)
#else
#define ELEMENT_STEP ((index_t)1)
#define PLANE_BASE(plane, PLANE_SIZE) ((index_t)(plane) * (PLANE_SIZE))
#define COORDS_OF(offset, plane, t, h, w, T, H, W)      \
    do {                                                \
        w = (offset) % (W);                             \
        h = (offset) / (W) % (H);                       \
        t = (offset) / ((index_t)(W) * (H)) % (T);      \
        plane = (offset) / ((index_t)(W) * (H) * (T));  \
    } while (0)
#endif

/* Memory offsets of input and output elements. */
#define IN_OFFSET(plane, t, h, w) \
    (PLANE_BASE(plane, IN_PLANE_SIZE) + PLANE_POSITION(t, h, w, IN_H, IN_W) * ELEMENT_STEP)
#define OUT_OFFSET(plane, t, h, w) \
    (PLANE_BASE(plane, OUT_PLANE_SIZE) + PLANE_POSITION(t, h, w, OUT_H, OUT_W) * ELEMENT_STEP)
#define OUT_COORDS(offset, plane, t, h, w) COORDS_OF(offset, plane, t, h, w, OUT_T, OUT_H, OUT_W)
#define IN_COORDS(offset, plane, t, h, w) COORDS_OF(offset, plane, t, h, w, IN_T, IN_H, IN_W)

/* Number of input elements pooled by output (ot, oh, ow). */
DEVICE_FN index_t window_area(index_t ot, index_t oh, index_t ow)
{
    return (T_WINDOW_END(ot) - T_WINDOW_START(ot))
         * (H_WINDOW_END(oh) - H_WINDOW_START(oh))
         * (W_WINDOW_END(ow) - W_WINDOW_START(ow));
}

/* A box of input elements of one plane: [t_start, t_end) x [h_start, h_end) x [w_start, w_end). */
typedef struct {
    index_t t_start, t_end, h_start, h_end, w_start, w_end;
} box_t;

/* The window of output (ot, oh, ow). */
DEVICE_FN box_t window_box(index_t ot, index_t oh, index_t ow)
{
    box_t box;
    box.t_start = T_WINDOW_START(ot), box.t_end = T_WINDOW_END(ot);
    box.h_start = H_WINDOW_START(oh), box.h_end = H_WINDOW_END(oh);
    box.w_start = W_WINDOW_START(ow), box.w_end = W_WINDOW_END(ow);
    return box;
}

/* The one element at plane position `position`. */
DEVICE_FN box_t element_box(index_t position)
{
    box_t box;
    box.t_start = position / ((index_t)IN_H * IN_W), box.t_end = box.t_start + 1;
    box.h_start = position / IN_W % IN_H, box.h_end = box.h_start + 1;
    box.w_start = position % IN_W, box.w_end = box.w_start + 1;
    return box;
}
