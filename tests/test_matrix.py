"""The full matrix: every op x direction x dtype x memory layout x legal variant, against the
float64 reference (docs/design.md: Kernels and variants, Quality bars), plus device arrays in channels-last memory and the
special values of max pooling (ties, NaN, all -inf) and of float16 averaging (near 65504).

One representative non-divisible shape per rank keeps this fast (every problem is one compile);
the special-value tests reuse those shapes so that they reuse the compiled kernels too.
"""

import math

import numpy as np
import pyopencl.array as cl_array
import pytest

import pool_tuner as pt
from pool_tuner import backends, reference
from pool_tuner.ops import memory_layout
from pool_tuner.problem import LAYOUT_NAMES, OPS, Problem

#: The single-level ops and their variants (the multi-level ops: tests/test_pyramid.py).
#: GeM (an operator with run-time arguments, whose backward takes x) has tests of its own: test_gem.py
OPS = {op: operation for op, operation in OPS.items() if not operation.multi_level and not operation.arguments}
from pool_tuner.shapes import resolve_output_size
from pool_tuner.variants import variants_for
from pool_tuner.windows import EXACT_MAX_WINDOW_LIMIT, max_window

from conftest import GLOBAL_ONLY, legal_variants, random_input, tiered

torch = pytest.importorskip("torch")
try:
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes ships with the test environment
    ml_dtypes = None

#: One non-divisible (overlapping windows) problem per rank: (input shape, output size).
REPRESENTATIVE = {
    1: ((2, 5, 13), 5),
    2: ((2, 5, 10, 9), (4, 7)),
    3: ((2, 3, 5, 6, 7), (3, 4, 2)),
}
DTYPES = ["float32", "float64", "float16", "bfloat16"]
TOLERANCES = {
    "float64": dict(rtol=1e-12, atol=1e-12),
    "float32": dict(rtol=1e-5, atol=1e-6),
    "float16": dict(rtol=2e-3, atol=2e-3),
    "bfloat16": dict(rtol=1.6e-2, atol=1.6e-2),
}
FLOAT32_TOL = TOLERANCES["float32"]


def np_dtype(name):
    if name == "bfloat16":
        if ml_dtypes is None:
            pytest.skip("bfloat16 needs ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def to_channels_last(x, ndim):
    """``x`` (logical channels-first) with channels-last memory: the channel axis (1, or 0 for
    batch-less inputs) stored last, the logical shape unchanged."""
    c = x.ndim - ndim - 1
    return np.moveaxis(np.ascontiguousarray(np.moveaxis(x, c, -1)), -1, c)


def in_layout(x, ndim, layout):
    x = to_channels_last(x, ndim) if layout == LAYOUT_NAMES[ndim][1] else np.ascontiguousarray(x)
    assert memory_layout(x, ndim) == layout
    return x


def as_float64(a):
    return np.asarray(a).astype(np.float32).astype(np.float64) if a.dtype.name == "bfloat16" else np.asarray(a, np.float64)


def forward(op, x, output_size, **kwargs):
    fn = getattr(pt, op)
    return fn(x, output_size, True, **kwargs) if OPS[op][0] == "max" else fn(x, output_size, **kwargs)


def backward(op, grad_out, input_shape, indices=None, **kwargs):
    fn = getattr(pt, f"{op}_backward")
    if OPS[op][0] == "max":
        return fn(grad_out, indices, input_shape, **kwargs)
    return fn(grad_out, input_shape, **kwargs)


def _matrix():
    cases = []
    for op, (kind, ndim) in OPS.items():
        shape, size = REPRESENTATIVE[ndim]
        for direction in ("forward", "backward"):
            for dtype in DTYPES:
                for layout in LAYOUT_NAMES[ndim]:
                    for variant in legal_variants(op, direction, shape, size, dtype, layout):
                        cases.append(pytest.param(op, direction, dtype, layout, variant,
                                                  id=f"{op}-{direction}-{dtype}-{layout}-{variant}"))
    # core: every variant in float32, and one variant of every other dtype and layout
    return tiered(cases, core=lambda values: values[2] == "float32", group=lambda values: values[:4])


def check_result(out, expected, dtype, layout, ndim, exact=False):
    assert isinstance(out, np.ndarray)
    assert out.dtype == dtype
    assert out.shape == expected.shape
    assert memory_layout(out, ndim) == layout, f"output strides {out.strides} are not {layout}"
    if layout == LAYOUT_NAMES[ndim][0]:
        assert out.flags.c_contiguous
    got = as_float64(out)
    assert not np.isnan(got).any(), "some outputs were never written (poisoned NaN left)"
    if exact:
        np.testing.assert_array_equal(got, expected)
    else:
        np.testing.assert_allclose(got, expected, **TOLERANCES[dtype.name])


def check_forward(op, out, x, size, layout):
    """A forward result against the reference on the same (cast) input: means within the dtype's
    tolerance; maxima -- one of the inputs, so exact in every dtype -- and their int64 first
    positions exactly, in the input's layout."""
    kind, ndim = OPS[op]
    expected = reference.forward(op, x, size)
    if kind == "avg":
        check_result(out, expected, x.dtype, layout, ndim)
        return
    (values, indices), (ref_values, ref_indices) = out, expected
    check_result(values, ref_values, x.dtype, layout, ndim, exact=True)
    assert indices.dtype == np.int64
    assert memory_layout(indices, ndim) == layout
    np.testing.assert_array_equal(indices, ref_indices)


@pytest.mark.parametrize("op,direction,dtype,layout,variant", _matrix())
def test_every_op_direction_dtype_layout_variant(op, direction, dtype, layout, variant, rng):
    kind, ndim = OPS[op]
    shape, size = REPRESENTATIVE[ndim]
    dt = np_dtype(dtype)
    x = in_layout(random_input(rng, shape, np.float64).astype(dt), ndim, layout)
    if direction == "forward":
        check_forward(op, forward(op, x, size, variant=variant), x, size, layout)
        return
    out_shape = shape[:-ndim] + resolve_output_size(size, shape[-ndim:])
    grad_out = in_layout(random_input(rng, out_shape, np.float64).astype(dt), ndim, layout)
    if kind == "avg":
        grad_in = backward(op, grad_out, shape, variant=variant)
        expected = reference.backward(op, grad_out, shape)
    else:
        _, ref_indices = reference.forward(op, x, size)
        indices = in_layout(ref_indices, ndim, layout)
        grad_in = backward(op, grad_out, shape, indices, variant=variant)
        expected = reference.backward(op, grad_out, shape, ref_indices)
    check_result(grad_in, expected, dt, layout, ndim)


# ---------------------------------------------------------------- batch-less channels-last


def _batchless():
    cases = []
    for op, (kind, ndim) in OPS.items():
        shape, size = REPRESENTATIVE[ndim]
        layout = LAYOUT_NAMES[ndim][1]
        for direction in ("forward", "backward"):
            legal = legal_variants(op, direction, shape[1:], size, layout=layout)
            # The kernels see a batch-less input as N = 1; what differs is the host's handling of
            # channel axis 0, which every variant shares: the default one and the channels-last
            # variants.
            for variant in [None] + [v for v in ("channels_vector", "channels_gather") if v in legal]:
                cases.append(pytest.param(op, direction, variant, id=f"{op}-{direction}-{variant}"))
    return cases


@pytest.mark.parametrize("op,direction,variant", _batchless())
def test_batchless_channels_last(op, direction, variant, rng):
    kind, ndim = OPS[op]
    shape, size = REPRESENTATIVE[ndim]
    shape = shape[1:]  # (C, *spatial), channel axis 0
    layout = LAYOUT_NAMES[ndim][1]
    x = to_channels_last(random_input(rng, shape), ndim)
    assert x.strides[0] == 4 and memory_layout(x, ndim) == layout
    dt = np.dtype(np.float32)
    if direction == "forward":
        if kind == "avg":
            check_result(forward(op, x, size, variant=variant), reference.forward(op, x, size), dt, layout, ndim)
        else:
            values, indices = forward(op, x, size, variant=variant)
            ref_values, ref_indices = reference.forward(op, x, size)
            check_result(values, ref_values, dt, layout, ndim, exact=True)
            assert memory_layout(indices, ndim) == layout
            np.testing.assert_array_equal(indices, ref_indices)
        return
    out_shape = shape[:1] + resolve_output_size(size, shape[1:])
    grad_out = to_channels_last(random_input(rng, out_shape), ndim)
    if kind == "avg":
        grad_in = backward(op, grad_out, shape, variant=variant)
        expected = reference.backward(op, grad_out, shape)
    else:
        _, ref_indices = reference.forward(op, x, size)
        grad_in = backward(op, grad_out, shape, to_channels_last(ref_indices, ndim), variant=variant)
        expected = reference.backward(op, grad_out, shape, ref_indices)
    check_result(grad_in, expected, dt, layout, ndim)


# ---------------------------------------------------------------- device arrays, channels-last


def device_channels_last(queue, x, ndim):
    """A pyopencl array of logical shape ``x.shape`` over channels-last device memory."""
    x_cl = to_channels_last(x, ndim)
    c = x.ndim - ndim - 1
    memory = cl_array.to_device(queue, np.ascontiguousarray(np.moveaxis(x, c, -1)))
    x_dev = cl_array.Array(queue, x.shape, x.dtype, data=memory.data, strides=x_cl.strides)
    assert memory_layout(x_dev, ndim) == LAYOUT_NAMES[ndim][1]
    return x_dev, memory


def device_memory_as_logical(queue, arr, ndim):
    """Read a channels-last device array back through its memory (strided arrays cannot .get())."""
    assert isinstance(arr, cl_array.Array)
    assert memory_layout(arr, ndim) == LAYOUT_NAMES[ndim][1], f"strides {arr.strides}"
    arr.finish()
    c = len(arr.shape) - ndim - 1
    memory_shape = arr.shape[:c] + arr.shape[c + 1:] + (arr.shape[c],)
    flat = cl_array.Array(queue, memory_shape, arr.dtype, data=arr.base_data).get()
    return np.moveaxis(flat, -1, c)


def _device_cases():
    cases = []
    for op, (kind, ndim) in OPS.items():
        shape, size = REPRESENTATIVE[ndim]
        legal = legal_variants(op, "forward", shape, size, layout=LAYOUT_NAMES[ndim][1])
        for variant in [None] + (["channels_vector"] if "channels_vector" in legal else []):
            cases.append(pytest.param(op, variant, id=f"{op}-{variant}"))
    return cases


@pytest.mark.parametrize("op,variant", _device_cases())
def test_device_array_channels_last_forward(op, variant, rng):
    kind, ndim = OPS[op]
    shape, size = REPRESENTATIVE[ndim]
    queue = backends.default_device().queue
    x = random_input(rng, shape)
    x_dev, _ = device_channels_last(queue, x, ndim)
    if kind == "avg":
        out = forward(op, x_dev, size, variant=variant)
        assert out.queue is queue
        np.testing.assert_allclose(device_memory_as_logical(queue, out, ndim), reference.forward(op, x, size),
                                   **FLOAT32_TOL)
    else:
        values, indices = forward(op, x_dev, size, variant=variant)
        ref_values, ref_indices = reference.forward(op, x, size)
        np.testing.assert_array_equal(device_memory_as_logical(queue, values, ndim), ref_values)
        assert indices.dtype == np.int64
        np.testing.assert_array_equal(device_memory_as_logical(queue, indices, ndim), ref_indices)


@pytest.mark.parametrize("op", ["adaptive_avg_pool2d", "adaptive_max_pool2d", "adaptive_max_pool3d"])
def test_device_array_channels_last_backward(op, rng):
    """Forward and backward on device arrays in channels-last memory, the indices passed on as
    the forward returned them."""
    kind, ndim = OPS[op]
    shape, size = REPRESENTATIVE[ndim]
    queue = backends.default_device().queue
    x = random_input(rng, shape)
    x_dev, _ = device_channels_last(queue, x, ndim)
    out_shape = shape[:-ndim] + resolve_output_size(size, shape[-ndim:])
    grad_out = random_input(rng, out_shape)
    grad_dev, _ = device_channels_last(queue, grad_out, ndim)
    if kind == "avg":
        grad_in = backward(op, grad_dev, shape)
        expected = reference.backward(op, grad_out, shape)
    else:
        _, indices = forward(op, x_dev, size)
        grad_in = backward(op, grad_dev, shape, indices)
        expected = reference.backward(op, grad_out, shape, reference.forward(op, x, size)[1])
    np.testing.assert_allclose(device_memory_as_logical(queue, grad_in, ndim), expected, **FLOAT32_TOL)


# ---------------------------------------------------------------- max pooling's special values


def _max_cases(dtypes=("float32",)):
    cases = []
    for op, (kind, ndim) in OPS.items():
        if kind != "max":
            continue
        shape, size = REPRESENTATIVE[ndim]
        for dtype in dtypes:
            for layout in LAYOUT_NAMES[ndim]:
                for variant in legal_variants(op, "forward", shape, size, dtype, layout):
                    cases.append(pytest.param(op, dtype, layout, variant, id=f"{op}-{dtype}-{layout}-{variant}"))
    return cases


def torch_max(op, x, size):
    values, indices = getattr(torch.nn.functional, op)(torch.from_numpy(as_float64(x)), size, return_indices=True)
    return values.numpy(), indices.numpy()


def run_max(op, x, size, layout, variant):
    ndim = OPS[op][1]
    values, indices = forward(op, in_layout(x, ndim, layout), size, variant=variant)
    assert memory_layout(values, ndim) == layout
    return as_float64(values), indices


@pytest.mark.parametrize("op,dtype,layout,variant", _max_cases(("float32", "float16")))
def test_max_ties_go_to_the_first_position(op, dtype, layout, variant, rng):
    ndim = OPS[op][1]
    shape, size = REPRESENTATIVE[ndim]
    dt = np.dtype(dtype)
    # Three distinct values: nearly every window holds its maximum several times.
    x = rng.integers(0, 3, size=shape).astype(dt)
    x[0, 0] = 1  # and one plane of all-equal windows
    values, indices = run_max(op, x, size, layout, variant)
    ref_values, ref_indices = reference.forward(op, x, size)
    np.testing.assert_array_equal(values, ref_values)
    np.testing.assert_array_equal(indices, ref_indices)
    starts = [pt.pooling_windows(i, o)[0] for i, o in zip(shape[-ndim:], ref_values.shape[-ndim:])]
    first = np.zeros(ref_values.shape[-ndim:], np.int64)
    for axis, s in enumerate(np.meshgrid(*starts, indexing="ij")):
        first = first * shape[-ndim + axis] + s
    np.testing.assert_array_equal(indices[0, 0], first)  # all-equal windows: their first element
    # PyTorch (CPU) also keeps the first maximum on ties.
    t_values, t_indices = torch_max(op, x, size)
    np.testing.assert_array_equal(values, t_values)
    np.testing.assert_array_equal(indices, t_indices)


@pytest.mark.parametrize("op,dtype,layout,variant", _max_cases())
def test_max_single_nan_wins_with_its_index(op, dtype, layout, variant, rng):
    ndim = OPS[op][1]
    shape, size = REPRESENTATIVE[ndim]
    x = random_input(rng, shape)
    planes = x.reshape(-1, int(np.prod(shape[-ndim:])))
    # One NaN per plane, at a random position: no window holds two.
    nan_at = rng.integers(0, planes.shape[1], size=planes.shape[0])
    planes[np.arange(planes.shape[0]), nan_at] = np.nan
    values, indices = run_max(op, x, size, layout, variant)
    ref_values, ref_indices = reference.forward(op, x, size)
    assert np.isnan(values).any() and not np.isnan(values).all()
    np.testing.assert_array_equal(values, ref_values)  # NaN compares equal to NaN here
    np.testing.assert_array_equal(indices, ref_indices)
    nan_windows = np.isnan(values)
    np.testing.assert_array_equal(indices[nan_windows], np.broadcast_to(
        nan_at.reshape(shape[:-ndim] + (1,) * ndim), values.shape)[nan_windows])
    t_values, t_indices = torch_max(op, x, size)
    np.testing.assert_array_equal(values, t_values)
    np.testing.assert_array_equal(indices, t_indices)


@pytest.mark.parametrize("op,dtype,layout,variant", _max_cases())
def test_max_several_nans_last_one_wins(op, dtype, layout, variant, rng):
    """docs/design.md, Semantics: the index of the last NaN in row-major window order, as PyTorch's."""
    ndim = OPS[op][1]
    shape, size = REPRESENTATIVE[ndim]
    x = random_input(rng, shape)
    x[rng.random(shape) < 0.3] = np.nan
    values, indices = run_max(op, x, size, layout, variant)
    ref_values, ref_indices = reference.forward(op, x, size)
    np.testing.assert_array_equal(values, ref_values)
    np.testing.assert_array_equal(indices, ref_indices)
    t_values, t_indices = torch_max(op, x, size)
    np.testing.assert_array_equal(values, t_values)
    np.testing.assert_array_equal(indices, t_indices)


@pytest.mark.parametrize("op,dtype,layout,variant", _max_cases())
def test_max_all_minus_inf_windows_give_the_first_position(op, dtype, layout, variant, rng):
    ndim = OPS[op][1]
    shape, size = REPRESENTATIVE[ndim]
    x = random_input(rng, shape)
    x[0] = -np.inf  # whole planes of -inf
    x[rng.random(shape) < 0.5] = -np.inf  # and -inf mixed with numbers (some windows all -inf)
    values, indices = run_max(op, x, size, layout, variant)
    ref_values, ref_indices = reference.forward(op, x, size)
    assert np.isneginf(values[0]).all()
    np.testing.assert_array_equal(values, ref_values)
    np.testing.assert_array_equal(indices, ref_indices)
    t_values, t_indices = torch_max(op, x, size)
    np.testing.assert_array_equal(values, t_values)
    np.testing.assert_array_equal(indices, t_indices)


# ---------------------------------------------------------------- the two-pass max of row_lanes > 1

#: Long window rows (and, with one output column, whole-plane runs) so the lanes really run.
LANE_SHAPES = {1: ((2, 3, 41), 3), 2: ((2, 3, 9, 37), (2, 1)), 3: ((1, 2, 3, 5, 29), (2, 2, 3))}
LANE_CONFIGS = {
    "thread_per_output": {"block_size_x": 32, "outputs_per_thread": 1, "row_lanes": 4},
    "block_per_row": {"block_size_x": 32, "threads_per_output": 2, "row_lanes": 8},
}
LANE_CASES = [pytest.param(op, layout, variant, id=f"{op}-{layout}-{variant}")
              for op, (kind, ndim) in OPS.items() if kind == "max"
              for layout in LAYOUT_NAMES[ndim] for variant in LANE_CONFIGS]


#: Windows inside a box of at most 256 elements (SMALL_BOX_LIMIT): thread_per_output's unrolled straight-line path,
#: with uniform windows and with windows of different sizes (whose box taps are clamped).
SMALL_WINDOW_SHAPES = {
    "small-uniform": {1: ((2, 3, 12), 4), 2: ((2, 3, 8, 9), (4, 3)), 3: ((1, 2, 4, 6, 9), (2, 3, 3))},
    "small-nonuniform": {1: ((2, 3, 13), 5), 2: ((2, 3, 7, 9), (5, 4)), 3: ((1, 2, 5, 6, 7), (3, 4, 4))},
}
SMALL_WINDOW_CONFIG = {"block_size_x": 32, "outputs_per_thread": 1, "row_lanes": 1}
for _kind in SMALL_WINDOW_SHAPES:
    LANE_CONFIGS[f"thread_per_output-{_kind}"] = SMALL_WINDOW_CONFIG
    LANE_CASES += [pytest.param(op, layout, f"thread_per_output-{_kind}", id=f"{op}-{layout}-{_kind}")
                   for op, (kind, ndim) in OPS.items() if kind == "max" for layout in LAYOUT_NAMES[ndim]]


def _small_window_case(variant, ndim):
    """(shape, size, variant) of a LANE_CASES variant, checking that a small-window shape takes the path."""
    small = variant.removeprefix("thread_per_output-")
    if small not in SMALL_WINDOW_SHAPES:
        return (*LANE_SHAPES[ndim], variant)
    shape, size = SMALL_WINDOW_SHAPES[small][ndim]
    pairs = list(zip(shape[-ndim:], np.broadcast_to(size, (ndim,))))
    assert math.prod(max_window(i, int(o)) for i, o in pairs) <= 256
    uniform = all(pt.fixed_pool_equivalent(i, int(o)) for i, o in pairs)
    assert uniform == (small == "small-uniform")
    return shape, size, "thread_per_output"


def special_max_input(rng, shape, fill):
    """float32 input for the position rule: "ties" (values 0-2), or 30 % "nans" or
    "minus_inf" among random numbers, with a whole plane of them."""
    if fill == "ties":
        return rng.integers(0, 3, size=shape).astype(np.float32)
    x = random_input(rng, shape)
    special = np.nan if fill == "nans" else -np.inf
    x[rng.random(shape) < 0.3] = special
    x[0, 0] = special
    return x


@pytest.mark.parametrize("op,layout,variant", LANE_CASES)
@pytest.mark.parametrize("fill", ["ties", "nans", "minus_inf"])
def test_max_with_row_lanes_keeps_the_first_position(op, layout, variant, fill, rng):
    """row_lanes > 1 finds the maximum first and its position in a second pass, and small windows
    reduce in unrolled straight-line code over a clamped box: ties and -inf windows must still give
    the first position in window order, several NaNs the last."""
    ndim = OPS[op][1]
    config = LANE_CONFIGS[variant]
    shape, size, variant = _small_window_case(variant, ndim)
    x = special_max_input(rng, shape, fill)
    values, indices = forward(op, in_layout(x, ndim, layout), size, variant=variant, config=config)
    ref_values, ref_indices = reference.forward(op, x, size)
    np.testing.assert_array_equal(as_float64(values), ref_values)
    np.testing.assert_array_equal(indices, ref_indices)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("op,layout,small", [
    pytest.param(op, layout, small, id=f"{op}-{layout}-{small}")
    for op, (kind, ndim) in OPS.items() if kind == "avg" for layout in LAYOUT_NAMES[ndim]
    for small in SMALL_WINDOW_SHAPES])
def test_avg_small_windows_count_each_element_once(op, layout, small, dtype, rng):
    """The unrolled small-window path loads clamped repeats past a short window's end and must mask
    them out of the sum: every mean matches the reference."""
    ndim = OPS[op][1]
    shape, size, variant = _small_window_case(f"thread_per_output-{small}", ndim)
    x = in_layout(random_input(rng, shape, np_dtype(dtype)), ndim, layout)
    out = forward(op, x, size, variant=variant, config=SMALL_WINDOW_CONFIG)
    np.testing.assert_allclose(as_float64(out), reference.forward(op, x, size), **TOLERANCES[dtype])


# ---------------------------------------------------------------- float16 near its maximum


@pytest.mark.parametrize("variant", [None] + pt.variants("adaptive_avg_pool2d"))
def test_float16_window_of_65000_averages_to_65000(variant):
    """A 4x4 window sums to 1,040,000 (the global-pooling variants: 8x8 to 4,160,000) -- far
    past float16's 65504: the float32 accumulator keeps the mean finite and exact."""
    layout = "NHWC" if variant in ("channels_vector", "global_channels") else "NCHW"
    size = (1, 1) if variant in GLOBAL_ONLY else (2, 2)
    x = in_layout(np.full((1, 2, 8, 8), 65000, np.float16), 2, layout)
    out = pt.adaptive_avg_pool2d(x, size, variant=variant)
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, np.full((1, 2, *size), 65000, np.float16))


@pytest.mark.parametrize("op,layout,variant", [
    pytest.param(op, layout, v, id=f"{op}-{layout}-{v}")
    for op, (kind, ndim) in OPS.items() if kind == "avg"
    for layout in LAYOUT_NAMES[ndim]
    for v in legal_variants(op, "forward", *REPRESENTATIVE[ndim], "float16", layout)
])
def test_float16_large_values_average_without_overflow(op, layout, variant, rng):
    ndim = OPS[op][1]
    shape, size = REPRESENTATIVE[ndim]
    x = in_layout(rng.uniform(60000, 65504, size=shape).astype(np.float16), ndim, layout)
    out = forward(op, x, size, variant=variant)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out.astype(np.float64), reference.forward(op, x, size), **TOLERANCES["float16"])


@pytest.mark.parametrize("op", ["adaptive_avg_pool1d", "adaptive_max_pool1d"])
def test_small_window_box_of_a_uniform_axis_past_the_exact_max_window_limit(op, rng):
    """Past EXACT_MAX_WINDOW_LIMIT outputs max_window is a bound (4 for 140001 -> 70000), but these
    windows are uniform (kernel 3, stride 2): the unrolled box must still be exactly 3 taps wide."""
    size = 70000
    assert size > EXACT_MAX_WINDOW_LIMIT and pt.fixed_pool_equivalent(2 * size + 1, size) == (3, 2, 0)
    x = random_input(rng, (1, 2, 2 * size + 1))
    out = forward(op, x, size, variant="thread_per_output", config=SMALL_WINDOW_CONFIG)
    if OPS[op][0] == "max":
        values, indices = out
        ref_values, ref_indices = reference.forward(op, x, size)
        np.testing.assert_array_equal(as_float64(values), ref_values)
        np.testing.assert_array_equal(indices, ref_indices)
    else:
        np.testing.assert_allclose(as_float64(out), reference.forward(op, x, size), **FLOAT32_TOL)


# ---------------------------------------------------------------- plane_reduce (global pooling only)

#: Global pooling whose planes (37, 63, 105 elements) leave a tail for every block size tried.
GLOBAL_SHAPES = {1: (2, 3, 37), 2: (2, 3, 7, 9), 3: (1, 2, 3, 5, 7)}
PLANE_REDUCE_CONFIGS = [{"block_size_x": 8}, {"block_size_x": 32}]


@pytest.mark.parametrize("config", PLANE_REDUCE_CONFIGS, ids=lambda c: f"block{c['block_size_x']}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
def test_plane_reduce_matches_the_reference(op, dtype, config, rng):
    """Every op and dtype: the interleaved partials and their merge give the reference's means, and
    exactly its maxima and first positions."""
    ndim = OPS[op][1]
    shape = GLOBAL_SHAPES[ndim]
    x = random_input(rng, shape, np_dtype(dtype))
    out = forward(op, x, (1,) * ndim, variant="plane_reduce", config=config)
    check_forward(op, out, x, (1,) * ndim, LAYOUT_NAMES[ndim][0])


@pytest.mark.parametrize("config", PLANE_REDUCE_CONFIGS, ids=lambda c: f"block{c['block_size_x']}")
@pytest.mark.parametrize("fill", ["ties", "nans", "minus_inf"])
@pytest.mark.parametrize("op", [op for op, (kind, _) in OPS.items() if kind == "max"])
def test_plane_reduce_max_keeps_the_first_position(op, fill, config, rng):
    """The partials' positions interleave (work-item j holds j, j + block, ...), so the merge needs
    the full first-position rule: ties, NaNs and all -inf planes."""
    ndim = OPS[op][1]
    shape = GLOBAL_SHAPES[ndim]
    x = special_max_input(rng, shape, fill)
    values, indices = forward(op, x, (1,) * ndim, variant="plane_reduce", config=config)
    ref_values, ref_indices = reference.forward(op, x, (1,) * ndim)
    np.testing.assert_array_equal(as_float64(values), ref_values)
    np.testing.assert_array_equal(indices, ref_indices)


# ---------------------------------------------------------------- the global-pooling variants

#: Configurations beyond the default, tried in float32: lane counts that leave tails, planes split
#: among work-items (parts of one lane step, more parts than the plane fills), several planes per
#: work-item with a partial last group, and a partial last work-group.
GLOBAL_CONFIGS = {
    "global_planes": [{"run_lanes": 4, "split": 4}, {"run_lanes": 32, "split": 16, "block_size_x": 16},
                      {"planes_per_item": 4, "block_size_x": 16}],
    "global_channels": [{"accumulators": 1}, {"accumulators": 8, "block_size_x": 16}],
    "global_broadcast": [{"split": 4}, {"split": 16, "block_size_x": 16}, {"block_size_x": 1024}],
}


def global_layouts(ndim, direction):
    """The layouts a global problem of ``direction`` can have through the API.  Outputs of size 1
    are in both layouts at once, which ``memory_layout`` counts as contiguous: a forward output, and
    a backward pass's grad_out -- from which the backward problem takes its layout."""
    return LAYOUT_NAMES[ndim] if direction == "forward" else LAYOUT_NAMES[ndim][:1]


def _global_cases(extra=True):
    cases = []
    for op, (kind, ndim) in OPS.items():
        for direction in ("forward", "backward"):
            for variant in variants_for(op, direction):
                if variant not in GLOBAL_CONFIGS:
                    continue
                for layout in global_layouts(ndim, direction):
                    if variant not in legal_variants(op, direction, GLOBAL_SHAPES[ndim], 1, layout=layout):
                        continue
                    configs = [("default", dtype, {}) for dtype in DTYPES]
                    if extra:
                        configs += [(str(i + 1), "float32", c) for i, c in enumerate(GLOBAL_CONFIGS[variant])]
                    for label, dtype, config in configs:
                        cases.append(pytest.param(op, direction, dtype, layout, variant, config,
                                                  id=f"{op}-{direction}-{dtype}-{layout}-{variant}-{label}"))
    # core: every variant and configuration in float32, one variant of every other dtype and layout
    return tiered(cases, core=lambda values: values[2] == "float32", group=lambda values: values[:4])


@pytest.mark.parametrize("op,direction,dtype,layout,variant,config", _global_cases())
def test_global_variants_match_the_reference(op, direction, dtype, layout, variant, config, rng):
    """Every op, dtype and layout, the default and the configurations above, on planes that no lane
    count divides and fewer planes than a work-group: the reference's means (and gradients) within
    the dtype's tolerance, exactly its maxima and first positions, and PyTorch's result."""
    kind, ndim = OPS[op]
    shape, size = GLOBAL_SHAPES[ndim], (1,) * ndim
    dt = np_dtype(dtype)
    x = in_layout(random_input(rng, shape, np.float64).astype(dt), ndim, layout)
    if direction == "forward":
        out = forward(op, x, size, variant=variant, config=config)
        check_forward(op, out, x, size, LAYOUT_NAMES[ndim][0])
        expected = getattr(torch.nn.functional, op)(torch.from_numpy(as_float64(x)), size)
        np.testing.assert_allclose(as_float64(out[0] if kind == "max" else out), expected.numpy(), **TOLERANCES[dtype])
        return
    grad_out = in_layout(random_input(rng, shape[:-ndim] + size, np.float64).astype(dt), ndim, layout)
    ref_indices = reference.forward(op, x, size)[1] if kind == "max" else None
    grad_in = backward(op, grad_out, shape, ref_indices, variant=variant, config=config)
    expected = reference.backward(op, grad_out, shape, ref_indices)
    check_result(grad_in, expected, dt, layout, ndim)
    x_torch = torch.from_numpy(as_float64(x)).requires_grad_()
    pooled = getattr(torch.nn.functional, op)(x_torch, size)
    pooled.backward(torch.from_numpy(as_float64(grad_out)))
    if kind == "avg":  # max: PyTorch's own indices may differ from the ones passed here on ties
        np.testing.assert_allclose(as_float64(grad_in), x_torch.grad.numpy(), **TOLERANCES[dtype])


@pytest.mark.parametrize("op,layout,variant,config", [
    pytest.param(op, layout, variant, config, id=f"{op}-{layout}-{variant}-{i}")
    for op, (kind, ndim) in OPS.items() if kind == "max"
    for variant in ("global_planes", "global_channels")
    for layout in LAYOUT_NAMES[ndim]
    if variant in legal_variants(op, "forward", GLOBAL_SHAPES[ndim], 1, layout=layout)
    for i, config in enumerate([{}] + GLOBAL_CONFIGS[variant])])
@pytest.mark.parametrize("fill", ["ties", "nans", "minus_inf"])
def test_global_variants_max_keep_the_first_position(op, layout, variant, config, fill, rng):
    """Value-only lanes, split parts and interleaved partials all keep the position rules: ties
    and all -inf planes the first position, NaNs the last NaN."""
    ndim = OPS[op][1]
    shape, size = GLOBAL_SHAPES[ndim], (1,) * ndim
    x = special_max_input(rng, shape, fill)
    values, indices = forward(op, in_layout(x, ndim, layout), size, variant=variant, config=config)
    ref_values, ref_indices = reference.forward(op, x, size)
    np.testing.assert_array_equal(as_float64(values), ref_values)
    np.testing.assert_array_equal(indices, ref_indices)


#: global_channels' runs of neighbouring channels (channels_per_item > 1 needs channels it divides):
#: 2x128 channels over non-square planes, runs of every width with the most accumulators their
#: partials' registers allow (GlobalChannels.REGISTER_WORDS), the widest with the fewest work-items
#: per work-group too.
CHANNEL_RUN_SHAPE = (2, 128, 5, 7)
CHANNEL_RUNS = [{"channels_per_item": 4, "accumulators": 8}, {"channels_per_item": 16, "accumulators": 2},
                {"channels_per_item": 32, "accumulators": 1}, {"channels_per_item": 64, "accumulators": 1},
                {"channels_per_item": 64, "accumulators": 1, "block_size_x": 64}]


@pytest.mark.parametrize("config", CHANNEL_RUNS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("op,dtype", [("adaptive_avg_pool2d", "float32"), ("adaptive_avg_pool2d", "float64"),
                                      ("adaptive_max_pool2d", "float32")])
def test_global_channels_runs_of_channels_match_the_reference(op, dtype, config, rng):
    """Each work-item's run of neighbouring channels, loaded together at every position: the
    reference's means, and exactly its maxima with their first positions (ties, NaNs and -inf in
    the input).  Runs whose partials would not fit the registers are refused, never run."""
    variant = variants_for(op)["global_channels"]
    problem = Problem.create(op, CHANNEL_RUN_SHAPE, (1, 1), dtype, "NHWC")
    limits = backends.default_device().info.limits
    if not variant.is_legal(config, problem, limits):
        assert variant.partial_words(config["channels_per_item"], config["accumulators"],
                                     problem) > variant.REGISTER_WORDS
        with pytest.raises(ValueError, match="registers"):
            forward(op, in_layout(random_input(rng, CHANNEL_RUN_SHAPE, np.float64).astype(dtype), 2, "NHWC"), 1,
                    variant="global_channels", config=config)
        return
    if OPS[op][0] == "max":
        for fill in ("ties", "nans", "minus_inf"):
            x = special_max_input(rng, CHANNEL_RUN_SHAPE, fill)
            values, indices = forward(op, in_layout(x, 2, "NHWC"), 1, variant="global_channels", config=config)
            ref_values, ref_indices = reference.forward(op, x, (1, 1))
            np.testing.assert_array_equal(as_float64(values), ref_values)
            np.testing.assert_array_equal(indices, ref_indices)
        return
    x = random_input(rng, CHANNEL_RUN_SHAPE, np.float64).astype(dtype)
    check_forward(op, forward(op, in_layout(x, 2, "NHWC"), 1, variant="global_channels", config=config), x, (1, 1),
                  "NCHW")


@pytest.mark.parametrize("shape", [(32, 2048, 7, 7), (8, 128, 56, 56), (16, 72, 56, 56), (2, 64, 7, 7),
                                   (1, 960, 7, 7), (3, 3, 9, 9)])
@pytest.mark.parametrize("op,dtype", [("adaptive_avg_pool2d", "float32"), ("adaptive_avg_pool2d", "float64"),
                                      ("adaptive_max_pool2d", "float32"), ("adaptive_gem_pool2d", "float16")])
def test_global_channels_default_runs_fit_the_launch_and_the_registers(op, dtype, shape):
    """The default (GlobalChannels.default_for) is legal wherever the variant is; its run is the
    widest of at most WIDEST_RUN channels (max: WIDEST_SELECTING_RUN) that divides the channels,
    fits the registers and leaves MIN_WORK_ITEMS work-items where one does."""
    variant = variants_for(op)["global_channels"]
    problem = Problem.create(op, shape, (1, 1), dtype, "NHWC")
    params = variant.default_for(problem)
    assert variant.is_legal(params, problem, backends.default_device().info.limits)
    run = params["channels_per_item"]
    runs = variant.search_space["channels_per_item"]
    widest = variant.WIDEST_SELECTING_RUN if problem.operation.selects else variant.WIDEST_RUN
    fitting = [n for n in runs if n <= widest and shape[1] % n == 0
               and problem.planes // n >= variant.MIN_WORK_ITEMS
               and variant.partial_words(n, 1, problem) <= variant.REGISTER_WORDS]
    assert run == (max(fitting) if fitting else max(n for n in runs if n <= 8 and shape[1] % n == 0))
    assert variant.partial_words(run, params["accumulators"], problem) <= variant.REGISTER_WORDS


@pytest.mark.parametrize("op,direction,layout,variant", [
    pytest.param(op, direction, layout, variant, id=f"{op}-{direction}-{layout}-{variant}")
    for op, (kind, ndim) in OPS.items() for direction in ("forward", "backward")
    for variant in GLOBAL_CONFIGS for layout in global_layouts(ndim, direction)
    if variant in legal_variants(op, direction, GLOBAL_SHAPES[ndim][1:], 1, layout=layout)])
def test_global_variants_batchless(op, direction, layout, variant, rng):
    """Batch-less (C, *spatial) inputs, channel axis 0, in either layout."""
    kind, ndim = OPS[op]
    shape, size = GLOBAL_SHAPES[ndim][1:], (1,) * ndim
    x = in_layout(random_input(rng, shape), ndim, layout)
    if direction == "forward":
        check_forward(op, forward(op, x, size, variant=variant), x, size, LAYOUT_NAMES[ndim][0])
        return
    grad_out = in_layout(random_input(rng, shape[:1] + size), ndim, layout)
    ref_indices = reference.forward(op, x, size)[1] if kind == "max" else None
    grad_in = backward(op, grad_out, shape, ref_indices, variant=variant)
    check_result(grad_in, reference.backward(op, grad_out, shape, ref_indices), np.dtype(np.float32), layout, ndim)


@pytest.mark.parametrize("op", list(OPS))
def test_global_variants_are_refused_elsewhere(op):
    """Legal only where every output size is 1 (and global_planes, global_channels in their layout)."""
    ndim = OPS[op][1]
    shape, size = REPRESENTATIVE[ndim]
    for direction in ("forward", "backward"):
        for layout in LAYOUT_NAMES[ndim]:
            assert not set(legal_variants(op, direction, shape, size, layout=layout)) & set(GLOBAL_ONLY)
    assert "global_channels" not in legal_variants(op, "forward", GLOBAL_SHAPES[ndim], 1, layout=LAYOUT_NAMES[ndim][0])
    assert "global_planes" not in legal_variants(op, "forward", GLOBAL_SHAPES[ndim], 1, layout=LAYOUT_NAMES[ndim][1])


# ---------------------------------------------------------------- thread_per_row at its row limit


@pytest.mark.parametrize("op,columns", [("adaptive_avg_pool2d", 4096), ("adaptive_max_pool2d", 1365)])
def test_thread_per_row_at_the_private_row_limit(op, columns, rng):
    """The widest rows thread_per_row accepts (16 KiB of partials: 4096 float32 values, or 1365
    value-position pairs for max) run and match the reference; one column more is refused."""
    shape, size = (1, 2, 5, columns), (2, 7)
    x = random_input(rng, shape)
    check_forward(op, forward(op, x, size, variant="thread_per_row"), x, size, "NCHW")
    with pytest.raises(ValueError, match="column partials per work-item; the limit is 16384"):
        forward(op, random_input(rng, (1, 2, 5, columns + 1)), size, variant="thread_per_row")


# ---------------------------------------------------------------- thread_per_row's unrolled columns


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op,shape,size", [
    ("adaptive_avg_pool1d", (2, 3, 1000), 128),          # the audio layer's windows (8 or 9 wide)
    ("adaptive_avg_pool2d", (2, 3, 5, 64), (2, 2)),      # 32 columns: the widest it unrolls
    ("adaptive_avg_pool2d", (1, 2, 5, 92), (2, 3)),      # 31 or 32 columns
    ("adaptive_avg_pool2d", (1, 2, 7, 5), (3, 7)),       # upsampling: windows of 1 or 2 columns
    ("adaptive_avg_pool3d", (1, 2, 4, 6, 50), (2, 3, 3)),  # overlapping windows of 17 or 18 columns
])
def test_thread_per_row_unrolled_columns(op, shape, size, dtype, rng):
    """unrolled_columns = 1 sums each window's column partials over the widest window with the
    taps past its end masked: every window width, in every dtype, against the reference."""
    config = {"block_size_x": 4, "unrolled_columns": 1}
    x = random_input(rng, shape, np.float64).astype(np_dtype(dtype))
    problem = Problem.create(op, shape, size, dtype=dtype)
    variant = variants_for(op)["thread_per_row"]
    assert "#define unrolled_columns 1" in variant.program(config, problem)
    out = forward(op, x, size, variant="thread_per_row", config=config)
    check_forward(op, out, x, size, LAYOUT_NAMES[OPS[op][1]][0])


def test_thread_per_row_record_without_unrolled_columns_gets_the_loop():
    """A configuration from before the parameter existed (a cached record) runs the loop form."""
    problem = Problem.create("adaptive_avg_pool1d", (2, 3, 1000), 128)
    variant = variants_for("adaptive_avg_pool1d")["thread_per_row"]
    config = variant.check_config({"block_size_x": 4}, problem, backends.default_device().info.limits)
    assert config == {"block_size_x": 4, "unrolled_columns": 0}


@pytest.mark.parametrize("op,shape,size,message", [
    ("adaptive_avg_pool2d", (1, 2, 5, 66), (2, 2), "unrolls at most 32 columns; windows here are up to 33 wide"),
    ("adaptive_max_pool2d", (1, 2, 5, 9), (2, 2), "unrolled_columns is for average pooling"),
])
def test_thread_per_row_unrolled_columns_refused(op, shape, size, message, rng):
    with pytest.raises(ValueError, match=message):
        forward(op, random_input(rng, shape), size, variant="thread_per_row",
                config={"block_size_x": 4, "unrolled_columns": 1})
