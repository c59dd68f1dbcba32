/* gem_plane_gradient -- GeM's backward over small channels-first planes: gem_input_gradient's pass
 * (the gradient of the input and the input terms of the gradient of p, kernels/operators/
 * gem_input_gradient.c) with one work-item per plane; neighbouring work-items take neighbouring planes.
 *
 * gem_input_gradient gives each input a work-item, which loads its plane's coefficients and masks
 * those of the windows that do not hold it, and reduces the terms of p per work-group in local
 * memory.  Here the plane's coefficients are loaded once, and which windows hold each input is known
 * at compile time (the plane is unrolled whole): each input's share is straight-line adds of the
 * coefficients of the windows that hold it, in ascending output order from +0 as in
 * gem_input_gradient (whose masked outputs add +0, which changes no sum that starts at +0), so the
 * input's gradient has its bits:
 *
 *   grad_in[i] = share_i * p * xc_i^(p-1)   where x_i >= eps, else 0
 *   p_terms[plane] = sum over the plane's inputs of share_i * xc_i^p * ln(xc_i)
 *
 * one term per plane, for the host to add up in plane order.  In OpenCL (but float64) planes of at
 * least eight inputs go in eight-input vector steps (gem.h's load8, gem_power8, gem_log8 and store8,
 * the scalar helpers' bits): PoCL's work-group vectoriser would turn a work-item's scalar loads of its
 * contiguous plane into strided gathers.  A last step that would run past the plane's end ends at its
 * end instead: it writes the same gradients again and adds the terms of its new inputs alone.
 * The host may run the pass on a slab of whole planes: first_input is the slab's first input in
 * memory, n_planes the slab's planes, coefficients and p_terms the slab's own; in and grad_in stay
 * the whole arrays.
 * Launch: ceil(N_PLANES / block_size_x) groups of block_size_x. */
#define FIRST_INPUT_PARAM , const int64_t_ first_input

/* shares[i] = the sum of the coefficients of the windows that hold input i of the plane whose
 * outputs' coefficients start at memory offset `base`, in ascending output order. */
DEVICE_FN void gather_shares(const GLOBAL acc_t* RESTRICT coefficients, index_t base, acc_t shares[PLANE_INPUTS])
{
    acc_t coefficient[PLANE_OUTPUTS];
#pragma unroll
    for (int o = 0; o < PLANE_OUTPUTS; ++o)
        coefficient[o] = coefficients[base + o];
#pragma unroll
    for (int i = 0; i < PLANE_INPUTS; ++i) {
        acc_t share = (acc_t)0;
#pragma unroll
        for (int o = 0; o < PLANE_OUTPUTS; ++o)
            if (plane_window_holds(i, o))
                share += coefficient[o];
        shares[i] = share;
    }
}

/* Writes the gradient of the plane's inputs at memory offset `base` and returns the plane's term of
 * dL/dp. */
DEVICE_FN acc_t plane_gradient(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT grad_in, index_t base,
                               const acc_t shares[PLANE_INPUTS], acc_t p, acc_t eps)
{
#if GEM_VECTORS && PLANE_INPUTS >= 8
    float8 terms = (float8)0.0f;
#pragma unroll
    for (int step = 0; step < (PLANE_INPUTS + 7) / 8; ++step) {
        const int i = plane_step_start(step);
        const float8 x = load8(in, base + i), share = private_load8(shares + i);
        const float8 c = x < eps ? (float8)eps : x, power = gem_power8(x, p, eps);
        store8(grad_in, base + i, x >= eps ? share * p * power / c : (float8)0.0f);
        const int8 new_input = (int8)(0, 1, 2, 3, 4, 5, 6, 7) + i >= 8 * step;
        terms += new_input ? share * power * gem_log8(c) : (float8)0.0f;
    }
    return ((terms.s0 + terms.s1) + (terms.s2 + terms.s3)) + ((terms.s4 + terms.s5) + (terms.s6 + terms.s7));
#else
    acc_t term = (acc_t)0;
#pragma unroll
    for (int i = 0; i < PLANE_INPUTS; ++i) {
        const acc_t x = LOAD(in, base + i), c = x < eps ? eps : x, power = gem_power(x, p, eps);
        STORE(grad_in, base + i, x >= eps ? shares[i] * p * power / c : (acc_t)0);
        term += shares[i] * power * gem_log(c);
    }
    return term;
#endif
}

KERNEL void gem_plane_gradient(const GLOBAL scalar_t* RESTRICT in, const GLOBAL acc_t* RESTRICT coefficients,
                               GLOBAL scalar_t* RESTRICT grad_in, GLOBAL acc_t* RESTRICT p_terms PLANES_PARAM GEM_PARAMS
                               FIRST_INPUT_PARAM)
{
    const index_t plane = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (PARTIAL_LAST_GROUP && plane >= N_PLANES)
        return;
    in += first_input;
    grad_in += first_input;
    acc_t shares[PLANE_INPUTS];
    gather_shares(coefficients, PLANE_BASE(plane, OUT_PLANE_SIZE), shares);
    const index_t base = PLANE_BASE(plane, IN_PLANE_SIZE);
    /* GeM's usual exponent 3 takes a copy of its own, in which the power folds to two multiplications
     * (p is the same for every work-item, so the branch is too). */
    p_terms[plane] = p == (acc_t)3 ? plane_gradient(in, grad_in, base, shares, (acc_t)3, eps)
                                   : plane_gradient(in, grad_in, base, shares, p, eps);
}
