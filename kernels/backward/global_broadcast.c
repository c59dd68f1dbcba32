/* global_broadcast -- backward, global pooling (every output size 1): every input of a plane is in
 * its one window, so its gradient is the plane's term (gradients.h: an even share of the output
 * gradient, or for a selecting op the gradient at the index and 0 elsewhere) -- a pure stream of
 * writes, each element written once.
 *
 * split work-items share a plane, each writing one contiguous part of it in order, and
 * neighbouring groups of split work-items take neighbouring planes (in channels-last memory
 * neighbouring channels, so that with split = 1 neighbouring work-items store neighbouring
 * elements).  The plane's gradient (and index) is read once per work-item.
 * Launch: ceil(N_PLANES / PLANES_PER_GROUP) groups of block_size_x. */
#define PLANES_PER_GROUP (block_size_x / split)
#define PART_SIZE ((IN_PLANE_SIZE + split - 1) / split)
KERNEL void pool_backward(const GLOBAL scalar_t* RESTRICT grad_out, INDICES_IN GLOBAL scalar_t* RESTRICT grad_in PLANES_PARAM)
{
    const index_t plane = (index_t)GROUP_ID * PLANES_PER_GROUP + LOCAL_ID_X / split;
    if (plane >= N_PLANES)
        return;
    const index_t o = OUT_OFFSET(plane, 0, 0, 0);
    const acc_t grad = LOAD(grad_out, o);
    const index_t base = PLANE_BASE(plane, IN_PLANE_SIZE);
    const index_t start = (index_t)(LOCAL_ID_X % split) * PART_SIZE;
    const index_t end = start + PART_SIZE < IN_PLANE_SIZE ? start + PART_SIZE : IN_PLANE_SIZE;
    for (index_t p = start; p < end; ++p)
        STORE(grad_in, base + p * ELEMENT_STEP, GRADIENT_TERM(grad, o, 0, 0, 0, p));
}
