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

The numpy functions below take numpy arrays (and, forward only, the device arrays of
``pool_tuner.adaptive_*``); ``pool_tuner.torch`` has the autograd op and modules.
"""

from __future__ import annotations

import math
import numbers
import threading

import numpy as np

from . import backends, dispatch, kernel_source, ops, plans
from .operations import BACKWARD, find
from .problem import ITEMSIZE, Problem
from .windows import pooling_windows

#: The work-group shape of the input-gradient kernel: ``block_size_x`` work-items, each taking
#: ``items_per_thread`` inputs ``block_size_x`` apart (neighbouring work-items on neighbouring inputs).
INPUT_GRADIENT_CONFIG = {"block_size_x": 256, "items_per_thread": 1}
INPUT_GRADIENT_FILE = "operators/gem_input_gradient.c"
INPUT_GRADIENT_KERNEL = "gem_input_gradient"

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
    ``x`` (an array like ``x``, in its layout) and ``p`` (a float), numpy arrays in and out.
    ``output``: the forward's result, when the caller has it (else it is computed)."""
    arguments = check_arguments(p, eps)
    for name, array in (("grad_out", grad_out), ("x", x)):
        if not isinstance(array, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray, got {type(array).__name__}")
    if output is None:
        output = forward(ndim, x, output_size, p, eps, device=device)
    if grad_out.shape != output.shape:
        raise ValueError(f"grad_out must have the shape of the output {output.shape}, got {grad_out.shape}")
    channels_last = ops.memory_layout(x, ndim) not in (None, plans.LAYOUT_NAMES[ndim][0])
    problem = Problem.create(find("gem", ndim).name, x.shape, tuple(output.shape[x.ndim - ndim:]),
                             _dtype_name(x.dtype), plans.LAYOUT_NAMES[ndim][int(channels_last)], direction="backward")
    acc = accumulation_dtype(problem)
    g, y = grad_out.astype(acc, copy=False), output.astype(acc, copy=False)
    x_memory = np.ascontiguousarray(in_memory_order(x, problem))
    outputs_coefficients = coefficients(g, y, arguments["p"], problem)
    grad_memory = np.empty(x_memory.shape, x.dtype)
    input_term = input_gradient(backends.resolve_device(device), problem, arguments, x_memory.ctypes.data,
                                outputs_coefficients.ctypes.data, grad_memory.ctypes.data)
    grad_x = np.moveaxis(grad_memory, -1, x.ndim - ndim - 1) if channels_last else grad_memory
    return grad_x, input_term + output_term(g, y, arguments["p"])


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
    """What the input-gradient kernel gathers: each output's ``dL/dm_o / area_o = dL/dy_o *
    y_o**(1-p) / (p * area_o)``, from ``dL/dy`` and ``y`` (numpy arrays, logical axes), computed
    in the accumulation dtype and stored in ``problem``'s memory order."""
    acc = accumulation_dtype(problem)
    grad_out, output = grad_out.astype(acc, copy=False), output.astype(acc, copy=False)
    values = grad_out * output ** acc(1 - p) / (acc(p) * window_areas(problem).astype(acc))
    return np.ascontiguousarray(in_memory_order(values, problem))


def output_term(grad_out, output, p) -> float:
    """The output part of ``dL/dp``: ``sum of dL/dy * y * (-ln(m) / p**2)`` with ``ln(m) = p ln(y)``,
    the terms in the arrays' dtype, their sum in float64."""
    return float(-np.sum(grad_out * output * np.log(output), dtype=np.float64) / p)


def input_gradient_groups(problem: Problem) -> int:
    """Work-groups of the input-gradient kernel for ``problem`` (GeM's backward problem)."""
    per_group = INPUT_GRADIENT_CONFIG["block_size_x"] * INPUT_GRADIENT_CONFIG["items_per_thread"]
    return -(-math.prod(problem.input_shape) // per_group)


def input_gradient_program(problem: Problem) -> str:
    """The input-gradient kernel's program for ``problem`` (GeM's backward problem)."""
    files = ("prelude.h", "windows.h", problem.operation.operator_header, INPUT_GRADIENT_FILE)
    per_group = INPUT_GRADIENT_CONFIG["block_size_x"] * INPUT_GRADIENT_CONFIG["items_per_thread"]
    partial = problem.channels * math.prod(problem.in_spatial) % per_group != 0
    return kernel_source.render_files(files, {**problem.defines(), **INPUT_GRADIENT_CONFIG,
                                              "PARTIAL_LAST_GROUP": int(partial)})


def helper_problems(ops=None, dtypes=("float32",)) -> list:
    """``(label, problem)``: a global and a windowed backward problem of each GeM op in ``ops``
    (None: every rank) and dtype, whose input-gradient programs ``pool-tuner compile-check``
    compiles beside the variants'."""
    found = []
    for ndim in (1, 2, 3):
        op = find("gem", ndim).name
        if ops is not None and op not in ops:
            continue
        for kind, size in (("global", 1), ("windows", 4)):
            for dtype in dtypes:
                found.append((f"{INPUT_GRADIENT_KERNEL}_{ndim}d_{kind}",
                              Problem.create(op, (2, 3) + (9,) * ndim, size, dtype, direction="backward")))
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
    """Run the input-gradient kernel over host memory (the input and its gradient, and the
    outputs' ``coefficients``, each in the problem's memory order): writes the gradient, returns
    the input part of ``dL/dp``, the work-groups' terms added in float64 in a fixed order
    (numpy's pairwise sum; ``tolist`` would allocate a Python float per work-group)."""
    if not device.info.shares_host_memory:
        raise NotImplementedError(f"GeM's backward on numpy arrays needs a device that shares host memory; "
                                  f"{device.info.describe()} does not")
    if device.info.host_fallback is not None:
        raise RuntimeError(f"GeM's backward cannot run in this process: {device.info.host_fallback}")
    groups = input_gradient_groups(problem)
    acc = accumulation_dtype(problem)
    terms = np.empty(groups, acc)
    in_bytes = math.prod(problem.input_shape) * ITEMSIZE[problem.dtype]
    coefficient_bytes = math.prod(problem.output_shape) * np.dtype(acc).itemsize
    launch = dispatch.Launch(input_gradient_kernel(device, problem), groups, (INPUT_GRADIENT_CONFIG["block_size_x"], 1),
                             (np.int64(problem.planes), acc(arguments["p"]), acc(arguments["eps"])))
    run = device.prepare(launch, (in_bytes, coefficient_bytes, in_bytes, terms.nbytes), 2)
    run(None, x_address, coefficients_address, grad_address, terms.ctypes.data)
    return float(np.sum(terms, dtype=np.float64))


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
