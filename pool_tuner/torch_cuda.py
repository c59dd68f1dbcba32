"""CUDA tensors in ``pool_tuner.torch``: PyTorch's allocator and streams, one memoised plan per
call signature.

The first call of a signature -- the op and direction, each tensor's shape, strides, dtype and
device, the output size (or input shape) and pool_tuner's options -- validates it, dispatches,
builds the kernel for the driver-API launch path (``backends.cuda_driver``) and fixes the grid,
the argument layout and the results' shapes and strides: a ``plans.Plan``.  Every later call of
the signature is one dictionary lookup, ``new_empty_strided`` for each result on the input's
device (PyTorch's caching allocator) and one ``cuLaunchKernel`` on PyTorch's current stream of
that device: the plan's ``run``, with this module's allocator, launching the device's ``prepare``d
launch.

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


import functools

import torch

from . import ops, plans, tuner
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
    results = run(plan(fn, tensors, size, options), tensors)
    return results if len(results) == 2 else results[0]


def plan(fn, tensors, size, options: dict) -> plans.Plan:
    """The plan of a call of single-level ``fn`` (see ``call``), made and memoised on its first use."""
    return plan_op(*_SIGNATURES[fn], tensors, size, plans.options_text(**options))


def plan_op(op: str, direction: str, tensors, size, options: str, key=None) -> plans.Plan:
    """The plan of a call of any op -- single- or multi-level -- in ``direction``, made and
    memoised on its first use.  ``size`` is what ``plans.make_plan`` takes: the output size, the
    input shape, or a multi-level backward's ``(input_shape, output_size, layout)`` with its flat
    gradient (and indices) buffers as ``tensors``; ``options``: pool_tuner's options as
    ``plans.options_text`` writes them.  ``key``: the call's ``plans.signature``, where the
    caller has made it already."""
    if key is None:
        try:
            key = plans.signature(op, direction, size, options, tensors[0].device,
                                  tuple(map(plans.describe_tensor, tensors)))
        except (TypeError, AttributeError):  # an argument that is no tensor: validated on every call
            key = None
    found = _PLANS.get(key) if key is not None else None
    if found is None:
        _refuse_capture(tensors[0])
        found = _make(op, direction, tensors, size, dict(plans.options_of(options)))
        if key is not None:
            _PLANS.put(key, found)
    return found


#: ``plan_of(key)``: the plan memoised under signature ``key`` (see ``plan_op``), or None -- the
#: table's own lookup, bound here, since every warm eager call (forward and backward) makes it.
plan_of = _PLANS.get


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


def _make(op, direction, tensors, size, options: dict) -> plans.Plan:
    """A new signature's plan (``plans.make_plan``) on the device that holds the tensors, built
    in the current context once ``check_context`` has found it to be the one owning the tensors'
    memory -- PyTorch's, the primary one (a warm call under any other is refused by the launch)."""
    first, name = tensors[0], DIRECTIONS[direction].argument
    index = first.device.index  # set on every CUDA tensor; None reads as device 0, as in backends.cuda
    device = cuda.device_by_ordinal(0 if index is None else index, name)
    plans.check_device_option(device, options.get("device"), name)
    check_context(device, first, name)
    if len(tensors) > 1:
        _check_indices_tensor(tensors[1], first)
    return plans.make_plan(op, direction, [plans.tensor_spec(t) for t in tensors], size, device, options.get("variant"),
                           options.get("config"), on_miss=tuner.tune_on_miss, names=(name,))


def check_context(device, tensor, name: str) -> int:
    """The calling thread's current context (``device.current_context``: the primary one bound
    where none is current), which must own ``tensor``'s memory: the context
    ``cuPointerGetAttribute(CONTEXT)`` names for its data pointer, or, where the driver names none
    (PyTorch's stream-ordered ``cudaMallocAsync`` memory), the device's primary context, where
    PyTorch allocates.  Another current context -- ``pycuda.autoinit``'s -- is refused with a
    ``ContextError`` naming both, before any kernel is built into it.

    Why refuse rather than build and launch in the owning context: pool_tuner's one rule is to
    load, allocate and launch in the caller's current context, never pushing another around a
    call (docs/design.md, "CUDA contexts"); a kernel built into the current context and launched
    there on another context's memory reads and writes illegal addresses, which poison the context
    for good on a GPU.  Made once per plan, not on a plan's warm calls: a warm launch under another
    context is refused by the driver, as the kernel's module is the plan's context's
    (``cuda_driver.PreparedLaunch``).  GeM's backward, whose launch is prepared per context and
    not per plan, makes it on every call (two driver calls)."""
    current = device.current_context()
    owner = cuda.cuda_driver.pointer_context(tensor.data_ptr()) or cuda.cuda_driver.primary_context(device.ordinal)
    if owner != current:
        raise cuda.cuda_driver.ContextError(
            f"{name} is memory of CUDA context {owner:#x} (cuda:{device.ordinal}'s "
            f"{'primary' if owner == cuda.cuda_driver.primary_context(device.ordinal) else 'own'} context, where "
            f"PyTorch allocated it), but the calling thread's current CUDA context is {current:#x}; pool_tuner "
            f"runs in the current context: pop the other context (PyCUDA: context.pop(), or import "
            f"pycuda.autoprimaryctx instead of pycuda.autoinit) or make {name}'s context current before calling")
    return current


def run(found: plans.Plan, tensors: list, scalars: tuple | None = None) -> list:
    """Run a plan on CUDA ``tensors``: inputs in neither layout copied into the problem's memory
    order first, results from PyTorch's allocator on the input's device, one launch of the plan's
    prepared launch on PyTorch's current stream of that device.  ``scalars``: the call's run-time
    kernel arguments where not the plan's (``Problem.with_arguments``: GeM's p and eps)."""
    first = tensors[0]
    if any(found.reorder):
        tensors = [_in_memory_order(t, found) if reorder else t for t, reorder in zip(tensors, found.reorder)]
    return found.run(tensors, functools.partial(empty_result, first), _data_ptr, current_raw_stream(first.get_device()),
                     scalars)


#: A tensor's address (``plans.Plan.run``).
_data_ptr = torch.Tensor.data_ptr


def empty_result(like, result: plans.Result, fill) -> torch.Tensor:
    """A result (``plans.Plan.run``'s allocator): ``like.new_empty_strided`` -- PyTorch's allocator
    on ``like``'s device -- of its dtype or int64 for indices, filled with ``fill`` unless it is None."""
    if result.dtype == "int64":
        out = like.new_empty_strided(result.shape, result.strides, dtype=torch.int64)
    else:  # like's dtype and device, which new_empty_strided keeps without their being asked for
        out = like.new_empty_strided(result.shape, result.strides)
    return out if fill is None else out.fill_(fill)


def _in_memory_order(t, found: plans.Plan):
    """An input in neither layout (or indices in another layout than ``grad_out``), copied into
    the problem's memory order on its device."""
    strides = plans.element_strides(found.problem, tuple(t.shape))
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def _check_indices_tensor(indices, grad_out) -> None:
    """Max backward's ``indices`` on CUDA: an int64 tensor on ``grad_out``'s device (the shape
    and layout rules are ``plans``')."""
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int64:
        raise TypeError(f"indices must be an int64 tensor, as returned with return_indices=True, got "
                        f"{getattr(indices, 'dtype', type(indices).__name__)}")
    if indices.device != grad_out.device:
        raise ValueError(f"indices must be on grad_out's device {grad_out.device}, got {indices.device}")
