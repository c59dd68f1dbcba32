"""Multi-level pooling (pool_tuner.pyramid, pool_tuner.fused): pyramids and avg+max from one read.

The oracle is the float64 reference pooling each level on its own by its definition
(``reference.forward`` of the multi-level op); PyTorch's separate calls are a second one.  Every
variant, dtype, layout and rank; level sets divisible and not, with upsampling and empty levels;
NaNs and ties for max (values and indices exact); backward against the reference sum of the
levels' gradients, bit-identical across runs; the cut-point cells themselves; bad arguments.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pool_tuner as pt
from pool_tuner import backends, pyramid, reference, shapes
from pool_tuner.problem import LAYOUT_NAMES, Problem
from pool_tuner.tuner import TOLERANCES
from pool_tuner.variants import variants_for
from pool_tuner.windows import pooling_windows

from conftest import EXHAUSTIVE, random_input, tiered

DTYPES = ["float32", "float64", "float16", "bfloat16"]
CHANNELS_LAST = {1: "NLC", 2: "NHWC", 3: "NDHWC"}
CONTIGUOUS = {ndim: names[0] for ndim, names in LAYOUT_NAMES.items()}
#: (shape, output sizes): PSPNet's and SPP's level sets on divisible and non-divisible planes,
#: levels of unequal axes and None, an upsampling level, an empty level.
CASES_2D = [
    ((2, 3, 12, 12), [1, 2, 3, 6]),
    ((2, 3, 13, 11), [1, 2, 3, 6]),
    ((1, 4, 13, 13), [4, 2, 1]),
    ((2, 2, 7, 9), [(2, 3), (None, 4), 5]),
    ((1, 3, 5, 4), [1, 7, (3, 6)]),
    ((2, 2, 6, 6), [2, (0, 3), 1]),
    ((3, 7, 7), [1, 3]),
]
CASES_1D = [((2, 3, 17), [1, 5, 20]), ((3, 10), [(4,), (3,)])]
CASES_3D = [((1, 2, 5, 6, 7), [1, 2, (3, 4, 5)]), ((2, 2, 4, 4, 4), [(1, 2, 3), 4])]


def _dtype(name):
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _channels_last(x, ndim):
    """``x`` stored channels-last, seen with its logical axes."""
    c = x.ndim - ndim - 1
    return np.moveaxis(np.ascontiguousarray(np.moveaxis(x, c, -1)), -1, c)


def _as64(a):
    return np.asarray(a).astype(np.float32).astype(np.float64) if a.dtype.name == "bfloat16" else a.astype(np.float64)


def _close(got, expected, dtype):
    got = _as64(got)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, expected, **TOLERANCES[dtype])


def _variants(op, direction, shape, sizes, layout=None, dtype="float32"):
    device = backends.resolve_device(None)
    problem = Problem.create(op, shape, sizes, dtype, layout=layout, direction=direction)
    return [name for name, v in variants_for(op, direction).items() if v.is_legal({}, problem, device.info.limits)]


def _layouts(ndim):
    return [None, CHANNELS_LAST[ndim]]


def _cases():
    """Core: the 2d cases contiguous with PSPNet's levels on a plane they do not divide, with kept
    axes, with empty levels and batch-less (the others -- levels on a plane they divide, in
    descending order, larger than the plane -- are the exhaustive tier's), the second 2d case
    channels-last, the first 1d and the second (smaller) 3d one."""
    core = {(1, 0), (3, 1)}
    for ndim, cases in ((1, CASES_1D), (2, CASES_2D), (3, CASES_3D)):
        for position, (shape, sizes) in enumerate(cases):
            for layout in _layouts(ndim):
                is_core = (ndim, position) in core or ndim == 2 and (position in (1, 3, 5, 6) if layout is None
                                                                     else position == 1)
                yield pytest.param(ndim, shape, sizes, layout, marks=() if is_core else EXHAUSTIVE)


# --------------------------------------------------------------------------------- the cells


@given(st.integers(1, 80), st.lists(st.integers(0, 100), min_size=1, max_size=5))
@settings(max_examples=200, deadline=None)
def test_every_window_of_every_level_is_a_run_of_whole_cells(in_size, out_sizes):
    cuts = pyramid.cuts(in_size, out_sizes)
    assert cuts[0] == 0 and cuts[-1] == in_size and np.all(np.diff(cuts) > 0)
    for out_size in out_sizes:
        if not out_size:
            continue
        starts, ends = pooling_windows(in_size, out_size)
        first, end = pyramid.window_cells(cuts, in_size, out_size)
        assert np.array_equal(cuts[first], starts) and np.array_equal(cuts[end], ends)
        assert np.all(end > first)


def test_pspnet_cuts_are_the_union_of_the_window_bounds():
    assert pyramid.cuts(64, [1, 2, 3, 6]).tolist() == [0, 10, 11, 21, 22, 32, 42, 43, 53, 54, 64]
    assert pyramid.cell_count(Problem.create("adaptive_avg_pool_pyramid2d", (1, 1, 64, 64), [1, 2, 3, 6])) == 100


# --------------------------------------------------------------------------------- forward


@pytest.mark.parametrize("ndim,shape,sizes,layout", list(_cases()))
@pytest.mark.parametrize("kind", ["avg", "max"])
def test_pyramid_every_variant_matches_reference(kind, ndim, shape, sizes, layout, rng):
    op = f"adaptive_{kind}_pool_pyramid{ndim}d"
    x = random_input(rng, shape)
    if kind == "max":  # ties: repeated values inside windows
        flat = x.reshape(-1)
        n = flat[1::3].size
        flat[::3][:n] = flat[1::3]
    values, indices = reference.forward(op, x, sizes)
    arg = _channels_last(x, ndim) if layout else x
    for variant in _variants(op, "forward", shape, sizes, layout):
        fn = pt.adaptive_avg_pool_pyramid if kind == "avg" else pt.adaptive_max_pool_pyramid
        extra = {} if kind == "avg" else {"return_indices": True}
        got = fn(arg, sizes, ndim=ndim, variant=variant, **extra)
        got_values, got_indices = (got, []) if kind == "avg" else got
        assert len(got_values) == len(sizes)
        for level, (g, e) in enumerate(zip(got_values, values)):
            assert g.shape == e.shape, (variant, level)
            _close(g, e, "float32")
            if layout and g.size:
                assert g.strides[g.ndim - ndim - 1] == g.itemsize, "levels keep the input's channels-last memory"
        for g, e in zip(got_indices, indices):
            assert g.dtype == np.int64 and np.array_equal(g, e), variant


@pytest.mark.parametrize("kind", ["avg", "max"])
def test_windows_past_the_unrolled_limit_are_finished_from_the_tables(kind, rng):
    """The work-item-per-plane kernels finish a plane from a list of constant windows where it is
    short (LEVEL_WINDOWS) and from the tables past ``UNROLLED_MERGES_LIMIT``: both paths against
    the reference, with ties and NaNs for max."""
    op, shape, sizes = f"adaptive_{kind}_pool_pyramid2d", (2, 3, 15, 15), [1, 2, 3, 5, 7, 9, 11]
    long_list = Problem.create(op, shape, sizes)
    short_list = Problem.create(op, shape, sizes[:3])
    assert pyramid.cell_merges(long_list) > pyramid.UNROLLED_MERGES_LIMIT >= pyramid.cell_merges(short_list)
    assert "LEVEL_WINDOWS(X)" not in pyramid.cell_defines(long_list)
    assert "LEVEL_WINDOWS(X)" in pyramid.cell_defines(short_list)
    for levels in (sizes, sizes[:3]):
        x = random_input(rng, shape)
        if kind == "max":
            x.reshape(-1)[::7] = x.reshape(-1)[1]
            x[0, 1, 3, 4] = x[1, 2, 12, 9] = np.nan
        values, indices = reference.forward(op, x, levels)
        for variant in ("pyramid_rows", "pyramid_stream"):
            if kind == "avg":
                got, got_indices = pt.adaptive_avg_pool_pyramid(x, levels, variant=variant), []
            else:
                got, got_indices = pt.adaptive_max_pool_pyramid(x, levels, return_indices=True, variant=variant)
            for g, e in zip(got, values):
                if kind == "avg":
                    _close(g, e, "float32")
                else:  # max values are exact, NaN where a window holds one
                    assert np.array_equal(g, e.astype(np.float32), equal_nan=True), variant
            for g, e in zip(got_indices, indices):
                assert np.array_equal(g, e), variant


#: (kind, dtype): float32 is test_pyramid_every_variant_matches_reference's (CASES_2D[1]) and in the
#: exhaustive tier here, as max pooling's float64 (max compares, and float64 compares as float32).
PYRAMID_DTYPE_CASES = tiered([pytest.param(kind, dtype, id=f"{kind}-{dtype}") for kind in ("avg", "max") for dtype in DTYPES],
                             core=lambda values: values[1] != "float32" and values != ("max", "float64"))


@pytest.mark.parametrize("layout", [None, pytest.param("NHWC", marks=EXHAUSTIVE)])
@pytest.mark.parametrize("kind,dtype", PYRAMID_DTYPE_CASES)
def test_pyramid_dtypes(kind, dtype, layout, rng):
    # CASES_2D[1]'s problem: its float32 programs are built once for both tests
    op, shape, sizes = f"adaptive_{kind}_pool_pyramid2d", (2, 3, 13, 11), [1, 2, 3, 6]
    x = random_input(rng, shape).astype(_dtype(dtype))
    values, indices = reference.forward(op, _as64(x), sizes)
    arg = _channels_last(x, 2) if layout else x
    for variant in _variants(op, "forward", shape, sizes, layout):
        if kind == "avg":
            got = pt.adaptive_avg_pool_pyramid(arg, sizes, variant=variant)
        else:
            got, got_indices = pt.adaptive_max_pool_pyramid(arg, sizes, return_indices=True, variant=variant)
            assert all(np.array_equal(g, e) for g, e in zip(got_indices, indices)), variant
        for g, e in zip(got, values):
            assert g.dtype == x.dtype
            _close(g, e, dtype)


def test_max_pyramid_nan_rule_and_all_minus_inf(rng):
    """A window with NaNs: NaN and the index of its last NaN; an all -inf window: the first position."""
    shape, sizes = (2, 3, 9, 10), [1, 2, 3, (4, 5)]
    x = random_input(rng, shape)
    x[0, 0, 1, 2] = x[0, 0, 7, 1] = x[1, 2, 4, 4] = np.nan
    x[0, 1] = -np.inf
    values, indices = reference.forward("adaptive_max_pool_pyramid2d", x, sizes)
    for variant in _variants("adaptive_max_pool_pyramid2d", "forward", shape, sizes):
        got, got_indices = pt.adaptive_max_pool_pyramid(x, sizes, return_indices=True, variant=variant)
        for g, e, gi, ei in zip(got, values, got_indices, indices):
            np.testing.assert_array_equal(g, e)  # NaN positions equal too
            np.testing.assert_array_equal(gi, ei)


def test_pyramid_matches_pytorch_separate_calls(rng):
    torch = pytest.importorskip("torch")
    x = random_input(rng, (2, 8, 21, 19))
    sizes = [1, 2, 3, 6]
    xt = torch.from_numpy(x)
    for got, size in zip(pt.adaptive_avg_pool_pyramid(x, sizes), sizes):
        np.testing.assert_allclose(got, torch.nn.functional.adaptive_avg_pool2d(xt, size).numpy(), rtol=1e-5, atol=1e-6)
    values, indices = pt.adaptive_max_pool_pyramid(x, sizes, return_indices=True)
    for got, got_indices, size in zip(values, indices, sizes):
        expected, expected_indices = torch.nn.functional.adaptive_max_pool2d(xt, size, return_indices=True)
        np.testing.assert_array_equal(got, expected.numpy())
        np.testing.assert_array_equal(got_indices, expected_indices.numpy())


@pytest.mark.parametrize("mode", ["avg+max", "cat"])
@pytest.mark.parametrize("layout", [None, "NHWC"])
def test_avgmax_matches_timm_definition(mode, layout, rng):
    shape = (3, 6, 7, 9)
    x = random_input(rng, shape)
    arg = _channels_last(x, 2) if layout else x
    (avg, mx), (indices,) = reference.forward("adaptive_avgmax_pool2d", x, (2, 3))
    expected = (avg + mx) / 2 if mode == "avg+max" else np.concatenate([avg, mx], axis=1)
    for variant in _variants("adaptive_avgmax_pool2d", "forward", shape, (2, 3), layout):
        got, got_indices = pt.adaptive_avgmax_pool2d(arg, (2, 3), mode, return_indices=True, variant=variant)
        _close(got, expected, "float32")
        assert np.array_equal(got_indices, indices)


def test_empty_batch_gives_empty_levels():
    got = pt.adaptive_avg_pool_pyramid(np.ones((0, 3, 5, 5), np.float32), [1, 2])
    assert [g.shape for g in got] == [(0, 3, 1, 1), (0, 3, 2, 2)]


def test_device_arrays_stay_on_the_device(rng):
    cl_array = pytest.importorskip("pyopencl.array")
    device = backends.resolve_device(None)
    x = random_input(rng, (2, 3, 13, 11))
    x_dev = device.to_device(x, device.queue)
    got = pt.adaptive_avg_pool_pyramid(x_dev, [1, 2, 3, 6])
    assert all(isinstance(g, cl_array.Array) for g in got)
    for g, e in zip(got, reference.forward("adaptive_avg_pool_pyramid2d", x, [1, 2, 3, 6])[0]):
        _close(g.get(), e, "float32")


# --------------------------------------------------------------------------------- backward


@pytest.mark.parametrize("ndim,shape,sizes,layout", list(_cases()))
@pytest.mark.parametrize("kind", ["avg", "max"])
def test_pyramid_backward_every_variant_matches_reference(kind, ndim, shape, sizes, layout, rng):
    op = f"adaptive_{kind}_pool_pyramid{ndim}d"
    x = random_input(rng, shape)
    values, indices = reference.forward(op, x, sizes)
    grads = [random_input(rng, v.shape) for v in values]
    expected = reference.backward(op, grads, shape, indices)
    grads_in = [_channels_last(g, ndim) for g in grads] if layout else grads
    for variant in _variants(op, "backward", shape, sizes, layout):
        if kind == "avg":
            got = pt.adaptive_avg_pool_pyramid_backward(grads_in, shape, ndim=ndim, variant=variant)
        else:
            got = pt.adaptive_max_pool_pyramid_backward(grads_in, indices, shape, ndim=ndim, variant=variant)
        assert got.shape == tuple(shape)
        _close(got, expected, "float32")


@pytest.mark.parametrize("ndim,shape,sizes,layout", [c for c in _cases() if c.values[0] != 3])
@pytest.mark.parametrize("kind", ["avg", "max"])
def test_pyramid_backward_on_device_arrays(kind, ndim, shape, sizes, layout, rng):
    """Device gradients and indices in, the input gradient out on the device, in their layout,
    every variant (results poisoned with NaN before each launch: tests/poisoning.py)."""
    cl_array = pytest.importorskip("pyopencl.array")
    device = backends.resolve_device(None)
    op = f"adaptive_{kind}_pool_pyramid{ndim}d"
    values, indices = reference.forward(op, random_input(rng, shape), sizes)
    grads = [random_input(rng, v.shape) for v in values]
    expected = reference.backward(op, grads, shape, indices)
    store = (lambda a: _channels_last(a, ndim)) if layout else (lambda a: a)  # noqa: E731

    def on_device(a):
        a = store(a)
        memory = device.to_device(np.ascontiguousarray(np.moveaxis(a, a.ndim - ndim - 1, -1)) if layout else a,
                                  device.queue)
        if not layout:
            return memory
        return device.arrays.strided_view(memory, a.shape, a.strides)

    grads_dev = [on_device(g) for g in grads]
    for variant in _variants(op, "backward", shape, sizes, layout):
        if kind == "avg":
            got = pt.adaptive_avg_pool_pyramid_backward(grads_dev, shape, ndim=ndim, variant=variant)
        else:
            got = pt.adaptive_max_pool_pyramid_backward(grads_dev, [on_device(i) for i in indices], shape, ndim=ndim,
                                                        variant=variant)
        assert isinstance(got, cl_array.Array) and got.shape == tuple(shape)
        assert pt.ops.memory_layout(got, ndim) == (layout or CONTIGUOUS[ndim])
        c = len(shape) - ndim - 1
        memory_shape = shape[:c] + shape[c + 1:] + shape[c:c + 1] if layout else shape
        memory = device.arrays.strided_view(got, memory_shape, shapes.c_strides(memory_shape, got.dtype.itemsize)).get()
        _close(np.moveaxis(memory, -1, c) if layout else memory, expected, "float32")


def test_pyramid_backward_device_array_errors(rng):
    pytest.importorskip("pyopencl.array")
    device = backends.resolve_device(None)
    shape, sizes = (2, 3, 7, 6), [(2, 2), (3, 3)]
    grads = [random_input(rng, (2, 3) + s) for s in sizes]
    grads_dev = [device.to_device(g, device.queue) for g in grads]
    with pytest.raises(TypeError, match=r"grad_outs\[1\] must be a device array"):
        pt.adaptive_avg_pool_pyramid_backward([grads_dev[0], grads[1]], shape)
    with pytest.raises(TypeError, match=r"grad_outs\[1\] must be a numpy.ndarray"):
        pt.adaptive_avg_pool_pyramid_backward([grads[0], grads_dev[1]], shape)
    channels_last = device.to_device(np.ascontiguousarray(np.moveaxis(grads[1], 1, -1)), device.queue)
    mixed = device.arrays.strided_view(channels_last, grads[1].shape, _channels_last(grads[1], 2).strides)
    with pytest.raises(ValueError, match=r"grad_outs\[0\] must be stored NHWC"):
        pt.adaptive_avg_pool_pyramid_backward([grads_dev[0], mixed], shape)
    _, indices = reference.forward("adaptive_max_pool_pyramid2d", random_input(rng, shape), sizes)
    with pytest.raises(TypeError, match=r"indices\[0\] must be a device array"):
        pt.adaptive_max_pool_pyramid_backward(grads_dev, indices, shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["avg", "max"])
def test_pyramid_backward_dtypes_and_determinism(kind, dtype, rng):
    op, shape, sizes = f"adaptive_{kind}_pool_pyramid2d", (2, 4, 13, 11), [1, 2, 3, 6]
    x = random_input(rng, shape)
    values, indices = reference.forward(op, x, sizes)
    grads = [random_input(rng, v.shape).astype(_dtype(dtype)) for v in values]
    expected = reference.backward(op, [_as64(g) for g in grads], shape, indices)
    for variant in _variants(op, "backward", shape, sizes, dtype=dtype):
        fn = pt.adaptive_avg_pool_pyramid_backward if kind == "avg" else (
            lambda g, s, **kw: pt.adaptive_max_pool_pyramid_backward(g, indices, s, **kw))
        first = fn(grads, shape, variant=variant)
        _close(first, expected, dtype)
        again = fn(grads, shape, variant=variant)
        assert first.tobytes() == again.tobytes(), "bit-identical across runs"


@pytest.mark.parametrize("mode", ["avg+max", "cat"])
def test_avgmax_backward(mode, rng):
    shape = (2, 5, 7, 7)
    x = random_input(rng, shape)
    (avg, mx), (indices,) = reference.forward("adaptive_avgmax_pool2d", x, 1)
    result, got_indices = pt.adaptive_avgmax_pool2d(x, 1, mode, return_indices=True)
    grad = random_input(rng, result.shape)
    level_grads = [grad / 2, grad / 2] if mode == "avg+max" else [grad[:, :5], grad[:, 5:]]
    expected = reference.backward("adaptive_avgmax_pool2d", level_grads, shape, [indices])
    for variant in _variants("adaptive_avgmax_pool2d", "backward", shape, 1):
        got = pt.adaptive_avgmax_pool2d_backward(grad, got_indices, shape, mode, variant=variant)
        _close(got, expected, "float32")


def _avgmax_on_device(device, a, layout):
    """A numpy array on the device, stored as ``layout`` says (None: contiguous), logical axes."""
    if not layout:
        return device.to_device(a, device.queue)
    memory = np.ascontiguousarray(np.moveaxis(a, -3, -1))
    return device.arrays.strided_view(device.to_device(memory, device.queue), a.shape, np.moveaxis(memory, -1, -3).strides)


def _avgmax_from_device(device, a):
    """A device array's values with its logical axes, whatever its memory order."""
    if pt.ops.memory_layout(a, 2) != "NHWC" or a.ndim < 3:
        return a.get()
    memory_shape = a.shape[:-3] + a.shape[-2:] + a.shape[-3:-2]
    memory = device.arrays.strided_view(a, memory_shape, shapes.c_strides(memory_shape, a.dtype.itemsize)).get()
    return np.moveaxis(memory, -1, -3)


@pytest.mark.parametrize("mode,layout,dtype", tiered(
    [pytest.param(mode, layout, dtype, id=f"{mode}-{layout}-{dtype}")
     for dtype in ("float32", "float16", "float64") for layout in (None, "NHWC") for mode in ("avg+max", "cat")],
    core=lambda values: values[2] == "float32" or values == ("avg+max", None, "float16")))
def test_avgmax_on_device_arrays(mode, layout, dtype, rng):
    """Device arrays in, the joined result, indices and the input gradient out on the device, in
    the input's layout: the numpy path's bits (the join kernels round as numpy does) and the
    reference's values; every variant, a batch and an unbatched input (results poisoned with NaN
    before each launch: tests/poisoning.py)."""
    pytest.importorskip("pyopencl.array")
    device = backends.resolve_device(None)
    for shape, size in (((3, 6, 7, 9), (2, 3)), ((5, 13, 11), (3, 3))):
        x = random_input(rng, shape).astype(dtype)
        (avg, mx), (indices,) = reference.forward("adaptive_avgmax_pool2d", _as64(x), size)
        expected = (avg + mx) / 2 if mode == "avg+max" else np.concatenate([avg, mx], axis=-3)
        grad = random_input(rng, expected.shape).astype(dtype)
        channels = avg.shape[-3]
        level_grads = [_as64(grad) / 2] * 2 if mode == "avg+max" else [_as64(grad)[..., :channels, :, :],
                                                                        _as64(grad)[..., channels:, :, :]]
        expected_grad = reference.backward("adaptive_avgmax_pool2d", level_grads, shape, [indices])
        x_dev, grad_dev = _avgmax_on_device(device, x, layout), _avgmax_on_device(device, grad, layout)
        for variant in _variants("adaptive_avgmax_pool2d", "forward", shape, size, layout, dtype):
            result, got_indices = pt.adaptive_avgmax_pool2d(x_dev, size, mode, return_indices=True, variant=variant)
            assert pt.ops.memory_layout(result, 2) == (layout or "NCHW")
            got = _avgmax_from_device(device, result)
            # numpy in the same layout, the same variant: the same sums' order
            numpy_result = pt.adaptive_avgmax_pool2d(_channels_last(x, 2) if layout else x, size, mode, variant=variant)
            assert got.shape == expected.shape and got.tobytes() == numpy_result.tobytes()
            _close(got, expected, dtype)
            assert np.array_equal(_avgmax_from_device(device, got_indices), indices)
        for variant in _variants("adaptive_avgmax_pool2d", "backward", shape, size, layout, dtype):
            got = pt.adaptive_avgmax_pool2d_backward(grad_dev, got_indices, shape, mode, variant=variant)
            assert pt.ops.memory_layout(got, 2) == (layout or "NCHW")
            got = _avgmax_from_device(device, got)
            numpy_grad = pt.adaptive_avgmax_pool2d_backward(_channels_last(grad, 2) if layout else grad, indices, shape,
                                                            mode, variant=variant)
            assert got.tobytes() == numpy_grad.tobytes()
            _close(got, expected_grad, dtype)


def test_avgmax_device_array_errors(rng):
    pytest.importorskip("pyopencl.array")
    device = backends.resolve_device(None)
    shape = (2, 4, 7, 7)
    result, indices = pt.adaptive_avgmax_pool2d(device.to_device(random_input(rng, shape), device.queue), 2, "cat",
                                                return_indices=True)
    grad = random_input(rng, result.shape)
    with pytest.raises(ValueError, match=r"indices\[0\] must be stored NHWC like the other levels"):
        pt.adaptive_avgmax_pool2d_backward(_avgmax_on_device(device, grad, "NHWC"), indices, shape, "cat")
    n_major = device.arrays.strided_view(device.to_device(grad, device.queue), grad.shape, (4, 8, 2 * 4 * 8, 4 * 8))
    with pytest.raises(ValueError, match=r"grad_out must be stored NCHW like the other levels"):
        pt.adaptive_avgmax_pool2d_backward(n_major, indices, shape, "cat")
    with pytest.raises(ValueError, match=r"grad_out must be the gradient of the mode='cat' result"):
        pt.adaptive_avgmax_pool2d_backward(device.to_device(np.ascontiguousarray(grad[:, :7]), device.queue), indices, shape, "cat")
    with pytest.raises(ValueError, match=r"grad_out must have shape \(2, 4\)"):
        pt.adaptive_avgmax_pool2d_backward(device.to_device(grad[:1], device.queue), indices, shape, "cat")
    with pytest.raises(TypeError, match=r"indices\[0\] must be a device array"):
        pt.adaptive_avgmax_pool2d_backward(device.to_device(grad, device.queue), indices.get(), shape, "cat")
    with pytest.raises(TypeError, match=r"grad_out must be a numpy.ndarray or a device array, got list"):
        pt.adaptive_avgmax_pool2d_backward(grad.tolist(), indices, shape, "cat")


# --------------------------------------------------------------------------------- dispatch, errors


def test_explain_covers_the_multi_level_ops():
    info = pt.explain("adaptive_avg_pool_pyramid2d", (8, 2048, 64, 64), [1, 2, 3, 6])
    assert info["problem_class"] == "pyramid" and info["variant"].startswith("pyramid_")
    assert info["output_shape"] == [8, 2048, 1, 1, 2, 2, 3, 3, 6, 6]
    back = pt.explain("adaptive_max_pool_pyramid2d", (32, 256, 13, 13), [1, 2, 4], direction="backward")
    assert back["variant"].startswith("pyramid_")
    assert pt.explain("adaptive_avgmax_pool2d", (32, 2048, 7, 7), 1)["output_shape"] == [32, 2048, 1, 1]
    assert set(pt.variants("adaptive_avg_pool_pyramid2d")) == {"pyramid_cells", "pyramid_columns", "pyramid_stream", "pyramid_rows",
                                                               "pyramid_channels", "pyramid_windows"}


def test_fine_levels_fall_back_to_the_cell_less_variant():
    """Levels so fine that the cut tables would not fit constant memory: pyramid_windows only."""
    problem = Problem.create("adaptive_avg_pool_pyramid1d", (1, 1, 5000), [1, 2000, 4999])
    device = backends.resolve_device(None)
    legal = [n for n, v in variants_for(problem.op).items() if v.is_legal({}, problem, device.info.limits)]
    assert legal == ["pyramid_windows"]
    x = np.random.default_rng(0).standard_normal((1, 1, 5000)).astype(np.float32)
    for got, e in zip(pt.adaptive_avg_pool_pyramid(x, [1, 2000, 4999]),
                      reference.forward("adaptive_avg_pool_pyramid1d", x, [1, 2000, 4999])[0]):
        _close(got, e, "float32")


def test_problem_round_trips_through_its_record_shapes():
    from pool_tuner import cache

    problem = Problem.create("adaptive_max_pool_pyramid2d", (4, 3, 13, 13), [4, (2, None), 1], layout="NHWC")
    record = {"problem": {"op": problem.op, "direction": "forward", "dtype": "float32", "layout": "NHWC",
                          "input_shape": list(problem.input_shape), "output_shape": list(problem.output_shape)}}
    assert cache.problem_of(record) == problem
    assert problem.levels == ((1, 4, 4), (1, 2, 13), (1, 1, 1))
    values, positions = problem.operation.output_counts(problem.input_shape, problem.output_shape)
    assert (values, positions) == (12 * (16 + 26 + 1),) * 2
    assert problem.bytes_read_written() == (4 * 3 * 169 * 4, values * 4 + positions * 8)


@pytest.mark.parametrize("call,error,words", [
    (lambda x: pt.adaptive_avg_pool_pyramid(x, []), ValueError, "output_sizes must hold at least one"),
    (lambda x: pt.adaptive_avg_pool_pyramid(x, 3), TypeError, "output_sizes must be a non-empty sequence"),
    (lambda x: pt.adaptive_avg_pool_pyramid(x, [1, -2]), ValueError, "output_sizes[1]"),
    (lambda x: pt.adaptive_avg_pool_pyramid(x, [1, (2, 2, 2)], ndim=2), ValueError, "output_sizes[1] must have 2 entries"),
    (lambda x: pt.adaptive_avg_pool_pyramid(x, [(1, 2), (2,)]), ValueError, "tuples of one length"),
    (lambda x: pt.adaptive_avg_pool_pyramid(x, [1, 2], ndim=4), ValueError, "ndim must be 1, 2 or 3"),
    (lambda x: pt.adaptive_avg_pool_pyramid(x.astype(np.int32), [1]), TypeError, "x.dtype"),
    (lambda x: pt.adaptive_avg_pool_pyramid(x, [1], variant="thread_per_output"), ValueError, "variant must be one of"),
    (lambda x: pt.adaptive_avgmax_pool2d(x, 1, mode="sum"), ValueError, "mode must be one of"),
    (lambda x: pt.adaptive_avg_pool_pyramid_backward(np.ones((2, 3, 1, 1), np.float32), x.shape), TypeError,
     "grad_outs must be a list"),
    (lambda x: pt.adaptive_avg_pool_pyramid_backward([np.ones((2, 4, 1, 1), np.float32)], x.shape), ValueError,
     "grad_outs[0] must have shape"),
    (lambda x: pt.adaptive_max_pool_pyramid_backward([np.ones((2, 3, 1, 1), np.float32)],
                                                     [np.zeros((2, 3, 1, 1), np.int32)], x.shape), TypeError,
     "indices[0] must have dtype int64"),
    (lambda x: pt.adaptive_max_pool_pyramid_backward([np.ones((2, 3, 2, 2), np.float32)],
                                                     [np.full((2, 3, 2, 2), 80, np.int64)], x.shape), ValueError,
     "indices must"),
])
def test_bad_arguments_are_named(call, error, words):
    x = np.ones((2, 3, 9, 9), np.float32)
    with pytest.raises(error) as caught:
        call(x)
    assert words in str(caught.value)


def test_sizes_of_the_levels_are_bounded_before_allocation():
    with pytest.raises(ValueError, match="output_sizes"):
        pt.explain("adaptive_avg_pool_pyramid1d", (1, 1, 10), [1, 2**40])
