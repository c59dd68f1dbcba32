/* smem_tiled -- backward gather over tiles of input gradients (tiles.h).
 *
 * The stage holds the gradients of every output whose window touches the tile -- already turned
 * into the share each reached input receives, and for selecting ops paired with their index --
 * and each work-item then gathers its inputs from it.  Pays off when windows overlap or outputs
 * outnumber inputs (upsampling). */
KERNEL void pool_backward(const GLOBAL scalar_t* RESTRICT grad_out, INDICES_IN GLOBAL scalar_t* RESTRICT grad_in PLANES_PARAM)
{
    LOCAL_MEM acc_t stage[STAGE_SIZE];
    IF_SELECTING(LOCAL_MEM int64_t_ stage_index[STAGE_SIZE];)
    const tile_t tile = tile_of_group(GROUP_ID);
    const index_t plane = tile.plane, t = tile.t;
    /* The stage: the outputs whose windows hold an input of the tile. */
    const index_t stage_ot_start = WINDOW_START(t, OUT_T, IN_T), stage_ot_end = WINDOW_END(t, OUT_T, IN_T);
    const index_t stage_oh_start = WINDOW_START(tile.h0, OUT_H, IN_H), stage_oh_end = WINDOW_END(tile.h_last, OUT_H, IN_H);
    const index_t stage_ow_start = WINDOW_START(tile.w0, OUT_W, IN_W), stage_ow_end = WINDOW_END(tile.w_last, OUT_W, IN_W);
    for (int s = TILE_THREAD; s < STAGE_SIZE; s += TILE_THREADS) {
        STAGE_COORDS(s, st, sh, sw);
        if (st < stage_ot_end - stage_ot_start && sh < stage_oh_end - stage_oh_start && sw < stage_ow_end - stage_ow_start) {
            const index_t ot = stage_ot_start + st, oh = stage_oh_start + sh, ow = stage_ow_start + sw;
            const index_t o = OUT_OFFSET(plane, ot, oh, ow);
            stage[s] = OP_GRADIENT_SHARE(LOAD(grad_out, o), window_area(ot, oh, ow));
            IF_SELECTING(stage_index[s] = indices[o];)
        }
    }
    BARRIER();

    for (int ty = 0; ty < tile_y; ++ty) {
        const index_t h = TILE_ROW(tile, ty);
        for (int tx = 0; tx < tile_x; ++tx) {
            const index_t w = TILE_COL(tile, tx);
            if (h >= IN_H || w >= IN_W)
                continue;
            const index_t position = PLANE_POSITION(t, h, w, IN_H, IN_W);
            /* The outputs whose windows hold input (t, h, w). */
            const index_t oh_start = WINDOW_START(h, OUT_H, IN_H), oh_end = WINDOW_END(h, OUT_H, IN_H);
            const index_t ow_start = WINDOW_START(w, OUT_W, IN_W), ow_end = WINDOW_END(w, OUT_W, IN_W);
            acc_t sum = (acc_t)0;
            for (index_t ot = stage_ot_start; ot < stage_ot_start + INVERSE_COUNT(T, stage_ot_start, stage_ot_end); ++ot)
                for (index_t oh = oh_start; oh < oh_start + INVERSE_COUNT(H, oh_start, oh_end); ++oh)
                    for (index_t ow = ow_start; ow < ow_start + INVERSE_COUNT(W, ow_start, ow_end); ++ow) {
                        const index_t s = STAGE_SLOT(ot - stage_ot_start, oh - stage_oh_start, ow - stage_ow_start);
                        sum += REACHES(stage_index[s], position) ? stage[s] : (acc_t)0;
                    }
            STORE(grad_in, IN_OFFSET(plane, t, h, w), sum);
        }
    }
}
