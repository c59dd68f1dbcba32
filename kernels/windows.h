/* windows.h -- adaptive window bounds and element offsets, shared by every pooling template.
 *
 * Every input is seen as N_PLANES planes (batch x channels) of IN_T x IN_H x IN_W elements;
 * 1d and 2d pooling are the cases IN_T = OUT_T = 1 (and IN_H = OUT_H = 1 for 1d), so one
 * template serves every rank and the compiler removes the size-1 loops.
 *
 * Output o of an axis with input size I and output size O pools input [start, end):
 *     start = floor(o * I / O),   end = ceil((o + 1) * I / O)
 * Sizes are compile-time defines, so these divisions become multiply-shifts.
 */

#define WINDOW_START(o, I, O) ((index_t)(((index_t)(o) * (I)) / (O)))
#define WINDOW_END(o, I, O) ((index_t)((((index_t)(o) + 1) * (I) + (O) - 1) / (O)))

#define IN_PLANE_SIZE ((index_t)IN_T * IN_H * IN_W)
#define OUT_PLANE_SIZE ((index_t)OUT_T * OUT_H * OUT_W)
#define OUT_NUMEL ((index_t)N_PLANES * OUT_PLANE_SIZE)

/* Offset of input element (t, h, w) of a plane, relative to the plane's first element. */
#define IN_OFFSET(t, h, w) (((index_t)(t) * IN_H + (h)) * IN_W + (w))
/* Offset of output element (plane, t, h, w). */
#define OUT_OFFSET(plane, t, h, w) ((((index_t)(plane) * OUT_T + (t)) * OUT_H + (h)) * OUT_W + (w))
