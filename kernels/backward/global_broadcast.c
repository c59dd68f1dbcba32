/* global_broadcast -- backward, global pooling (every output size 1), either layout: every input
 * of a plane is in its one window, so its gradient is its plane's term (gradients.h: an even share
 * of the output gradient, or for a selecting op the gradient at the index and 0 elsewhere) -- a
 * pure stream of writes.
 *
 * Each work-item writes vector_width neighbouring input gradients per step, steps block_size_x *
 * vector_width elements apart, so every store of a work-item and of neighbouring work-items is
 * contiguous; the host defines PARTIAL_LAST_GROUP when the grid runs past the last input.
 * Launch: ceil(IN_NUMEL / (block_size_x * vector_width * inputs_per_thread)) groups of block_size_x. */
KERNEL void pool_backward(const GLOBAL scalar_t* RESTRICT grad_out, INDICES_IN GLOBAL scalar_t* RESTRICT grad_in)
{
    const index_t first = ((index_t)GROUP_ID * (block_size_x * inputs_per_thread) + LOCAL_ID_X) * vector_width;
    for (int s = 0; s < inputs_per_thread; ++s)
#pragma unroll
        for (int k = 0; k < vector_width; ++k) {
            const index_t i = first + (index_t)s * block_size_x * vector_width + k;
#if PARTIAL_LAST_GROUP
            if (i >= IN_NUMEL)
                return;
#endif
            index_t plane, t, h, w;
            IN_COORDS(i, plane, t, h, w);
            const index_t o = OUT_OFFSET(plane, 0, 0, 0);
            STORE(grad_in, i, GRADIENT_TERM(LOAD(grad_out, o), o, 0, 0, 0, PLANE_POSITION(t, h, w, IN_H, IN_W)));
        }
}
