/* operators.h -- the pooling op as a small operator: the only place that names an op.
 *
 * The host defines one POOL_<op> (pool_tuner.problem.Problem.defines).  Every kernel reduces its
 * windows (reduction.h) and routes its gradients (gradients.h) through the definitions below, the
 * way PyOpenCL's ReductionKernel takes its neutral element, map and reduce expressions: no kernel
 * names an op.  A new op is one more block here plus its reference in pool_tuner/reference.py.
 *
 * An op is one of two kinds:
 *   accumulating (OP_SELECTS 0, avg): every element of a window enters the result;
 *   selecting    (OP_SELECTS 1, max): the result is one element of the window that no element
 *                beats (OP_BEATS); among tied elements the first in row-major window order, or the
 *                last where OP_TIE_TO_LATER says so -- the position rule: the kernels also output
 *                its plane position (PyTorch's indices), and the backward pass routes the output's
 *                gradient to that input alone.
 *
 *   OP_IDENTITY               the value of an empty reduction (combining it changes nothing)
 *   OP_MAP(x)                 what an element enters the reduction as
 *   OP_COMBINE(a, b)          two (partial) values combined into one
 *   OP_FINISH(value, area)    the output of a window of `area` elements from its combined value
 *   OP_BEATS(a, b)            selecting ops: does value a win over value b?  Neither beating the
 *                             other is a tie, which goes to the earlier position unless
 *   OP_TIE_TO_LATER(a)        selecting ops: a tie between elements of value a goes to the later
 *                             position (equal for tied values)
 *   OP_GRADIENT_SHARE(grad, area)  what each input that an output's gradient reaches receives, for
 *                             a window of `area` elements
 *   OP_PARAMS, OP_ARGS        the op's run-time arguments (none for avg and max): a parameter list,
 *                             after PLANES_PARAM in the forward kernels' signatures and last in those
 *                             of reduction.h's helpers, and the matching argument list, last in the
 *                             helpers' calls.  Each is empty or starts with a comma, as INDICES_OUT;
 *                             OP_MAP and OP_FINISH may name the parameters
 * `area` is evaluated only by the ops that use it.
 */

#if POOL_AVG
/* The mean of the window; its gradient is spread evenly over the window. */
#define OP_SELECTS 0
#define OP_IDENTITY ((acc_t)0)
#define OP_MAP(x) (x)
#define OP_COMBINE(a, b) ((a) + (b))
#define OP_FINISH(value, area) ((value) / (acc_t)(area))
#define OP_GRADIENT_SHARE(grad, area) ((grad) / (acc_t)(area))

#elif POOL_MAX
/* The maximum of the window, a NaN winning over numbers; its gradient goes to the maximum's input. */
#define OP_SELECTS 1
#define OP_IDENTITY (-(acc_t)INFINITY)
#define OP_MAP(x) (x)
#define OP_COMBINE(a, b) max_or_nan(a, b)
#define OP_FINISH(value, area) (value)
#define OP_BEATS(a, b) max_beats(a, b)
#define OP_TIE_TO_LATER(a) IS_NAN(a)
#define OP_GRADIENT_SHARE(grad, area) (grad)

/* Larger wins and a NaN beats numbers; equal values (or two NaNs) tie.  Two NaNs tie to the later
 * position because PyTorch's max scan takes every NaN it meets (`val > max || isnan(val)`, on CPU
 * and CUDA alike), so its index is the window's last NaN.  Branch-free, so CPU compilers vectorise
 * it. */
DEVICE_FN int max_beats(acc_t a, acc_t b)
{
    return (IS_NAN(a) & !IS_NAN(b)) | (a > b);
}

/* The larger of a and b, a NaN winning and staying: the value of the maximum (of two NaNs either
 * may be kept; the position rule treats every NaN alike). */
DEVICE_FN acc_t max_or_nan(acc_t a, acc_t b)
{
    return (b > a || IS_NAN(b)) ? b : a;
}

#else
#error "pool_tuner: no POOL_* define given"
#endif

/* avg and max take no run-time argument. */
#define OP_PARAMS
#define OP_ARGS

/* Code that only selecting ops have: the positions they keep, the indices they write and read.
 * Variadic, so that it may hold commas. */
#if OP_SELECTS
#define IF_SELECTING(...) __VA_ARGS__
#else
#define IF_SELECTING(...)
#endif
