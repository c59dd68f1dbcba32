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
 * Launch: ceil(N_PLANES / block_size_x) groups of block_size_x. */
#define PLANE_OUTPUTS (OUT_T * OUT_H * OUT_W)

KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out PLANES_PARAM GEM_PARAMS)
{
    const index_t plane = (index_t)GROUP_ID * block_size_x + LOCAL_ID_X;
    if (PARTIAL_LAST_GROUP && plane >= N_PLANES)
        return;
    acc_t sums[PLANE_OUTPUTS];
#pragma unroll
    for (int o = 0; o < PLANE_OUTPUTS; ++o)
        sums[o] = (acc_t)0;
    const index_t base = PLANE_BASE(plane, IN_PLANE_SIZE);
#pragma unroll
    for (int i = 0; i < IN_T * IN_H * IN_W; ++i) {
        const int t = i / (IN_H * IN_W), h = i / IN_W % IN_H, w = i % IN_W;
        const acc_t power = gem_power(LOAD(in, base + i), p, eps);
#pragma unroll
        for (int o = 0; o < PLANE_OUTPUTS; ++o) {
            const int ot = o / (OUT_H * OUT_W), oh = o / OUT_W % OUT_H, ow = o % OUT_W;
            if (WINDOW_HOLDS(t, ot, OUT_T, T_WINDOW_START, T_WINDOW_END)
                && WINDOW_HOLDS(h, oh, OUT_H, H_WINDOW_START, H_WINDOW_END)
                && WINDOW_HOLDS(w, ow, OUT_W, W_WINDOW_START, W_WINDOW_END))
                sums[o] += power;
        }
    }
#pragma unroll
    for (int o = 0; o < PLANE_OUTPUTS; ++o) {
        const int ot = o / (OUT_H * OUT_W), oh = o / OUT_W % OUT_H, ow = o % OUT_W;
        STORE(out, PLANE_BASE(plane, OUT_PLANE_SIZE) + o, gem_root(sums[o], window_area(ot, oh, ow), p));
    }
}
