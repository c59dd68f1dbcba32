/* avgmax_join.c -- timm's two ways of joining avgmax's levels, and the split of their gradient
 * back into the levels' gradients, for device arrays (pool_tuner/avgmax.py; numpy arrays are
 * joined by numpy with the same roundings, so both give the same bits).
 *
 * `levels` is avgmax's flat buffer (pool_tuner/pyramid.py): the `count` averages, then the
 * `count` maxima, each level stored as the input is.  Element i of one level and element i of the
 * other are the same output, so
 *
 *   "avg+max":  joined[i] = (avg[i] + max[i]) / 2, the sum rounded to the storage type before
 *               it is halved, as `0.5 * (avg + max)` rounds in numpy and PyTorch;
 *   "cat":      joined is rows of 2 * `row` elements, each the `row` averages then the `row`
 *               maxima of one sample (channels-first: row = C * H * W) or of one position
 *               (channels-last: row = C) -- the two levels concatenated along the channels.
 *
 * The host defines JOIN_BLOCK, the work-group size.  Offsets are 64-bit: one program serves every
 * shape of a dtype. */

#define ELEMENT ((int64_t_)GROUP_ID * JOIN_BLOCK + LOCAL_ID_X)

/* Where element j of the joined "cat" rows lies in `levels`. */
DEVICE_FN int64_t_ cat_source(const int64_t_ j, const int64_t_ count, const int64_t_ row)
{
    const int64_t_ position = j % (2 * row);
    const int64_t_ level = position / row;
    return level * count + (j / (2 * row)) * row + (position - level * row);
}

KERNEL void join_mean(const GLOBAL scalar_t *RESTRICT levels, GLOBAL scalar_t *RESTRICT joined,
                      const int64_t_ count)
{
    const int64_t_ i = ELEMENT;
    if (i < count) {
        STORE(joined, i, LOAD(levels, i) + LOAD(levels, count + i));  /* rounds the sum */
        STORE(joined, i, (acc_t)0.5 * LOAD(joined, i));
    }
}

KERNEL void join_cat(const GLOBAL scalar_t *RESTRICT levels, GLOBAL scalar_t *RESTRICT joined,
                     const int64_t_ count, const int64_t_ row)
{
    const int64_t_ j = ELEMENT;
    if (j < 2 * count)
        STORE(joined, j, LOAD(levels, cat_source(j, count, row)));
}

/* The gradients: "avg+max" gives each level half of the joined gradient; "cat" hands each level
 * its own rows back. */
KERNEL void split_mean(const GLOBAL scalar_t *RESTRICT joined, GLOBAL scalar_t *RESTRICT levels,
                       const int64_t_ count)
{
    const int64_t_ i = ELEMENT;
    if (i < count) {
        const acc_t share = (acc_t)0.5 * LOAD(joined, i);
        STORE(levels, i, share);
        STORE(levels, count + i, share);
    }
}

KERNEL void split_cat(const GLOBAL scalar_t *RESTRICT joined, GLOBAL scalar_t *RESTRICT levels,
                      const int64_t_ count, const int64_t_ row)
{
    const int64_t_ j = ELEMENT;
    if (j < 2 * count)
        STORE(levels, cat_source(j, count, row), LOAD(joined, j));
}
