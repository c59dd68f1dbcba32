"""Generalized-mean (GeM) pooling: ``y = (mean over the window of max(x, eps)**p) ** (1/p)``.

GeM (Radenovic et al., TPAMI 2018) is the pooling head of image retrieval, re-identification and
place recognition models; ``p = 1`` is average pooling and ``p -> inf`` max pooling.  It is one op
object (``operations.OPERATIONS["adaptive_gem_pool2d"]``, kind ``gem``) with its operator in
``kernels/operators/gem.h``; ``p`` and ``eps`` reach the kernels as run-time arguments, so a
learnt exponent that changes every step needs no new build.

Forward: one read of the input, no temporary (GeM's forward variants, dispatched and tuned like
every op's).  Backward, for ``x`` and ``p``, deterministic (no atomics), with no input-sized
temporary:

1. each output's coefficient ``dL/dy_o * y_o**(1-p) / (p * area_o)`` (``coefficients``:
   host arithmetic in the accumulation dtype);
2. ``kernels/operators/gem_input_gradient.c``, one pass over the input: each input gathers the
   coefficients of the outputs whose windows hold it (its inverse windows), and from that share,
   its value, ``p`` and ``eps`` writes its gradient; per work-group it adds up the input terms of the
   gradient of ``p``, which the host adds in a fixed order.  On CPU devices, small channels-first
   planes run ``kernels/operators/gem_plane_gradient.c`` instead (``input_gradient_form``): the same
   pass with a work-item per plane, the same gradient bits, one term of ``p`` per plane.

Over host memory (numpy arrays, CPU tensors) both steps run slab by slab (``slabs``): the
coefficients and ``dL/dp``'s output terms of a slab of planes, then the kernel over that slab's
inputs, each slab's workspace in the gradient's memory that later slabs write, the last slabs'
allocated within a small share of the input (``SLAB_SHARE_OF_INPUT``): no output-sized
temporary (a float32 coefficient per output is 37% of a float16 input of 7x7 planes pooled to
3x3).  ``dL/dp`` is added in one order whatever the slabs (``_add_in_order``): the same bits for
any slab size.

The functions below take numpy arrays and the device arrays of ``pool_tuner.adaptive_*`` (the
backward's output-sized step on the host, its input pass on the arrays' device and stream);
``pool_tuner.torch`` has the autograd op and modules.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import numbers
import threading

import numpy as np

from . import backends, dispatch, host_fallback, kernel_source, ops, plans
from .backends import cuda_arrays
from .gem_forms import (ELEMENT_FORM, GROUP_INPUTS, INPUT_GRADIENT_CONFIG, INPUT_GRADIENT_KERNEL, PLANE_FORM,
                        GradientForm, input_gradient_form)
from .operations import BACKWARD, find
from .problem import ITEMSIZE, Problem
from .windows import pooling_windows

_KERNELS: dict = {}
_KERNELS_LOCK = threading.Lock()


def check_arguments(p, eps, p_name: str = "p") -> dict:
    """``{"p": p, "eps": eps}`` as floats, after checking both: real, finite and positive."""
    values = {}
    for name, value in ((p_name, p), ("eps", eps)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
        # finite as a comparison (not math.isfinite), which torch.compile traces on a symbolic float
        if not -math.inf < value < math.inf or value <= 0:
            raise ValueError(f"{name} must be finite and > 0, got {value!r}")
        values[name] = float(value)
    return {"p": values[p_name], "eps": values["eps"]}


def forward(ndim: int, x, output_size, p=3.0, eps=1e-6, *, device=None, variant=None, config=None):
    """GeM pooling of ``x`` (numpy or device array) over its last ``ndim`` axes."""
    arguments = check_arguments(p, eps)
    return ops.pool_forward(find("gem", ndim).name, x, output_size, device=device, variant=variant, config=config,
                            arguments=arguments)


def backward(ndim: int, grad_out, x, output_size, p=3.0, eps=1e-6, *, output=None, device=None) -> tuple:
    """``(grad_x, grad_p)``: the gradients of ``sum(grad_out * adaptive_gem_pool(x, ...))`` for
    ``x`` (an array like ``x``, in its layout) and ``p`` (a float): numpy arrays in and out, or
    device arrays of one device (``_backward_on_device``).  ``output``: the forward's result, when
    the caller has it (else it is computed)."""
    arguments = check_arguments(p, eps)
    owner = plans.device_of(x)
    if owner is not None:
        if plans.device_of(grad_out) is not owner:
            raise TypeError(f"grad_out must be a device array on x's device ({owner.info.describe()}), got "
                            f"{type(grad_out).__name__}")
        plans.check_same_context(owner, grad_out, "grad_out", x, "x")
        if output is not None:
            plans.check_same_context(owner, output, "output", x, "x")
        plans.check_device_option(owner, device, "x")
        if output is None:
            output = forward(ndim, x, output_size, p, eps)
        return _backward_on_device(owner, ndim, grad_out, x, output, arguments)
    for name, array in (("grad_out", grad_out), ("x", x)):
        if not isinstance(array, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray or a device array, got {type(array).__name__}")
    if output is None:
        output = forward(ndim, x, output_size, p, eps, device=device)
    if grad_out.shape != output.shape:
        raise ValueError(f"grad_out must have the shape of the output {output.shape}, got {grad_out.shape}")
    _check_dtype_of_x(x.dtype, (("grad_out", grad_out.dtype), ("output", output.dtype)))
    dev = backends.resolve_device(device)
    if not dev.info.shares_host_memory:  # through copies on the device, as pool_tuner.ops does
        queue = dev.queue
        grad_x, grad_p = _backward_on_device(dev, ndim, *(dev.to_device(a, queue) for a in (grad_out, x, output)),
                                             arguments)
        return dev.to_host(grad_x), grad_p
    channels_last = ops.memory_layout(x, ndim) not in (None, plans.LAYOUT_NAMES[ndim][0])
    problem = Problem.create(find("gem", ndim).name, x.shape, tuple(output.shape[x.ndim - ndim:]),
                             _dtype_name(x.dtype), plans.LAYOUT_NAMES[ndim][int(channels_last)], direction="backward")
    x_memory = np.ascontiguousarray(in_memory_order(x, problem))
    grad_memory = np.empty(x_memory.shape, x.dtype)
    grad_p = backward_on_host(dev, problem, arguments, grad_out, output, x_memory.ctypes.data,
                              grad_memory.ctypes.data)
    grad_x = np.moveaxis(grad_memory, -1, x.ndim - ndim - 1) if channels_last else grad_memory
    return grad_x, grad_p


def _check_dtype_of_x(x_dtype, named_dtypes) -> None:
    """GeM's backward reads ``grad_out`` and ``output`` as arrays of ``x``'s dtype (as PyTorch's
    autograd gives them): another dtype is a mistake of the caller's, refused by name rather than
    converted."""
    for name, dtype in named_dtypes:
        if np.dtype(dtype) != np.dtype(x_dtype):
            raise ValueError(f"{name} must have x's dtype ({np.dtype(x_dtype)}), got {np.dtype(dtype)}")


#: The share of the input's bytes that the host backward may allocate for a slab's workspace (the
#: slabs whose workspace cannot lie in the gradient's unwritten memory): half of the 1% that GeM's
#: backward may allocate beyond its input and result, the rest left to Python's and numpy's own.
SLAB_SHARE_OF_INPUT = 0.005
#: Inputs up to which the host backward runs as one slab, whatever its workspace.
MIN_SLAB_INPUTS = 1 << 16
#: Output terms of ``dL/dp`` are summed in blocks of this many, each block's sum then added in order.
SUM_BLOCK = 256
#: The alignment of each array of a slab's workspace, in bytes.
WORKSPACE_ALIGNMENT = 64


@dataclasses.dataclass(frozen=True)
class Slab:
    """Units ``[start, stop)`` of a backward problem (``_units``: planes channels-first, samples
    channels-last, each a contiguous run of input and output memory), the offset of its first
    input in the input's memory, the backward problem of those units alone, whose grid the
    input-gradient kernel runs on the slab, and whether the slab's workspace lies in the
    gradient's memory past the slab (``in_place``: not written yet) or is allocated."""
    start: int
    stop: int
    first_input: int
    problem: Problem
    in_place: bool


def slabs(problem: Problem) -> tuple:
    """The slabs the host backward of ``problem`` runs in (``Slab``s, in memory order).

    A slab needs a workspace of about three arrays of its outputs in the accumulation dtype
    (``_workspace_layout``), 1.1 times a float16 input of 7x7 planes pooled to 3x3.  The
    gradient's memory past a slab is not written until later slabs run, so while it holds the
    workspace, a slab takes as many units as fit there (``in_place``: a large share of the
    remaining units each time, so few launches); the rest run in allocated workspaces within
    ``SLAB_SHARE_OF_INPUT`` of the input.  Every slab but the last covers a multiple of the units
    that end on a boundary of both a work-group of the kernel and a ``SUM_BLOCK`` of output
    terms, so each slab's sums are those of one pass over the whole, in order.  One allocated
    slab where the input is small (``MIN_SLAB_INPUTS``) or its whole workspace within the share."""
    return _slabs(problem, SLAB_SHARE_OF_INPUT, MIN_SLAB_INPUTS)


@functools.lru_cache(maxsize=64)
def _slabs(problem: Problem, share: float, min_inputs: int) -> tuple:
    units, unit_inputs, unit_outputs = _units(problem)
    unit_bytes = unit_inputs * ITEMSIZE[problem.dtype]
    budget = share * units * unit_bytes
    if units * unit_inputs <= min_inputs or _workspace_bytes(problem, units) <= budget:
        return (Slab(0, units, 0, problem, False),)
    step = math.lcm(GROUP_INPUTS // math.gcd(GROUP_INPUTS, unit_inputs), SUM_BLOCK // math.gcd(SUM_BLOCK, unit_outputs))
    found, start = [], 0
    while True:
        remaining = units - start
        per_unit = _workspace_bytes(problem, remaining) / remaining
        count = int(remaining * unit_bytes / (per_unit + unit_bytes)) // step * step
        while count >= step and _workspace_bytes(problem, count) > (remaining - count) * unit_bytes:
            count -= step
        if count < step:
            break
        found.append(Slab(start, start + count, start * unit_inputs, _slab_problem(problem, count, step), True))
        start += count
    size = max(step, int(budget * step / _workspace_bytes(problem, step)) // step * step)
    while size > step and _workspace_bytes(problem, size) > budget:
        size -= step
    found += [Slab(first, min(first + size, units), first * unit_inputs,
                   _slab_problem(problem, min(size, units - first), step), False)
              for first in range(start, units, size)]
    return tuple(found)


def _workspace_layout(problem: Problem, count: int) -> tuple:
    """``(dtype, shape)`` of each array of the workspace of a slab of ``count`` units of
    ``problem``: its outputs' ``y`` and ``dL/dy`` (then the windows' areas) widened to the
    accumulation dtype, their coefficients (first dL/dp's output terms), all in memory order; the
    kernel's terms (its work-groups' or, the plane form, its planes': room for either); the output terms' block sums; a float64 array for
    ``_add_in_order``."""
    acc = accumulation_dtype(problem)
    _, unit_inputs, unit_outputs = _units(problem)
    out_shape = problem.memory_shape(problem.output_shape)
    unit_shape = tuple(out_shape[len(out_shape) - problem.ndim - int(problem.channels_last):])
    groups = max(-(-count * unit_inputs // GROUP_INPUTS), count)  # work-groups' terms, or planes'
    blocks = -(-count * unit_outputs // SUM_BLOCK)
    outputs = (acc, (count,) + unit_shape)
    return (outputs, outputs, outputs, (acc, (groups,)), (acc, (blocks,)), (np.float64, (max(groups, blocks) + 1,)))


def _workspace_bytes(problem: Problem, count: int) -> int:
    """The bytes a slab of ``count`` units needs for its workspace, aligned from any address."""
    aligned = 0
    for dtype, shape in _workspace_layout(problem, count):
        aligned += -(-math.prod(shape) * np.dtype(dtype).itemsize // WORKSPACE_ALIGNMENT) * WORKSPACE_ALIGNMENT
    return aligned + WORKSPACE_ALIGNMENT


def _carve(memory: np.ndarray, layout: tuple) -> list:
    """The arrays of ``layout`` (``_workspace_layout``) over ``memory`` (a flat uint8 array that
    holds ``_workspace_bytes``), each at the next ``WORKSPACE_ALIGNMENT``-aligned address: views,
    no allocation beyond their headers."""
    arrays = []
    base = position = memory.__array_interface__["data"][0]
    for dtype, shape in layout:
        position = -(-position // WORKSPACE_ALIGNMENT) * WORKSPACE_ALIGNMENT
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        arrays.append(memory[position - base:position - base + nbytes].view(dtype).reshape(shape))
        position += nbytes
    return arrays


def _units(problem: Problem) -> tuple:
    """``(units, inputs per unit, outputs per unit)``: the runs of memory the host backward
    slabs ``problem`` by, whole planes channels-first, whole samples (all their channels)
    channels-last."""
    in_plane = math.prod(problem.input_shape[-problem.ndim:])
    out_plane = math.prod(problem.output_shape[-problem.ndim:])
    per_unit = problem.channels if problem.channels_last else 1
    return problem.planes // per_unit, in_plane * per_unit, out_plane * per_unit


def _slab_problem(problem: Problem, units: int, step: int) -> Problem:
    """The backward problem of ``units`` units of ``problem``: channels-last, that many samples;
    channels-first, that many planes, as samples of ``step`` channels where they divide (whole
    work-groups per sample, so the kernel is built without a bounds check, and every such slab
    shares one build), else one sample of them all."""
    if problem.channels_last:
        batch = (units, problem.channels)
    else:
        batch = (units // step, step) if units % step == 0 else (1, units)
    return Problem.create(problem.op, batch + tuple(problem.input_shape[-problem.ndim:]),
                          tuple(problem.output_shape[-problem.ndim:]), problem.dtype, problem.layout,
                          direction="backward")


def _unit_view(array: np.ndarray, problem: Problem) -> np.ndarray:
    """An output-shaped array (logical axes) in ``problem``'s memory order as ``(units, ...)``:
    a view, or, for strides that cannot be seen so, a contiguous copy."""
    memory = in_memory_order(array, problem)
    units, _, _ = _units(problem)
    shape = (units,) + memory.shape[memory.ndim - problem.ndim - int(problem.channels_last):]
    try:
        return memory.reshape(shape, copy=False)
    except ValueError:
        return np.ascontiguousarray(memory).reshape(shape)


def backward_on_host(device, problem: Problem, arguments: dict, grad_out, output, x_address: int,
                     grad_address: int) -> float:
    """GeM's backward over host memory, slab by slab (``slabs``): writes the input's gradient at
    ``grad_address`` from the input at ``x_address`` (each in ``problem``'s memory order, the
    gradient's memory ours to use until it is written) and returns ``dL/dp``.  ``grad_out`` and
    ``output``: numpy arrays with logical axes, in any float dtype and strides.

    Each slab's ``y`` and ``dL/dy`` are copied, widened to the accumulation dtype, into its
    workspace (in the gradient's memory past the slab, or allocated), where its output terms, then
    its coefficients are made: every ufunc then runs on same-shaped contiguous operands of one
    dtype, which numpy does without its iteration buffers (a cast, a broadcast or a strided
    operand would allocate 8192 elements' worth per call, 1% of a float16 32x2048x7x7 input).  The
    input terms and the output terms of ``dL/dp`` are each added in one order (``_add_in_order``),
    the same whatever the slabs.  An in-place slab's coefficients and terms lie inside the
    gradient's buffer, outside the part the kernel writes: a device whose host buffers are the
    memory itself (PoCL's) sees one memory; one that copies maps the gradient back before the
    terms (``HostLaunch``'s order), so the terms it reads are the kernel's."""
    in_bytes = math.prod(problem.input_shape) * ITEMSIZE[problem.dtype]
    if problem.is_empty:  # no output, so no output depends on any input: zeros, and nothing to launch
        ctypes.memset(grad_address, 0, in_bytes)
        return 0.0
    p = arguments["p"]
    acc = accumulation_dtype(problem)
    found = slabs(problem)
    _, unit_inputs, _ = _units(problem)
    grad_units, output_units = _unit_view(grad_out, problem), _unit_view(output, problem)
    allocated = [_workspace_bytes(problem, s.stop - s.start) for s in found if not s.in_place]
    workspace = np.empty(max(allocated), np.uint8) if allocated else None
    gradient = np.frombuffer((ctypes.c_char * max(in_bytes, 1)).from_address(grad_address), np.uint8)
    areas = _unit_areas(problem)
    input_part = output_part = 0.0
    for slab in found:
        count = slab.stop - slab.start
        past_slab = (slab.first_input + count * unit_inputs) * ITEMSIZE[problem.dtype]
        y, g, v, terms, sums, chained = _carve(gradient[past_slab:] if slab.in_place else workspace,
                                               _workspace_layout(problem, count))
        np.copyto(y, output_units[slab.start:slab.stop])
        np.copyto(g, grad_units[slab.start:slab.stop])
        np.log(y, out=v)  # dL/dp's output terms ln(y) * y * dL/dy
        v *= y
        v *= g
        output_part = _add_in_order(output_part, _block_sums(v.reshape(-1), sums), chained)
        np.power(y, acc(1 - p), out=v)  # the coefficients dL/dy * y**(1-p) / (p * area)
        v *= g
        v /= acc(p)
        areas_tiled = g  # dL/dy's last use is above: its array takes the windows' areas
        np.copyto(areas_tiled, areas)
        v /= areas_tiled
        input_part = input_gradient(device, problem, slab, arguments, x_address, v.ctypes.data, grad_address, terms,
                                    chained, input_part)
    return input_part - output_part / p


@functools.lru_cache(maxsize=64)
def _unit_areas(problem: Problem) -> np.ndarray:
    """The windows' areas of one unit's outputs (``_units``) in ``problem``'s memory order and
    accumulation dtype, broadcastable to a slab's outputs (read-only)."""
    areas = window_areas(problem).astype(accumulation_dtype(problem))
    areas = areas[..., np.newaxis] if problem.channels_last else areas
    areas.flags.writeable = False
    return areas


def _block_sums(terms: np.ndarray, sums: np.ndarray) -> np.ndarray:
    """``sums``, set to the sums of ``SUM_BLOCK`` consecutive ``terms`` (the last block may be
    shorter), each in the terms' dtype (a block's sum depends on nothing but its terms)."""
    whole = terms.size - terms.size % SUM_BLOCK
    np.sum(terms[:whole].reshape(-1, SUM_BLOCK), axis=1, out=sums[:whole // SUM_BLOCK])
    if whole < terms.size:
        sums[-1] = np.sum(terms[whole:])
    return sums


def _add_in_order(running: float, values: np.ndarray, chained: np.ndarray) -> float:
    """``running`` plus ``values``, added one after the other in float64 (a cumulative sum in
    ``chained``, a float64 array longer than ``values``), so a sum split into consecutive parts
    has the bits of the whole's."""
    chained = chained[:values.size + 1]
    chained[0] = running
    chained[1:] = values
    return float(np.cumsum(chained, out=chained)[-1])


def _backward_on_device(owner, ndim: int, grad_out, x, output, arguments: dict) -> tuple:
    """``backward`` on device arrays of ``owner``, results on ``x``'s queue (its stream) as the
    caller's kind of array: the outputs' coefficients computed on the host from ``grad_out`` and
    ``output`` (output-sized copies, after waiting for x's queue), the input-gradient kernel on
    device memory (``input_gradient_on_device``), and ``dL/dp``'s terms copied back and added in
    order.  A device that shares host memory (PoCL) runs the numpy path on host copies of the
    arrays' memory instead (its prepared launches take host addresses, not its arrays), the
    gradient returned in x's memory layout as on a GPU."""
    queue = owner.arrays.queue_of(x)
    operation = find("gem", ndim)
    layout = ops.memory_layout(x, ndim)
    out_spatial = tuple(output.shape[len(output.shape) - ndim:])
    # one value per plane: both layouts are the same memory
    layouts = (layout,) if math.prod(out_spatial) > 1 else plans.LAYOUT_NAMES[ndim]
    for name, array in (("grad_out", grad_out), ("output", output)):
        if tuple(array.shape) != tuple(output.shape):
            raise ValueError(f"{name} must have the shape of the output {tuple(output.shape)}, "
                             f"got {tuple(array.shape)}")
        if ops.memory_layout(array, ndim) not in layouts:
            raise ValueError(f"{name} must be in x's memory layout ({layout}) on a device")
    _check_dtype_of_x(plans.numpy_spec(x).dtype, (("grad_out", plans.numpy_spec(grad_out).dtype),
                                                  ("output", plans.numpy_spec(output).dtype)))
    if layout is None:
        raise ValueError(f"x must be contiguous or channels-last on a device (GeM's backward reads it in place), got "
                         f"strides {plans.numpy_spec(x).strides}")
    dtype = plans.numpy_spec(x).dtype
    problem = Problem.create(operation.name, tuple(x.shape), out_spatial, _dtype_name(dtype), layout,
                             direction="backward")
    if problem.is_empty:  # as backward_on_host: zeros, nothing to copy or launch
        grad = owner.empty(problem.memory_shape(x.shape), dtype, queue, fill=0)
        if problem.channels_last:
            grad = owner.arrays.strided_view(grad, tuple(x.shape), _byte_strides(problem, x.shape, dtype))
        return owner.arrays.deliver(grad, queue), 0.0
    x_in, grad_in, output_in = (owner.arrays.wrap_input(a, name) for a, name in
                                ((x, "x"), (grad_out, "grad_out"), (output, "output")))
    # grad_out's and output's producers, before they are read on the host: x's stream here, and on
    # CUDA each array's own stream in the copies (they may name other, non-blocking, streams)
    owner.synchronize(queue)
    host = [np.empty(problem.memory_shape(output.shape), dtype) for _ in range(2)]
    owner.copy(host[0], grad_in)
    owner.copy(host[1], output_in)
    if owner.info.shares_host_memory:
        x_host = np.empty(problem.memory_shape(x.shape), dtype)
        owner.copy(x_host, x_in)
        grad_x, grad_p = backward(ndim, _logical(host[0], problem), _logical(x_host, problem), out_spatial,
                                  arguments["p"], arguments["eps"], output=_logical(host[1], problem), device=owner)
        grad = owner.to_device(np.ascontiguousarray(in_memory_order(grad_x, problem)), queue)
        if problem.channels_last:
            grad = owner.arrays.strided_view(grad, tuple(x.shape), _byte_strides(problem, x.shape, dtype))
        return owner.arrays.deliver(grad, queue), grad_p
    acc = accumulation_dtype(problem)
    g, y = (_logical(a, problem).astype(acc) for a in host)
    outputs_coefficients = owner.to_device(coefficients(g, y, arguments["p"], problem), queue)
    grad = owner.empty(problem.memory_shape(x.shape), dtype, queue)
    terms = owner.empty((input_gradient_terms(owner, problem),), acc, queue)
    input_gradient_on_device(owner, problem, arguments, queue.stream,
                             *map(_address, (x_in, outputs_coefficients, grad, terms)))
    owner.synchronize(queue)
    grad_p = float(np.sum(owner.to_host(terms), dtype=np.float64)) + output_term(g, y, arguments["p"])
    if problem.channels_last:
        grad = owner.arrays.strided_view(grad, tuple(x.shape), _byte_strides(problem, x.shape, dtype))
    return owner.arrays.deliver(grad, queue), grad_p


def _logical(memory: np.ndarray, problem: Problem) -> np.ndarray:
    """An array in ``problem``'s memory order seen with the logical (channels-first) axes."""
    if not problem.channels_last:
        return memory
    return np.moveaxis(memory, -1, memory.ndim - problem.ndim - 1)


def _byte_strides(problem: Problem, logical_shape, dtype) -> tuple:
    return tuple(s * np.dtype(dtype).itemsize for s in plans.element_strides(problem, tuple(logical_shape)))


def _address(array) -> int:
    """A CUDA array's device pointer (its ``__cuda_array_interface__``'s)."""
    return cuda_arrays.cuda_array_interface(array)["data"][0]


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def in_memory_order(array: np.ndarray, problem: Problem) -> np.ndarray:
    """``array`` (logical axes: batch, channels, spatial) with its axes in ``problem``'s memory
    order: channels moved last where the problem is channels-last."""
    if not problem.channels_last:
        return array
    return np.moveaxis(array, array.ndim - problem.ndim - 1, -1)


def accumulation_dtype(problem: Problem):
    """The numpy dtype GeM's kernels accumulate ``problem`` in: float64 for float64, else float32."""
    return np.float64 if problem.dtype == "float64" else np.float32


def window_areas(problem: Problem) -> np.ndarray:
    """The number of inputs each output of one plane pools, shaped like the plane's outputs."""
    areas = np.ones((), np.int64)
    for in_size, out_size in zip(problem.in_spatial, problem.out_spatial):
        starts, ends = pooling_windows(in_size, out_size)
        areas = np.multiply.outer(areas, ends - starts)
    return areas.reshape(problem.out_spatial[3 - problem.ndim:])


def coefficients(grad_out, output, p: float, problem: Problem) -> np.ndarray:
    """What the input-gradient kernel gathers (``coefficient_values``) from ``dL/dy`` and ``y``
    (numpy arrays, logical axes, in the accumulation dtype or a narrower float one), computed in
    the accumulation dtype and stored in ``problem``'s memory order.  A narrower array is widened
    by the ufuncs as they go, not copied whole: the result is the only output-sized array made."""
    acc = accumulation_dtype(problem)
    powered = np.power(output, 1 - float(p), dtype=acc)
    values = coefficient_values(grad_out, powered, float(p), window_areas(problem).astype(acc))
    return np.ascontiguousarray(in_memory_order(values, problem))


def coefficient_values(grad_out, powered, p, areas):
    """Each output's ``dL/dm_o / area_o = dL/dy_o * y_o**(1-p) / (p * area_o)``, written over
    ``powered = y_o**(1-p)`` (the caller's, in the accumulation dtype, ``1 - p`` taken in it) and
    returned: numpy arrays, or tensors of one device (CUDA tensors' backward), ``p`` a Python
    float, ``areas`` the windows' areas (``window_areas``) in that dtype, ``grad_out`` in it or a
    narrower float dtype (widened exactly).  In place: no output-sized temporary."""
    powered *= grad_out
    powered /= p * areas
    return powered


def output_term(grad_out, output, p) -> float:
    """The output part of ``dL/dp``: ``sum of dL/dy * y * (-ln(m) / p**2)`` with ``ln(m) = p ln(y)``,
    the terms ``ln(y) * y * dL/dy`` in the accumulation dtype (float32 for narrower arrays, widened
    as the ufuncs go) in one output-sized array, their sum in float64."""
    terms = np.log(output, dtype=np.result_type(output.dtype, np.float32))
    terms *= output
    terms *= grad_out
    return float(-np.sum(terms, dtype=np.float64) / p)


def input_gradient_groups(problem: Problem, form: GradientForm = ELEMENT_FORM) -> int:
    """Work-groups of ``form``'s input-gradient kernel for ``problem`` (GeM's backward problem)."""
    if form.per_plane:
        return -(-problem.planes // form.config["block_size_x"])
    return -(-math.prod(problem.input_shape) // GROUP_INPUTS)


def input_gradient_terms(device, problem: Problem) -> int:
    """The terms of ``dL/dp`` that the input-gradient pass of ``problem`` on ``device`` writes
    (``input_gradient_form``): one per work-group, or per plane."""
    form = input_gradient_form(device, problem)
    return problem.planes if form.per_plane else input_gradient_groups(problem, form)


def input_gradient_program(problem: Problem, form: GradientForm = ELEMENT_FORM) -> str:
    """``form``'s input-gradient program for ``problem`` (GeM's backward problem)."""
    files = ("prelude.h", "windows.h", problem.operation.operator_header, form.file)
    plane_size = math.prod(problem.in_spatial)
    if form.per_plane:
        partial = problem.channels % form.config["block_size_x"] != 0  # per sample: one build for any batch
        return kernel_source.render_files(files, {**problem.defines(), **form.config,
                                                  "PARTIAL_LAST_GROUP": int(partial)})
    partial = problem.channels * plane_size % GROUP_INPUTS != 0
    groups_per_plane = plane_size // GROUP_INPUTS if plane_size % GROUP_INPUTS == 0 and not problem.channels_last else 0
    return kernel_source.render_files(files, {**problem.defines(), **INPUT_GRADIENT_CONFIG,
                                              "PARTIAL_LAST_GROUP": int(partial), "GROUPS_PER_PLANE": groups_per_plane})


def helper_problems(ops=None, dtypes=("float32",)) -> list:
    """``(label, problem, form)``: a global and a windowed backward problem of each GeM op in ``ops``
    (None: every rank) and dtype, and a problem of small planes, whose input-gradient programs
    (``form``'s) ``pool-tuner compile-check`` compiles beside the variants'."""
    found = []
    for ndim in (1, 2, 3):
        op = find("gem", ndim).name
        if ops is not None and op not in ops:
            continue
        # 9-wide planes gather inverse windows; 256-element planes into at most 16 outputs fill whole
        # work-groups and mask their outputs
        for kind, spatial, size in (("global", (9,) * ndim, 1), ("windows", (9,) * ndim, 4),
                                    ("group_planes", {1: (256,), 2: (16, 16), 3: (4, 8, 8)}[ndim],
                                     {1: 3, 2: 3, 3: (2, 2, 3)}[ndim])):
            for dtype in dtypes:
                found.append((f"{INPUT_GRADIENT_KERNEL}_{ndim}d_{kind}",
                              Problem.create(op, (2, 3) + spatial, size, dtype, direction="backward"), ELEMENT_FORM))
        # a plane in vector steps and a last step that ends at its end
        spatial, size = {1: ((13,), 3), 2: ((7, 7), 2), 3: ((3, 4, 4), (1, 2, 2))}[ndim]
        for dtype in dtypes:
            found.append((f"{PLANE_FORM.kernel}_{ndim}d", Problem.create(op, (2, 3) + spatial, size, dtype,
                                                                           direction="backward"), PLANE_FORM))
    return found


def input_gradient_kernel(device, problem: Problem, form: GradientForm = ELEMENT_FORM):
    """``form``'s built input-gradient kernel of ``problem``'s per-sample shape on ``device``'s
    default context (built once per form and ``Problem.kernel_key``)."""
    context = device.queue.context
    key = (context, form.kernel, problem.kernel_key)
    kernel = _KERNELS.get(key)
    if kernel is None:
        with _KERNELS_LOCK:
            kernel = _KERNELS.get(key)
            if kernel is None:
                kernel = _KERNELS[key] = device.build(context, input_gradient_program(problem, form), form.kernel)
    return kernel


def input_gradient(device, problem: Problem, slab: Slab, arguments: dict, x_address: int, coefficients_address: int,
                   grad_address: int, terms: np.ndarray, chained: np.ndarray, running: float) -> float:
    """Run the input-gradient kernel on ``slab`` of ``problem`` over host memory on a device that
    shares it (the whole input and its gradient, and the slab's outputs' ``coefficients``, each in
    the problem's memory order): writes the slab's gradient, returns ``running`` plus the slab's
    input part of ``dL/dp``, the kernel's terms (``input_gradient_terms``: its work-groups' or its
    planes', written into the start of ``terms``, the accumulation dtype) added one after the other
    in float64 (``_add_in_order``
    in ``chained``).  In a process where the device's kernels cannot run, ``host_fallback``'s
    pass instead (its float64 sum added once)."""
    if device.info.host_fallback is not None:
        offset = slab.first_input * ITEMSIZE[problem.dtype]
        return running + host_fallback.gem_input_gradient(slab.problem, arguments, x_address + offset,
                                                          coefficients_address, grad_address + offset)
    input_gradient_on_device(device, problem, arguments, None, x_address, coefficients_address, grad_address,
                             terms.ctypes.data, slab)
    return _add_in_order(running, terms[:input_gradient_terms(device, slab.problem)], chained)


def input_gradient_on_device(device, problem: Problem, arguments: dict, stream, x_address: int,
                             coefficients_address: int, grad_address: int, terms_address: int,
                             slab: Slab | None = None) -> None:
    """Launch the input-gradient kernel on memory given by address (as ``input_gradient``, the
    terms of ``dL/dp`` written to ``input_gradient_terms`` acc-dtype elements at
    ``terms_address``), on ``slab`` of ``problem`` (None: the whole): over host memory where the
    device shares it (``stream`` None, written when this returns), else over device memory on the
    raw stream handle ``stream`` (CUDA: PyTorch's current stream), without waiting.  The launch is
    prepared once per device, context, problem and slab shape, its kernel built in the context
    current then (CUDA: the calling thread's; ``pool_tuner.torch`` checks first that it is the one
    owning the tensors); ``p``, ``eps`` and the slab's first input reach it as
    this call's scalars."""
    acc = accumulation_dtype(problem)
    part, first_input = (problem, 0) if slab is None else (slab.problem, slab.first_input)
    scalars = (np.int64(part.planes), acc(arguments["p"]), acc(arguments["eps"]), np.int64(first_input))
    _prepared_input_gradient(device, problem, part, device.queue.context)(
        stream, x_address, coefficients_address, grad_address, terms_address, scalars=scalars)


@functools.lru_cache(maxsize=64)
def _prepared_input_gradient(device, problem: Problem, part: Problem, context):
    """The input-gradient kernel of ``part`` (``problem`` or one of its slabs' problems) on
    ``device`` with its grid fixed (``prepare``) over the whole input and gradient of ``problem``
    and ``part``'s coefficients and terms, its scalars the defaults until a call passes its own.
    Prepared per ``context`` (the device's queue's: on CUDA the calling thread's current one), as
    its kernel is loaded into that context: arrays of ``pycuda.autoinit``'s context and of the
    primary one each get a launch of their own context's kernel."""
    form = input_gradient_form(device, part)
    groups = input_gradient_groups(part, form)
    acc = accumulation_dtype(problem)
    in_bytes = math.prod(problem.input_shape) * ITEMSIZE[problem.dtype]
    coefficient_bytes = math.prod(part.output_shape) * np.dtype(acc).itemsize
    terms_bytes = input_gradient_terms(device, part) * np.dtype(acc).itemsize
    defaults = dict(problem.operation.arguments)
    launch = dispatch.Launch(input_gradient_kernel(device, part, form), groups, (form.config["block_size_x"], 1),
                             (np.int64(part.planes), acc(defaults["p"]), acc(defaults["eps"]), np.int64(0)))
    return device.prepare(launch, (in_bytes, coefficient_bytes, in_bytes, terms_bytes), 2)


def _make(ndim: int):
    def adaptive_gem_pool(x, output_size, p=3.0, eps=1e-6, *, device=None, variant=None, config=None):
        return forward(ndim, x, output_size, p, eps, device=device, variant=variant, config=config)

    def adaptive_gem_pool_backward(grad_out, x, output_size, p=3.0, eps=1e-6, *, output=None, device=None):
        return backward(ndim, grad_out, x, output_size, p, eps, output=output, device=device)

    name = find("gem", ndim).name
    adaptive_gem_pool.__name__ = adaptive_gem_pool.__qualname__ = name
    adaptive_gem_pool.__doc__ = (
        f"Adaptive generalized-mean (GeM) pooling of a {ndim}d-pooled array to ``output_size``: "
        f"``(mean over the window of max(x, eps)**p) ** (1/p)``, ``p`` and ``eps`` finite and > 0 "
        f"(``p = 1`` is average pooling; large ``p`` tends to max pooling).")
    adaptive_gem_pool_backward.__name__ = adaptive_gem_pool_backward.__qualname__ = BACKWARD.op_name(find("gem", ndim))
    adaptive_gem_pool_backward.__doc__ = (
        f"``(grad_x, grad_p)`` of {name}: the gradients for ``x`` and ``p`` of "
        f"``sum(grad_out * {name}(x, output_size, p, eps))``, deterministic (no atomics).")
    return adaptive_gem_pool, adaptive_gem_pool_backward


adaptive_gem_pool1d, adaptive_gem_pool1d_backward = _make(1)
adaptive_gem_pool2d, adaptive_gem_pool2d_backward = _make(2)
adaptive_gem_pool3d, adaptive_gem_pool3d_backward = _make(3)
