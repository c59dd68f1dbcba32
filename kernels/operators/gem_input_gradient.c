/* gem_input_gradient -- GeM's backward, after the gather: the gradient of the input and the terms of
 * the gradient of p, elementwise in memory order (the input, the shares and the gradient share a
 * layout).
 *
 * A backward variant, through gem.h's operator, has gathered each input's share of the gradient of
 * the window means m_o that hold it: shares[i] = sum over those o of dL/dm_o / area_o -- or, in
 * global pooling (PLANE_SHARES), where each input has one window, its plane's, shares holds the
 * window means' gradients dL/dm_plane themselves and no gather runs.  Then, with
 * xc = max(x, eps) and m_o = mean of xc^p over window o,
 *
 *   grad_in[i] = shares[i] * p * xc_i^(p-1)   where x_i >= eps, else 0 (clamp(min=eps)'s gradient)
 *   dL/dp      = sum over o of dL/dy_o * dy_o/dp, whose input part sum_i shares[i] * xc_i^p * ln(xc_i)
 *                each work-group adds up for its inputs into p_terms[group], in work-item order, for
 *                the host to add up in group order (deterministic: no atomics).
 *
 * Gathered shares may be grad_in's own memory (float32 and float64: acc_t is scalar_t), each
 * element read before the same work-item writes it, so neither is RESTRICT.
 * Launch: ceil(IN_NUMEL / (block_size_x * items_per_thread)) groups of block_size_x. */
/* The plane of the input at memory offset i (windows.h's layouts). */
#if CHANNELS_LAST
#define PLANE_OF(i) ((i) / (IN_PLANE_SIZE * N_CHANNELS) * N_CHANNELS + (i) % N_CHANNELS)
#else
#define PLANE_OF(i) ((i) / IN_PLANE_SIZE)
#endif

KERNEL void gem_input_gradient(const GLOBAL scalar_t* RESTRICT in, const GLOBAL acc_t* shares,
                               GLOBAL scalar_t* grad_in, GLOBAL acc_t* RESTRICT p_terms PLANES_PARAM GEM_PARAMS)
{
    LOCAL_MEM acc_t partial[block_size_x];
    const index_t first = (index_t)GROUP_ID * (block_size_x * items_per_thread) + LOCAL_ID_X;
    /* Only the last work-group can run past the end: the others' work-items stay branch-free
     * (the condition is the same for a whole group), so CPU compilers vectorise them. */
    const int whole_group = (GROUP_ID + 1) * (block_size_x * items_per_thread) <= IN_NUMEL;
    acc_t term = (acc_t)0;
    for (int k = 0; k < items_per_thread; ++k) {
        const index_t i = first + (index_t)k * block_size_x;
        if (!whole_group && i >= IN_NUMEL)
            break;
        const acc_t x = LOAD(in, i);
        const acc_t c = x < eps ? eps : x;
        const acc_t power = gem_power(x, p, eps);
#if PLANE_SHARES
        const acc_t share = shares[PLANE_OF(i)] / (acc_t)IN_PLANE_SIZE;
#else
        const acc_t share = shares[i];
#endif
        STORE(grad_in, i, x >= eps ? share * p * power / c : (acc_t)0);
        term += share * power * gem_log(c);
    }
    partial[LOCAL_ID_X] = term;
    BARRIER();
    if (LOCAL_ID_X == 0) {
        acc_t sum = (acc_t)0;
        for (int k = 0; k < block_size_x; ++k)
            sum += partial[k];
        p_terms[GROUP_ID] = sum;
    }
}
