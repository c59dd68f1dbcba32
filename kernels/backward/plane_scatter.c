/* plane_scatter -- backward: one work-item per plane scatters its outputs' gradients into its own
 * input plane, outputs in row-major order.
 *
 * Each output's share goes to every input its gradient reaches (REACHED_BOX: the window, or a
 * selecting op's one input), so every input receives its terms in the order the gather variants sum
 * them, from the same starting 0: the results are bit-identical to theirs -- and no two work-items
 * share an element, so no atomics.  Each output's share (avg: gradient / area) is computed once
 * rather than once per input; the innermost loop walks a row of the box, contiguous in
 * channels-first memory, which CPU compilers vectorise.  The plane is accumulated in place, so the
 * host allows it only where storage and accumulator types agree (float32, float64).
 * Launch: ceil(N_PLANES / block_size_x) groups of block_size_x. */
KERNEL void pool_backward(const GLOBAL scalar_t* RESTRICT grad_out, INDICES_IN GLOBAL scalar_t* RESTRICT grad_in PLANES_PARAM)
{
    const index_t plane = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (plane >= N_PLANES)
        return;
    const index_t base = PLANE_BASE(plane, IN_PLANE_SIZE);
    for (index_t p = 0; p < IN_PLANE_SIZE; ++p)
        grad_in[base + p * ELEMENT_STEP] = (acc_t)0;
    for (index_t ot = 0; ot < OUT_T; ++ot)
        for (index_t oh = 0; oh < OUT_H; ++oh)
            for (index_t ow = 0; ow < OUT_W; ++ow) {
                const index_t o = OUT_OFFSET(plane, ot, oh, ow);
                const acc_t share = OP_GRADIENT_SHARE(LOAD(grad_out, o), window_area(ot, oh, ow));
                const box_t reached = REACHED_BOX(o, ot, oh, ow);
                for (index_t t = reached.t_start; t < reached.t_end; ++t)
                    for (index_t h = reached.h_start; h < reached.h_end; ++h) {
                        const index_t row = IN_OFFSET(plane, t, h, 0);
                        for (index_t w = reached.w_start; w < reached.w_end; ++w)
                            grad_in[row + w * ELEMENT_STEP] += share;
                    }
            }
}
