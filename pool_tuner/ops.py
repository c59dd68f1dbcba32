"""The public pooling functions: validate, dispatch, launch.

Each call validates all of its arguments (raising ``TypeError``/``ValueError`` that name the
argument) before anything is built or launched, asks ``dispatch`` for the variant and configuration
(handing it the tuner's tune-on-miss, ``POOL_TUNER_AUTOTUNE=1``), and launches the memoised kernel.
Devices are used only through the contract of ``backends.base``.  numpy in -> numpy out (through the default queue of the chosen
device); a device array in (``pyopencl.array.Array``, PyCUDA ``GPUArray`` or any
``__cuda_array_interface__`` object) -> a device array out on the input's own queue/device, no
host round trip.

Memory layout: contiguous (channels-first) and channels-last inputs are recognised from their
strides and processed in place; the result has the same memory format.  Other strided numpy
inputs are copied to contiguous first.
"""

from __future__ import annotations

import math
import os

import numpy as np

from . import backends, dispatch, shapes, tuner
from .problem import LAYOUT_NAMES, OPS, Problem, check_dtype
from .variants import variants_for
from .windows import pooling_windows

#: Set to "1" to fill every output with NaN (indices with INDEX_POISON) before its kernel runs, so
#: that an element a kernel forgets to write cannot pass a comparison by accident (the test suite
#: sets it).
POISON_ENV = "POOL_TUNER_POISON_OUTPUTS"
poison_outputs = os.environ.get(POISON_ENV) == "1"
INDEX_POISON = np.iinfo(np.int64).min
#: Quiet-NaN bit patterns of the 16-bit floats (PyOpenCL cannot fill float16 arrays, and
#: bfloat16 travels as its bits anyway), used to poison them through a uint16 view.
NAN_BITS = {"float16": 0x7E00, "bfloat16": 0x7FC0}


def _locate(x, device, name="x"):
    """Return ``(device, queue, is_device_array, x)`` for array argument ``x`` and ``device=``;
    a device array comes back as its backend's kernel argument (CUDA: a GPUArray view)."""
    owner = backends.device_of_array(x)
    if owner is not None:
        check_device_option(owner, device, name)
        return owner, owner.queue_of(x), True, owner.wrap_input(x, name)
    if not isinstance(x, np.ndarray):
        hint = ("; for PyTorch tensors use pool_tuner.torch (the same functions, with autograd)"
                if type(x).__module__.startswith("torch") else "")
        raise TypeError(f"{name} must be a numpy.ndarray or a device array (pyopencl Array, PyCUDA "
                        f"GPUArray, __cuda_array_interface__), got {type(x).__name__}{hint}")
    chosen = backends.resolve_device(device)
    return chosen, chosen.queue, False, x


def check_device_option(owner, device, name: str) -> None:
    """A ``device=`` argument, when given, must be the device that holds array ``name``."""
    if device is not None and backends.resolve_device(device) is not owner:
        raise ValueError(
            f"device={device!r} does not hold {name}: {name} is an array on "
            f"{owner.describe()}; pass device=None or that device"
        )


def _same_strides(shape, strides, expected) -> bool:
    """Strides equal where they matter (axes of size 1 may have any stride)."""
    return all(n == 1 or s == e for n, s, e in zip(shape, strides, expected))


def memory_layout(x, ndim: int, name: str = "x") -> str | None:
    """The layout name of ``x``'s memory (``NCHW``-like or ``NHWC``-like), or None for other
    strides.  Ambiguous cases (one channel, empty arrays) count as contiguous."""
    if x.flags.c_contiguous:  # the common case, answered by the array itself
        return LAYOUT_NAMES[ndim][0]
    return strides_layout(tuple(x.shape), x.strides, x.dtype.itemsize, ndim)


def strides_layout(shape: tuple, strides, itemsize: int, ndim: int) -> str | None:
    """The layout name of memory with ``shape`` and ``strides`` (in units of ``itemsize``: bytes
    for numpy, elements for torch with ``itemsize=1``), or None; see ``memory_layout``."""
    contiguous, channels_last = LAYOUT_NAMES[ndim]
    if math.prod(shape) == 0 or _same_strides(shape, strides, shapes.c_strides(shape, itemsize)):
        return contiguous
    c = len(shape) - ndim - 1
    if c < 0:
        return None
    memory = shape[:c] + shape[c + 1:] + (shape[c],)
    mem_strides = shapes.c_strides(memory, itemsize)
    expected = mem_strides[:c] + (mem_strides[-1],) + mem_strides[c:-1]
    return channels_last if _same_strides(shape, strides, expected) else None


def _check_float64(device, dtype, name):
    if dtype == "float64" and not device.supports_float64:
        raise TypeError(f"{name} has dtype float64, which {device.describe()} does not support; use float32")


class _Call:
    """One validated call: the problem, device, queue and how arrays cross the host boundary."""

    def __init__(self, problem: Problem, device, queue, is_device: bool):
        self.problem, self.device, self.queue, self.is_device = problem, device, queue, is_device
        # numpy arrays used in place by devices that share host memory: device array id -> ndarray
        self.zero_copy = not is_device and device.shares_host_memory
        self.host_of: dict = {}

    @property
    def channel_axis(self) -> int:
        return len(self.problem.input_shape) - self.problem.ndim - 1

    @staticmethod
    def storage_dtype(dtype):
        """bfloat16 buffers are handled as their uint16 bits on the device (memoised: this is on
        every call's path, and ``dtype.name`` builds a string)."""
        try:
            return _STORAGE_DTYPES[dtype]
        except KeyError:
            storage = np.dtype(np.uint16) if np.dtype(dtype).name == "bfloat16" else np.dtype(dtype)
            _STORAGE_DTYPES[dtype] = storage
            return storage

    def to_device(self, x, name: str):
        """``x`` as a device array in the problem's memory order (no copy for device arrays)."""
        if self.is_device:
            return x
        if self.problem.channels_last:
            x = np.moveaxis(x, self.channel_axis, -1)
        host = np.ascontiguousarray(x)
        host = host.view(self.storage_dtype(host.dtype))
        if self.zero_copy and host.size:
            return self._keep(self.device.wrap_host(self.queue, host, writable=False), host)
        return self.device.to_device(host, self.queue)

    def empty(self, logical_shape, dtype):
        shape, storage = self.problem.memory_shape(logical_shape), self.storage_dtype(dtype)
        if self.zero_copy and math.prod(shape):
            host = np.empty(shape, storage)
            out = self._keep(self.device.wrap_host(self.queue, host, writable=True), host)
        else:
            out = self.device.empty(shape, storage, self.queue)
        if poison_outputs and out.size:
            name = np.dtype(dtype).name
            if name in NAN_BITS:
                self.device.fill_bits(out, NAN_BITS[name], self.queue)
            else:
                self.device.fill(out, INDEX_POISON if name == "int64" else np.nan, self.queue)
        return out

    def _keep(self, array, host):
        self.host_of[id(array)] = (array, host)
        return array

    def result(self, out, logical_dtype):
        """The output as the caller expects it: numpy, or a device array with the input's layout."""
        dtype = np.dtype(logical_dtype)
        if not self.is_device:
            if id(out) in self.host_of:
                host = self.device.sync_host(self.queue, out, self.host_of[id(out)][1])
            else:
                host = self.device.to_host(out)
            host = host.view(dtype)
            return np.moveaxis(host, -1, self.channel_axis) if self.problem.channels_last else host
        if out.dtype != dtype:
            out = out.view(dtype)
        if not self.problem.channels_last:
            return out
        return self.device.strided_view(out, _last_axis_to(out.shape, self.channel_axis),
                                        _last_axis_to(out.strides, self.channel_axis))

    def launch(self, choice, arrays):
        """Launch ``choice`` on ``arrays`` (inputs, then outputs); the outputs wait for it."""
        launch = dispatch.prepare(self.device, self.queue.context, self.problem, choice)
        event = self.device.launch(self.queue, launch.kernel, launch.groups, launch.block, arrays)
        for array in arrays:
            self.device.track(array, event)


_STORAGE_DTYPES: dict = {}


def _last_axis_to(sequence, axis: int) -> tuple:
    """Move the last entry of a shape or strides tuple to position ``axis``."""
    items = list(sequence)
    items.insert(axis, items.pop())
    return tuple(items)


_PROBLEMS: dict = {}


def _exact(value):
    """A memo key that tells apart arguments that merely compare equal (``8.0 == 8``,
    ``True == 1``), so that a bad argument never reuses a good call's validation: a sequence's key
    holds its elements' types (a nested sequence is never a valid size, so never gets stored)."""
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(value), tuple(map(type, value)))
    return (type(value), value)


def _problem(op, direction, x, output_size, name, input_shape=None) -> Problem:
    """The validated problem of a call, memoised on the array's shape, strides and dtype so that
    repeated calls skip validation and layout detection (keys that are not hashable, e.g. list
    output sizes, are validated every time)."""
    key = (op, direction, x.shape, x.strides, x.dtype, _exact(output_size), _exact(input_shape))
    try:
        return _PROBLEMS[key]
    except KeyError:
        pass
    except TypeError:
        key = None
    dtype = check_dtype(getattr(x, "dtype", None), f"{name}.dtype")
    layout = memory_layout(x, OPS[op][1], name)
    if layout is None:
        raise ValueError(f"{name} must be contiguous or channels-last; got strides {x.strides} for shape {x.shape}")
    if direction == "forward":
        problem = Problem.create(op, x.shape, output_size, dtype, layout, shape_name=name)
    else:
        problem = _backward_problem(op, x, input_shape, dtype, layout)
    if key is not None:
        _PROBLEMS[key] = problem
    return problem


def _backward_problem(op, grad_out, input_shape, dtype, layout) -> Problem:
    _, ndim = OPS[op]
    batch, spatial = shapes.split_input_shape(input_shape, ndim, "input_shape")
    grad_shape = tuple(grad_out.shape)
    if len(grad_shape) != len(batch) + ndim or grad_shape[: len(batch)] != batch:
        raise ValueError(
            f"grad_out must have shape {batch} + ({ndim} output sizes) to match input_shape "
            f"{tuple(input_shape)}, got {grad_shape}"
        )
    return Problem.create(op, batch + spatial, grad_shape[len(batch):], dtype, layout, direction="backward",
                          shape_name="input_shape")


def _forward_call(op, x, output_size, device):
    _, ndim = OPS[op]
    dev, queue, is_device, x = _locate(x, device)
    if not is_device and memory_layout(x, ndim) is None:
        x = np.ascontiguousarray(x)
    problem = _problem(op, "forward", x, output_size, "x")
    _check_float64(dev, problem.dtype, "x")
    return _Call(problem, dev, queue, is_device), x


def pool_forward(op: str, x, output_size, return_indices=False, *, device=None, variant=None, config=None):
    """Shared body of every forward op."""
    call, x = _forward_call(op, x, output_size, device)
    problem = call.problem
    choice = dispatch.choose(problem, call.device, variant, config, on_miss=tuner.tune_on_miss)
    out = call.empty(problem.output_shape, x.dtype)
    buffers = [out]
    if problem.kind == "max":
        indices = call.empty(problem.output_shape, np.int64)
        buffers.append(indices)
    if not problem.is_empty:
        call.launch(choice, [call.to_device(x, "x")] + buffers)
    values = call.result(out, x.dtype)
    if problem.kind == "max" and return_indices:
        return values, call.result(indices, np.int64)
    return values


def pool_backward(op: str, grad_out, input_shape, indices=None, *, device=None, variant=None, config=None):
    """Shared body of every backward op."""
    kind, ndim = OPS[op]
    dev, queue, is_device, grad_out = _locate(grad_out, device, "grad_out")
    if not is_device and memory_layout(grad_out, ndim, "grad_out") is None:
        grad_out = np.ascontiguousarray(grad_out)
    if isinstance(input_shape, np.ndarray) or not hasattr(input_shape, "__len__"):
        raise TypeError(f"input_shape must be a tuple of ints, got {type(input_shape).__name__}")
    problem = _problem(op, "backward", grad_out, None, "grad_out", tuple(input_shape))
    _check_float64(dev, problem.dtype, "grad_out")
    call = _Call(problem, dev, queue, is_device)
    if kind == "max":
        indices = _check_indices(indices, grad_out, call)
    choice = dispatch.choose(problem, dev, variant, config, on_miss=tuner.tune_on_miss)
    grad_in = call.empty(problem.input_shape, grad_out.dtype)
    if math.prod(problem.input_shape):
        if problem.is_empty:  # no outputs: nothing flows back
            dev.fill(grad_in.view(np.uint8), np.uint8(0), queue)
        else:
            args = [call.to_device(grad_out, "grad_out")]
            if kind == "max":
                args.append(call.to_device(indices, "indices"))
            call.launch(choice, args + [grad_in])
    return call.result(grad_in, grad_out.dtype)


def _check_indices(indices, grad_out, call):
    """Max backward's ``indices``: int64, the shape, layout and kind of array of ``grad_out``,
    and (for numpy) every index inside its output's window -- as the forward pass produces them."""
    problem = call.problem
    if indices is None:
        raise TypeError("indices must be the int64 indices returned by adaptive_max_pool*d(..., return_indices=True)")
    owner = backends.device_of_array(indices)
    if call.is_device != (owner is not None) or not hasattr(indices, "dtype"):
        raise TypeError(f"indices must be the same kind of array as grad_out ({type(grad_out).__name__}), got {type(indices).__name__}")
    if call.is_device:
        if owner is not call.device:
            raise ValueError("indices must be on the same device as grad_out")
        indices = call.device.wrap_input(indices, "indices")
    if np.dtype(indices.dtype) != np.int64:
        raise TypeError(f"indices must have dtype int64, got {indices.dtype}")
    if tuple(indices.shape) != tuple(grad_out.shape):
        raise ValueError(f"indices must have the shape of grad_out {tuple(grad_out.shape)}, got {tuple(indices.shape)}")
    if call.is_device and memory_layout(indices, problem.ndim, "indices") != problem.layout:
        raise ValueError(f"indices must have the memory layout of grad_out ({problem.layout})")
    if not call.is_device and indices.size:
        _check_indices_in_windows(indices, problem)
    return indices


def _check_indices_in_windows(indices, problem):
    """numpy indices only (device arrays are not read back): each inside its output's window.
    The gather kernels never dereference an index, so a bad one cannot fault -- but it would
    silently drop a gradient, hence the check."""
    plane_shape = problem.input_shape[-problem.ndim:]
    if indices.min() < 0 or indices.max() >= math.prod(plane_shape):
        raise ValueError(f"indices must lie in [0, {math.prod(plane_shape)}) (positions within the pooled plane)")
    # Raveled first: numpy 2.4's unravel_index misplaces coordinates of some multi-d inputs.
    coords = [c.reshape(indices.shape) for c in np.unravel_index(indices.ravel(), plane_shape)]
    for axis, coord in enumerate(coords):
        i_size = problem.input_shape[-problem.ndim + axis]
        o_size = problem.output_shape[-problem.ndim + axis]
        starts, ends = pooling_windows(i_size, o_size)
        shape = [1] * indices.ndim
        shape[indices.ndim - problem.ndim + axis] = o_size
        if np.any(coord < starts.reshape(shape)) or np.any(coord >= ends.reshape(shape)):
            raise ValueError("indices must each lie inside their output's pooling window, as returned by the forward pass")


def _doc_forward(kind, ndim):
    shape = {1: "(N, C, L) or (C, L)", 2: "(N, C, H, W) or (C, H, W)", 3: "(N, C, T, H, W) or (C, T, H, W)"}[ndim]
    what = "average" if kind == "avg" else "max"
    extra = ("" if kind == "avg" else
             " With ``return_indices=True`` also returns int64 indices (positions within each pooled "
             "plane, as PyTorch); NaN wins, ties go to the first position.")
    return (f"Adaptive {what} pooling of a {shape} array to ``output_size`` (an int, or {ndim} entries "
            f"that may be ``None`` to keep that size).{extra}")


def _make_forward(op):
    kind, ndim = OPS[op]
    if kind == "avg":
        def forward(x, output_size, *, device=None, variant=None, config=None):
            return pool_forward(op, x, output_size, device=device, variant=variant, config=config)
    else:
        def forward(x, output_size, return_indices=False, *, device=None, variant=None, config=None):
            return pool_forward(op, x, output_size, return_indices, device=device, variant=variant, config=config)
    forward.__name__ = forward.__qualname__ = op
    forward.__doc__ = _doc_forward(kind, ndim)
    return forward


def _make_backward(op):
    kind, ndim = OPS[op]
    if kind == "avg":
        def backward(grad_out, input_shape, *, device=None, variant=None, config=None):
            return pool_backward(op, grad_out, input_shape, device=device, variant=variant, config=config)
    else:
        def backward(grad_out, indices, input_shape, *, device=None, variant=None, config=None):
            return pool_backward(op, grad_out, input_shape, indices, device=device, variant=variant, config=config)
    backward.__name__ = backward.__qualname__ = f"{op}_backward"
    backward.__doc__ = (f"Gradient of {op} with respect to its input, as a deterministic gather "
                        f"(no atomics: bit-identical across runs and variants).")
    return backward


adaptive_avg_pool1d = _make_forward("adaptive_avg_pool1d")
adaptive_avg_pool2d = _make_forward("adaptive_avg_pool2d")
adaptive_avg_pool3d = _make_forward("adaptive_avg_pool3d")
adaptive_max_pool1d = _make_forward("adaptive_max_pool1d")
adaptive_max_pool2d = _make_forward("adaptive_max_pool2d")
adaptive_max_pool3d = _make_forward("adaptive_max_pool3d")
adaptive_avg_pool1d_backward = _make_backward("adaptive_avg_pool1d")
adaptive_avg_pool2d_backward = _make_backward("adaptive_avg_pool2d")
adaptive_avg_pool3d_backward = _make_backward("adaptive_avg_pool3d")
adaptive_max_pool1d_backward = _make_backward("adaptive_max_pool1d")
adaptive_max_pool2d_backward = _make_backward("adaptive_max_pool2d")
adaptive_max_pool3d_backward = _make_backward("adaptive_max_pool3d")


def explain(op, input_shape, output_size, dtype="float32", layout=None, device=None, *, direction="forward",
            variant=None, config=None) -> dict:
    """What a call would run, without running it: variant, params, ``source`` of the decision
    (``forced``/``cache``/``nearest``/``default``), device, cache key, and ``partial``: for a
    decision from an interrupted tuning's record, what that tuning covered (else None).  ``layout=None`` means
    contiguous channels-first; ``direction="backward"`` explains the backward pass."""
    dev = backends.resolve_device(device)
    problem = Problem.create(op, input_shape, output_size, dtype, layout, direction=direction)
    info = dispatch.describe(problem, dev, dispatch.choose(problem, dev, variant, config, memoise=False))
    record = dispatch.tuning_cache().lookup(info["record_key"]) if info["record_key"] else None
    # An interrupted tuning's record: what it covered (see pool_tuner.tuner), else None.
    info["partial"] = None if record is None else record.get("partial")
    info["autotune_on_miss"] = tuner.autotune_enabled()
    return info


def release_memory() -> int:
    """Free the device memory that pool_tuner holds for reuse by later results (OpenCL results on
    a device's own queue come from a memory pool, see README "Memory"); returns the number of
    blocks freed.  Arrays still referenced are untouched."""
    return sum(device.release_memory() for device in backends.all_devices())


def devices() -> list:
    """Every device pool_tuner can run on, with ids that keep their meaning when other drivers are
    installed (``cuda:<ordinal>``, ``opencl:<platform>:<device>`` such as ``opencl:pocl:0``)."""
    return backends.all_devices()


def variants(op: str, direction: str = "forward") -> list:
    """Names of the kernel variants available for ``op`` (e.g. ``"adaptive_avg_pool2d"``)."""
    return list(variants_for(op, direction))
