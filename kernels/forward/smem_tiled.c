/* smem_tiled -- forward: tiles of outputs (tiles.h).
 *
 * The stage holds the input box under the tile's windows, so overlapping windows read global
 * memory once; each work-item then reduces its outputs' windows from it. */
KERNEL void pool_forward(const GLOBAL scalar_t* RESTRICT in, GLOBAL scalar_t* RESTRICT out INDICES_OUT PLANES_PARAM OP_PARAMS)
{
    LOCAL_MEM acc_t stage[STAGE_SIZE];
    const tile_t tile = tile_of_group(GROUP_ID);
    const index_t plane = tile.plane, ot = tile.t;
    /* The stage: the union of the tile's windows. */
    const index_t t_start = T_WINDOW_START(ot), t_end = T_WINDOW_END(ot);
    const index_t h_start = H_WINDOW_START(tile.h0), h_end = H_WINDOW_END(tile.h_last);
    const index_t w_start = W_WINDOW_START(tile.w0), w_end = W_WINDOW_END(tile.w_last);
    for (int s = TILE_THREAD; s < STAGE_SIZE; s += TILE_THREADS) {
        STAGE_COORDS(s, st, sh, sw);
        if (st < t_end - t_start && sh < h_end - h_start && sw < w_end - w_start)
            stage[s] = LOAD(in, IN_OFFSET(plane, t_start + st, h_start + sh, w_start + sw));
    }
    BARRIER();

    for (int ty = 0; ty < tile_y; ++ty) {
        const index_t oh = TILE_ROW(tile, ty);
        for (int tx = 0; tx < tile_x; ++tx) {
            const index_t ow = TILE_COL(tile, tx);
            if (oh >= OUT_H || ow >= OUT_W)
                continue;
            const box_t window = window_box(ot, oh, ow);
            reduction_t r = reduce_init();
            for (index_t t = window.t_start; t < window.t_end; ++t)
                for (index_t h = window.h_start; h < window.h_end; ++h)
                    for (index_t w = window.w_start; w < window.w_end; ++w)
                        reduce_step(&r, stage[STAGE_SLOT(t - t_start, h - h_start, w - w_start)],
                                    PLANE_POSITION(t, h, w, IN_H, IN_W) OP_ARGS);
            STORE_RESULT(OUT_OFFSET(plane, ot, oh, ow), r, ot, oh, ow);
        }
    }
}
