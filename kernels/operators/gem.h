/* operators/gem.h -- generalized-mean (GeM) pooling's operator, in operators.h's place in GeM's programs:
 *
 *   y = (mean over the window of max(x, eps)^p)^(1/p)
 *
 * Only GeM's programs include this header (pool_tuner.operations.OPERATOR_HEADERS), so the programs of
 * the other ops, and the kernel hashes of their tuning records, do not change when GeM does.
 *
 * The OP_* definitions are those of the inner mean -- an accumulating op over the mapped elements
 * max(x, eps)^p -- which is what the backward gather routes (gradients.h): the gradient of a window's
 * mean reaches each of its inputs divided by the window's area.  p and eps are run-time kernel
 * arguments (a learnt exponent changes every training step, so it must not cost a build); the
 * shared reduction helpers (reduction.h) take no run-time argument, so GeM's forward variants
 * (kernels/forward/gem_*.c) map and finish through gem_power and gem_root themselves.
 */
#define OP_SELECTS 0
#define OP_IDENTITY ((acc_t)0)
#define OP_MAP(x) (x)
#define OP_COMBINE(a, b) ((a) + (b))
#define OP_FINISH(value, area) ((value) / (acc_t)(area))
#define OP_GRADIENT_SHARE(grad, area) ((grad) / (acc_t)(area))
#define IF_SELECTING(...)

/* GeM's forward kernels take p and eps after the plane count. */
#define GEM_PARAMS , const acc_t p, const acc_t eps

/* max(x, eps)^p, a NaN staying NaN (as PyTorch's clamp(min=eps) keeps it).  The default exponent 3
 * is two multiplications, as PyTorch's pow computes a power of 3. */
DEVICE_FN acc_t gem_power(acc_t x, acc_t p, acc_t eps)
{
    const acc_t c = x < eps ? eps : x;
    return p == (acc_t)3 ? c * c * c : pow(c, p);
}

/* The output of a window whose mapped elements sum to `sum` over `area` elements. */
DEVICE_FN acc_t gem_root(acc_t sum, index_t area, acc_t p)
{
    return pow(sum / (acc_t)area, (acc_t)1 / p);
}
