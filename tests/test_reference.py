"""The float64 numpy reference (the oracle) against PyTorch CPU, hand-computed cases and the
worked examples of docs/design.md (Semantics)."""

from __future__ import annotations

import numpy as np
import pytest

from pool_tuner import reference as ref

torch = pytest.importorskip("torch")
F = torch.nn.functional

TOL = dict(rtol=1e-12, atol=1e-12)
NAN = np.nan
INF = np.inf

AVG = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}
MAX = {1: F.adaptive_max_pool1d, 2: F.adaptive_max_pool2d, 3: F.adaptive_max_pool3d}


# ``rng`` is the shared fixture of tests/conftest.py: fresh per run and per test id, replayable
# with POOL_TUNER_TEST_SEED (printed in the pytest header).


def randn(rng, shape):
    """Random float64 data, never zero (and never all the same)."""
    x = rng.standard_normal(shape)
    x[x == 0] = 0.5
    return x


def resolved(shape, output_size, ndim):
    """output_size with None entries replaced by the input size (torch 1d does not take None)."""
    spatial = shape[-ndim:]
    if isinstance(output_size, int):
        return (output_size,) * ndim
    return tuple(s if o is None else o for o, s in zip(output_size, spatial))


# (input shape, output_size) per rank: divisible, non-divisible, upsampling, O=1, O=I, size-1 axes,
# prime sizes, None entries, batch-less, empty batch/channels, output size 0.
CASES = {
    1: [
        ((2, 3, 8), 4),
        ((2, 3, 10), 4),
        ((2, 3, 14), (4,)),
        ((2, 3, 5), 7),
        ((2, 3, 2), 3),
        ((2, 3, 9), 1),
        ((2, 3, 9), 9),
        ((2, 3, 1), 1),
        ((2, 3, 1), 3),
        ((2, 3, 13), 5),
        ((2, 3, 31), 7),
        ((2, 3, 11), (None,)),
        ((3, 17), 5),
        ((0, 3, 10), 4),
        ((2, 0, 10), 4),
        ((2, 3, 10), 0),
    ],
    2: [
        ((2, 3, 8, 8), 4),
        ((2, 3, 8, 9), (5, 7)),
        ((2, 3, 10, 9), 7),
        ((2, 3, 10, 9), (None, 7)),
        ((2, 3, 10, 9), (3, None)),
        ((2, 3, 3, 4), (5, 7)),
        ((2, 3, 9, 7), 1),
        ((2, 3, 9, 7), (9, 7)),
        ((2, 3, 1, 1), (3, 2)),
        ((2, 3, 7, 1), (3, 1)),
        ((2, 3, 1, 11), (1, 4)),
        ((2, 3, 13, 17), (5, 3)),
        ((3, 23, 37), (5, 7)),
        ((0, 3, 8, 8), 4),
        ((2, 0, 8, 8), 4),
        ((2, 3, 8, 8), 0),
        ((2, 3, 8, 8), (0, 3)),
    ],
    3: [
        ((2, 3, 4, 6, 8), 2),
        ((2, 3, 5, 7, 9), (3, 4, 5)),
        ((2, 2, 3, 4, 5), (5, 6, 7)),
        ((2, 3, 5, 6, 7), 1),
        ((2, 3, 3, 4, 5), (3, 4, 5)),
        ((2, 3, 5, 6, 7), (None, 2, None)),
        ((2, 3, 1, 1, 5), (2, 3, 2)),
        ((2, 3, 7, 11, 13), (2, 3, 5)),
        ((3, 4, 5, 6), (2, 3, 4)),
        ((0, 3, 4, 5, 6), 2),
        ((2, 0, 4, 5, 6), 2),
        ((2, 3, 4, 5, 6), 0),
        ((2, 3, 4, 5, 6), (2, 0, 3)),
    ],
}
ALL_CASES = [
    pytest.param(ndim, shape, size, id=f"{ndim}d-{shape}->{size}")
    for ndim in CASES
    for shape, size in CASES[ndim]
]


def is_empty(shape, size, ndim):
    return 0 in shape or 0 in resolved(shape, size, ndim)


def torch_refuses_channels(shape, ndim, op):
    """torch 2.x refuses C=0 for max pooling of every rank and for avg pooling in 3d."""
    return len(shape) == ndim + 2 and shape[1] == 0 and (op == "max" or ndim == 3)


@pytest.mark.parametrize("ndim, shape, size", ALL_CASES)
def test_avg_forward_vs_torch(rng, ndim, shape, size):
    x = randn(rng, shape)
    got = ref.adaptive_avg_pool(x, size, ndim)
    out_shape = shape[: len(shape) - ndim] + resolved(shape, size, ndim)
    assert got.dtype == np.float64 and got.shape == out_shape
    if torch_refuses_channels(shape, ndim, "avg"):
        return  # empty result checked by shape above
    want = AVG[ndim](torch.from_numpy(x), resolved(shape, size, ndim)).numpy()
    assert want.shape == out_shape
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("ndim, shape, size", ALL_CASES)
def test_max_forward_vs_torch(rng, ndim, shape, size):
    x = randn(rng, shape)
    values, indices = ref.adaptive_max_pool(x, size, ndim)
    out_shape = shape[: len(shape) - ndim] + resolved(shape, size, ndim)
    assert values.dtype == np.float64 and values.shape == out_shape
    assert indices.dtype == np.int64 and indices.shape == out_shape
    if torch_refuses_channels(shape, ndim, "max"):
        return
    want_v, want_i = MAX[ndim](torch.from_numpy(x), resolved(shape, size, ndim), return_indices=True)
    assert want_v.shape == out_shape
    np.testing.assert_array_equal(values, want_v.numpy())  # a max is exact
    np.testing.assert_array_equal(indices, want_i.numpy())


@pytest.mark.parametrize("ndim, shape, size", ALL_CASES)
def test_avg_backward_vs_torch(rng, ndim, shape, size):
    x = randn(rng, shape)
    out_shape = shape[: len(shape) - ndim] + resolved(shape, size, ndim)
    g = randn(rng, out_shape)
    got = ref.adaptive_avg_pool_backward(g, shape, ndim)
    assert got.dtype == np.float64 and got.shape == shape
    if is_empty(shape, size, ndim):
        # torch's backward refuses an empty grad_output; the gradient of an empty output is 0.
        np.testing.assert_array_equal(got, np.zeros(shape))
        return
    xt = torch.from_numpy(x).requires_grad_()
    AVG[ndim](xt, resolved(shape, size, ndim)).backward(torch.from_numpy(g))
    np.testing.assert_allclose(got, xt.grad.numpy(), **TOL)


@pytest.mark.parametrize("ndim, shape, size", ALL_CASES)
def test_max_backward_vs_torch(rng, ndim, shape, size):
    x = randn(rng, shape)
    out_shape = shape[: len(shape) - ndim] + resolved(shape, size, ndim)
    g = randn(rng, out_shape)
    _, indices = ref.adaptive_max_pool(x, size, ndim)
    got = ref.adaptive_max_pool_backward(g, indices, shape, ndim)
    assert got.dtype == np.float64 and got.shape == shape
    if is_empty(shape, size, ndim):
        np.testing.assert_array_equal(got, np.zeros(shape))
        return
    xt = torch.from_numpy(x).requires_grad_()
    MAX[ndim](xt, resolved(shape, size, ndim)).backward(torch.from_numpy(g))
    np.testing.assert_allclose(got, xt.grad.numpy(), **TOL)


@pytest.mark.parametrize("ndim, shape, size", [c for c in ALL_CASES if not is_empty(*c.values[1:], c.values[0])])
def test_avg_backward_is_adjoint_of_forward(rng, ndim, shape, size):
    # <pool(x), g> == <x, pool_backward(g)>: ties forward and backward without torch.
    x = randn(rng, shape)
    y = ref.adaptive_avg_pool(x, size, ndim)
    g = randn(rng, y.shape)
    lhs = float(np.sum(y * g))
    rhs = float(np.sum(x * ref.adaptive_avg_pool_backward(g, shape, ndim)))
    assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-12)


# --- docs/design.md (Semantics) worked examples -------------------------------------------------------


def test_design_1d_worked_example():
    x = np.arange(14, dtype=np.float64)[None, None]
    y = ref.adaptive_avg_pool(x, 4, 1)
    np.testing.assert_array_equal(y[0, 0], [1.5, 4.5, 8.5, 11.5])
    g = np.array([[[1.0, 2.0, 3.0, 4.0]]])
    gi = ref.adaptive_avg_pool_backward(g, x.shape, 1)
    np.testing.assert_array_equal(gi[0, 0], [0.25, 0.25, 0.25, 0.75, 0.5, 0.5, 0.5, 0.75, 0.75, 0.75, 1.75, 1, 1, 1])
    # and torch agrees
    np.testing.assert_array_equal(y, F.adaptive_avg_pool1d(torch.from_numpy(x), 4).numpy())
    xt = torch.from_numpy(x).requires_grad_()
    F.adaptive_avg_pool1d(xt, 4).backward(torch.from_numpy(g))
    np.testing.assert_array_equal(gi, xt.grad.numpy())


DESIGN_2D = [
    ((1, 64, 8, 9), (5, 7)),
    ((1, 64, 10, 9), 7),
    ((1, 64, 10, 9), (None, 7)),
    ((1, 16, 16), (4, 4)),
    ((1, 23, 37), (5, 7)),
    ((16, 20, 20), (5, 5)),
]


@pytest.mark.parametrize("shape, size", DESIGN_2D, ids=[f"{s}->{o}" for s, o in DESIGN_2D])
def test_design_2d_seed_shapes(rng, shape, size):
    x = randn(rng, shape)
    xt = torch.from_numpy(x).requires_grad_()
    # torch takes the output size as given (None entries included)
    want = F.adaptive_avg_pool2d(xt, size)
    got = ref.adaptive_avg_pool(x, size, 2)
    assert got.shape == tuple(want.shape)
    np.testing.assert_allclose(got, want.detach().numpy(), **TOL)
    g = randn(rng, got.shape)
    want.backward(torch.from_numpy(g))
    np.testing.assert_allclose(ref.adaptive_avg_pool_backward(g, shape, 2), xt.grad.numpy(), **TOL)

    xt.grad = None
    want_v, want_i = F.adaptive_max_pool2d(xt, size, return_indices=True)
    values, indices = ref.adaptive_max_pool(x, size, 2)
    np.testing.assert_array_equal(values, want_v.detach().numpy())
    np.testing.assert_array_equal(indices, want_i.numpy())
    want_v.backward(torch.from_numpy(g))
    np.testing.assert_allclose(ref.adaptive_max_pool_backward(g, indices, shape, 2), xt.grad.numpy(), **TOL)


# --- max pooling special values: hand-computed expectations ----------------------------------
# (input (N=1, C=1 prepended), output_size, expected values, expected indices, torch agrees?)
# Every case is PyTorch's too (docs/design.md, Semantics): of several NaNs the last wins.

MAX_SPECIAL = [
    # 1d, single NaN per window; windows of 5 -> 2 are [0,3), [2,5)
    pytest.param([[1.0, NAN, 3.0, 2.0, 5.0]], 2, [[NAN, 5.0]], [[1, 4]], True, id="1d-nan"),
    # 1d, NaN in the overlap of two windows: both report it
    pytest.param([[1.0, 4.0, NAN, 2.0, 5.0]], 2, [[NAN, NAN]], [[2, 2]], True, id="1d-nan-overlap"),
    # 1d, several NaNs in one window: the last wins
    pytest.param([[NAN, 2.0, NAN, 4.0]], 1, [[NAN]], [[2]], True, id="1d-two-nans"),
    pytest.param([[1.0, NAN, INF, NAN]], 1, [[NAN]], [[3]], True, id="1d-nan-inf-nan"),
    pytest.param([[1.0, NAN, 3.0, NAN, 0.0]], 1, [[NAN]], [[3]], True, id="1d-issue-25"),
    # 1d ties: first position; windows of 5 -> 2 are [0,3), [2,5), the tie at 2 and 4 only in window 2
    pytest.param([[3.0, 1.0, 3.0, 2.0, 3.0]], 2, [[3.0, 3.0]], [[0, 2]], True, id="1d-ties"),
    pytest.param([[2.0, 2.0, 2.0]], 2, [[2.0, 2.0]], [[0, 1]], True, id="1d-all-equal"),
    # 1d all -inf windows: first position of each window (10 -> 4: 0:3, 2:5, 5:8, 7:10)
    pytest.param([[-INF] * 10], 4, [[-INF] * 4], [[0, 2, 5, 7]], True, id="1d-all-neg-inf"),
    pytest.param([[-INF, -INF, 1.0, -INF, -INF]], 2, [[1.0, 1.0]], [[2, 2]], True, id="1d-neg-inf-and-value"),
    pytest.param([[1.0, INF, INF, 0.0]], 1, [[INF]], [[1]], True, id="1d-inf-ties"),
    # 2d, one window 3x3 (W=3): NaNs at (0,1), (1,0), (2,2): last in row-major order is (2,2) -> 8
    pytest.param(
        [[[1.0, NAN, 5.0], [NAN, 0.0, 1.0], [3.0, 3.0, NAN]]], 1, [[[NAN]]], [[[8]]], True, id="2d-three-nans"
    ),
    pytest.param([[[1.0, 2.0, 5.0], [NAN, 0.0, 1.0], [3.0, 3.0, 4.0]]], 1, [[[NAN]]], [[[3]]], True, id="2d-nan"),
    # 2d ties at (0,2) and (1,0) in a 2x3 window: row-major first is (0,2) -> 2
    pytest.param([[[1.0, 0.0, 7.0], [7.0, 0.0, 1.0]]], 1, [[[7.0]]], [[[2]]], True, id="2d-ties"),
    # 2d 3x3 -> 2x2 all -inf: windows rows/cols 0:2, 1:3 -> first positions (0,0),(0,1),(1,0),(1,1)
    pytest.param([[[-INF] * 3] * 3], 2, [[[-INF, -INF], [-INF, -INF]]], [[[0, 1], [3, 4]]], True, id="2d-all-neg-inf"),
    # 3d 2x2x2 -> 1 with ties at (0,1,1)=3 and (1,0,0)=4: first is 3
    pytest.param(
        [[[[0.0, 1.0], [2.0, 9.0]], [[9.0, 1.0], [2.0, 3.0]]]], 1, [[[[9.0]]]], [[[[3]]]], True, id="3d-ties"
    ),
    # 3d, NaNs at (0,1,0)=2 and (1,0,1)=5: last is 5
    pytest.param(
        [[[[0.0, 1.0], [NAN, 9.0]], [[9.0, NAN], [2.0, 3.0]]]], 1, [[[[NAN]]]], [[[[5]]]], True, id="3d-two-nans"
    ),
    pytest.param([[[[-INF] * 2] * 2] * 2], (2, 1, 1), [[[[-INF]], [[-INF]]]], [[[[0]], [[4]]]], True, id="3d-neg-inf"),
]


@pytest.mark.parametrize("x, size, values, indices, torch_agrees", MAX_SPECIAL)
def test_max_special_values(x, size, values, indices, torch_agrees):
    x = np.array(x, dtype=np.float64)[None]
    ndim = x.ndim - 2
    got_v, got_i = ref.adaptive_max_pool(x, size, ndim)
    expected_v = np.array(values, dtype=np.float64)[None]
    expected_i = np.array(indices, dtype=np.int64)[None]
    np.testing.assert_array_equal(got_v, expected_v)  # treats NaN == NaN, checks the infinities
    np.testing.assert_array_equal(got_i, expected_i)
    # the gradient goes to the reported position
    g = np.arange(1.0, got_v.size + 1).reshape(got_v.shape)
    gi = ref.adaptive_max_pool_backward(g, got_i, x.shape, ndim)
    expected_gi = np.zeros(x.size // x.shape[0] // x.shape[1])
    np.add.at(expected_gi, expected_i.ravel(), g.ravel())
    np.testing.assert_array_equal(gi.ravel(), expected_gi)
    if torch_agrees:
        want_v, want_i = MAX[ndim](torch.from_numpy(x), size, return_indices=True)
        np.testing.assert_array_equal(want_v.numpy(), expected_v)
        np.testing.assert_array_equal(want_i.numpy(), expected_i)


def test_max_last_nan_per_plane_random(rng):
    # Many planes at once, NaNs sprinkled at random: every window's index is its last NaN in
    # row-major order, found here by PyTorch's scalar scan of the window (a NaN always takes over).
    shape, size = (3, 4, 7, 9), (3, 4)
    x = randn(rng, shape)
    x[rng.random(shape) < 0.08] = NAN
    x[rng.random(shape) < 0.05] = -INF
    values, indices = ref.adaptive_max_pool(x, size, 2)
    hs = [(o * 7 // 3, -(-(o + 1) * 7 // 3)) for o in range(3)]
    ws = [(o * 9 // 4, -(-(o + 1) * 9 // 4)) for o in range(4)]
    for n in range(3):
        for c in range(4):
            for oh, (h0, h1) in enumerate(hs):
                for ow, (w0, w1) in enumerate(ws):
                    best, best_i = None, None
                    for h in range(h0, h1):
                        for w in range(w0, w1):
                            v = x[n, c, h, w]
                            if best is None or np.isnan(v) or v > best:
                                best, best_i = v, h * 9 + w
                    assert indices[n, c, oh, ow] == best_i
                    np.testing.assert_array_equal(values[n, c, oh, ow], best)


# --- dtypes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32])
def test_input_dtypes_are_computed_in_float64(rng, dtype):
    x = (randn(rng, (2, 3, 10, 7)) * 8).astype(dtype)
    x64 = x.astype(np.float64)
    y = ref.adaptive_avg_pool(x, (4, 3), 2)
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, F.adaptive_avg_pool2d(torch.from_numpy(x64), (4, 3)).numpy(), **TOL)
    v, i = ref.adaptive_max_pool(x, (4, 3), 2)
    assert v.dtype == np.float64 and i.dtype == np.int64
    g = randn(rng, (2, 3, 4, 3)).astype(dtype)
    assert ref.adaptive_avg_pool_backward(g, x.shape, 2).dtype == np.float64
    assert ref.adaptive_max_pool_backward(g, i, x.shape, 2).dtype == np.float64


def test_does_not_modify_inputs(rng):
    x = randn(rng, (2, 3, 6, 5))
    g = randn(rng, (2, 3, 4, 4))
    x0, g0 = x.copy(), g.copy()
    _, idx = ref.adaptive_max_pool(x, 4, 2)
    idx0 = idx.copy()
    ref.adaptive_avg_pool(x, 4, 2)
    ref.adaptive_avg_pool_backward(g, x.shape, 2)
    ref.adaptive_max_pool_backward(g, idx, x.shape, 2)
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(g, g0)
    np.testing.assert_array_equal(idx, idx0)


def test_channels_last_and_strided_inputs(rng):
    # Only the logical shape matters to the oracle (numpy may sum in another order: tolerance).
    x = randn(rng, (2, 3, 9, 11))
    want = ref.adaptive_avg_pool(x, (4, 5), 2)
    x_cl = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(ref.adaptive_avg_pool(x_cl, (4, 5), 2), want, **TOL)
    big = randn(rng, (2, 3, 18, 22))
    big[:, :, ::2, ::2] = x
    np.testing.assert_allclose(ref.adaptive_avg_pool(big[:, :, ::2, ::2], (4, 5), 2), want, **TOL)


# --- bad input ---------------------------------------------------------------------------------

BAD_FORWARD = [
    pytest.param((8, 8), 4, 2, ValueError, r"x must be 3-d or 4-d", id="rank-too-low"),
    pytest.param((1, 2, 3, 8, 8), 4, 2, ValueError, r"x must be 3-d or 4-d", id="rank-too-high"),
    pytest.param((8,), 4, 1, ValueError, r"x must be 2-d or 3-d", id="1d-rank"),
    pytest.param((2, 3, 8, 8), -1, 2, ValueError, r"output_size must be >= 0", id="negative"),
    pytest.param((2, 3, 8, 8), (4, -2), 2, ValueError, r"output_size\[1\] must be >= 0", id="negative-entry"),
    pytest.param((2, 3, 8, 8), (4, 4, 4), 2, ValueError, r"output_size must have 2 entries", id="3-entries"),
    pytest.param((2, 3, 8, 8, 8), (4, 4), 3, ValueError, r"output_size must have 3 entries", id="2-entries"),
    pytest.param((2, 3, 8, 8), 2.0, 2, TypeError, r"output_size", id="float"),
    pytest.param((2, 3, 8, 8), (2.0, 3), 2, TypeError, r"output_size\[0\] must be an int", id="float-entry"),
    pytest.param((2, 3, 8, 8), (2, True), 2, TypeError, r"output_size\[1\] must be an int", id="bool-entry"),
    pytest.param((2, 3, 8, 8), None, 2, TypeError, r"output_size", id="bare-None"),
    pytest.param((2, 3, 0, 8), 4, 2, ValueError, r"x has a pooled dimension of size 0", id="zero-pooled-dim"),
    pytest.param((3, 5, 0), 4, 2, ValueError, r"x has a pooled dimension of size 0", id="zero-pooled-dim-batchless"),
    pytest.param((2, 3, 8, 8), 4, 4, ValueError, r"ndim must be 1, 2 or 3", id="bad-ndim"),
]


@pytest.mark.parametrize("shape, size, ndim, exc, match", BAD_FORWARD)
@pytest.mark.parametrize("op", [ref.adaptive_avg_pool, ref.adaptive_max_pool])
def test_bad_forward_arguments(op, shape, size, ndim, exc, match):
    x = np.ones(shape)
    with pytest.raises(exc, match=match):
        op(x, size, ndim)


@pytest.mark.parametrize("op", [ref.adaptive_avg_pool, ref.adaptive_max_pool])
@pytest.mark.parametrize("dtype", [np.bool_, np.complex128, object])
def test_bad_forward_dtype(op, dtype):
    with pytest.raises(TypeError, match=r"x must be a real"):
        op(np.ones((2, 3, 4, 4), dtype=dtype), 2, 2)


BAD_BACKWARD = [
    pytest.param((2, 3, 4, 4), (8,), ValueError, r"input_shape must be 3-d or 4-d", id="input-rank"),
    pytest.param((2, 3, 4, 4), (2, 3, 0, 8), ValueError, r"input_shape has a pooled dimension", id="input-zero"),
    pytest.param((2, 3, 4, 4), (2, 3, -8, 8), ValueError, r"input_shape\[2\] must be >= 0", id="input-neg"),
    pytest.param((2, 3, 4, 4), (2, 3, 8.0, 8), TypeError, r"input_shape\[2\] must be an int", id="input-float"),
    pytest.param((3, 4, 4), (2, 3, 8, 8), ValueError, r"grad_out must have the rank", id="grad-rank"),
    pytest.param((2, 4, 4, 4), (2, 3, 8, 8), ValueError, r"grad_out must have the batch/channel dims", id="grad-batch"),
]


@pytest.mark.parametrize("grad_shape, input_shape, exc, match", BAD_BACKWARD)
@pytest.mark.parametrize("op", ["avg", "max"])
def test_bad_backward_arguments(op, grad_shape, input_shape, exc, match):
    g = np.ones(grad_shape)
    idx = np.zeros(grad_shape, dtype=np.int64)
    with pytest.raises(exc, match=match):
        if op == "avg":
            ref.adaptive_avg_pool_backward(g, input_shape, 2)
        else:
            ref.adaptive_max_pool_backward(g, idx, input_shape, 2)


@pytest.mark.parametrize(
    "indices, exc, match",
    [
        pytest.param(np.zeros((2, 3, 4), dtype=np.int64), ValueError, r"indices must have the shape", id="shape"),
        pytest.param(np.zeros((2, 3, 4, 4)), TypeError, r"indices must be an integer array", id="float"),
        pytest.param(
            np.full((2, 3, 4, 4), 64, dtype=np.int64), ValueError, r"indices must lie in \[0, 64\)", id="high"
        ),
        pytest.param(np.full((2, 3, 4, 4), -1, dtype=np.int64), ValueError, r"indices must lie in \[0, 64\)", id="neg"),
    ],
)
def test_bad_max_backward_indices(indices, exc, match):
    with pytest.raises(exc, match=match):
        ref.adaptive_max_pool_backward(np.ones((2, 3, 4, 4)), indices, (2, 3, 8, 8), 2)
