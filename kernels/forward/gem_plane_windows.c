/* gem_plane_windows -- forward, GeM pooling (kernels/operators/gem.h) of small channels-first planes
 * into few outputs: each work-item maps every input of one plane once (below: a few twice, to the
 * same value), and adds it to the sums of the outputs whose windows hold it, in order, then takes
 * each output's p-th root; neighbouring work-items take neighbouring planes.
 *
 * The shared thread_per_output maps an input once for every window that holds it (overlapping
 * windows: up to four times in 2d) and reads each window's taps from per-work-item window starts.
 * Here the plane is unrolled whole, so which windows hold each input is known at compile time
 * (straight-line adds, no masks), and the outputs of a plane come from one read of it.  Each
 * window's sum takes its inputs in ascending order, as thread_per_output's small box does (one row
 * lane), so the bits are the same.  Not for global pooling, where gem_planes' contiguous lanes
 * do better.
 *
 * The plane is mapped first, into private memory, and the windows then sum the mapped values.  In
 * OpenCL (but float64) the map takes eight contiguous inputs at a time in vector loads and
 * arithmetic (planes of fewer than eight inputs one by one), and the roots, narrowed to the storage
 * type, eight outputs at a time (gem.h's gem_power8, gem_root8 and stored8, the scalar helpers'
 * bits): PoCL's work-group vectoriser turns a work-item's scalar loads of its contiguous plane into
 * strided gathers, and its scalar roots stay scalar.
 * Launch: ceil(N_PLANES / block_size_x) groups of block_size_x. */
/* The window sums, past PLANE_OUTPUTS to a whole number of vector steps. */
#define SUMS ((PLANE_OUTPUTS + 7) / 8 * 8)

/* powers[i] = max(x_i, eps)^p for every input x_i of the plane at memory offset `base`.  In vector
 * steps, a last step that would run past the plane's end ends at its end instead: it maps some
 * inputs of the step before it again, to the same values. */
DEVICE_FN void map_plane(const GLOBAL scalar_t* RESTRICT in, index_t base, acc_t powers[PLANE_INPUTS], acc_t p,
                         acc_t eps)
{
#if GEM_VECTORS && PLANE_INPUTS >= 8
#pragma unroll
    for (int step = 0; step < (PLANE_INPUTS + 7) / 8; ++step) {
        const int i = plane_step_start(step);
        private_store8(gem_power8(load8(in, base + i), p, eps), powers + i);
    }
#else
#pragma unroll
    for (int i = 0; i < PLANE_INPUTS; ++i)
        powers[i] = gem_power(LOAD(in, base + i), p, eps);
#endif
}

/* out[o] = the p-th root of the mean of window o, from its sum, for every output o of the plane
 * whose outputs start at memory offset `base`. */
DEVICE_FN void store_roots(GLOBAL scalar_t* RESTRICT out, index_t base, const acc_t sums[SUMS], acc_t p)
{
#if GEM_VECTORS
#pragma unroll
    for (int o = 0; o < PLANE_OUTPUTS; o += 8) {
        acc_t areas[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int ok = o + k, ot = ok / (OUT_H * OUT_W), oh = ok / OUT_W % OUT_H, ow = ok % OUT_W;
            areas[k] = ok < PLANE_OUTPUTS ? (acc_t)window_area(ot, oh, ow) : (acc_t)1;
        }
        const stored8_t roots = stored8(gem_root8(private_load8(sums + o), private_load8(areas), p));
#pragma unroll
        for (int k = 0; k < 8 && o + k < PLANE_OUTPUTS; ++k)
            ((GLOBAL stored_t*)out)[base + o + k] = roots[k];
    }
#else
#pragma unroll
    for (int o = 0; o < PLANE_OUTPUTS; ++o) {
        const int ot = o / (OUT_H * OUT_W), oh = o / OUT_W % OUT_H, ow = o % OUT_W;
        STORE(out, base + o, gem_root(sums[o], window_area(ot, oh, ow), p));
    }
#endif
}

KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out PLANES_PARAM GEM_PARAMS)
{
    const index_t plane = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (PARTIAL_LAST_GROUP && plane >= N_PLANES)
        return;
    const index_t base = PLANE_BASE(plane, IN_PLANE_SIZE);
    /* GeM's usual exponent 3 takes a copy of the map of its own, in which the power folds to two
     * multiplications (p is the same for every work-item, so the branch is too). */
    acc_t powers[PLANE_INPUTS];
    if (p == (acc_t)3)
        map_plane(in, base, powers, (acc_t)3, eps);
    else
        map_plane(in, base, powers, p, eps);
    acc_t sums[SUMS];
#pragma unroll
    for (int o = 0; o < SUMS; ++o)
        sums[o] = (acc_t)0;
#pragma unroll
    for (int i = 0; i < PLANE_INPUTS; ++i)
#pragma unroll
        for (int o = 0; o < PLANE_OUTPUTS; ++o)
            if (plane_window_holds(i, o))
                sums[o] += powers[i];
    store_roots(out, PLANE_BASE(plane, OUT_PLANE_SIZE), sums, p);
}
