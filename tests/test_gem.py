"""GeM pooling on numpy arrays: forward and backward (for x and p) against the float64 reference,
every forward variant, dtype and layout; p = 1 is average pooling, large p tends to max; the clamp's
edges; bad arguments; the op as one object (its operator header, its rules)."""

import math

import numpy as np
import pytest

import pool_tuner as pt
from pool_tuner import gem, kernel_source, reference
from pool_tuner.operations import OPERATIONS, find
from pool_tuner.problem import LAYOUT_NAMES, Problem
from pool_tuner.variants import _Global, variants_for

from conftest import gem_p_term_magnitude, tiered

TOL = {"float64": 1e-12, "float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}
SHAPES = [((2, 3, 10, 9), (4, 7)), ((2, 5, 7, 7), 1), ((1, 4, 23, 37), (5, 7)), ((2, 3, 5, 6), (7, 9)),
          ((3, 8, 16, 16), (2, 2)),
          # one sample's outputs (forward) or inputs (backward) fill whole work-groups: no bounds check
          ((2, 64, 8, 8), 3), ((2, 64, 7, 7), 1)]


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return np.dtype(name)


def _input(rng, shape, dtype="float64", low=0.0):
    """Non-negative features with some below eps (post-ReLU activations are)."""
    x = rng.random(shape) * 2 + low
    x[rng.random(shape) < 0.1] = 0.0
    return x.astype(_dtype(dtype))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("shape,size", SHAPES)
def test_forward_matches_the_reference(rng, shape, size, dtype):
    x = _input(rng, shape, dtype)
    p = 1.0 + 3 * rng.random()
    got = pt.adaptive_gem_pool2d(x, size, p=p)
    assert got.dtype == x.dtype
    expected = reference.adaptive_gem_pool(x.astype(np.float64), size, 2, p)
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=TOL[dtype], atol=TOL[dtype])


#: GeM's forward variants: the shared ones that take its operator's arguments, and its own.
GEM_VARIANTS = list(variants_for("adaptive_gem_pool2d"))


def _configs(variant, problem, limits):
    """The default and the first and last configurations that run ``problem`` (a variant shaped for
    another kind of device forced, as ``variant=`` does)."""
    legal = [c for c in variant.configurations()
             if variant.refusal({**variant.default_for(problem), **c}, problem, limits, forced=True) is None]
    picks = [c for c in (variant.default_for(problem), *legal[:1], *legal[-1:])
             if variant.refusal({**variant.default_for(problem), **c}, problem, limits, forced=True) is None]
    return [dict(c) for c in {tuple(sorted(c.items())): c for c in picks}.values()]


def _variant_cases() -> list:
    """Core (conftest.tiered): float32 everywhere, float64's configurations at rank 2, and one
    variant of every other rank, layout and dtype."""
    cases = [pytest.param(ndim, channels_last, variant, dtype, id=f"{ndim}-{channels_last}-{variant}-{dtype}")
             for ndim in (1, 2, 3) for channels_last in (False, True) for variant in GEM_VARIANTS
             for dtype in ("float64", "float32", "float16")]
    return tiered(cases, core=lambda values: values[3] == "float32" or values[3] == "float64" and values[0] == 2,
                  group=lambda values: (values[0], values[1], values[3]))


@pytest.mark.parametrize("ndim,channels_last,variant,dtype", _variant_cases())
def test_every_variant_rank_and_layout(rng, variant, channels_last, ndim, dtype):
    """Every forward variant of GeM -- the shared ones through gem.h's operator, and its own --
    against the reference, at every rank and layout it fits (the others refused before a kernel
    runs), at its default and its first and last legal configurations (float64; the default in the
    narrower types), p = 3 (the folded power) and another."""
    op = find("gem", ndim)
    table = variants_for(op.name)
    shape = (2, 8) + (5, 6, 7)[3 - ndim:]
    size = 1 if isinstance(table[variant], _Global) else (3, 4, 2)[3 - ndim:]  # the global variants' problems
    layout = LAYOUT_NAMES[ndim][int(channels_last)]
    problem = Problem.create(op.name, shape, size, dtype, layout)
    x = _input(rng, shape, dtype)
    if channels_last:
        x = np.moveaxis(np.ascontiguousarray(np.moveaxis(x, 1, -1)), -1, 1)
    limits = pt.devices()[0].info.limits
    configs = _configs(table[variant], problem, limits)
    if not configs:
        with pytest.raises(ValueError, match=variant):
            getattr(pt, op.name)(x, size, p=2.0, variant=variant)
        return
    for config in configs if dtype == "float64" else configs[:1]:
        for p in (3.0, 2.5):
            got = getattr(pt, op.name)(x, size, p=p, variant=variant, config=config)
            assert got.dtype == x.dtype
            want = reference.adaptive_gem_pool(x.astype(np.float64), size, ndim, p)
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=TOL[dtype], atol=TOL[dtype],
                                       err_msg=f"{variant} {config} p={p}")


def test_the_shared_variants_take_gem_through_its_operator():
    """GeM's forward registry is every single-level forward variant whose kernel passes the
    operator's arguments, plus its own (gem_planes, gem_plane_windows: they call gem.h's helpers); avg
    and max do not get GeM's own; the backward has none (GeM runs its own input-gradient kernel)."""
    shared = ["thread_per_output", "thread_per_row", "block_per_row", "plane_reduce", "smem_tiled", "channels_vector",
              "global_planes", "global_channels", "global_blocks"]
    for op in ("adaptive_gem_pool1d", "adaptive_gem_pool2d", "adaptive_gem_pool3d"):
        assert list(variants_for(op)) == shared + ["gem_planes", "gem_plane_windows"]
        assert not variants_for(op, "backward")
    for op in ("adaptive_avg_pool2d", "adaptive_max_pool2d"):
        assert list(variants_for(op)) == shared


#: (shape, size, dtype): every shape in float32 and the first in each other dtype in the core tier.
SMALL_PLANE_CASES = tiered([pytest.param(shape, size, dtype, id=f"{shape}->{size}-{dtype}")
                            for dtype in ("float32", "float64", "float16", "bfloat16")
                            for shape, size in [((2, 6, 40), 5), ((3, 5, 7, 7), 3), ((2, 4, 6, 5), (4, 1)),
                                                ((1, 3, 8, 8), 2), ((2, 3, 3, 4, 5), (2, 3, 2)),
                                                ((2, 70, 7, 7), (2, 3)), ((2, 9, 2, 3), (2, 2)),
                                                ((2, 5, 3, 5), (2, 3))]],
                           core=lambda values: values[2] == "float32", group=lambda values: values[2])


@pytest.mark.parametrize("shape,size,dtype", SMALL_PLANE_CASES)
def test_small_planes_map_each_input_once_with_the_windows_bits(rng, shape, size, dtype):
    """gem_plane_windows (the default for small channels-first planes into few outputs) against
    the reference, and bit for bit against thread_per_output with one row lane, which sums each
    window over its box in the same order.
    Planes of 40 to 64 inputs (vector steps of eight, tails of 0 to 7) and of 6 (the tail only)."""
    ndim = len(shape) - 2
    op = find("gem", ndim)
    x = _input(rng, shape, dtype)
    x[(0,) * x.ndim] = np.nan
    assert pt.explain(op.name, shape, size, dtype)["variant"] == "gem_plane_windows"
    for p in (3.0, 2.5):
        got = getattr(pt, op.name)(x, size, p=p)
        windows = getattr(pt, op.name)(x, size, p=p, variant="thread_per_output",
                                       config={"row_lanes": 1, "outputs_per_thread": 1})
        np.testing.assert_array_equal(got.astype(np.float64), windows.astype(np.float64))  # NaN where NaN
        want = reference.adaptive_gem_pool(x.astype(np.float64), size, ndim, p)
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=TOL[dtype] * 10)


def test_small_planes_variant_is_refused_where_it_does_not_fit(rng):
    x = _input(rng, (2, 3, 9, 9), "float32")
    with pytest.raises(ValueError, match="at most 64 inputs"):
        pt.adaptive_gem_pool2d(x, 3, variant="gem_plane_windows")
    with pytest.raises(ValueError, match="at most 64 inputs"):
        pt.adaptive_gem_pool2d(x[..., :8, :8], 5, variant="gem_plane_windows")
    channels_last = np.moveaxis(np.ascontiguousarray(np.moveaxis(x[..., :7, :7], 1, -1)), -1, 1)
    with pytest.raises(ValueError, match="channels-first"):
        pt.adaptive_gem_pool2d(channels_last, 3, variant="gem_plane_windows")
    with pytest.raises(ValueError, match="not for global pooling"):
        pt.adaptive_gem_pool2d(x[..., :7, :7], 1, variant="gem_plane_windows")
    explained = pt.explain("adaptive_gem_pool2d", (2, 3, 9, 9), 3)
    assert explained["source"] == "default" and explained["variant"] != "gem_plane_windows"


def test_p_changes_without_a_new_build(rng):
    """p is a run-time argument: the same plan (and kernel) serves every value."""
    x = _input(rng, (2, 4, 9, 9))
    for p in (1.0, 2.0, 3.0, 4.5, 3.0):
        np.testing.assert_allclose(pt.adaptive_gem_pool2d(x, (2, 3), p=p),
                                   reference.adaptive_gem_pool(x, (2, 3), 2, p), rtol=1e-12)
    source = kernel_source.render("forward/thread_per_output.c", {"POOL_GEM": 1},
                                  OPERATIONS["adaptive_gem_pool2d"].operator_header)
    assert "OP_PARAMS , const acc_t gem_p, const acc_t gem_eps" in source and "#define gem_p " not in source


def test_p_one_is_average_pooling_and_large_p_tends_to_max(rng):
    x = rng.random((2, 3, 10, 9)) + 0.5
    np.testing.assert_allclose(pt.adaptive_gem_pool2d(x, (4, 7), p=1.0), pt.adaptive_avg_pool2d(x, (4, 7)), rtol=1e-14)
    large = pt.adaptive_gem_pool2d(x, (4, 7), p=200.0)
    maximum = pt.adaptive_max_pool2d(x, (4, 7))
    assert np.all(large <= maximum * (1 + 1e-12)) and np.all(large >= maximum * 0.98)


def test_the_clamp(rng):
    """Inputs below eps count as eps (negative, zero, -inf); a window of them pools to eps; NaN propagates."""
    eps = 1e-3
    x = np.full((1, 2, 4, 4), -5.0)
    x[0, 1, :2] = 0.0
    x[0, 1, 2:] = -np.inf
    np.testing.assert_allclose(pt.adaptive_gem_pool2d(x, 1, p=3.0, eps=eps), np.full((1, 2, 1, 1), eps), rtol=1e-12)
    x = rng.random((1, 2, 4, 4))
    x[0, 0, 1, 1] = np.nan
    y = pt.adaptive_gem_pool2d(x, (2, 2), p=3.0)
    assert np.isnan(y[0, 0, 0, 0]) and not np.isnan(y[0, 0, 1, 1]) and not np.isnan(y[0, 1]).any()


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("shape,size", SHAPES)
def test_backward_matches_the_reference(rng, shape, size, dtype):
    x = _input(rng, shape, dtype)
    p = 1.5 + 2 * rng.random()
    y = pt.adaptive_gem_pool2d(x, size, p=p)
    g = rng.standard_normal(y.shape).astype(x.dtype)
    grad_x, grad_p = pt.adaptive_gem_pool2d_backward(g, x, size, p=p)
    expected_x, expected_p = reference.adaptive_gem_pool_backward(g.astype(np.float64), x.astype(np.float64), size, 2, p)
    assert grad_x.dtype == x.dtype and grad_x.shape == x.shape
    scale = np.abs(expected_x).max()
    np.testing.assert_allclose(grad_x.astype(np.float64), expected_x, rtol=TOL[dtype] * 10, atol=TOL[dtype] * 10 * scale)
    assert grad_p == pytest.approx(expected_p, rel=TOL[dtype] * 100, abs=TOL[dtype] * 100)


def test_backward_by_finite_differences(rng):
    """The reference's gradients are those of its forward (central differences in float64)."""
    x = _input(rng, (1, 2, 7, 6), low=0.01)
    g = rng.standard_normal((1, 2, 3, 4))
    p, h = 2.7, 1e-6

    def loss(x, p):
        return float((g * reference.adaptive_gem_pool(x, (3, 4), 2, p)).sum())

    grad_x, grad_p = pt.adaptive_gem_pool2d_backward(g, x, (3, 4), p=p)
    assert grad_p == pytest.approx((loss(x, p + h) - loss(x, p - h)) / (2 * h), rel=1e-6)
    for index in [(0, 0, 0, 0), (0, 1, 3, 2), (0, 0, 6, 5)]:
        bump = np.zeros_like(x)
        bump[index] = h
        assert grad_x[index] == pytest.approx((loss(x + bump, p) - loss(x - bump, p)) / (2 * h), rel=1e-5, abs=1e-9)


def test_backward_channels_last_and_3d(rng):
    x = _input(rng, (2, 5, 6, 7))
    x_cl = np.moveaxis(np.ascontiguousarray(np.moveaxis(x, 1, -1)), -1, 1)
    g = rng.standard_normal((2, 5, 4, 3))
    gx, gp = pt.adaptive_gem_pool2d_backward(g, x_cl, (4, 3), p=3.0)
    ex, ep = reference.adaptive_gem_pool_backward(g, x, (4, 3), 2, 3.0)
    np.testing.assert_allclose(gx, ex, rtol=1e-11, atol=1e-14)
    assert gp == pytest.approx(ep, rel=1e-11)
    g1 = rng.standard_normal((2, 5, 1, 1))
    gx, gp = pt.adaptive_gem_pool2d_backward(g1, x_cl, 1, p=3.0)  # global: no gather, shares per plane
    ex, ep = reference.adaptive_gem_pool_backward(g1, x, 1, 2, 3.0)
    np.testing.assert_allclose(gx, ex, rtol=1e-11, atol=1e-14)
    assert gp == pytest.approx(ep, rel=1e-11)
    x3 = _input(rng, (2, 3, 4, 5, 6))
    g3 = rng.standard_normal((2, 3, 2, 3, 4))
    gx, gp = pt.adaptive_gem_pool3d_backward(g3, x3, (2, 3, 4), p=2.0)
    ex, ep = reference.adaptive_gem_pool_backward(g3, x3, (2, 3, 4), 3, 2.0)
    np.testing.assert_allclose(gx, ex, rtol=1e-11, atol=1e-14)
    assert gp == pytest.approx(ep, rel=1e-11)


@pytest.mark.parametrize("ndim,spatial,size", [(1, (512,), 5), (2, (32, 32), 3), (2, (16, 16), (4, 1)),
                                                (2, (64, 64), 1), (3, (4, 8, 8), (2, 3, 2))])
def test_backward_where_planes_fill_whole_work_groups(rng, ndim, spatial, size):
    """Channels-first planes of a multiple of the input-gradient kernel's work-group: the plane is
    the group's and each input masks all of its plane's outputs (few) instead of gathering its
    inverse window.  Same bits as the gather (channels-last memory takes it), and the reference."""
    shape = (2, 3) + spatial
    x = _input(rng, shape, "float32")
    backward = getattr(pt, f"adaptive_gem_pool{ndim}d_backward")
    y = getattr(pt, f"adaptive_gem_pool{ndim}d")(x, size, p=2.5)
    g = rng.standard_normal(y.shape).astype(np.float32)
    grad_x, grad_p = backward(g, x, size, p=2.5)
    x_cl = np.moveaxis(np.ascontiguousarray(np.moveaxis(x, 1, -1)), -1, 1)
    grad_cl, _ = backward(g, x_cl, size, p=2.5, output=y)
    assert np.array_equal(grad_x, grad_cl)
    expected_x, expected_p = reference.adaptive_gem_pool_backward(g.astype(np.float64), x.astype(np.float64), size,
                                                                  ndim, 2.5)
    scale = np.abs(expected_x).max()
    np.testing.assert_allclose(grad_x, expected_x, rtol=TOL["float32"] * 10, atol=TOL["float32"] * 10 * scale)
    assert grad_p == pytest.approx(expected_p, rel=TOL["float32"] * 100)


def test_backward_is_deterministic(rng):
    x = _input(rng, (4, 16, 12, 12), "float32")
    g = rng.standard_normal((4, 16, 3, 3)).astype(np.float32)
    first = pt.adaptive_gem_pool2d_backward(g, x, 3, p=3.0)
    for _ in range(3):
        again = pt.adaptive_gem_pool2d_backward(g, x, 3, p=3.0)
        assert np.array_equal(again[0], first[0]) and again[1] == first[1]


def _in_layout(x, channels_last):
    return np.moveaxis(np.ascontiguousarray(np.moveaxis(x, 1, -1)), -1, 1) if channels_last else x


#: (channels-last, size, dtype): float32 everywhere in the core tier, the other dtypes once each.
SLAB_CASES = tiered([pytest.param(channels_last, size, dtype, id=f"{channels_last}-{size}-{dtype}")
                     for dtype in ("float32", "float16", "float64") for channels_last in (False, True)
                     for size in (1, 3, (5, 7))],
                    core=lambda values: values[2] == "float32", group=lambda values: values[2])


@pytest.mark.parametrize("channels_last,size,dtype", SLAB_CASES)
def test_the_backward_in_slabs_has_the_bits_of_one_pass(rng, monkeypatch, dtype, size, channels_last):
    """The host backward's slabs (with no allocation allowed: workspaces in the gradient's unwritten
    memory, then the smallest slabs the rule allows: 256 planes channels-first, two samples
    channels-last) give the gradients of one pass over the whole, to the bit, dL/dp included (its
    terms added in one order whatever the slabs), and the float64 reference's."""
    x = _in_layout(_input(rng, (8, 128, 7, 7), dtype), channels_last)
    y = pt.adaptive_gem_pool2d(x, size, p=2.5)
    g = rng.standard_normal(y.shape).astype(x.dtype)
    problem = Problem.create("adaptive_gem_pool2d", x.shape, size, dtype, LAYOUT_NAMES[2][int(channels_last)],
                             direction="backward")
    monkeypatch.setattr(gem, "MIN_SLAB_INPUTS", 1 << 40)
    assert len(gem.slabs(problem)) == 1
    whole = pt.adaptive_gem_pool2d_backward(g, x, size, p=2.5, output=y)
    monkeypatch.setattr(gem, "SLAB_SHARE_OF_INPUT", 0.0)
    monkeypatch.setattr(gem, "MIN_SLAB_INPUTS", 1)
    assert len(gem.slabs(problem)) > 1
    sliced = pt.adaptive_gem_pool2d_backward(g, x, size, p=2.5, output=y)
    assert np.array_equal(sliced[0], whole[0]) and sliced[1] == whole[1]
    expected_x, expected_p = reference.adaptive_gem_pool_backward(g.astype(np.float64), x.astype(np.float64), size,
                                                                  2, 2.5)
    scale = np.abs(expected_x).max()
    np.testing.assert_allclose(sliced[0], expected_x, rtol=TOL[dtype] * 10, atol=TOL[dtype] * 10 * scale)
    # dL/dp sums terms of both signs: its error is relative to their magnitude, not to the sum
    y64 = reference.adaptive_gem_pool(x.astype(np.float64), size, 2, 2.5)
    magnitude = gem_p_term_magnitude(g, y64, 2.5)
    assert abs(sliced[1] - expected_p) <= TOL[dtype] * magnitude


@pytest.mark.parametrize("channels_last", [False, True])
def test_the_host_fallback_runs_the_same_slabs(rng, monkeypatch, channels_last):
    """Where the device's kernels cannot run (a forked child's PoCL), each slab's input gradient is
    ``host_fallback``'s pass over the slab's memory and workspace: the reference's gradients."""
    import types

    x = _in_layout(_input(rng, (8, 128, 7, 7), "float32"), channels_last)
    y = pt.adaptive_gem_pool2d(x, 3, p=2.5)
    g = rng.standard_normal(y.shape).astype(np.float32)
    monkeypatch.setattr(gem, "SLAB_SHARE_OF_INPUT", 0.0)
    monkeypatch.setattr(gem, "MIN_SLAB_INPUTS", 1)
    problem = Problem.create("adaptive_gem_pool2d", x.shape, 3, "float32", LAYOUT_NAMES[2][int(channels_last)],
                             direction="backward")
    assert len(gem.slabs(problem)) > 1
    child = types.SimpleNamespace(info=types.SimpleNamespace(host_fallback="forked: the host's pass"),
                                  prepare=lambda *a: pytest.fail("a kernel was prepared"))
    x_memory = np.ascontiguousarray(gem.in_memory_order(x, problem))
    grad = np.full(x_memory.shape, np.nan, np.float32)
    grad_p = gem.backward_on_host(child, problem, {"p": 2.5, "eps": 1e-6}, g, y, x_memory.ctypes.data,
                                  grad.ctypes.data)
    grad_x = np.moveaxis(grad, -1, 1) if channels_last else grad
    expected_x, expected_p = reference.adaptive_gem_pool_backward(g.astype(np.float64), x.astype(np.float64), 3, 2, 2.5)
    np.testing.assert_allclose(grad_x, expected_x, rtol=1e-4, atol=1e-4 * np.abs(expected_x).max())
    assert grad_p == pytest.approx(expected_p, rel=1e-3)


@pytest.mark.parametrize("shape,size,dtype,layout", [((32, 2048, 7, 7), 3, "float16", "NCHW"),
                                                     ((32, 2048, 7, 7), 1, "float32", "NHWC"),
                                                     ((8, 2048, 64, 64), 3, "float16", "NCHW"),
                                                     ((2, 3, 10, 9), (4, 7), "float32", "NCHW")])
def test_slabs_tile_the_units_with_workspaces_where_they_fit(shape, size, dtype, layout):
    """The slabs cover the units (planes, or samples channels-last) in order; every slab but the
    last ends on a work-group's and a sum block's boundary; an in-place slab's workspace fits in
    the gradient's memory past it, an allocated one within SLAB_SHARE_OF_INPUT of the input (or is
    the smallest slab); few launches for issue 37's shapes; a small input is one slab: its own
    problem."""
    problem = Problem.create("adaptive_gem_pool2d", shape, size, dtype, layout, direction="backward")
    found = gem.slabs(problem)
    units, unit_inputs, unit_outputs = gem._units(problem)
    assert [s.start for s in found] == [0] + [s.stop for s in found[:-1]] and found[-1].stop == units
    if math.prod(shape) <= gem.MIN_SLAB_INPUTS:
        assert found == (gem.Slab(0, units, 0, problem, False),)
        return
    assert len(found) <= 12
    unit_bytes = unit_inputs * np.dtype(dtype).itemsize
    for slab in found:
        count = slab.stop - slab.start
        assert math.prod(slab.problem.input_shape) == count * unit_inputs
        assert slab.first_input == slab.start * unit_inputs
        if slab is not found[-1]:
            assert count * unit_inputs % 256 == 0 and count * unit_outputs % gem.SUM_BLOCK == 0
        if slab.in_place:
            assert gem._workspace_bytes(problem, count) <= (units - slab.stop) * unit_bytes
        else:
            assert (gem._workspace_bytes(problem, count) <= gem.SLAB_SHARE_OF_INPUT * units * unit_bytes
                    or count * unit_inputs <= 256 * unit_inputs)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("size,channels_last", [(1, False), (3, False), (1, True)])
def test_the_numpy_backward_allocates_at_most_one_percent_of_the_input(rng, dtype, size, channels_last):
    """7x7 planes (a retrieval or regional head): one float32 array of the outputs is 4% or 37% of
    a float16 input.  Beyond the gradient it returns, the backward of numpy arrays (grad_out and
    output in x's dtype and layout) allocates only its last slabs' workspace, within the issue's 1%
    of the input, plus 16 KiB for Python's own allocations (tracemalloc counts numpy's and
    Python's).  Not channels-last 7x7 -> 3: its last slab is a whole sample (above 1%)."""
    import tracemalloc

    x = _in_layout(_input(rng, (32, 2048, 7, 7), dtype), channels_last)
    y = pt.adaptive_gem_pool2d(x, size, p=2.5)
    g = rng.standard_normal(y.shape).astype(x.dtype)
    pt.adaptive_gem_pool2d_backward(g, x, size, p=2.5, output=y)  # warm: the kernels are built
    tracemalloc.start()
    grad_x, _ = pt.adaptive_gem_pool2d_backward(g, x, size, p=2.5, output=y)
    extra = tracemalloc.get_traced_memory()[1] - grad_x.nbytes
    tracemalloc.stop()
    assert extra <= 0.01 * x.nbytes + 16 * 1024, f"{extra / x.nbytes:.2%} of the input"


def test_the_clamp_gradient_passes_at_eps_and_stops_below():
    """PyTorch's clamp(min=eps) passes the gradient where x >= eps (x == eps included)."""
    eps = 0.25
    x = np.array([[[eps, eps / 2, 1.0, -1.0]]])
    gx, _ = pt.adaptive_gem_pool1d_backward(np.ones((1, 1, 1)), x, 1, p=2.0, eps=eps)
    assert gx[0, 0, 0] > 0 and gx[0, 0, 1] == 0 and gx[0, 0, 2] > 0 and gx[0, 0, 3] == 0


@pytest.mark.parametrize("p,eps,error", [(0.0, 1e-6, ValueError), (-1.0, 1e-6, ValueError), (math.inf, 1e-6, ValueError),
                                         (3.0, 0.0, ValueError), (3.0, math.nan, ValueError), ("3", 1e-6, TypeError),
                                         (True, 1e-6, TypeError), (3.0, None, TypeError)])
def test_bad_arguments_are_refused_by_name(p, eps, error):
    x = np.ones((1, 2, 4, 4))
    name = "p" if not isinstance(p, float) or not (math.isfinite(p) and p > 0) else "eps"
    with pytest.raises(error, match=name):
        pt.adaptive_gem_pool2d(x, 2, p=p, eps=eps)
    with pytest.raises(error, match=name):
        pt.adaptive_gem_pool2d_backward(np.ones((1, 2, 2, 2)), x, 2, p=p, eps=eps)


@pytest.mark.parametrize("arrays", ["numpy", "device arrays"])
@pytest.mark.parametrize("name", ["grad_out", "output"])
@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int64])
def test_a_grad_out_or_output_not_of_xs_dtype_is_refused_by_name(rng, arrays, name, dtype):
    """GeM's backward reads grad_out and output as x's dtype: another is refused, not converted."""
    x = rng.random((2, 3, 8, 8)).astype(np.float32) + 0.5
    given = {"grad_out": rng.standard_normal((2, 3, 2, 2)).astype(np.float32), "output": pt.adaptive_gem_pool2d(x, 2)}
    given[name] = (given[name] * 4).astype(dtype)
    if arrays == "device arrays":
        cla = pytest.importorskip("pyopencl.array")
        from pool_tuner import backends

        queue = backends.resolve_device(None).queue
        x, given = cla.to_device(queue, x), {key: cla.to_device(queue, value) for key, value in given.items()}
    with pytest.raises(ValueError, match=f"{name} must have x's dtype \\(float32\\), got {np.dtype(dtype)}"):
        pt.adaptive_gem_pool2d_backward(given["grad_out"], x, 2, output=given["output"])


def test_the_op_is_one_object_with_its_own_operator_header():
    op = OPERATIONS["adaptive_gem_pool2d"]
    assert op.operator_header == "operators/gem.h" and not op.selects and op.rules_kind == "avg"
    assert [name for name, _ in op.arguments] == ["p", "eps"]
    for variant in variants_for(op.name, "forward").values():
        files = kernel_source.program_files(variant.template, op.operator_header)
        assert "operators/gem.h" in files and "operators.h" not in files
    avg = OPERATIONS["adaptive_avg_pool2d"]
    for variant in variants_for(avg.name, "forward").values():
        assert "operators/gem.h" not in kernel_source.program_files(variant.template, avg.operator_header)
    assert pt.explain(op.name, (32, 2048, 7, 7), 1)["variant"] == "gem_planes"  # its own, before avg's rules
    assert pt.explain(op.name, (32, 2048, 7, 7), 1, layout="NHWC")["variant"] == "global_channels"  # avg's rule


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_the_backward_is_explained_as_the_input_gradient_kernel_it_runs(ndim):
    """GeM's backward runs its own input-gradient kernel, not the backward variants: the registry
    lists none, explain names that kernel and its one configuration, tune has nothing to tune."""
    from pool_tuner import gem, tuner

    op = find("gem", ndim)
    assert op.backward_kernel == gem.INPUT_GRADIENT_KERNEL
    assert pt.variants(op.name, "backward") == [] and variants_for(op.name, "forward")
    # planes past the plane form's limits (tests/test_gem_backward_planes.py explains that form)
    shape, size = (2, 3) + (72,) * ndim, (4,) * ndim
    info = pt.explain(op.name, shape, size, direction="backward")
    assert (info["variant"], info["params"], info["source"]) == (gem.INPUT_GRADIENT_KERNEL, gem.INPUT_GRADIENT_CONFIG,
                                                                 "own")
    assert info["rule"] is None and info["cache_key"] is None and info["output_shape"] == [2, 3] + [4] * ndim
    assert set(info) == set(pt.explain(op.name, shape, size))
    with pytest.raises(ValueError, match="variant"):
        pt.explain(op.name, shape, size, direction="backward", variant="thread_per_input")
    with pytest.raises(ValueError, match="nothing to tune"):
        tuner.tune(op.name, shape, size, direction="backward", store=False)


def test_the_cli_refuses_to_tune_gems_backward_before_tuning_anything(capsys):
    from pool_tuner import cli

    code = cli.main(["tune", "--op", "adaptive_gem_pool2d", "--input", "1x2x6x6", "--output", "3x3",
                     "--direction", "backward", "--quiet"])
    assert code != 0 and "nothing to tune" in capsys.readouterr().err


@pytest.mark.parametrize("size", [1, (4, 7)])
def test_backward_on_device_arrays_gives_device_arrays(rng, size):
    """PyOpenCL arrays in, PyOpenCL arrays out (grad_x), the gradients of x and p as on numpy arrays."""
    cla = pytest.importorskip("pyopencl.array")
    from pool_tuner import backends

    queue = backends.resolve_device(None).queue
    x = rng.random((2, 3, 10, 9)).astype(np.float32) + 0.5
    grad = rng.random((2, 3) + ((1, 1) if size == 1 else size)).astype(np.float32)
    got_x, got_p = pt.adaptive_gem_pool2d_backward(cla.to_device(queue, grad), cla.to_device(queue, x), size, 2.5, 1e-3)
    want_x, want_p = reference.adaptive_gem_pool_backward(grad, x, size, 2, 2.5, 1e-3)
    assert isinstance(got_x, cla.Array)
    np.testing.assert_allclose(got_x.get(), want_x, rtol=1e-4, atol=1e-6)
    assert got_p == pytest.approx(want_p, rel=1e-4)


def test_a_new_p_every_call_reuses_the_prepared_launches(rng, monkeypatch):
    """A learnt p changes every step: forward and backward keep their prepared launches (the call's
    p and eps written into the scalar slots), and each call computes with its own p."""
    from pool_tuner import backends

    x = rng.random((2, 3, 10, 9)).astype(np.float32) + 0.5
    grad = rng.random((2, 3, 3, 4)).astype(np.float32)
    pt.adaptive_gem_pool2d_backward(grad, x, (3, 4), 3.0)  # plans made, launches prepared
    device = backends.resolve_device(None)
    prepared = []
    real = type(device).prepare
    monkeypatch.setattr(type(device), "prepare", lambda self, *a: prepared.append(a) or real(self, *a))
    for p in (1.5, 2.5, 4.0):
        np.testing.assert_allclose(pt.adaptive_gem_pool2d(x, (3, 4), p), reference.adaptive_gem_pool(x, (3, 4), 2, p),
                                   rtol=1e-5, atol=1e-6)
        got_x, got_p = pt.adaptive_gem_pool2d_backward(grad, x, (3, 4), p)
        want_x, want_p = reference.adaptive_gem_pool_backward(grad, x, (3, 4), 2, p)
        np.testing.assert_allclose(got_x, want_x, rtol=1e-4, atol=1e-6)
        assert got_p == pytest.approx(want_p, rel=1e-4)
    assert prepared == [], "a call with its own p prepared a launch again"


def _same_bits_or_nan(got, expected, each=False):
    """Whether float arrays hold the same bits, a NaN matching a NaN of the same sign whatever its
    payload (F16C's widening quiets a signalling NaN, numpy's and the integer conversion keep it);
    per element with ``each``."""
    same = ((got.view(np.uint32) == expected.view(np.uint32))
            | (np.isnan(got) & np.isnan(expected) & (np.signbit(got) == np.signbit(expected))))
    return same if each else bool(same.all())


def test_float16_conversions_of_gem_programs_match_numpy():
    """GeM's OpenCL programs widen and narrow float16 one at a time in integer arithmetic (gem.h's
    LOAD and STORE) and eight at a time through OpenCL's eight-wide conversions (load8, stored8,
    store8): every float16 value widens exactly; floats narrow to numpy's bits (round to nearest
    even: halfway cases, subnormals, overflow to infinity, NaN), each way."""
    cl = pytest.importorskip("pyopencl")
    device = pt.devices()[0]
    problem = Problem.create("adaptive_gem_pool1d", (1, 1, 4), 2, "float16")
    source = kernel_source.render_files(("prelude.h", "windows.h", "operators/gem.h"), problem.defines()) + """
__kernel void widen(__global const half* h, __global float* f) { int i = get_global_id(0); f[i] = LOAD(h, i); }
__kernel void narrow(__global const float* f, __global half* h) { int i = get_global_id(0); STORE(h, i, f[i]); }
__kernel void widen8(__global const half* h, __global float* f)
{ int i = get_global_id(0); vstore8(load8((__global const scalar_t*)h, 8 * (index_t)i), i, f); }
__kernel void narrow8(__global const float* f, __global half* h)
{ int i = get_global_id(0); vstore8(stored8(vload8(i, f)), i, (__global stored_t*)h); }
__kernel void store8_narrow(__global const float* f, __global half* h)
{ int i = get_global_id(0); store8((__global scalar_t*)h, 8 * (index_t)i, vload8(i, f)); }
"""
    context, queue = device.queue.context, device.queue
    program = cl.Program(context, source).build()
    every_half = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    widened = np.empty(every_half.size, np.float32)
    flags = cl.mem_flags
    halves = cl.Buffer(context, flags.READ_ONLY | flags.COPY_HOST_PTR, hostbuf=every_half)
    floats = cl.Buffer(context, flags.WRITE_ONLY, widened.nbytes)
    expected = every_half.astype(np.float32)
    for name, items in (("widen", every_half.size), ("widen8", every_half.size // 8)):
        widened.fill(np.nan)
        cl.enqueue_copy(queue, floats, widened)
        cl.Kernel(program, name)(queue, (items,), None, halves, floats)
        cl.enqueue_copy(queue, widened, floats)
        assert _same_bits_or_nan(widened, expected), name
    finite = expected[np.isfinite(expected)].astype(np.float64)
    spacing = np.spacing(finite.astype(np.float16)).astype(np.float64)
    rng = np.random.default_rng(0)
    with np.errstate(over="ignore"):
        values = np.concatenate([expected, (finite + spacing / 2).astype(np.float32),
                                 (finite + spacing / 4).astype(np.float32),
                                 (rng.standard_normal(100_000) * 10.0 ** rng.integers(-9, 6, 100_000)).astype(np.float32),
                                 np.array([65519.99, 65520.0, 1e10, -1e10, np.inf, -np.inf, np.nan, -0.0, 2.98e-8],
                                          np.float32)])
        expected_halves = values.astype(np.float16)
    padding = np.zeros(-values.size % 8, np.float32)  # stored8 takes eight at a time
    values = np.concatenate([values, padding])
    expected_halves = np.concatenate([expected_halves, padding.astype(np.float16)])
    source_floats = cl.Buffer(context, flags.READ_ONLY | flags.COPY_HOST_PTR, hostbuf=values)
    for name, items in (("narrow", values.size), ("narrow8", values.size // 8), ("store8_narrow", values.size // 8)):
        kernel = cl.Kernel(program, name)
        narrowed = np.empty(values.size, np.float16)
        target = cl.Buffer(context, flags.WRITE_ONLY, narrowed.nbytes)
        kernel(queue, (items,), None, source_floats, target)
        cl.enqueue_copy(queue, narrowed, target)
        queue.finish()
        same = ((narrowed.view(np.uint16) == expected_halves.view(np.uint16))
                | (np.isnan(narrowed) & np.isnan(expected_halves)))
        assert same.all(), (name, values[~same][:5], narrowed[~same][:5], expected_halves[~same][:5])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_vector_map_and_roots_of_gem_programs_have_the_scalar_bits(dtype):
    """gem_power8(load8(...)) (gem.h: eight contiguous elements in OpenCL's vector types) against the
    scalar gem_power(LOAD(...)), bit for bit, over every float16/bfloat16 value or wide float32 ones
    (negative, zero, subnormal, around eps, huge, infinite, NaN) and exponents whose powers under-
    and overflow; gem_root8 against gem_root on those values as sums over areas of 1 to 64."""
    cl = pytest.importorskip("pyopencl")
    device = pt.devices()[0]
    problem = Problem.create("adaptive_gem_pool1d", (1, 1, 8), 2, dtype)
    source = kernel_source.render_files(("prelude.h", "windows.h", "operators/gem.h"), problem.defines()) + """
__kernel void scalar_map(__global const scalar_t* x, __global float* y, float p, float eps)
{ int i = get_global_id(0); y[i] = gem_power(LOAD(x, i), p, eps); }
__kernel void vector_map(__global const scalar_t* x, __global float* y, float p, float eps)
{ int i = get_global_id(0); vstore8(gem_power8(load8(x, 8 * (index_t)i), p, eps), i, y); }
__kernel void scalar_root(__global const scalar_t* x, __global float* y, float p, float eps)
{ int i = get_global_id(0); y[i] = gem_root(LOAD(x, i), 1 + i % 64, p); }
__kernel void vector_root(__global const scalar_t* x, __global float* y, float p, float eps)
{
    int i = get_global_id(0);
    const float8 areas = 1.0f + convert_float8((8 * i + (int8)(0, 1, 2, 3, 4, 5, 6, 7)) % 64);
    vstore8(gem_root8(load8(x, 8 * (index_t)i), areas, p), i, y);
}
"""
    context, queue = device.queue.context, device.queue
    program = cl.Program(context, source).build()
    pairs = [(cl.Kernel(program, f"scalar_{name}"), cl.Kernel(program, f"vector_{name}")) for name in ("map", "root")]
    if dtype == "float32":
        rng = np.random.default_rng(1)
        x = np.concatenate([(rng.standard_normal(1 << 16) * 10.0 ** rng.integers(-40, 39, 1 << 16)).astype(np.float32),
                            rng.random(1 << 12).astype(np.float32) * 3e-6,
                            np.array([0.0, -0.0, 1e-6, -1e-6, 1e-45, 3.4e38, np.inf, -np.inf, np.nan, -np.nan],
                                     np.float32)])
        x = np.concatenate([x, np.zeros(-x.size % 8, np.float32)])
    else:
        x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(_dtype(dtype))
    flags = cl.mem_flags
    inputs = cl.Buffer(context, flags.READ_ONLY | flags.COPY_HOST_PTR, hostbuf=x)
    scalar, vector = np.full(x.size, np.nan, np.float32), np.full(x.size, -1.0, np.float32)
    scalar_buffer, vector_buffer = (cl.Buffer(context, flags.WRITE_ONLY, x.size * 4) for _ in range(2))
    for p, eps in [(3.0, 1e-6), (2.5, 1e-6), (1.0, 1e-6), (0.37, 1e-3), (7.9, 1e-6), (60.0, 1e-6), (3.0, 0.5)]:
        for scalar_kernel, vector_kernel in pairs:
            scalar_kernel(queue, (x.size,), None, inputs, scalar_buffer, np.float32(p), np.float32(eps))
            vector_kernel(queue, (x.size // 8,), None, inputs, vector_buffer, np.float32(p), np.float32(eps))
            cl.enqueue_copy(queue, scalar, scalar_buffer)
            cl.enqueue_copy(queue, vector, vector_buffer)
            queue.finish()
            differ = ~_same_bits_or_nan(scalar, vector, each=True)
            assert not differ.any(), (scalar_kernel.function_name, p, eps, x[differ][:5], scalar[differ][:5],
                                      vector[differ][:5])


#: (input shape, output size) of GeM problems with no input or no output.
EMPTY_PROBLEMS = [((0, 3, 8, 8), 2), ((2, 0, 8, 8), 2), ((2, 3, 8, 8), (0, 2))]


@pytest.mark.parametrize("arrays", ["numpy", "device arrays"])
@pytest.mark.parametrize("shape, size", EMPTY_PROBLEMS)
def test_the_backward_of_a_problem_with_no_input_or_no_output_is_zeros(rng, arrays, shape, size):
    """No output depends on any input: ``grad_x`` is zeros of x's shape and ``grad_p`` 0, with
    nothing launched (the launch's empty buffers were refused by OpenCL: INVALID_BUFFER_SIZE)."""
    x = rng.random(shape).astype(np.float32) + 0.5
    grad = rng.random(pt.adaptive_gem_pool2d(x, size).shape).astype(np.float32)
    if arrays == "device arrays":
        cla = pytest.importorskip("pyopencl.array")
        from pool_tuner import backends

        queue = backends.resolve_device(None).queue
        grad, x = cla.to_device(queue, grad), cla.to_device(queue, x)
    got_x, got_p = pt.adaptive_gem_pool2d_backward(grad, x, size, 2.5)
    assert type(got_x) is type(x) and got_x.shape == shape
    assert not np.any(got_x.get() if arrays == "device arrays" else got_x) and got_p == 0.0
