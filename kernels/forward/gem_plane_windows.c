/* gem_plane_windows -- forward, GeM pooling (kernels/operators/gem.h) of small channels-first planes
 * into few outputs: each work-item maps every input of one plane once, in order, and adds it to the
 * sums of the outputs whose windows hold it, then takes each output's p-th root; neighbouring
 * work-items take neighbouring planes.
 *
 * gem_windows maps an input once for every window that holds it (overlapping windows: up to four
 * times in 2d) and reads each window's taps from per-work-item window starts.  Here the plane is
 * unrolled whole, so which windows hold each input is known at compile time (straight-line adds, no
 * masks), and the outputs of a plane come from one read of it.  Each window's sum takes its inputs
 * in ascending order, as gem_windows' box does, so the bits are the same.
 *
 * The plane is mapped first, into private memory: in OpenCL (but float64) eight contiguous inputs at
 * a time in vector loads and arithmetic (gem.h's gem_power8, the scalar map's bits), the last
 * IN_PLANE_SIZE % 8 one by one; the windows then sum the mapped values.
 * Launch: ceil(N_PLANES / block_size_x) groups of block_size_x. */
#define PLANE_OUTPUTS (OUT_T * OUT_H * OUT_W)
#define PLANE_INPUTS (IN_T * IN_H * IN_W)

/* powers[i] = max(x_i, eps)^p for every input x_i of the plane at memory offset `base`. */
DEVICE_FN void map_plane(const GLOBAL scalar_t* RESTRICT in, index_t base, acc_t powers[PLANE_INPUTS], acc_t p, acc_t eps)
{
    int i = 0;
#if defined(__OPENCL_VERSION__) && !DTYPE_FLOAT64
#pragma unroll
    for (; i + 8 <= PLANE_INPUTS; i += 8)
        vstore8(gem_power8(load8(in, base + i), p, eps), 0, powers + i);
#endif
#pragma unroll
    for (; i < PLANE_INPUTS; ++i)
        powers[i] = gem_power(LOAD(in, base + i), p, eps);
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
    acc_t sums[PLANE_OUTPUTS];
#pragma unroll
    for (int o = 0; o < PLANE_OUTPUTS; ++o)
        sums[o] = (acc_t)0;
#pragma unroll
    for (int i = 0; i < PLANE_INPUTS; ++i) {
        const int t = i / (IN_H * IN_W), h = i / IN_W % IN_H, w = i % IN_W;
#pragma unroll
        for (int o = 0; o < PLANE_OUTPUTS; ++o) {
            const int ot = o / (OUT_H * OUT_W), oh = o / OUT_W % OUT_H, ow = o % OUT_W;
            if (WINDOW_HOLDS(t, ot, OUT_T, T_WINDOW_START, T_WINDOW_END)
                && WINDOW_HOLDS(h, oh, OUT_H, H_WINDOW_START, H_WINDOW_END)
                && WINDOW_HOLDS(w, ow, OUT_W, W_WINDOW_START, W_WINDOW_END))
                sums[o] += powers[i];
        }
    }
#pragma unroll
    for (int o = 0; o < PLANE_OUTPUTS; ++o) {
        const int ot = o / (OUT_H * OUT_W), oh = o / OUT_W % OUT_H, ow = o % OUT_W;
        STORE(out, PLANE_BASE(plane, OUT_PLANE_SIZE) + o, gem_root(sums[o], window_area(ot, oh, ow), p));
    }
}
