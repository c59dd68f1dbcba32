/* tiles.h -- the tiles of the smem_tiled variants, forward and backward alike.
 *
 * A work-group of block_size_x x block_size_y work-items writes a tile of TILE_H x TILE_W
 * elements of one (plane, t) slice of the array it produces, whose pooled sizes the host passes
 * as WRITE_T/H/W (the output forward, the input gradient backward).  It first stages what the
 * tile reads, a STAGE_T x STAGE_H x STAGE_W box (host-computed bound over all tiles), in local
 * memory; then each work-item computes tile_y x tile_x elements from there.
 * Launch: N_PLANES * WRITE_T * TILES_H * TILES_W groups.  Only the tiled variants' programs include
 * this header (pool_tuner/kernel_source.py).
 */
#define TILE_W (block_size_x * tile_x)
#define TILE_H (block_size_y * tile_y)
#define TILES_W ((WRITE_W + TILE_W - 1) / TILE_W)
#define TILES_H ((WRITE_H + TILE_H - 1) / TILE_H)
#define STAGE_SIZE (STAGE_T * STAGE_H * STAGE_W)
#define TILE_THREAD (LOCAL_ID_Y * block_size_x + LOCAL_ID_X)
#define TILE_THREADS (block_size_x * block_size_y)

typedef struct {
    index_t plane, t;     /* the slice */
    index_t h0, w0;       /* first element written */
    index_t h_last, w_last; /* last element written (tiles at the edge are cut) */
} tile_t;

DEVICE_FN tile_t tile_of_group(index_t group)
{
    tile_t tile;
    tile.h0 = group / TILES_W % TILES_H * TILE_H;
    tile.w0 = group % TILES_W * TILE_W;
    tile.t = group / ((index_t)TILES_W * TILES_H) % WRITE_T;
    tile.plane = group / ((index_t)TILES_W * TILES_H * WRITE_T);
    tile.h_last = (tile.h0 + TILE_H < WRITE_H ? tile.h0 + TILE_H : WRITE_H) - 1;
    tile.w_last = (tile.w0 + TILE_W < WRITE_W ? tile.w0 + TILE_W : WRITE_W) - 1;
    return tile;
}

/* Coordinates (st, sh, sw) of stage slot s. */
#define STAGE_COORDS(s, st, sh, sw) \
    const index_t st = (s) / (STAGE_H * STAGE_W), sh = (s) / STAGE_W % STAGE_H, sw = (s) % STAGE_W
#define STAGE_SLOT(st, sh, sw) (((st) * STAGE_H + (sh)) * STAGE_W + (sw))

/* Element (ty, tx) of this work-item's tile_y x tile_x share of the tile. */
#define TILE_ROW(tile, ty) ((tile).h0 + LOCAL_ID_Y + (ty) * block_size_y)
#define TILE_COL(tile, tx) ((tile).w0 + LOCAL_ID_X + (tx) * block_size_x)
