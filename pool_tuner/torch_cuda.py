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
a signature has been seen (the first call compiles through pool_tuner's cubin cache,
``backends.cuda_compile``): calls work from any thread -- the autograd engine's backward thread, a DataLoader worker, a user's -- and inside
``torch.cuda.graph`` capture, where the launch is recorded into the graph and the results come
from the graph's memory pool.  Capture a signature only after calling it once (PyTorch asks for
such a warm-up before capture anyway): building a kernel is not allowed while a stream captures,
so a signature first met during capture is a ``ValueError`` that says so.
Results are ordered after the inputs' producers by the stream itself, as PyTorch's own ops are.

The multi-level ops take the same path (``plan_op``): a forward's results are the flat buffers of
every level (pool_tuner.pyramid), which ``pool_tuner.torch`` views level by level, and a
backward reads such flat buffers of the levels' gradients and indices.
"""

from __future__ import annotations

import math

import torch

from . import dispatch, ops, plans, tuner
from .backends import cuda
from .operations import DIRECTIONS, FUNCTIONS

#: PyTorch's current stream of a CUDA device as a raw ``cudaStream_t`` (the call Inductor's
#: generated code makes); CPU-only builds of PyTorch lack it and have no CUDA tensors.
current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

#: pool_tuner.ops function -> (op, direction): what ``call`` and ``plan`` take (the multi-level ops
#: and GeM, whose operator takes arguments, have no function of that form; ``plan_op`` takes any op
#: by name)
_SIGNATURES = {getattr(ops, name): (operation.name, direction.name)
               for name, (operation, direction) in FUNCTIONS.items() if operation.in_pytorch}

_PLANS = plans.PlanTable("torch_cuda.plans")


def call(fn, tensors, size, options: dict):
    """``fn`` (a pool_tuner.ops pooling function) on CUDA ``tensors`` -- ``[x]``, ``[grad_out]`` or
    ``[grad_out, indices]`` -- with ``size`` (the output size of a forward pass, the input shape
    of a backward one) and pool_tuner's keyword ``options`` (``device``, ``variant``,
    ``config``).  Returns what ``fn`` returns, as tensors: the result, or a max forward's
    ``(values, indices)``."""
    results = plan(fn, tensors, size, options)(tensors)
    return results if len(results) == 2 else results[0]


def plan(fn, tensors, size, options: dict) -> "_Plan":
    """The plan of a call of single-level ``fn`` (see ``call``), made and memoised on its first use."""
    return plan_op(*_SIGNATURES[fn], tensors, size, options)


def plan_op(op: str, direction: str, tensors, size, options: dict, key=None) -> "_Plan":
    """The plan of a call of any op -- single- or multi-level -- in ``direction``, made and
    memoised on its first use.  ``size`` is what ``plans.make_plan`` takes: the output size, the
    input shape, or a multi-level backward's ``(input_shape, output_size, layout)`` with its flat
    gradient (and indices) buffers as ``tensors``.  ``key``: the signature to memoise it under,
    where the caller has one of its own (``pool_tuner.torch``'s eager path, ``plan_of``)."""
    if key is None:
        try:
            key = (op, direction, ops._exact(size), _options_key(options),
                   *[(t.shape, t.stride(), t.dtype, t.device) for t in tensors])
        except (TypeError, AttributeError):  # an unhashable size or option: validated on every call
            key = None
    found = _PLANS.get(key) if key is not None else None
    if found is None:
        _refuse_capture(tensors[0])
        found = _Plan(op, direction, tensors, size, options)
        if key is not None:
            _PLANS.put(key, found)
    return found


def plan_of(key) -> "_Plan | None":
    """The plan memoised under signature ``key`` (see ``plan_op``), or None."""
    return _PLANS.get(key)


def _refuse_capture(first) -> None:
    """A first call may compile, load modules and tune -- none of which a stream being captured
    into a CUDA graph allows, and whose failure there would surface as an obscure capture error.
    So a plan miss during capture is refused with what to do instead."""
    if _capturing(first.device.index):
        raise ValueError(
            f"pool_tuner.torch met a new call signature ({tuple(first.shape)}, {first.dtype}, strides "
            f"{first.stride()}) while a CUDA graph is being captured on {first.device}: its first call compiles "
            "and loads kernels, which capture forbids; call each signature once before capture (PyTorch's "
            "warm-up on a side stream does that)")


def _capturing(index) -> bool:
    """Whether PyTorch's current stream of CUDA device ``index`` is being captured."""
    if not torch.cuda.is_available():  # a CPU-only PyTorch captures nothing
        return False
    with torch.cuda.device(index):
        return torch.cuda.is_current_stream_capturing()


def _options_key(options: dict) -> tuple:
    """The options as a memo key (``dispatch.config_key`` for the config)."""
    return options.get("device"), options.get("variant"), dispatch.config_key(options.get("config"))


class _Plan:
    """A call signature's ``plans.Plan`` with what the driver-API launch adds (see the module
    docstring): ``copies``, per input, None or the strides it is copied to first; ``outputs``,
    each result's (shape, strides, dtype); ``launch``, the prepared driver-API launch (None when
    there is nothing to compute)."""

    __slots__ = ("plan", "copies", "outputs", "launch")

    @property
    def problem(self):
        return self.plan.problem

    def __init__(self, op, direction, tensors, size, options):
        first, name = tensors[0], DIRECTIONS[direction].argument
        index = first.device.index  # set on every CUDA tensor; None reads as device 0, as in backends.cuda
        device = cuda.device_by_ordinal(0 if index is None else index, name)
        plans.check_device_option(device, options.get("device"), name)
        if len(tensors) > 1:
            _check_indices_tensor(tensors[1], first)
        target = device.driver_target
        found = plans.make_plan(op, direction, [plans.tensor_spec(t) for t in tensors], size, device, options.get("variant"),
                                options.get("config"), on_miss=tuner.tune_on_miss, names=(name,),
                                context=target, build_target=target)
        self.plan = found
        problem = found.problem
        copies = [plans.element_strides(problem, tuple(t.shape)) if reorder else None
                  for t, reorder in zip(tensors, found.reorder)]
        self.copies = None if copies == [None] * len(copies) else tuple(copies)
        self.outputs = tuple((r.shape, r.strides, torch.int64 if r.dtype == "int64" else first.dtype)
                             for r in found.results)
        self.launch = None
        if found.launch is not None:
            launch = found.launch
            self.launch = target.prepared(launch.kernel, launch.groups, launch.block, len(tensors) + len(self.outputs),
                                          launch.scalars)

    def __call__(self, tensors) -> list:
        device = tensors[0].device
        if self.copies is not None:
            tensors = [t if strides is None else torch.empty_strided(t.shape, strides, dtype=t.dtype, device=device).copy_(t)
                       for t, strides in zip(tensors, self.copies)]
        results = [torch.empty_strided(shape, strides, dtype=dtype, device=device) for shape, strides, dtype in self.outputs]
        if ops.poison_outputs:
            for r in results:
                r.fill_(ops.INDEX_POISON if r.dtype == torch.int64 else math.nan)
        if self.launch is not None:
            self.launch(current_raw_stream(device.index), *[t.data_ptr() for t in tensors], *[r.data_ptr() for r in results])
        elif self.plan.zero_fill:
            results[0].zero_()
        return results


def _check_indices_tensor(indices, grad_out) -> None:
    """Max backward's ``indices`` on CUDA: an int64 tensor on ``grad_out``'s device (the shape
    and layout rules are ``plans``')."""
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int64:
        raise TypeError(f"indices must be an int64 tensor, as returned with return_indices=True, got "
                        f"{getattr(indices, 'dtype', type(indices).__name__)}")
    if indices.device != grad_out.device:
        raise ValueError(f"indices must be on grad_out's device {grad_out.device}, got {indices.device}")
