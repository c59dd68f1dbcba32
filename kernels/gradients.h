/* gradients.h -- routing gradients through the operator (operators.h): what the backward kernels share.
 *
 * The backward pass is a gather: each work-item owns input gradients and sums the terms of exactly
 * the outputs whose windows hold its input, found with the inverse windows (windows.h).  No
 * atomics: every grad_in element is written once, by one work-item, in a fixed order -- results are
 * bit-identical across runs (PyTorch's CUDA backward passes scatter with atomics instead).
 *
 *   grad_in[i] = sum over the outputs o whose gradient reaches i of OP_GRADIENT_SHARE(grad_out[o], area(o))
 *
 * where the gradient of an accumulating op's output reaches every input of its window, and that of
 * a selecting op's output only the input at its index (the position the forward pass selected).
 */

/* The backward kernels' parameter, before grad_in, for selecting ops: the indices of the forward pass. */
#define INDICES_IN IF_SELECTING(const GLOBAL int64_t_* RESTRICT indices,)

/* Does the gradient of an output whose index (selecting ops) is `index` reach the input at plane
 * position `position` of its window? */
#if OP_SELECTS
#define REACHES(index, position) ((index) == (int64_t_)(position))
#else
#define REACHES(index, position) ((void)(position), 1)
#endif

/* The term of output (ot, oh, ow), held at memory offset `offset` with gradient `grad`, in the
 * gradient of the input at plane position `position` of its window. */
#define GRADIENT_TERM(grad, offset, ot, oh, ow, position) \
    (REACHES(indices[offset], position) ? OP_GRADIENT_SHARE(grad, window_area(ot, oh, ow)) : (acc_t)0)

/* The inputs (a box_t) that the gradient of output (ot, oh, ow), held at memory offset `offset`,
 * reaches: its window, or for a selecting op the one input at its index. */
#if OP_SELECTS
#define REACHED_BOX(offset, ot, oh, ow) element_box((index_t)indices[offset])
#else
#define REACHED_BOX(offset, ot, oh, ow) window_box(ot, oh, ow)
#endif
