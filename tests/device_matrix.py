"""The variant matrix on one device, through the public functions on that device's arrays: one
harness for every backend, so that the check proven here on PoCL is the one that runs on a GPU
(tests/test_cuda.py) -- only the device differs.

A case is an op, a direction, a variant (and configuration), a dtype, a memory layout and a
shape.  Its inputs are fresh random arrays copied to the device in the layout's memory order (a
channels-last array is the device's strided view of it); the op runs through its public function
(``Operation.function_name`` and its ``_backward``) with ``variant=`` and ``config=``, so the library
builds every launch -- its arguments, outputs and run-time scalars -- as a user's call does; every
result is read back through its own strides and compared with the float64 reference
(``pool_tuner.reference``): every output of every op (a pyramid's levels, avgmax's average and
maximum and its indices, max pooling's indices exactly), GeM with its run-time ``p`` and ``eps``.
Outputs are poisoned before each kernel runs (conftest.py), so an element never written fails.
"""

import numpy as np
import pytest

import pool_tuner as pt
from pool_tuner import compile_check, reference
from pool_tuner.problem import LAYOUT_NAMES, OPS, Problem
from pool_tuner.variants import REGISTRY

from conftest import random_input

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes ships with the test environment
    ml_dtypes = None

#: Per rank: divisible, non-divisible (overlapping windows), upsampling, global, O = I, long windows.
SHAPES = {
    1: [((2, 3, 16), (4,)), ((2, 5, 13), (5,)), ((1, 2, 5), (7,)), ((2, 4, 50), (1,)), ((2, 3, 9), (9,)),
        ((2, 3, 100), (3,))],
    2: [((2, 3, 8, 8), (4, 4)), ((2, 3, 10, 9), (4, 7)), ((1, 2, 5, 5), (7, 7)), ((2, 4, 7, 7), (1, 1)),
        ((2, 3, 6, 5), (6, 5)), ((2, 3, 64, 64), (6, 3))],
    3: [((1, 2, 4, 4, 4), (2, 2, 2)), ((2, 3, 5, 6, 7), (3, 4, 2)), ((1, 2, 3, 3, 3), (5, 4, 5)),
        ((2, 2, 6, 6, 6), (1, 1, 1)), ((1, 2, 3, 4, 5), (3, 4, 5)), ((1, 2, 16, 16, 16), (3, 2, 1))],
}
#: The shape of each rank used for the dtype x layout and configuration matrices.
REPRESENTATIVE = {ndim: shapes[1] for ndim, shapes in SHAPES.items()}
DTYPES = ("float32", "float64", "float16", "bfloat16")
TOLERANCES = {
    "float64": dict(rtol=1e-12, atol=1e-12),
    "float32": dict(rtol=1e-5, atol=1e-6),
    "float16": dict(rtol=2e-3, atol=2e-3),
    "bfloat16": dict(rtol=1.6e-2, atol=1.6e-2),
}
#: GeM's run-time arguments in every case: not the defaults, so a kernel that ignored them fails.
GEM_ARGUMENTS = {"p": 2.5, "eps": 1e-3}


# ---------------------------------------------------------------------- the problem of a case

def output_sizes(op: str, size: tuple):
    """What a case's call pools to: a pyramid two levels (``size`` and a global one), so that its
    results are several; every other op ``size``."""
    return [size, 1] if OPS[op].pyramid else size


def problem_of(op, direction, shape, size, dtype="float32", layout=None) -> Problem:
    return Problem.create(op, shape, output_sizes(op, size), dtype, layout, direction)


def has_legal_config(op, direction, name, shape, size, dtype="float32", layout=None) -> bool:
    """Whether a call naming the variant can run the problem at all on a GPU (its representative
    configurations under CUDA's limits, as the compile check compiles them); cases without are not
    generated."""
    return bool(REGISTRY[(op, direction)][name].representative_configurations(
        problem_of(op, direction, shape, size, dtype, layout), compile_check.CUDA_LIMITS))


def layout_for(name: str, ndim: int) -> str:
    """The layout a variant's shape-matrix case runs in: the variants that work on neighbouring
    channels need channels-last memory, every other runs channels-first."""
    channels_last = name in ("channels_vector", "channels_gather", "pyramid_channels", "global_channels")
    return LAYOUT_NAMES[ndim][int(channels_last)]


def variant_cases(with_shapes: bool) -> list:
    """``(op, direction, variant, layout, shape, size)`` of every variant of every op and direction:
    on every shape of its rank, or on the representative one."""
    cases = []
    for (op, direction), table in REGISTRY.items():
        ndim = OPS[op].ndim
        for name in table:
            layout = layout_for(name, ndim)
            for shape, size in (SHAPES[ndim] if with_shapes else [REPRESENTATIVE[ndim]]):
                if has_legal_config(op, direction, name, shape, size, layout=layout):
                    cases.append(pytest.param(op, direction, name, layout, shape, size,
                                              id=f"{op}-{direction}-{name}-{layout}-{shape}->{size}"))
    return cases


def dtype_layout_cases() -> list:
    """``(op, direction, dtype, layout, variant)`` of every dtype and layout of every variant, on the
    representative shape of its rank."""
    cases = []
    for (op, direction), table in REGISTRY.items():
        ndim = OPS[op].ndim
        shape, size = REPRESENTATIVE[ndim]
        for dtype in DTYPES:
            for layout in LAYOUT_NAMES[ndim]:
                for name in table:
                    if has_legal_config(op, direction, name, shape, size, dtype, layout):
                        cases.append(pytest.param(op, direction, dtype, layout, name,
                                                  id=f"{op}-{direction}-{dtype}-{layout}-{name}"))
    return cases


def configurations(device, variant_name, problem, which) -> list:
    """The configurations of ``which`` (``default``, ``smallest``, ``largest``) that a call naming
    the variant can run on ``device`` (``Variant.representative_configurations``), without repeats."""
    picks = REGISTRY[(problem.op, problem.direction)][variant_name].representative_configurations(
        problem, device.info.limits)
    return [config for label, config in picks.items() if set(label.split("+")) & set(which)]


# ---------------------------------------------------------------------- arrays on the device

def host_dtype(dtype: str) -> np.dtype:
    if dtype == "bfloat16":
        if ml_dtypes is None:
            pytest.skip("bfloat16 needs ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def as_float64(a) -> np.ndarray:
    a = np.asarray(a)
    return a.astype(np.float32).astype(np.float64) if a.dtype.name == "bfloat16" else a.astype(np.float64)


def to_device(device, host: np.ndarray, ndim: int, channels_last: bool):
    """``host`` (logical, channels-first axes) as a device array of ``device`` with the layout's
    memory: channels-last memory seen through the logical axes by the device's strided view."""
    if not channels_last:
        return device.to_device(host)
    channel = host.ndim - ndim - 1
    memory = np.ascontiguousarray(np.moveaxis(host, channel, -1))
    strides = np.moveaxis(memory, -1, channel).strides
    return device.arrays.strided_view(device.to_device(memory), host.shape, strides)


def to_host(device, array) -> np.ndarray:
    """A result read back through its own shape, strides and offset (a pyramid's levels are views
    of one buffer; channels-last results are strided): the bytes it spans, copied from the device
    as they are, seen with its strides."""
    shape, dtype = tuple(array.shape), np.dtype(array.dtype)
    if hasattr(array, "__cuda_array_interface__"):
        interface = array.__cuda_array_interface__
        strides = interface.get("strides") or _c_strides(shape, dtype.itemsize)
        source = array
    else:  # a pyopencl array: its buffer from its offset
        strides, source = array.strides, array
    if not all(shape):
        return np.empty(shape, dtype)
    span = sum((n - 1) * s for n, s in zip(shape, strides)) + dtype.itemsize
    raw = np.empty(span, np.uint8)
    _copy_span(device, raw, source)
    return np.lib.stride_tricks.as_strided(raw.view(dtype), shape, strides).copy()


def _c_strides(shape, itemsize) -> tuple:
    return tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) * itemsize for i in range(len(shape)))


def _copy_span(device, raw: np.ndarray, array) -> None:
    """Copy ``raw.nbytes`` bytes from where ``array``'s first element is (copies move bytes)."""
    if hasattr(array, "__cuda_array_interface__"):
        device.copy(raw, array)
        return
    import pyopencl as cl

    array.finish()
    cl.enqueue_copy(array.queue, raw, array.base_data, src_offset=array.offset, is_blocking=True)


def check_round_trip(device, rng):
    """What the harness writes to ``device`` it reads back: both layouts, and a channels-last view
    of a part of a flat buffer at an offset (a pyramid's level)."""
    x = random_input(rng, (2, 3, 5, 4))
    for channels_last in (False, True):
        np.testing.assert_array_equal(to_host(device, to_device(device, x, 2, channels_last)), x)
    memory = np.ascontiguousarray(np.moveaxis(x, 1, -1))
    flat = device.to_device(np.concatenate([np.full(7, np.nan, np.float32), memory.ravel()]))
    level = device.arrays.strided_view(flat[7:7 + x.size], x.shape, np.moveaxis(memory, -1, 1).strides)
    np.testing.assert_array_equal(to_host(device, level), x)


# ---------------------------------------------------------------------- running a case

def call_forward(op, x, size, variant, config):
    """``(values per result, indices per max result)`` of the op's public forward function."""
    operation = OPS[op]
    function = getattr(pt, operation.function_name)
    options = dict(variant=variant, config=config)
    if operation.pyramid:
        if operation.selects:
            return function(x, output_sizes(op, size), True, ndim=operation.ndim, **options)
        return function(x, output_sizes(op, size), ndim=operation.ndim, **options), []
    if operation.multi_level:  # avgmax: both levels side by side ("cat") and the max level's indices
        joined, indices = function(x, size, "cat", True, **options)
        return [joined], [indices]
    if operation.arguments:
        return [function(x, size, **GEM_ARGUMENTS, **options)], []
    if operation.selects:
        values, indices = function(x, size, True, **options)
        return [values], [indices]
    return [function(x, size, **options)], []


def expected_forward(op, x64, size):
    """The reference's ``(values per result, indices per max result)``, as ``call_forward`` gives them."""
    operation = OPS[op]
    if operation.arguments:
        return [reference.forward(op, x64, size, **GEM_ARGUMENTS)], []
    expected = reference.forward(op, x64, output_sizes(op, size))
    if not operation.multi_level:
        return ([expected[0]], [expected[1]]) if operation.selects else ([expected], [])
    values, indices = expected
    if not operation.pyramid:
        channel = x64.ndim - operation.ndim - 1
        return [np.concatenate(values, axis=channel)], indices
    return values, indices


def call_backward(op, grads, indices, shape, variant, config):
    """The op's public backward function on one gradient per result (and the indices the
    forward gave)."""
    operation = OPS[op]
    function = getattr(pt, f"{operation.function_name}_backward")
    options = dict(variant=variant, config=config)
    if operation.pyramid:
        if operation.selects:
            return function(grads, indices, shape, ndim=operation.ndim, **options)
        return function(grads, shape, ndim=operation.ndim, **options)
    if operation.multi_level:
        return function(grads[0], indices[0], shape, "cat", **options)
    if operation.selects:
        return function(grads[0], indices[0], shape, **options)
    return function(grads[0], shape, **options)


def _expected_backward(op, grads64, indices, shape):
    operation = OPS[op]
    if operation.pyramid:
        return reference.backward(op, grads64, shape, indices)
    if operation.multi_level:  # avgmax "cat": the average level's gradient, then the maximum's
        channel = grads64[0].ndim - operation.ndim - 1
        return reference.backward(op, np.split(grads64[0], 2, axis=channel), shape, indices)
    return reference.backward(op, grads64[0], shape, indices[0] if indices else None)


def _check_values(got, expected, dtype, exact, label):
    got = as_float64(got)
    assert got.shape == expected.shape, f"{label}: shape {got.shape}, expected {expected.shape}"
    assert not np.isnan(got).any(), f"{label}: outputs never written (poison left)"
    if exact:
        np.testing.assert_array_equal(got, expected, err_msg=label)
    else:
        np.testing.assert_allclose(got, expected, **TOLERANCES[dtype], err_msg=label)


def case_input(rng, op, shape, size, dtype):
    """``(x, expected values, expected indices)`` of a case: a fresh random input of ``dtype`` and
    the reference's results on it (``expected_forward``)."""
    x = random_input(rng, shape, np.float64).astype(host_dtype(dtype))
    values, indices = expected_forward(op, as_float64(x), size)
    return x, values, indices


def check_case(device, op, direction, dtype, layout, variant, shape, size, rng, which=("default",)):
    """Run one case on ``device`` in each configuration of ``which`` and compare every result with
    the float64 reference: means within the dtype's tolerance, maxima and indices exactly, the
    gradients within the tolerance."""
    operation = OPS[op]
    ndim = operation.ndim
    problem = problem_of(op, direction, shape, size, dtype, layout)
    configs = configurations(device, variant, problem, which)
    if not configs:
        pytest.skip(f"{variant} has no legal configuration for {problem} on {device.info.describe()}")
    channels_last = problem.channels_last
    x, values, indices = case_input(rng, op, shape, size, dtype)
    dt = x.dtype
    for config in configs:
        label = f"{variant} {config} on {device.info.describe()}"
        if direction == "forward":
            got_values, got_indices = call_forward(op, to_device(device, x, ndim, channels_last), size, variant,
                                                    config)
            assert len(got_values) == len(values), label
            maxima = operation.selects and not operation.also_mean  # avgmax's joined result holds means too
            for level, (got, want) in enumerate(zip(got_values, values)):
                _check_values(to_host(device, got), want, dtype, maxima, f"{label}: result {level}")
            assert len(got_indices) == len(indices), label
            for level, (got, want) in enumerate(zip(got_indices, indices)):
                got = to_host(device, got)
                assert got.dtype == np.int64, label
                np.testing.assert_array_equal(got, want, err_msg=f"{label}: indices {level}")
            continue
        grads = [random_input(rng, v.shape, np.float64).astype(dt) for v in values]
        device_grads = [to_device(device, g, ndim, channels_last) for g in grads]
        device_indices = [to_device(device, i, ndim, channels_last) for i in indices]
        grad_in = call_backward(op, device_grads, device_indices, shape, variant, config)
        expected = _expected_backward(op, [as_float64(g) for g in grads], indices, shape)
        _check_values(to_host(device, grad_in), expected, dtype, False, f"{label}: input gradient")


def gem_backward_cases() -> list:
    """``(ndim, dtype, layout)`` of GeM's backward, which runs kernels of its own (no variants):
    every rank, dtype and layout on the representative shape."""
    return [pytest.param(ndim, dtype, layout, id=f"gem{ndim}d-{dtype}-{layout}")
            for ndim in (1, 2, 3) for dtype in DTYPES for layout in LAYOUT_NAMES[ndim]]


def check_gem_backward(device, ndim, dtype, layout, rng):
    """GeM's gradients for ``x`` and ``p`` on ``device``'s arrays against the reference's (the
    tolerances of tests/test_gem.py: ``grad_x`` relative to its largest, ``grad_p`` summed over
    every output)."""
    shape, size = REPRESENTATIVE[ndim]
    op = f"adaptive_gem_pool{ndim}d"
    channels_last = layout == LAYOUT_NAMES[ndim][1]
    x = np.abs(random_input(rng, shape, np.float64)).astype(host_dtype(dtype))
    grad = random_input(rng, shape[:-ndim] + size, np.float64).astype(host_dtype(dtype))
    grad_x, grad_p = getattr(pt, f"{op}_backward")(to_device(device, grad, ndim, channels_last),
                                                    to_device(device, x, ndim, channels_last), size, **GEM_ARGUMENTS)
    want_x, want_p = reference.adaptive_gem_pool_backward(as_float64(grad), as_float64(x), size, ndim, **GEM_ARGUMENTS)
    tolerance = 10 * TOLERANCES[dtype]["rtol"]
    got_x = as_float64(to_host(device, grad_x))
    assert not np.isnan(got_x).any(), f"{op} on {device.info.describe()}: gradients never written (poison left)"
    np.testing.assert_allclose(got_x, want_x, rtol=tolerance, atol=tolerance * np.abs(want_x).max())
    assert float(grad_p) == pytest.approx(want_p, rel=10 * tolerance, abs=10 * tolerance)
