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
   output-sized host arithmetic in the accumulation dtype);
2. ``kernels/operators/gem_input_gradient.c``, one pass over the input: each input gathers the
   coefficients of the outputs whose windows hold it (its inverse windows), and from that share,
   its value, ``p`` and ``eps`` writes its gradient; per work-group it adds up the input terms of the
   gradient of ``p``, which the host adds in a fixed order.

The functions below take numpy arrays and the device arrays of ``pool_tuner.adaptive_*`` (the
backward's output-sized step on the host, its input pass on the arrays' device and stream);
``pool_tuner.torch`` has the autograd op and modules.
"""

from __future__ import annotations

import functools
import math
import numbers
import threading

import numpy as np

from . import backends, dispatch, host_fallback, kernel_source, ops, plans
from .backends import cuda_arrays
from .operations import BACKWARD, find
from .problem import ITEMSIZE, Problem
from .windows import pooling_windows

#: The input-gradient kernel, as GeM's op object names it (``Operation.backward_kernel``), and its one
#: configuration (neighbouring work-items on neighbouring inputs).
INPUT_GRADIENT_KERNEL = find("gem", 2).backward_kernel
INPUT_GRADIENT_CONFIG = find("gem", 2).backward_kernel_config
INPUT_GRADIENT_FILE = f"operators/{INPUT_GRADIENT_KERNEL}.c"

_KERNELS: dict = {}
_KERNELS_LOCK = threading.Lock()


def check_arguments(p, eps, p_name: str = "p") -> dict:
    """``{"p": p, "eps": eps}`` as floats, after checking both: real, finite and positive."""
    values = {}
    for name, value in ((p_name, p), ("eps", eps)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value) or value <= 0:
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
    dev = backends.resolve_device(device)
    if not dev.info.shares_host_memory:  # through copies on the device, as pool_tuner.ops does
        queue = dev.queue
        grad_x, grad_p = _backward_on_device(dev, ndim, *(dev.to_device(a, queue) for a in (grad_out, x, output)),
                                             arguments)
        return dev.to_host(grad_x), grad_p
    channels_last = ops.memory_layout(x, ndim) not in (None, plans.LAYOUT_NAMES[ndim][0])
    problem = Problem.create(find("gem", ndim).name, x.shape, tuple(output.shape[x.ndim - ndim:]),
                             _dtype_name(x.dtype), plans.LAYOUT_NAMES[ndim][int(channels_last)], direction="backward")
    acc = accumulation_dtype(problem)
    g, y = grad_out.astype(acc, copy=False), output.astype(acc, copy=False)
    x_memory = np.ascontiguousarray(in_memory_order(x, problem))
    outputs_coefficients = coefficients(g, y, arguments["p"], problem)
    grad_memory = np.empty(x_memory.shape, x.dtype)
    input_term = input_gradient(dev, problem, arguments, x_memory.ctypes.data, outputs_coefficients.ctypes.data,
                                grad_memory.ctypes.data)
    grad_x = np.moveaxis(grad_memory, -1, x.ndim - ndim - 1) if channels_last else grad_memory
    return grad_x, input_term + output_term(g, y, arguments["p"])


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
    if layout is None:
        raise ValueError(f"x must be contiguous or channels-last on a device (GeM's backward reads it in place), got "
                         f"strides {plans.numpy_spec(x).strides}")
    dtype = plans.numpy_spec(x).dtype
    problem = Problem.create(operation.name, tuple(x.shape), out_spatial, _dtype_name(dtype), layout,
                             direction="backward")
    x_in, grad_in, output_in = (owner.arrays.wrap_input(a, name) for a, name in
                                ((x, "x"), (grad_out, "grad_out"), (output, "output")))
    owner.synchronize(queue)  # grad_out's and output's producers, before they are read on the host
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
    terms = owner.empty((input_gradient_groups(problem),), acc, queue)
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


def input_gradient_groups(problem: Problem) -> int:
    """Work-groups of the input-gradient kernel for ``problem`` (GeM's backward problem)."""
    per_group = INPUT_GRADIENT_CONFIG["block_size_x"] * INPUT_GRADIENT_CONFIG["items_per_thread"]
    return -(-math.prod(problem.input_shape) // per_group)


def input_gradient_program(problem: Problem) -> str:
    """The input-gradient kernel's program for ``problem`` (GeM's backward problem)."""
    files = ("prelude.h", "windows.h", problem.operation.operator_header, INPUT_GRADIENT_FILE)
    per_group = INPUT_GRADIENT_CONFIG["block_size_x"] * INPUT_GRADIENT_CONFIG["items_per_thread"]
    plane_size = math.prod(problem.in_spatial)
    partial = problem.channels * plane_size % per_group != 0
    groups_per_plane = plane_size // per_group if plane_size % per_group == 0 and not problem.channels_last else 0
    return kernel_source.render_files(files, {**problem.defines(), **INPUT_GRADIENT_CONFIG,
                                              "PARTIAL_LAST_GROUP": int(partial), "GROUPS_PER_PLANE": groups_per_plane})


def helper_problems(ops=None, dtypes=("float32",)) -> list:
    """``(label, problem)``: a global and a windowed backward problem of each GeM op in ``ops``
    (None: every rank) and dtype, whose input-gradient programs ``pool-tuner compile-check``
    compiles beside the variants'."""
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
                              Problem.create(op, (2, 3) + spatial, size, dtype, direction="backward")))
    return found


def input_gradient_kernel(device, problem: Problem):
    """The built input-gradient kernel of ``problem``'s per-sample shape on ``device``'s default
    context (built once per ``Problem.kernel_key``)."""
    context = device.queue.context
    key = (context, problem.kernel_key)
    kernel = _KERNELS.get(key)
    if kernel is None:
        with _KERNELS_LOCK:
            kernel = _KERNELS.get(key)
            if kernel is None:
                kernel = _KERNELS[key] = device.build(context, input_gradient_program(problem), INPUT_GRADIENT_KERNEL)
    return kernel


def input_gradient(device, problem: Problem, arguments: dict, x_address: int, coefficients_address: int,
                   grad_address: int) -> float:
    """Run the input-gradient kernel over host memory on a device that shares it (the input and
    its gradient, and the outputs' ``coefficients``, each in the problem's memory order): writes
    the gradient, returns the input part of ``dL/dp``, the work-groups' terms added in float64 in
    a fixed order (numpy's pairwise sum; ``tolist`` would allocate a Python float per work-group).
    In a process where the device's kernels cannot run, ``host_fallback``'s pass instead."""
    if device.info.host_fallback is not None:
        return host_fallback.gem_input_gradient(problem, arguments, x_address, coefficients_address, grad_address)
    terms = np.empty(input_gradient_groups(problem), accumulation_dtype(problem))
    input_gradient_on_device(device, problem, arguments, None, x_address, coefficients_address, grad_address,
                             terms.ctypes.data)
    return float(np.sum(terms, dtype=np.float64))


def input_gradient_on_device(device, problem: Problem, arguments: dict, stream, x_address: int,
                             coefficients_address: int, grad_address: int, terms_address: int) -> None:
    """Launch the input-gradient kernel on memory given by address (as ``input_gradient``, the
    work-groups' terms written to ``input_gradient_groups(problem)`` acc-dtype elements at
    ``terms_address``): over host memory where the device shares it (``stream`` None, written
    when this returns), else over device memory on the raw stream handle ``stream`` (CUDA:
    PyTorch's current stream), without waiting.  The launch is prepared once per device and
    problem, its kernel built in the context current then (CUDA: the primary one, where PyTorch's
    tensors live; a later call under another context is refused by the launch, naming both);
    ``p`` and ``eps`` reach it as this call's scalars."""
    acc = accumulation_dtype(problem)
    scalars = (np.int64(problem.planes), acc(arguments["p"]), acc(arguments["eps"]))
    _prepared_input_gradient(device, problem)(stream, x_address, coefficients_address, grad_address, terms_address,
                                              scalars=scalars)


@functools.lru_cache(maxsize=64)
def _prepared_input_gradient(device, problem: Problem):
    """The input-gradient kernel of ``problem`` on ``device`` with its grid and argument storage
    fixed (``prepare``), its scalars the defaults until a call passes its own."""
    groups = input_gradient_groups(problem)
    acc = accumulation_dtype(problem)
    in_bytes = math.prod(problem.input_shape) * ITEMSIZE[problem.dtype]
    coefficient_bytes = math.prod(problem.output_shape) * np.dtype(acc).itemsize
    defaults = dict(problem.operation.arguments)
    launch = dispatch.Launch(input_gradient_kernel(device, problem), groups, (INPUT_GRADIENT_CONFIG["block_size_x"], 1),
                             (np.int64(problem.planes), acc(defaults["p"]), acc(defaults["eps"])))
    return device.prepare(launch, (in_bytes, coefficient_bytes, in_bytes, groups * np.dtype(acc).itemsize), 2)


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
