"""CUDA tensors in ``pool_tuner.torch``: PyTorch's allocator and streams, one memoised plan per
call signature.

The first call of a signature -- the op and direction, each tensor's shape, strides, dtype and
device, the output size (or input shape) and pool_tuner's options -- validates it, dispatches,
builds the kernel for the driver-API launch path (``backends.cuda_driver``) and fixes the grid,
the argument layout and the results' shapes and strides: a ``_Plan``.  Every later call of the
signature is one dictionary lookup, ``torch.empty_strided`` for each result on the input's device
(PyTorch's caching allocator) and one ``cuLaunchKernel`` on PyTorch's current stream of that
device.

So nothing here makes or frees a PyCUDA object, or touches PyCUDA's per-thread context stack, once
a signature has been seen (the first call builds through PyCUDA's compiler only): calls work from
any thread -- the autograd engine's backward thread, a DataLoader worker, a user's -- and inside
``torch.cuda.graph`` capture, where the launch is recorded into the graph and the results come
from the graph's memory pool.  Capture a signature only after calling it once (PyTorch asks for
such a warm-up before capture anyway): building a kernel is not allowed while a stream captures.
Results are ordered after the inputs' producers by the stream itself, as PyTorch's own ops are.
"""

from __future__ import annotations

import math

import torch

from . import dispatch, memo, ops, shapes, tuner
from .backends import cuda
from .problem import LAYOUT_NAMES, OPS, Problem

#: PyTorch's current stream of a CUDA device as a raw ``cudaStream_t`` (the call Inductor's
#: generated code makes); CPU-only builds of PyTorch lack it and have no CUDA tensors.
current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

#: pool_tuner.ops function -> (op, direction)
_SIGNATURES = {getattr(ops, op + suffix): (op, direction)
               for op in OPS for suffix, direction in (("", "forward"), ("_backward", "backward"))}

_PLANS = memo.table("torch_cuda.plans")  # filed under the problem: evicted with its kernel
dispatch.register_dependent_memo(_PLANS)  # a plan holds a decision: forgotten with it (after tuning)


def call(fn, tensors, size, options: dict):
    """``fn`` (a pool_tuner.ops pooling function) on CUDA ``tensors`` -- ``[x]``, ``[grad_out]`` or
    ``[grad_out, indices]`` -- with ``size`` (the output size of a forward pass, the input shape
    of a backward one) and pool_tuner's keyword ``options`` (``device``, ``variant``,
    ``config``).  Returns what ``fn`` returns, as tensors: the result, or a max forward's
    ``(values, indices)``."""
    results = plan(fn, tensors, size, options)(tensors)
    return results if len(results) == 2 else results[0]


def plan(fn, tensors, size, options: dict) -> "_Plan":
    """The plan of a call signature (see ``call``), made and memoised on its first use."""
    try:
        key = (fn, ops._exact(size), _options_key(options),
               *[(t.shape, t.stride(), t.dtype, t.device) for t in tensors])
        found = _PLANS.get(key)
    except (TypeError, AttributeError):  # an unhashable size or option: validated on every call
        key = found = None
    if found is None:
        found = _Plan(fn, tensors, size, options)
        if key is not None:
            _PLANS.put(found.problem, key, found)
    return found


def _options_key(options: dict) -> tuple:
    """The options as a memo key (``dispatch.config_key`` for the config)."""
    return options.get("device"), options.get("variant"), dispatch.config_key(options.get("config"))


def _strides(problem: Problem, logical_shape) -> tuple:
    """Element strides of a logical (channels-first) array stored in the problem's memory order."""
    strides = shapes.c_strides(problem.memory_shape(logical_shape), 1)
    if problem.channels_last:
        strides = ops._last_axis_to(strides, len(logical_shape) - problem.ndim - 1)
    return strides


def _layout(t: torch.Tensor, ndim: int) -> str | None:
    return ops.strides_layout(tuple(t.shape), t.stride(), 1, ndim)


class _Plan:
    """Everything one call signature does, decided on its first call (see the module docstring):
    ``inputs``, per input, None or the strides it is copied to first (inputs in neither layout, or
    indices in another layout than ``grad_out``); ``outputs``, each result's (shape, strides,
    dtype); ``launch``, the prepared launch (None when there is nothing to compute);
    ``zero_fill``, whether the result is all zeros instead (a backward pass with no outputs)."""

    __slots__ = ("problem", "choice", "inputs", "outputs", "launch", "zero_fill")

    def __init__(self, fn, tensors, size, options):
        op, direction = _SIGNATURES[fn]
        kind, ndim = OPS[op]
        first, name = tensors[0], ("x" if direction == "forward" else "grad_out")
        index = first.device.index  # set on every CUDA tensor; None reads as device 0, as in backends.cuda
        device = cuda.device_by_ordinal(0 if index is None else index, name)
        ops.check_device_option(device, options.get("device"), name)
        layout = _layout(first, ndim)
        inputs = [None if layout is not None else shapes.c_strides(first.shape, 1)]
        layout = layout or LAYOUT_NAMES[ndim][0]
        dtype = str(first.dtype).removeprefix("torch.")
        if direction == "forward":
            problem = Problem.create(op, tuple(first.shape), size, dtype, layout, shape_name=name)
            results = [(problem.output_shape, first.dtype)] + ([(problem.output_shape, torch.int64)] if kind == "max" else [])
        else:
            problem = ops._backward_problem(op, first, tuple(size), dtype, layout)
            results = [(problem.input_shape, first.dtype)]
            if kind == "max":
                inputs.append(_indices_copy(tensors[1], first, problem))
        self.problem = problem
        self.choice = dispatch.choose(problem, device, options.get("variant"), options.get("config"),
                                      on_miss=tuner.tune_on_miss)
        self.inputs = None if inputs == [None] * len(inputs) else tuple(inputs)
        self.outputs = tuple((shape, _strides(problem, shape), dtype) for shape, dtype in results)
        self.zero_fill = problem.is_empty and direction == "backward" and math.prod(problem.input_shape) > 0
        self.launch = None
        if not problem.is_empty:
            target = device.driver_target
            launch = dispatch.prepare(target, target, problem, self.choice)
            self.launch = target.prepared(launch.kernel, launch.groups, launch.block, len(tensors) + len(results))

    def __call__(self, tensors) -> tuple:
        device = tensors[0].device
        if self.inputs is not None:
            tensors = [t if strides is None else torch.empty_strided(t.shape, strides, dtype=t.dtype, device=device).copy_(t)
                       for t, strides in zip(tensors, self.inputs)]
        results = [torch.empty_strided(shape, strides, dtype=dtype, device=device) for shape, strides, dtype in self.outputs]
        if ops.poison_outputs:
            for r in results:
                r.fill_(ops.INDEX_POISON if r.dtype == torch.int64 else math.nan)
        if self.launch is not None:
            self.launch(current_raw_stream(device.index), *[t.data_ptr() for t in tensors], *[r.data_ptr() for r in results])
        elif self.zero_fill:
            results[0].zero_()
        return results


def _indices_copy(indices, grad_out, problem: Problem):
    """Max backward's ``indices``: a CUDA int64 tensor of ``grad_out``'s shape on its device (as
    the forward pass returns them); None if they are in ``problem``'s layout, else the strides
    they are copied to."""
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int64:
        raise TypeError(f"indices must be an int64 tensor, as returned with return_indices=True, got "
                        f"{getattr(indices, 'dtype', type(indices).__name__)}")
    if indices.device != grad_out.device:
        raise ValueError(f"indices must be on grad_out's device {grad_out.device}, got {indices.device}")
    if tuple(indices.shape) != tuple(grad_out.shape):
        raise ValueError(f"indices must have the shape of grad_out {tuple(grad_out.shape)}, got {tuple(indices.shape)}")
    if _layout(indices, problem.ndim) == problem.layout:
        return None
    return _strides(problem, tuple(indices.shape))
