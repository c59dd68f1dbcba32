"""Property tests: random problems through the public API against ``pool_tuner.reference``.

Hypothesis draws the rank (1d/2d/3d), batch-less or not, small N and C (0 included), pooled sizes
1..12, output sizes (ints, ``None`` entries, 0, larger than the input, or one int for every axis),
dtype (float32/float64/float16), memory layout (contiguous/channels-last), op (avg/max),
direction, and any variant legal for the problem at its default configuration.  Every new
problem compiles a kernel (~0.3 s on PoCL), so the example counts are bounded to keep the file
near a minute; each run draws fresh examples (hypothesis' database replays past failures first).
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import pool_tuner as pt
from pool_tuner import ops, reference
from pool_tuner.problem import LAYOUT_NAMES, OPS, Problem
from pool_tuner.windows import max_window

from conftest import variants_legal_for

#: (rtol, atol): docs/design.md, Quality bars -- float64 1e-12, float32 1e-5, float16 by its epsilon (float32 accumulation).
TOLERANCE = {"float64": (1e-12, 1e-12), "float32": (1e-5, 1e-6), "float16": (2.0**-10, 1e-4)}
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def problems(draw, direction):
    """``(op, input shape, output_size argument, resolved output shape, dtype, layout, variant)``."""
    kind = draw(st.sampled_from(["avg", "max"]))
    ndim = draw(st.sampled_from([1, 2, 3]))
    op = f"adaptive_{kind}_pool{ndim}d"
    channels = draw(st.integers(0, 4) if draw(st.integers(0, 9)) == 0 else st.integers(1, 4))
    batch = (channels,) if draw(st.booleans()) else (draw(st.integers(0, 3)), channels)
    spatial = tuple(draw(st.integers(1, 12)) for _ in range(ndim))
    entry = st.one_of(st.none(), st.just(0), st.integers(1, 12), st.integers(13, 16))
    if draw(st.integers(0, 4)) == 0:
        size = draw(st.integers(0, 16))  # one int for every axis
        out_spatial = (size,) * ndim
    else:
        size = tuple(draw(entry) for _ in range(ndim))
        out_spatial = tuple(i if o is None else o for i, o in zip(spatial, size))
    if ndim == 1 and not isinstance(size, int) and draw(st.booleans()):
        size = size[0] if size[0] is not None else size  # 1d also takes a bare int
    dtype = draw(st.sampled_from(["float32", "float64", "float16"]))
    layout = draw(st.sampled_from(LAYOUT_NAMES[ndim]))
    return op, batch + spatial, size, batch + out_spatial, dtype, layout


def _layout_array(a, ndim, layout):
    """``a`` (logical, channels-first) with the memory order of ``layout``."""
    if layout == LAYOUT_NAMES[ndim][0]:
        return np.ascontiguousarray(a)
    c = a.ndim - ndim - 1
    return np.moveaxis(np.ascontiguousarray(np.moveaxis(a, c, -1)), -1, c)


def _random(rng, shape, dtype):
    x = rng.uniform(-2.0, 2.0, size=shape)
    x[np.abs(x) < 1e-3] = 0.5
    return x.astype(dtype)


#: Unit roundoff of the accumulation: float32 for float32 and float16 storage.
ACCUMULATION_EPS = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-24}


def _check(got, expected, dtype, what, magnitude=None, terms=1):
    """``got`` within ``rtol * |expected| + atol``, plus -- for sums of ``terms`` terms whose absolute
    values sum to ``magnitude`` (the reference run on absolute values) -- the rounding bound of any
    summation order, ``(terms - 1) * eps * magnitude``: a result that cancels to near zero keeps the
    absolute error of its large terms (e.g. 432 gradients of about 1 summing to 0.03)."""
    rtol, atol = TOLERANCE[dtype]
    assert got.shape == expected.shape, f"{what}: shape {got.shape}, expected {expected.shape}"
    assert got.dtype == np.dtype(dtype), f"{what}: dtype {got.dtype}, expected {dtype}"
    if magnitude is None or terms <= 1:
        np.testing.assert_allclose(got.astype(np.float64), expected, rtol=rtol, atol=atol, err_msg=what)
        return
    bound = rtol * np.abs(expected) + atol + (terms - 1) * ACCUMULATION_EPS[dtype] * np.asarray(magnitude, np.float64)
    off = ~(np.abs(got.astype(np.float64) - expected) <= bound)
    if off.any():
        first = np.unravel_index(np.argmax(off), off.shape)
        raise AssertionError(f"{what}: {off.sum()} of {off.size} results off; at {first}: got {got[first]!r}, "
                             f"expected {expected[first]!r}, allowed error {bound[first]!r}")


def _terms(in_spatial, out_spatial, direction) -> int:
    """The most terms one result sums: the largest window (forward) or inverse window (backward)."""
    pairs = zip(in_spatial, out_spatial) if direction == "forward" else zip(out_spatial, in_spatial)
    return int(np.prod([max_window(i, o) if i and o else 0 for i, o in pairs]))


def _setup(draw_problem, data, direction):
    op, in_shape, size, out_shape, dtype, layout = draw_problem
    ndim = OPS[op][1]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    logical = in_shape if direction == "forward" else out_shape
    x = _layout_array(_random(rng, logical, dtype), ndim, layout)
    # Empty arrays and single channels are ambiguous: the library treats them as contiguous.
    actual_layout = ops.memory_layout(x, ndim)
    problem = Problem.create(op, in_shape, out_shape[-ndim:], dtype, actual_layout, direction=direction)
    variant = data.draw(st.sampled_from(variants_legal_for(problem)), label="variant")
    return op, ndim, in_shape, size, out_shape, dtype, actual_layout, x, rng, variant


@settings(max_examples=70, **SETTINGS)
@given(drawn=problems("forward"), data=st.data())
def test_forward_matches_reference(drawn, data):
    op, ndim, in_shape, size, out_shape, dtype, layout, x, _, variant = _setup(drawn, data, "forward")
    kind = OPS[op][0]
    fn = getattr(pt, op)
    if kind == "avg":
        got = fn(x, size, variant=variant)
        _check(got, reference.forward(op, x, size), dtype, f"{op} {variant}",
               reference.forward(op, np.abs(x), size), _terms(in_shape[-ndim:], out_shape[-ndim:], "forward"))
    else:
        values, indices = fn(x, size, return_indices=True, variant=variant)
        want_values, want_indices = reference.forward(op, x, size)
        _check(values, want_values, dtype, f"{op} {variant} values")
        np.testing.assert_array_equal(values.astype(np.float64), want_values)  # max is exact
        assert indices.dtype == np.int64
        np.testing.assert_array_equal(indices, want_indices)
        assert got_layout_ok(indices, ndim, layout)
    assert got_layout_ok(values if kind == "max" else got, ndim, layout)


def got_layout_ok(out, ndim, layout) -> bool:
    """The output keeps the input's memory format (docs/design.md, Semantics): its strides are those of
    ``layout`` (axes of size 1 may have any stride)."""
    if out.size == 0:  # an empty array's strides mean nothing
        return True
    expected = _layout_array(np.empty(out.shape, out.dtype), ndim, layout).strides
    return all(n == 1 or a == b for n, a, b in zip(out.shape, out.strides, expected))


@settings(max_examples=50, **SETTINGS)
@given(drawn=problems("backward"), data=st.data())
def test_backward_matches_reference(drawn, data):
    op, ndim, in_shape, size, out_shape, dtype, layout, grad, rng, variant = _setup(drawn, data, "backward")
    kind = OPS[op][0]
    # float16 with no outputs but some inputs: see test_float16_backward_of_an_empty_output_is_zero
    assume(not (dtype == "float16" and grad.size == 0 and np.prod(in_shape) > 0))
    fn = getattr(pt, f"{op}_backward")
    magnitude = terms = None
    if kind == "avg":
        got = fn(grad, in_shape, variant=variant)
        expected = reference.backward(op, grad, in_shape)
        magnitude = reference.backward(op, np.abs(grad), in_shape)
        terms = _terms(in_shape[-ndim:], out_shape[-ndim:], "backward")
    else:
        _, indices = reference.forward(op, _random(rng, in_shape, "float64"), out_shape[-ndim:])
        indices = _layout_array(indices, ndim, layout)
        got = fn(grad, indices, in_shape, variant=variant)
        expected = reference.backward(op, grad, in_shape, indices)
    _check(got, expected, dtype, f"{op} backward {variant}", magnitude, terms or 1)
    assert got_layout_ok(got, ndim, layout)


@settings(max_examples=15, **SETTINGS)
@given(drawn=problems("forward"), data=st.data())
def test_avg_backward_is_the_adjoint_of_the_forward(drawn, data):
    """<forward(x), g> == <x, backward(g)> for average pooling, whatever the variants: a check
    that needs no reference at all."""
    op, in_shape, size, out_shape, _, layout = drawn
    op = op.replace("max", "avg")
    ndim = OPS[op][1]
    assume(np.prod(in_shape) > 0 and np.prod(out_shape) > 0)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    x = _layout_array(_random(rng, in_shape, "float64"), ndim, layout)
    g = _layout_array(_random(rng, out_shape, "float64"), ndim, layout)
    forward_problem = Problem.create(op, in_shape, out_shape[-ndim:], "float64", ops.memory_layout(x, ndim))
    backward_problem = Problem.create(op, in_shape, out_shape[-ndim:], "float64", ops.memory_layout(g, ndim),
                                      direction="backward")
    fv = data.draw(st.sampled_from(variants_legal_for(forward_problem)), label="forward variant")
    bv = data.draw(st.sampled_from(variants_legal_for(backward_problem)), label="backward variant")
    y = getattr(pt, op)(x, size, variant=fv)
    gx = getattr(pt, f"{op}_backward")(g, in_shape, variant=bv)
    lhs, rhs = float(np.sum(y * g)), float(np.sum(x * gx))
    assert lhs == pytest.approx(rhs, rel=1e-10, abs=1e-10)


def test_max_backward_accepts_the_forwards_own_indices():
    """Indices returned by the forward pass are accepted by the backward pass whatever their
    shape: here (3, 64, 56, 1) -- coordinate attention's (H, 1) pooling -- whose trailing unit axis
    and more than 8192 elements trip numpy 2.4's np.unravel_index (numpy issue #31980) in the
    host-side index check."""
    rng = np.random.default_rng(0)
    x = _random(rng, (3, 64, 56, 3), "float32")
    values, indices = pt.adaptive_max_pool2d(x, (56, 1), return_indices=True)
    grad = pt.adaptive_max_pool2d_backward(np.ones_like(values), indices, x.shape)
    np.testing.assert_allclose(grad, reference.backward("adaptive_max_pool2d", np.ones_like(values), x.shape, indices))


@pytest.mark.parametrize("op", ["adaptive_avg_pool2d", "adaptive_max_pool2d"])
def test_float16_backward_of_an_empty_output_is_zero(op):
    """Output size 0 with a non-empty input: nothing flows back, grad_in is all zeros -- for
    float16 too (found by test_backward_matches_reference)."""
    grad = np.zeros((2, 3, 0, 4), np.float16)
    args = (grad,) if op.startswith("adaptive_avg") else (grad, np.zeros(grad.shape, np.int64))
    got = getattr(pt, f"{op}_backward")(*args, (2, 3, 5, 4))
    assert got.dtype == np.float16 and got.shape == (2, 3, 5, 4)
    assert not got.any()


@settings(max_examples=40, **SETTINGS)
@given(drawn=problems("forward"), data=st.data())
def test_max_with_nans_matches_pytorch(drawn, data):
    """Max pooling's values, indices and input gradients equal PyTorch's (CPU) for any pattern of
    NaNs and infinities, through the numpy API, the reference and pool_tuner.torch (docs/design.md,
    Semantics: of several NaNs in a window the last wins, as PyTorch's scan takes every NaN)."""
    torch = pytest.importorskip("torch")
    import pool_tuner.torch as ptt

    drawn = (drawn[0].replace("avg", "max"),) + drawn[1:]
    op, ndim, in_shape, size, out_shape, dtype, layout, x, rng, variant = _setup(drawn, data, "forward")
    assume(np.prod(out_shape) > 0)  # PyTorch refuses empty max pooling
    share = data.draw(st.sampled_from([0.05, 0.3, 0.7, 1.0]), label="NaN share")
    x[rng.random(x.shape) < share] = np.nan
    x[rng.random(x.shape) < 0.1] = data.draw(st.sampled_from([np.inf, -np.inf]), label="infinity")
    out_size = out_shape[-ndim:]
    torch_fn = getattr(torch.nn.functional, op)
    want_values, want_indices = torch_fn(torch.from_numpy(x), out_size, return_indices=True)
    values, indices = getattr(pt, op)(x, size, return_indices=True, variant=variant)
    np.testing.assert_array_equal(values, want_values.numpy())
    np.testing.assert_array_equal(indices, want_indices.numpy())
    np.testing.assert_array_equal(reference.forward(op, x, size)[1], want_indices.numpy())

    grad = torch.from_numpy(_random(rng, out_shape, dtype))
    ours, theirs = torch.from_numpy(x).requires_grad_(), torch.from_numpy(x).requires_grad_()
    getattr(ptt, op)(ours, size, variant=variant).backward(grad)
    torch_fn(theirs, out_size).backward(grad)
    # PyTorch sums float16 gradients in float16: each of an input's terms may round, at the scale of
    # the partial sums (the terms' size), however small the total after cancellation.
    terms = _terms(in_shape[-ndim:], out_size, "backward")
    rtol, atol = TOLERANCE[dtype]
    scale = float(np.abs(grad.numpy().astype(np.float64)).max(initial=0.0))
    np.testing.assert_allclose(ours.grad.numpy().astype(np.float64), theirs.grad.numpy().astype(np.float64),
                               rtol=rtol * terms, atol=max(atol, rtol * scale) * terms)
