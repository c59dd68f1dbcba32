"""PyTorch integration: ``torch.library`` custom ops, functional forms and ``nn.Module``s.

Drop-in replacements for ``torch.nn.AdaptiveAvgPool{1,2,3}d`` / ``AdaptiveMaxPool{1,2,3}d`` and
``torch.nn.functional.adaptive_{avg,max}_pool{1,2,3}d`` that run pool_tuner's kernels, forward and
backward::

    import pool_tuner.torch as ptt
    pool = ptt.AdaptiveAvgPool2d((5, 7))   # repr: pool_tuner.torch.AdaptiveAvgPool2d(output_size=(5, 7))
    y = ptt.adaptive_max_pool2d(x, 3, return_indices=True)

* Same constructor arguments, attributes and results as PyTorch's (the modules subclass PyTorch's,
  so ``isinstance(m, torch.nn.AdaptiveAvgPool2d)`` holds); the repr names the class as
  ``pool_tuner.torch.…`` so that a printed model shows which layers run pool_tuner.  Keyword-only
  ``device=``/``variant=``/``config=`` choose the pool_tuner device and force the forward kernel
  (gradients use the dispatched backward kernels of the same device).
* The kernels are custom operators ``torch.ops.pool_tuner.adaptive_{avg,max}_pool{1,2,3}d`` and
  ``…_backward`` (``torch.library.custom_op``), with fake implementations (shape, dtype, memory
  format) and autograd registered on the op: ``torch.compile(fullgraph=True)`` and
  ``torch.export`` see them as single graph nodes, forward and backward.  The pool_tuner options
  travel in the schema as one string (``_encode_options``), so they survive compile and export.
* Gradients come from pool_tuner's deterministic gather kernels (no atomics), so they are
  bit-identical across runs and work under ``torch.use_deterministic_algorithms(True)``.
* Double backward: the avg backward ("adaptive unpooling") is linear and its adjoint is the
  forward, so its own backward runs the forward kernel; the max backward's backward is a gather
  by index.  ``gradcheck`` and ``gradgradcheck`` pass for all six ops (max: on tie-free inputs).
* CPU tensors cross to numpy without copies (bfloat16 through its int16 bits and
  ``ml_dtypes.bfloat16``); channels-last inputs (``torch.channels_last``/``channels_last_3d``,
  and likewise channel-innermost 1d and batch-less tensors) are read in place, other strides
  copied to contiguous first.  Results and gradients have PyTorch's memory format, which users
  ``.view()`` on: channels-last only of a batched 1d or 2d pooling's channels-last input,
  contiguous otherwise (``_pytorch_channels_last``).  CUDA tensors go through
  ``pool_tuner.torch_cuda``: results from PyTorch's caching allocator, kernels launched on
  PyTorch's current stream, from any thread and inside CUDA graph capture.
* Indices are int64 positions within each pooled plane/volume, exactly as PyTorch's.
* During ``torch.onnx.export`` the functional forms and modules trace an exact decomposition into
  standard ONNX operators instead (``pool_tuner.onnx``): ONNX runtimes cannot run pool_tuner.
* TorchScript is refused with a message pointing to ``torch.compile`` / ``torch.export``.

Importing ``pool_tuner`` never imports torch; importing this module does.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import operator

import numpy as np

try:
    import torch
except ModuleNotFoundError as error:  # only torch itself missing, not something torch imports
    if error.name != "torch":
        raise
    raise ImportError(
        'pool_tuner.torch needs PyTorch, which is not installed: pip install "pool-tuner[torch]"'
    ) from error

from . import avgmax as _avgmax
from . import fused as _fused
from . import gem as _gem
from . import memo as _memo
from . import plans as _plans
from . import pyramid as _pyramid
from . import torch_cpu as _torch_cpu
from . import torch_cuda as _torch_cuda
from . import torch_timm as _torch_timm
from .backends import cuda as _cuda_backend
from .backends import env_device_setting
from .backends import resolve_device as _resolve_device
from .decomposition import decompose
from .operations import BACKWARD, FORWARD, SINGLE_LEVEL, find
from .problem import LAYOUT_NAMES, OPS, Problem
from .shapes import RANK_NAMES, resolve_output_size
from .variants import get_variant

__all__ = [
    "AdaptiveAvgPool1d",
    "AdaptiveAvgPool2d",
    "AdaptiveAvgPool3d",
    "AdaptiveMaxPool1d",
    "AdaptiveMaxPool2d",
    "AdaptiveMaxPool3d",
    "adaptive_avg_pool1d",
    "adaptive_avg_pool2d",
    "adaptive_avg_pool3d",
    "adaptive_max_pool1d",
    "adaptive_max_pool2d",
    "adaptive_max_pool3d",
    "replace_pooling",
    "AdaptiveAvgMaxPool2d",
    "GlobalPool2d",
    "PyramidPooling",
    "adaptive_avg_pool_pyramid",
    "adaptive_avgmax_pool2d",
    "adaptive_max_pool_pyramid",
    "explain_pooling",
    "fuse_sibling_pools",
    "global_pool2d",
    "fused_adaptive_pools",
    "AdaptiveGeMPool1d",
    "AdaptiveGeMPool2d",
    "AdaptiveGeMPool3d",
    "adaptive_gem_pool1d",
    "adaptive_gem_pool2d",
    "adaptive_gem_pool3d",
]

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
KINDS = ("avg", "max")
NDIMS = (1, 2, 3)
#: What TorchScript users are told to use instead (modules refuse ``torch.jit.script``).
NO_TORCHSCRIPT = (
    "pool_tuner.torch layers cannot be compiled by torch.jit.script (TorchScript cannot call "
    "pool_tuner's Python host code); use torch.compile(model) to compile, torch.export.export(model, "
    "args) to export a graph, or pool_tuner.onnx.export / torch.onnx.export for ONNX"
)


# --------------------------------------------------------------------------------------------
# Tensor <-> array, without copies


def _bfloat16():
    import ml_dtypes  # only needed for bfloat16 tensors

    return ml_dtypes.bfloat16


def _check_tensor(t, name: str):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype float32, float64, float16 or bfloat16, got {t.dtype}")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on device {t.device}; pool_tuner.torch takes CPU and CUDA tensors")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")


# --------------------------------------------------------------------------------------------
# Memory format: the fake (meta) implementations and the real ones must agree on the strides of
# every result, so both derive them from here.  Two rules: the layout pool_tuner's kernels read an
# input in (``_is_channels_last``), and the layout of what pool_tuner.torch returns, which is
# PyTorch's (``_pytorch_channels_last``) -- results are copied where the two part.


def _is_channels_last(t: torch.Tensor, ndim: int) -> bool:
    """Whether pool_tuner's kernels read ``t`` as channels-last (in place, and write their results
    so): the channel axis innermost in memory, the others in order (``torch.channels_last`` for
    4-d, ``channels_last_3d`` for 5-d, and the same for 1d and batch-less inputs).  Contiguous
    wins ties, as in ``pool_tuner.ops.memory_layout``; any other strides are copied to contiguous."""
    return not t.is_contiguous() and t.movedim(t.dim() - ndim - 1, -1).is_contiguous()


def _pytorch_channels_last(rank: int, ndim: int, read_channels_last: bool) -> bool:
    """PyTorch's rule for the layout of an adaptive pooling's results and input gradient, which
    users ``.view()`` and so is part of its semantics: channels-last where the input of a batched
    1d or 2d pooling (``rank`` ``ndim + 2``) is (``torch.channels_last``; in 1d, the channel axis
    innermost), contiguous for every other input -- batch-less ones, and 3d pooling's
    ``channels_last_3d`` -- whichever layout pool_tuner's kernel read it in
    (``read_channels_last``, ``_is_channels_last``)."""
    return read_channels_last and ndim < 3 and rank == ndim + 2


def _channels_last_result(t: torch.Tensor, ndim: int) -> bool:
    """Whether PyTorch gives an adaptive pooling of ``t`` channels-last results (``_pytorch_channels_last``)."""
    return _pytorch_channels_last(t.dim(), ndim, _is_channels_last(t, ndim))


def _channels_last_gradient(channels_last_result: bool, averages: bool, output_size) -> bool:
    """Whether PyTorch gives the input of an adaptive pooling a channels-last gradient: where it
    gives channels-last results (``channels_last_result``), but not for an average (``averages``:
    every level of the pooling is one) to all-ones, which PyTorch computes as a mean, whose
    gradient is contiguous."""
    return channels_last_result and not (averages and all(n == 1 for n in output_size))


def _problem_channels_last(problem: Problem) -> bool:
    """``_pytorch_channels_last`` of a plan's problem: whether its results are returned as the
    kernel writes them, read off the problem (a warm eager call looks at no strides)."""
    return _pytorch_channels_last(len(problem.input_shape), problem.ndim, problem.channels_last)


def _in_pytorch_layout(results: list, problem: Problem) -> list:
    """A forward plan's results, written in the layout its kernel read the input in, in PyTorch's
    (``_pytorch_channels_last``): copied to contiguous where the kernel read a channels-last input
    whose results PyTorch gives contiguous."""
    if problem.channels_last and not _problem_channels_last(problem):
        return [result.contiguous() for result in results]
    return results


def _empty(shape, like: torch.Tensor, dtype, channels_last: bool, ndim: int) -> torch.Tensor:
    """An uninitialised result of ``shape`` on ``like``'s device, channels-last or contiguous."""
    if not channels_last:
        return torch.empty(shape, dtype=dtype, device=like.device)
    c = len(shape) - ndim - 1
    memory = list(shape[:c]) + list(shape[c + 1:]) + [shape[c]]
    return torch.empty(memory, dtype=dtype, device=like.device).movedim(-1, c)


def _in_input_layout(grad_out: torch.Tensor, output_strides) -> torch.Tensor:
    """``grad_out`` in the layout of the forward's input, which is its result's (strides
    ``output_strides``), copied where it is not: the backward writes the input's gradient in the
    layout it reads ``grad_out`` in, and PyTorch's pooling backwards give the input's gradient the
    input's memory format whatever ``grad_out``'s (a channels-last network's gradients stay
    channels-last).  Strides of axes of size 1 do not count: a 1x1 result's two layouts are the
    same memory, so its ``grad_out`` is read as it is (and the gradient comes contiguous)."""
    if _plans.same_strides(grad_out.shape, grad_out.stride(), output_strides):
        return grad_out
    return torch.empty_strided(grad_out.shape, output_strides, dtype=grad_out.dtype,
                               device=grad_out.device).copy_(grad_out)


def _in_layout(t: torch.Tensor, channels_last: bool, ndim: int) -> torch.Tensor:
    """``t`` in the memory format its fake implementation promised: as it is where the kernel
    wrote it so (the layout it read its input in, ``_is_channels_last``), else copied."""
    if _is_channels_last(t, ndim) == channels_last and (channels_last or t.is_contiguous()):
        return t
    return _copied(t, channels_last, ndim)


def _copied(t: torch.Tensor, channels_last: bool, ndim: int) -> torch.Tensor:
    """A copy of ``t``, channels-last or contiguous."""
    return _empty(t.shape, t, t.dtype, channels_last, ndim).copy_(t)


def _run(op: str, direction: str, tensors: list, size, options: str) -> list:
    """Run pool_tuner's kernel of ``op`` on ``tensors`` (``[x]``, ``[grad_out]`` or ``[grad_out,
    indices]``): CPU tensors through ``pool_tuner.torch_cpu``, CUDA tensors through
    ``pool_tuner.torch_cuda`` (PyTorch's allocator and current stream, any thread, CUDA graphs),
    each plan memoised under the call's ``plans.signature``.  Returns the results as a list of
    tensors."""
    first = tensors[0]
    descriptions = tuple(map(_describe, tensors))
    if first.is_cuda:
        key = _signature(op, direction, size, options, first.device, descriptions)
        return _torch_cuda.run(_torch_cuda.plan_op(op, direction, tensors, size, options, key), tensors)
    return _torch_cpu.run(_cpu_plan(op, direction, tensors, size, options, descriptions), tensors)


def _cpu_plan(op: str, direction: str, tensors: list, size, options: str, descriptions=None):
    """The memoised plan of a call on CPU tensors, under its ``plans.signature``."""
    descriptions = tuple(map(_describe, tensors)) if descriptions is None else descriptions
    key = _signature(op, direction, size, options, env_device_setting(), descriptions)
    return _torch_cpu.plan(op, direction, tensors, size, options, key)


# --------------------------------------------------------------------------------------------
# pool_tuner options as one schema string (``plans.options_text``), so a compiled or exported graph
# carries them as a constant argument of the op.


def _encode_options(device=None, variant=None, config=None) -> str:
    return _plans.options_text(device, variant, config)


# A constant of the graph: torch.compile does not trace json.  This is what
# ``torch.compiler.assume_constant_result`` does, without the import of ``torch._dynamo`` that the
# decorator makes at once and that would take longer than the rest of ``import pool_tuner.torch``
# (tests/test_torch_toolchain.py compiles a functional form with options under fullgraph=True).
_encode_options._dynamo_marked_constant = True


@functools.lru_cache(maxsize=256)
def _backward_options(options: str) -> str:
    """The options of every kernel of the graph but the forward: the device only (a forced
    variant or config names a forward kernel of one shape)."""
    return _encode_options(device=dict(_plans.options_of(options)).get("device"))


# --------------------------------------------------------------------------------------------
# The custom ops: torch.ops.pool_tuner.adaptive_{avg,max}_pool{1,2,3}d and ..._backward


def _custom_op_name(operation, backward: bool) -> str:
    """The qualified name of the custom op of ``operation``'s forward or backward pass."""
    return "pool_tuner::" + (BACKWARD if backward else FORWARD).op_name(operation)


#: (selects, backward) -> the schema of a single-level custom op
_SCHEMAS = {
    (False, False): "(Tensor input, SymInt[] output_size, str options) -> Tensor",
    (True, False): "(Tensor input, SymInt[] output_size, str options) -> (Tensor, Tensor)",
    (False, True): "(Tensor grad_out, SymInt[] input_shape, str options) -> Tensor",
    (True, True): "(Tensor grad_out, Tensor indices, SymInt[] input_shape, str options) -> Tensor",
}

#: (kind, ndim, backward) -> the registered op (a ``torch.library.CustomOpDef``)
_OPS: dict = {}


def _define(operation, backward: bool, real, fake):
    op = torch.library.custom_op(_custom_op_name(operation, backward), real, mutates_args=(),
                                 device_types=("cpu", "cuda"), schema=_SCHEMAS[operation.selects, backward])
    op.register_fake(fake)
    _OPS[operation.kind, operation.ndim, backward] = op
    return op


def _register(operation):
    """Define the forward and backward ops of one single-level operation and wire their autograd."""
    op, ndim, selects = operation.name, operation.ndim, operation.selects

    def output_shape(input, output_size):
        return list(input.shape[: input.dim() - ndim]) + list(output_size)

    if not selects:
        def forward(input, output_size, options):
            (result,) = _run(op, "forward", [input], tuple(output_size), options)
            return _in_layout(result, _channels_last_result(input, ndim), ndim)

        def forward_fake(input, output_size, options):
            return _empty(output_shape(input, output_size), input, input.dtype, _channels_last_result(input, ndim),
                          ndim)

        def backward(grad_out, input_shape, options):
            (result,) = _run(op, "backward", [grad_out], tuple(input_shape), options)
            return _in_layout(result, _channels_last_result(grad_out, ndim), ndim)
    else:
        def forward(input, output_size, options):
            values, indices = _run(op, "forward", [input], tuple(output_size), options)
            channels_last = _channels_last_result(input, ndim)
            return _in_layout(values, channels_last, ndim), _in_layout(indices, channels_last, ndim)

        def forward_fake(input, output_size, options):
            shape, channels_last = output_shape(input, output_size), _channels_last_result(input, ndim)
            return (_empty(shape, input, input.dtype, channels_last, ndim),
                    _empty(shape, input, torch.int64, channels_last, ndim))

        def backward(grad_out, indices, input_shape, options):
            (result,) = _run(op, "backward", [grad_out, indices], tuple(input_shape), options)
            return _in_layout(result, _channels_last_result(grad_out, ndim), ndim)

    def backward_fake(grad_out, *rest):
        input_shape = rest[-2]
        return _empty(list(input_shape), grad_out, grad_out.dtype, _channels_last_result(grad_out, ndim), ndim)

    forward_op = _define(operation, False, forward, forward_fake)
    backward_op = _define(operation, True, backward, backward_fake)

    def forward_setup(ctx, inputs, output):
        input, output_size, ctx.options = inputs
        ctx.input_shape, ctx.output_strides = list(input.shape), (output[0] if selects else output).stride()
        ctx.channels_last_gradient = _channels_last_gradient(_channels_last_result(input, ndim), not selects,
                                                             output_size)
        if selects:
            ctx.save_for_backward(output[1])

    def in_gradient_layout(ctx, grad_in):
        """The backward op's gradient, laid out as its ``grad_out`` (the result's layout), in
        PyTorch's layout for the input's gradient: copied where a result whose pooled axes are all
        1 -- both layouts, read as contiguous -- had a max pooling's gradient come contiguous."""
        return _in_layout(grad_in, ctx.channels_last_gradient, ndim)

    if not selects:
        def forward_grad(ctx, grad_out):
            grad_out = _in_input_layout(grad_out, ctx.output_strides)
            grad_in = backward_op(grad_out, ctx.input_shape, _backward_options(ctx.options))
            return in_gradient_layout(ctx, grad_in), None, None

        def backward_setup(ctx, inputs, output):
            grad_out, _, ctx.options = inputs
            ctx.output_size = list(grad_out.shape[grad_out.dim() - ndim:])

        def backward_grad(ctx, grad_grad_in):
            """Adaptive unpooling is linear; its adjoint is the forward pooling."""
            return forward_op(grad_grad_in, ctx.output_size, ctx.options), None, None
    else:
        def forward_grad(ctx, grad_out, _grad_indices):
            (indices,) = ctx.saved_tensors
            grad_out = _in_input_layout(grad_out, ctx.output_strides)
            grad_in = backward_op(grad_out, indices, ctx.input_shape, _backward_options(ctx.options))
            return in_gradient_layout(ctx, grad_in), None, None

        def backward_setup(ctx, inputs, output):
            _, indices, input_shape, _ = inputs
            ctx.input_shape = list(input_shape)
            ctx.save_for_backward(indices)

        def backward_grad(ctx, grad_grad_in):
            """The max backward scatters grad_out to the argmax positions; its adjoint gathers
            grad_grad_in at the indices, plane by plane (pure index math, deterministic)."""
            (indices,) = ctx.saved_tensors
            batch = ctx.input_shape[: len(ctx.input_shape) - ndim]
            flat_in = grad_grad_in.reshape(batch + [math.prod(ctx.input_shape[len(batch):])])
            flat_idx = indices.reshape(batch + [math.prod(indices.shape[len(batch):])])
            return torch.gather(flat_in, -1, flat_idx).reshape(indices.shape), None, None, None

    forward_op.register_autograd(forward_grad, setup_context=forward_setup)
    backward_op.register_autograd(backward_grad, setup_context=backward_setup)


for _op in SINGLE_LEVEL:
    _register(OPS[_op])


# --------------------------------------------------------------------------------------------
# Functional forms (torch.nn.functional's signatures, plus pool_tuner's keyword arguments)


def _check_input(input, ndim: int, output_size) -> list:
    """Validate a functional call's arguments, named as the caller wrote them, and return the
    output size with ``None`` entries resolved (ints, or SymInts of dynamic input sizes)."""
    return list(resolve_output_size(output_size, _pooled_sizes(input, ndim), "output_size"))


def _pooled_sizes(input, ndim: int) -> tuple:
    """The sizes of ``input``'s ``ndim`` pooled axes, once ``input`` is checked to be a tensor
    of a rank ``ndim``-d pooling takes, with no pooled axis empty."""
    _check_tensor(input, "input")
    rank = input.dim()
    if rank != ndim + 1 and rank != ndim + 2:
        raise ValueError(f"input must be {ndim + 1}-d or {ndim + 2}-d {RANK_NAMES[ndim]} for {ndim}d pooling, "
                         f"got shape {tuple(input.shape)}")
    spatial = tuple(input.shape[input.dim() - ndim:])
    if any(size == 0 for size in spatial):
        raise ValueError(f"input has a pooled dimension of size 0 (shape {tuple(input.shape)}); "
                         f"pooled dimensions must be >= 1")
    return spatial


def _exported_to_onnx() -> bool:
    return torch.onnx.is_in_onnx_export()


def _check_no_functorch_transform():
    """torch.func transforms (grad, vmap, jacrev, ...) cannot run custom ops whose autograd is
    registered with ``register_autograd`` (PyTorch 2.13); say so instead of PyTorch's message
    about ``setup_context``."""
    if not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None:
        raise RuntimeError(
            "pool_tuner.torch pooling cannot run inside torch.func transforms (grad, vmap, jacrev, ...): its "
            "kernels are torch.library custom ops, which PyTorch's transforms do not differentiate; use "
            "torch.autograd.grad / .backward() for gradients"
        )


#: (kind, ndim) -> its single-level operation
_OPERATIONS = {(kind, ndim): find(kind, ndim) for kind in KINDS for ndim in NDIMS}


#: What a plain eager call is told apart by (``_pool``), bound once.  Dynamo reads
#: ``is_dynamo_compiling`` as True while it traces (and, asked first, looks at nothing else);
#: everything else that traces -- ``torch.jit.trace``, ``torch.func``, export's fake tensors and
#: dispatch modes -- is told by the C functions and the tensor's type.
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_tracing_state = torch._C._get_tracing_state
_functorch_level = torch._C._functorch.peek_interpreter_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack
_deterministic = torch._C._get_deterministic_algorithms
_grad_enabled = torch.is_grad_enabled
_signature, _describe, _tensor_signature = _plans.signature, _plans.describe_tensor, _plans.tensor_signature
_Tensor = torch.Tensor
#: The races' winners (``torch_cpu.WINNERS``, a memo table) and PyTorch's kernels, by op.
_winner_of, _PYTORCH, _PYTORCH_KERNELS = _torch_cpu.WINNERS.get, _torch_cpu.PYTORCH, _torch_cpu.PYTORCH_KERNELS
_mark_winner_used = _torch_cpu.WINNERS.mark_used
_FORWARD, _BACKWARD = FORWARD.name, BACKWARD.name


def _plain_eager(input) -> bool:
    """Whether a call on ``input`` is a plain eager one: not traced, compiled, exported,
    transformed by torch.func or under a dispatch mode."""
    return (not _is_dynamo_compiling() and type(input) is _Tensor and _tracing_state() is None
            and _functorch_level() is None and not _dispatch_modes())


def _pool(operation, input, output_size, return_indices: bool, options: str):
    """A single-level forward: a plain eager call on a CPU or CUDA tensor through its plan,
    skipping the custom op's dispatch layers (``_eager_cpu_pool``, ``_eager_cuda_pool``);
    everything else through the custom op."""
    if _plain_eager(input):
        if input.is_cpu:
            return _eager_cpu_pool(operation, input, output_size, return_indices, options)
        if input.is_cuda:
            return _eager_cuda_pool(operation, input, output_size, return_indices, options)
    output_size = _check_input(input, operation.ndim, output_size)
    _check_no_functorch_transform()
    if _exported_to_onnx():
        # torch.onnx.export: standard ONNX operators instead of the kernels (pool_tuner.decomposition)
        if return_indices:
            raise ValueError(f"{operation.name} with return_indices=True cannot be exported to ONNX "
                             f"(pool_tuner.onnx exports values only)")
        return decompose(operation.kind, operation.ndim, input, output_size, f"pool_tuner.torch.{operation.name}")
    if _tracing_state() is not None and any(isinstance(size, _Tensor) for size in output_size):
        return _traced_keeping_axes(operation, input, output_size, return_indices, options)
    return _custom_op_pool(operation, input, output_size, return_indices, options)


def _traced_keeping_axes(operation, input, output_size: list, return_indices: bool, options: str):
    """A forward under ``torch.jit.trace`` whose output size keeps axes (``None`` entries): those
    resolve to the traced input's sizes, which are tensors there, and the custom op's ``SymInt[]``
    argument cannot take them (PyTorch's tracer asserts). Adaptive pooling to an axis's own size is
    the identity along it, so the kept axes are folded into the batch and the others pooled by the
    custom op of their rank; the trace follows the input's sizes along the kept axes, as PyTorch's
    own layers' traces do. Max indices are made indices into the whole pooled plane again."""
    ndim = operation.ndim
    lead = input.dim() - ndim
    spatial = [input.shape[lead + axis] for axis in range(ndim)]
    kept = [axis for axis, size in enumerate(output_size) if isinstance(size, _Tensor)]
    pooled = [axis for axis in range(ndim) if axis not in kept]
    channels_last = _channels_last_result(input, ndim)  # fixed in the trace

    def in_layout(tensor):
        """``tensor`` in PyTorch's layout, by operations the trace records with the input's sizes."""
        if not channels_last:
            return tensor.contiguous()
        return tensor.movedim(lead - 1, -1).contiguous().movedim(-1, lead - 1)

    if not pooled:  # every axis kept: the identity (indices: each position its own)
        values = in_layout(input.clone())
        if not return_indices:
            return values
        plane = functools.reduce(operator.mul, spatial)
        return values, in_layout(torch.arange(plane, device=input.device).reshape(spatial).expand(input.shape))
    order = list(range(lead)) + [lead + axis for axis in kept + pooled]
    folded = input.permute(order)
    outer = folded.shape[:lead + len(kept)]
    result = _custom_op_pool(find(operation.kind, len(pooled)), folded.flatten(0, lead + len(kept) - 1),
                             [output_size[axis] for axis in pooled], return_indices, options)
    inverse = [order.index(dim) for dim in range(input.dim())]

    def unfolded(tensor):
        return in_layout(tensor.unflatten(0, outer).permute(inverse))

    if not return_indices:
        return unfolded(result)
    values, indices = result
    # an index into the pooled axes' plane -> its coordinates -> an index into the whole plane
    full = torch.zeros_like(indices)
    for position, axis in enumerate(pooled):
        inner = functools.reduce(operator.mul, [spatial[a] for a in pooled[position + 1:]], 1)
        full = full + (indices // inner) % spatial[axis] * _plane_stride(spatial, axis)
    full = unfolded(full)
    for axis in kept:
        shape = [1] * input.dim()
        shape[lead + axis] = -1
        full = full + torch.arange(spatial[axis], device=input.device).reshape(shape) * _plane_stride(spatial, axis)
    return unfolded(values), in_layout(full)


def _plane_stride(spatial: list, axis: int):
    """The step of a row-major index into a plane of ``spatial`` sizes along ``axis``."""
    return functools.reduce(operator.mul, spatial[axis + 1:], 1)


def _eager_cpu_pool(operation, input, output_size, return_indices: bool, options: str):
    """An eager forward on a CPU tensor through its plan (``pool_tuner.torch_cpu``), without the
    custom op's dispatch layers where no gradient is needed.  A new signature's plan may race
    PyTorch's kernel before its first result (``torch_cpu.race_pytorch``), never under
    ``torch.use_deterministic_algorithms(True)``, where pool_tuner's kernel runs untimed.

    This runs on every call of a layer, inside models whose other layers leave the caches cold:
    each object it touches costs, so a warm call is its signature and one lookup, which gives
    either PyTorch's kernel or the plan (whose entry the call then marks used)."""
    op = operation.name
    key = _tensor_signature(op, _FORWARD, output_size, options, env_device_setting(), input)
    if not _deterministic():
        try:
            found = _winner_of(key)
        except TypeError:  # an unhashable output size: the custom op's path validates it
            return _custom_op_pool(operation, input, _check_input(input, operation.ndim, output_size), return_indices,
                                   options)
        if found is None:  # a new signature (or one met only under deterministic algorithms): raced now
            found = _torch_cpu.winner(op, input, tuple(_check_input(input, operation.ndim, output_size)), options, key)
        if found is _PYTORCH:  # the race's winner: PyTorch's own kernel runs this layer
            if type(output_size) is int:
                kernel, selects = _PYTORCH_KERNELS[op]
                result = kernel(input, output_size)
                return result if not selects or return_indices else result[0]
            form, size = _torch_cpu.PYTORCH_FORMS[op], _pytorch_size(operation, input, output_size)
            return form(input, size, True) if return_indices else form(input, size)
        _mark_winner_used(key)
    else:
        found = _torch_cpu.plan_of(key)
        if found is None:
            size = tuple(_check_input(input, operation.ndim, output_size))
            found = _torch_cpu.plan(op, _FORWARD, [input], size, options, key)
    if input.requires_grad and _grad_enabled():
        output_size = list(found.problem.output_shape[-operation.ndim:])
        return _custom_op_pool(operation, input, output_size, return_indices, options)
    results = _in_pytorch_layout(_torch_cpu.run(found, [input]), found.problem)
    return (results[0], results[1]) if return_indices else results[0]


def _pytorch_size(operation, input, output_size):
    """``output_size`` as PyTorch's functional forms take it, for a call whose race PyTorch's
    kernel won: as given where it is an int or a sequence of ints, which they take unchanged, else
    resolved as pool_tuner's validation resolves it (``None`` entries, which PyTorch's 1d forms
    refuse; numpy integers, which its 2d and 3d forms refuse), so that a call is accepted or refused
    the same whichever side won its race."""
    if type(output_size) is int or (type(output_size) in (tuple, list) and all(type(v) is int for v in output_size)):
        return output_size
    return _check_input(input, operation.ndim, output_size)


def _pytorch_runs(operation, input, output_size, options: str, form=None) -> bool:
    """Whether PyTorch's own computation runs a forward of ``operation`` on ``input``: a plain
    eager call on a CPU tensor whose signature's race PyTorch's won -- raced now, before the
    signature's first result, where it is new (``torch_cpu.race_pytorch``; see its "one answer
    per input").  Never under ``torch.use_deterministic_algorithms(True)``, where pool_tuner's
    kernel runs untimed.  ``form(input, size)``: the computation that runs where PyTorch's wins,
    and so the one the race times, where it is not the op's ``torch_cpu.PYTORCH_FORMS``; its
    races are decided apart from the op's own."""
    if not (_plain_eager(input) and input.is_cpu) or _deterministic():
        return False
    key = _tensor_signature(operation.name, _FORWARD, output_size, options, env_device_setting(), input)
    try:
        winner = _winner_of(key if form is None else (key, form))
    except TypeError:  # an unhashable output size: the custom op's path validates it
        return False
    if winner is None:
        levels = _levels_of(operation, input, output_size, "output_size")
        size = levels if operation.pyramid else levels[0]
        # the plan under the key of the path that runs it where pool_tuner's side wins: a single-level
        # op's eager path (_eager_cpu_pool) keys it as this call, a multi-level op's custom op by _cpu_plan
        plan_key = key if not operation.multi_level else _signature(operation.name, _FORWARD, size, options,
                                                                      env_device_setting(), (_describe(input),))
        winner = _torch_cpu.winner(operation.name, input, size, options, key, form, plan_key)
    return winner is _PYTORCH


def _eager_cuda_pool(operation, input, output_size, return_indices: bool, options: str):
    """An eager forward on a CUDA tensor through its plan (``pool_tuner.torch_cuda``): a warm call
    is its signature, one lookup, the results' allocation and one launch; with a gradient to
    compute, inside ``_EagerPooling`` (an ``autograd.Function``) instead of the custom op."""
    key = _tensor_signature(operation.name, _FORWARD, output_size, options, input.device, input)
    found = _torch_cuda.plan_of(key)
    if found is None:
        size = tuple(_check_input(input, operation.ndim, output_size))
        found = _torch_cuda.plan_op(operation.name, _FORWARD, [input], size, options, key)
    if input.requires_grad and _grad_enabled():
        results = _apply_eager_pooling(_unwrap_if_dead(input), found, options)
    else:
        results = _in_pytorch_layout(_torch_cuda.run(found, [input]), found.problem)
    return (results[0], results[1]) if return_indices else results[0]


class _EagerPooling(torch.autograd.Function):
    """The autograd of an eager CUDA forward (``_eager_cuda_pool``): the forward is the plan's
    launch; the backward launches the backward kernel through its own plan, or, where the
    backward is itself differentiated (``create_graph=True``), runs the backward custom op, whose
    autograd gives the double backward."""

    @staticmethod
    def forward(ctx, input, found, options: str):
        problem = found.problem
        results = _in_pytorch_layout(_torch_cuda.run(found, [input]), problem)
        ctx.operation, ctx.input_shape = problem.operation, tuple(input.shape)
        ctx.output_strides = results[0].stride()
        ctx.channels_last_gradient = _channels_last_gradient(
            _problem_channels_last(problem), not problem.operation.selects, problem.output_shape[-problem.ndim:])
        ctx.options = _backward_options(options)
        if len(results) > 1:  # a max pooling's indices: what its backward reads, never differentiated
            ctx.mark_non_differentiable(results[1])
            ctx.save_for_backward(results[1])
        return tuple(results)

    @staticmethod
    def backward(ctx, grad_out, *_grad_indices):
        tensors = [_in_input_layout(grad_out, ctx.output_strides), *ctx.saved_tensors]
        operation, channels_last = ctx.operation, ctx.channels_last_gradient
        if _grad_enabled():
            grad_in = _OPS[operation.kind, operation.ndim, True](*tensors, list(ctx.input_shape), ctx.options)
            return _in_layout(grad_in, channels_last, operation.ndim), None, None
        key = _signature(operation.name, _BACKWARD, ctx.input_shape, ctx.options, grad_out.device,
                         tuple(map(_describe, tensors)))
        found = _torch_cuda.plan_of(key)
        if found is None:
            found = _torch_cuda.plan_op(operation.name, _BACKWARD, tensors, ctx.input_shape, ctx.options, key)
        (grad_in,) = _torch_cuda.run(found, tensors)
        if found.problem.channels_last != channels_last:  # the kernel's layout: a warm call reads no strides
            grad_in = _copied(grad_in, channels_last, operation.ndim)
        return grad_in, None, None


#: ``_EagerPooling.apply`` without ``autograd.Function.apply``'s Python layer, which a plain eager
#: call (``_plain_eager``: no torch.func transform active) needs only for its unwrapping of
#: tensors a dead transform left behind (``_unwrap_if_dead``, one C call) -- it binds default
#: arguments only for a ``setup_context``, which this function has not.  The training step
#: of a model runs it on every pooling layer.
_apply_eager_pooling = super(torch.autograd.Function, _EagerPooling).apply
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def _custom_op_pool(operation, input, output_size: list, return_indices: bool, options: str):
    """The forward through the custom op (``torch.ops.pool_tuner.…``), with its autograd."""
    op = _OPS[operation.kind, operation.ndim, False]
    if not operation.selects:
        return op(input, output_size, options)
    values, indices = op(input, output_size, options)
    return (values, indices) if return_indices else values


def adaptive_avg_pool1d(input, output_size, *, device=None, variant=None, config=None):
    """``torch.nn.functional.adaptive_avg_pool1d`` on pool_tuner's kernels; ``device=`` (a
    pool_tuner device id), ``variant=`` and ``config=`` are passed to ``pool_tuner.adaptive_avg_pool1d``."""
    return _pool(_OPERATIONS["avg", 1], input, output_size, False, _encode_options(device, variant, config))


def adaptive_avg_pool2d(input, output_size, *, device=None, variant=None, config=None):
    """``torch.nn.functional.adaptive_avg_pool2d`` on pool_tuner's kernels (see ``adaptive_avg_pool1d``)."""
    return _pool(_OPERATIONS["avg", 2], input, output_size, False, _encode_options(device, variant, config))


def adaptive_avg_pool3d(input, output_size, *, device=None, variant=None, config=None):
    """``torch.nn.functional.adaptive_avg_pool3d`` on pool_tuner's kernels (see ``adaptive_avg_pool1d``)."""
    return _pool(_OPERATIONS["avg", 3], input, output_size, False, _encode_options(device, variant, config))


def adaptive_max_pool1d(input, output_size, return_indices=False, *, device=None, variant=None, config=None):
    """``torch.nn.functional.adaptive_max_pool1d`` on pool_tuner's kernels: returns the pooled
    values, and with ``return_indices=True`` also their int64 indices, as PyTorch."""
    return _pool(_OPERATIONS["max", 1], input, output_size, return_indices, _encode_options(device, variant, config))


def adaptive_max_pool2d(input, output_size, return_indices=False, *, device=None, variant=None, config=None):
    """``torch.nn.functional.adaptive_max_pool2d`` on pool_tuner's kernels (see ``adaptive_max_pool1d``)."""
    return _pool(_OPERATIONS["max", 2], input, output_size, return_indices, _encode_options(device, variant, config))


def adaptive_max_pool3d(input, output_size, return_indices=False, *, device=None, variant=None, config=None):
    """``torch.nn.functional.adaptive_max_pool3d`` on pool_tuner's kernels (see ``adaptive_max_pool1d``)."""
    return _pool(_OPERATIONS["max", 3], input, output_size, return_indices, _encode_options(device, variant, config))


# --------------------------------------------------------------------------------------------
# Modules: subclasses of PyTorch's, so constructor arguments, attributes and isinstance checks
# are PyTorch's own.


class _OwnModule:
    """What every pool_tuner module shares: a repr that names it ``pool_tuner.torch.…`` (so a
    printed model shows which layers run pool_tuner), shows its arguments -- PyTorch's own for the
    drop-ins, ``repr_fields`` for the modules PyTorch has no counterpart of -- and the pool_tuner
    options where set; and a clear refusal of TorchScript."""

    repr_fields: tuple = ()

    def _get_name(self) -> str:
        return f"pool_tuner.torch.{type(self).__name__}"

    def extra_repr(self) -> str:
        parts = [super().extra_repr()] + [f"{name}={getattr(self, name)!r}" for name in self.repr_fields]
        parts += [f"{name}={getattr(self, name)!r}" for name in ("device", "variant", "config")
                  if getattr(self, name) is not None]
        return ", ".join(part for part in parts if part)

    def __prepare_scriptable__(self):
        """Called by ``torch.jit.script`` on every submodule before compiling it."""
        raise RuntimeError(NO_TORCHSCRIPT)


def _option(name: str) -> property:
    """A pool_tuner option of a drop-in module (``device``, ``variant``, ``config``), which may be
    set at any time: setting it encodes the module's options into the schema string its forward
    passes on (``_options``), so that a call does not encode them."""
    stored = "_" + name

    def get(self):
        return self.__dict__.get(stored)

    def set(self, value):
        self.__dict__[stored] = value
        self.__dict__["_options"] = _encode_options(self.device, self.variant, self.config)

    return property(get, set, doc=f"pool_tuner's ``{name}=`` option of this layer.")


class _PoolTunerModule(_OwnModule):
    """What the six drop-in modules share: keyword-only pool_tuner options and the forward."""

    kind: str
    ndim: int
    device, variant, config = _option("device"), _option("variant"), _option("config")

    def _set_options(self, device, variant, config):
        """Keep the options; a variant is checked here, where the layer is made, not at its first forward."""
        if variant is not None:
            get_variant(_OPERATIONS[self.kind, self.ndim].name, variant)
        self.device, self.variant, self.config = device, variant, config

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.operation = _OPERATIONS[cls.kind, cls.ndim]
        cls.returns_indices = cls.operation.returns_indices

    def forward(self, input):
        return _pool(self.operation, input, self.output_size, self.returns_indices and self.return_indices,
                     self._options)


class AdaptiveAvgPool1d(_PoolTunerModule, torch.nn.AdaptiveAvgPool1d):
    """``torch.nn.AdaptiveAvgPool1d`` on pool_tuner's kernels."""

    kind, ndim = "avg", 1

    def __init__(self, output_size, *, device=None, variant=None, config=None):
        super().__init__(output_size)
        self._set_options(device, variant, config)


class AdaptiveAvgPool2d(_PoolTunerModule, torch.nn.AdaptiveAvgPool2d):
    """``torch.nn.AdaptiveAvgPool2d`` on pool_tuner's kernels."""

    kind, ndim = "avg", 2

    def __init__(self, output_size, *, device=None, variant=None, config=None):
        super().__init__(output_size)
        self._set_options(device, variant, config)


class AdaptiveAvgPool3d(_PoolTunerModule, torch.nn.AdaptiveAvgPool3d):
    """``torch.nn.AdaptiveAvgPool3d`` on pool_tuner's kernels."""

    kind, ndim = "avg", 3

    def __init__(self, output_size, *, device=None, variant=None, config=None):
        super().__init__(output_size)
        self._set_options(device, variant, config)


class AdaptiveMaxPool1d(_PoolTunerModule, torch.nn.AdaptiveMaxPool1d):
    """``torch.nn.AdaptiveMaxPool1d`` on pool_tuner's kernels."""

    kind, ndim = "max", 1

    def __init__(self, output_size, return_indices=False, *, device=None, variant=None, config=None):
        super().__init__(output_size, return_indices)
        self._set_options(device, variant, config)


class AdaptiveMaxPool2d(_PoolTunerModule, torch.nn.AdaptiveMaxPool2d):
    """``torch.nn.AdaptiveMaxPool2d`` on pool_tuner's kernels."""

    kind, ndim = "max", 2

    def __init__(self, output_size, return_indices=False, *, device=None, variant=None, config=None):
        super().__init__(output_size, return_indices)
        self._set_options(device, variant, config)


class AdaptiveMaxPool3d(_PoolTunerModule, torch.nn.AdaptiveMaxPool3d):
    """``torch.nn.AdaptiveMaxPool3d`` on pool_tuner's kernels."""

    kind, ndim = "max", 3

    def __init__(self, output_size, return_indices=False, *, device=None, variant=None, config=None):
        super().__init__(output_size, return_indices)
        self._set_options(device, variant, config)


#: PyTorch's layer class -> pool_tuner's
REPLACEMENTS = {
    torch.nn.AdaptiveAvgPool1d: AdaptiveAvgPool1d,
    torch.nn.AdaptiveAvgPool2d: AdaptiveAvgPool2d,
    torch.nn.AdaptiveAvgPool3d: AdaptiveAvgPool3d,
    torch.nn.AdaptiveMaxPool1d: AdaptiveMaxPool1d,
    torch.nn.AdaptiveMaxPool2d: AdaptiveMaxPool2d,
    torch.nn.AdaptiveMaxPool3d: AdaptiveMaxPool3d,
}


# --------------------------------------------------------------------------------------------
# Multi-level pooling: a pyramid, and avg+max, from one read of the input (pool_tuner.fused).
# The custom ops ``torch.ops.pool_tuner.adaptive_{avg,max}_pool_pyramid{1,2,3}d`` and
# ``…adaptive_avgmax_pool2d`` (and ``…_backward``) return the flat buffers of every level
# (pool_tuner.pyramid); the functional forms view them level by level, in the input's memory
# format, so that compile and export see one node and views.


def _level_schema(selects: bool, backward: bool) -> str:
    if not backward:
        return "(Tensor input, SymInt[] sizes, str options) -> " + ("(Tensor, Tensor)" if selects else "Tensor")
    indices = "Tensor indices, " if selects else ""
    return (f"(Tensor grad_out, {indices}SymInt[] input_shape, SymInt[] sizes, bool channels_last, str options) "
            f"-> Tensor")


#: (op, backward) -> the registered multi-level op
_LEVEL_OPS: dict = {}


def _level_sizes(operation, sizes) -> tuple:
    """A schema's flat ``sizes`` as the op's ``output_size`` argument: a pyramid's levels (tuples),
    avgmax's one size."""
    sizes = tuple(sizes)
    levels = tuple(sizes[k:k + operation.ndim] for k in range(0, len(sizes), operation.ndim))
    return levels if operation.pyramid else levels[0]


def _level_layout(operation, sizes) -> _pyramid.LevelLayout:
    """The level layout of a multi-level op whose schema ``sizes`` are these (plain ints)."""
    sizes = tuple(int(n) for n in sizes)
    spatial = tuple(sizes[k:k + operation.ndim] for k in range(0, len(sizes), operation.ndim))
    if not operation.pyramid:
        spatial = spatial * len(operation.level_kinds(1))
    return _pyramid.level_layout(operation.level_ops(len(spatial)), spatial)


def _register_levels(op: str):
    """Define a multi-level op's forward and backward custom ops and wire their autograd."""
    operation = OPS[op]
    ndim, selects = operation.ndim, operation.selects

    def planes(shape):
        return math.prod(shape[:len(shape) - ndim])

    def forward(input, sizes, options):
        results = _run(op, "forward", [input], _level_sizes(operation, sizes), options)
        return tuple(results) if selects else results[0]

    def forward_fake(input, sizes, options):
        layout, n = _level_layout(operation, sizes), planes(input.shape)
        values = input.new_empty((n * layout.values_per_plane,))
        if not selects:
            return values
        return values, input.new_empty((n * layout.indices_per_plane,), dtype=torch.int64)

    def gradient_channels_last(input_shape, sizes, channels_last: bool) -> bool:
        """Whether the input's gradient is channels-last (``channels_last``: the kernels' layout, the
        flat buffers'): as PyTorch's gradient of the levels pooled one by one."""
        return _channels_last_gradient(_pytorch_channels_last(len(input_shape), ndim, channels_last),
                                       not selects, sizes)

    def backward(grad_out, *rest):
        input_shape, sizes, channels_last, options = rest[-4:]
        layout = LAYOUT_NAMES[ndim][1 if channels_last else 0]
        tensors = [grad_out.contiguous()] + [t.contiguous() for t in rest[:-4]]
        (result,) = _run(op, "backward", tensors, (tuple(input_shape), _level_sizes(operation, sizes), layout), options)
        return _in_layout(result, gradient_channels_last(input_shape, sizes, channels_last), ndim)

    def backward_fake(grad_out, *rest):
        input_shape, sizes, channels_last = rest[-4:-1]
        return _empty(list(input_shape), grad_out, grad_out.dtype,
                      gradient_channels_last(input_shape, sizes, channels_last), ndim)

    ops = {}
    for backward_op, (real, fake) in ((False, (forward, forward_fake)), (True, (backward, backward_fake))):
        defined = torch.library.custom_op(_custom_op_name(operation, backward_op), real,
                                          mutates_args=(), device_types=("cpu", "cuda"),
                                          schema=_level_schema(selects, backward_op))
        defined.register_fake(fake)
        ops[backward_op] = _LEVEL_OPS[op, backward_op] = defined

    def setup(ctx, inputs, output):
        input, sizes, ctx.options = inputs
        ctx.input_shape, ctx.sizes = list(input.shape), list(sizes)
        ctx.channels_last = _is_channels_last(input, ndim)
        if selects:
            ctx.save_for_backward(output[1])

    def gradient(ctx, grad_values, *_grad_indices):
        args = [grad_values, *ctx.saved_tensors, ctx.input_shape, ctx.sizes, ctx.channels_last,
                _backward_options(ctx.options)]
        return ops[True](*args), None, None

    def backward_setup(ctx, inputs, output):
        ctx.input_shape, ctx.sizes, ctx.channels_last, ctx.options = inputs[-4:]
        if selects:
            ctx.save_for_backward(inputs[1])

    def second_gradient(ctx, grad_grad_in):
        """The multi-level backward is linear in the levels' gradients: its adjoint pools
        ``grad_grad_in`` to every level again -- averages through the avg pyramid's forward,
        max levels by a gather at their indices (see ``_adjoint_of_backward``)."""
        indices = ctx.saved_tensors[0] if selects else None
        grad_values = _adjoint_of_backward(operation, grad_grad_in, indices, ctx.input_shape, ctx.sizes,
                                           ctx.channels_last, ctx.options)
        return (grad_values,) + (None,) * (4 + selects)

    ops[False].register_autograd(gradient, setup_context=setup)
    ops[True].register_autograd(second_gradient, setup_context=backward_setup)


def _adjoint_of_backward(operation, grad_grad_in, indices, input_shape, sizes, channels_last: bool, options: str):
    """The gradient of a multi-level backward with respect to its flat ``grad_out``: every level
    of ``grad_grad_in`` (the input's shape), in the flat buffer's order and memory format.  An avg
    level's backward spreads its gradient over its windows, so its adjoint is that level's average
    pooling (the avg pyramid's forward kernel, one read for every avg level); a max level's routes
    it to its index, so its adjoint gathers at the index (pure index math, as the single-level max
    backward's)."""
    ndim = operation.ndim
    grad_grad_in = _in_layout(grad_grad_in, channels_last, ndim)
    layout = _level_layout(operation, sizes)
    batch = list(input_shape[:len(input_shape) - ndim])
    means = iter(())
    if not all(layout.selects):
        avg_sizes = [n for spatial, selects in zip(layout.spatial, layout.selects) if not selects for n in spatial]
        avg_op = find("avg", ndim, pyramid=True)
        flat_means = _LEVEL_OPS[avg_op.name, False](grad_grad_in, avg_sizes, options)
        if not operation.selects:  # every level an average: the avg pyramid's buffer is the answer
            return flat_means
        means = iter(_level_views(flat_means, grad_grad_in, _level_layout(avg_op, avg_sizes), ndim, channels_last))
    maxima = iter(())
    if indices is not None:
        maxima = iter(_level_views(indices, grad_grad_in, layout, ndim, channels_last, positions=True))
    plane = grad_grad_in.reshape(batch + [math.prod(input_shape[len(batch):])])
    parts = []
    for selects in layout.selects:
        if not selects:
            level = next(means)
        else:
            level_indices = next(maxima)
            flat_indices = level_indices.reshape(batch + [-1])
            level = torch.gather(plane, -1, flat_indices).reshape(level_indices.shape)
        parts.append(_memory_order(level, channels_last, ndim).reshape(-1))
    return torch.cat(parts)


def _memory_order(t: torch.Tensor, channels_last: bool, ndim: int) -> torch.Tensor:
    """A level's logical tensor with its axes in the order of its memory in a flat buffer (the
    channel axis last where channels-last), so that ``reshape(-1)`` lays it out as the buffer."""
    return t.movedim(t.dim() - ndim - 1, -1) if channels_last else t


for _op, _operation in OPS.items():
    if _operation.multi_level:
        _register_levels(_op)


def _level_views(flat, input, layout, ndim: int, channels_last: bool, positions: bool = False) -> list:
    """The levels inside a multi-level op's flat buffer (values, or with ``positions`` the max
    levels' indices), as views in the input's memory format; sizes may be symbolic."""
    batch = list(input.shape[:input.dim() - ndim])
    planes = math.prod(batch)
    bases = layout.index_bases if positions else layout.value_bases
    views = []
    for selects, spatial, size, base in zip(layout.selects, layout.spatial, layout.sizes, bases):
        if positions and not selects:
            continue
        part = flat.narrow(0, planes * base, planes * size)
        if not channels_last:
            views.append(part.view(batch + list(spatial)))
        else:
            views.append(part.view(batch[:-1] + list(spatial) + batch[-1:]).movedim(-1, len(batch) - 1))
    return views


def _levels_of(operation, input, output_size, name: str) -> tuple:
    """The checked sizes of every level of ``operation`` on ``input`` (a single-level op: one)."""
    if not operation.multi_level:
        return (tuple(_check_input(input, operation.ndim, output_size)),)
    return operation.resolve_levels(output_size, _pooled_sizes(input, operation.ndim), name)


def _decomposed_levels(operation, input, output_size, name: str) -> list:
    """The values of every level of a multi-level op, each its exact decomposition into standard
    ONNX operators (``pool_tuner.decomposition``)."""
    levels = _levels_of(operation, input, output_size, name)
    return [decompose(level.kind, operation.ndim, input, list(size), f"pool_tuner.torch.{operation.name}")
            for level, size in zip(operation.level_ops(len(levels)), levels)]


class _Composition(torch.nn.Module):
    """A multi-level pool_tuner layer as standard operators only (its ``composed()``, what
    ``pool_tuner.onnx.export`` exports): ``compute(input, **arguments)``."""

    def __init__(self, compute, **arguments):
        super().__init__()
        self.compute, self.arguments = compute, arguments

    def forward(self, input):
        return self.compute(input, **self.arguments)


def _multi_level(op: str, input, output_size, options: str, name: str) -> tuple[list, list]:
    """``(values per level, indices per max level)`` of a multi-level op: through its custom op, or
    under ``torch.onnx.export`` the exact per-level decompositions (values only).  Each level in
    PyTorch's layout of its own adaptive pooling (``_pytorch_channels_last``): a view of the flat
    buffers, which are in the layout the kernel read the input in, copied where that differs."""
    operation = OPS[op]
    if _exported_to_onnx():
        return _decomposed_levels(operation, input, output_size, name), []
    ndim = operation.ndim
    levels = _levels_of(operation, input, output_size, name)
    level_ops = operation.level_ops(len(levels))
    _check_no_functorch_transform()
    sizes = [n for level in (levels if operation.pyramid else levels[:1]) for n in level]
    out = _LEVEL_OPS[op, False](input, sizes, options)
    values, indices = out if operation.selects else (out, None)
    layout = _pyramid.level_layout(level_ops, tuple(tuple(int(n) for n in level) for level in levels))
    channels_last = _is_channels_last(input, ndim)
    views = (_level_views(values, input, layout, ndim, channels_last),
             [] if indices is None else _level_views(indices, input, layout, ndim, channels_last, positions=True))
    if channels_last and not _pytorch_channels_last(input.dim(), ndim, channels_last):
        return tuple([view.contiguous() for view in found] for found in views)
    return views


def _pyramid_op(kind: str, input, output_sizes, ndim) -> str:
    _check_tensor(input, "input")
    return find(kind, _fused.pyramid_rank(tuple(input.shape), output_sizes, ndim), pyramid=True).name


def adaptive_avg_pool_pyramid(input, output_sizes, *, ndim=None, device=None, variant=None, config=None) -> list:
    """Adaptive average pooling of ``input`` to every size of ``output_sizes``, from one read of
    ``input`` (``pool_tuner.adaptive_avg_pool_pyramid``): one tensor per size, each what
    ``torch.nn.functional.adaptive_avg_pool{ndim}d`` gives, with autograd (the gradient written
    once, every level's added in order)."""
    op = _pyramid_op("avg", input, output_sizes, ndim)
    return _multi_level(op, input, output_sizes, _encode_options(device, variant, config), "output_sizes")[0]


def adaptive_max_pool_pyramid(input, output_sizes, return_indices=False, *, ndim=None, device=None, variant=None,
                              config=None):
    """Adaptive max pooling of ``input`` to every size of ``output_sizes`` from one read: a list of
    tensors, and with ``return_indices=True`` also the list of their int64 indices (PyTorch's)."""
    op = _pyramid_op("max", input, output_sizes, ndim)
    values, indices = _multi_level(op, input, output_sizes, _encode_options(device, variant, config), "output_sizes")
    return (values, indices) if return_indices else values


#: timm's avg+max pooling: an average and a max level from one read.
_AVGMAX = find("avgmax", 2)


def adaptive_avgmax_pool2d(input, output_size=1, mode="avg+max", *, device=None, variant=None, config=None):
    """timm's ``adaptive_avgmax_pool2d`` (``mode="avg+max"``: ``0.5 * (avg + max)``) or
    ``adaptive_catavgmax_pool2d`` (``mode="cat"``: ``torch.cat((avg, max), 1)``), both poolings
    from one read of ``input``."""
    _avgmax.check_mode(mode)
    options = _encode_options(device, variant, config)
    if _pytorch_runs(_AVGMAX, input, output_size, options):  # the race's winner on this CPU input
        avg, mx = _torch_cpu.PYTORCH_FORMS[_AVGMAX.name](input, _pytorch_size(_AVGMAX, input, output_size))
    else:
        (avg, mx), _ = _multi_level(_AVGMAX.name, input, output_size, options, "output_size")
    return _join_avgmax(avg, mx, mode)


def _join_avgmax(avg, mx, mode: str):
    """timm's join of avgmax's levels (``pool_tuner.avgmax``)."""
    return 0.5 * (avg + mx) if mode == "avg+max" else torch.cat((avg, mx), avg.dim() - 3)


def _composed_avgmax(input, output_size, mode: str):
    """``AdaptiveAvgMaxPool2d`` in standard operators."""
    return _join_avgmax(*_decomposed_levels(_AVGMAX, input, output_size, "output_size"), mode)


def _composed_pyramid(input, output_sizes, mode: str, ndim):
    """``PyramidPooling`` in standard operators."""
    operation = find(mode, _fused.pyramid_rank(tuple(input.shape), output_sizes, ndim), pyramid=True)
    return _decomposed_levels(operation, input, output_sizes, "output_sizes")


#: ``PyramidPooling``'s modes and the function each runs.
_PYRAMID_MODES = {"avg": adaptive_avg_pool_pyramid, "max": adaptive_max_pool_pyramid}


class PyramidPooling(_OwnModule, torch.nn.Module):
    """A pooling pyramid: ``forward(x)`` returns ``x`` pooled to every size of ``output_sizes``
    (a list, one tensor per size), average (``mode="avg"``, PSPNet's pyramid pooling) or max
    (``mode="max"``, SPP-Net), from one read of ``x``."""

    repr_fields = ("output_sizes", "mode")

    def __init__(self, output_sizes, mode="avg", *, ndim=None, device=None, variant=None, config=None):
        super().__init__()
        if mode not in _PYRAMID_MODES:
            raise ValueError(f"mode must be 'avg' or 'max', got {mode!r}")
        if isinstance(output_sizes, (str, bytes)) or not hasattr(output_sizes, "__len__") or not len(output_sizes):
            raise ValueError(f"output_sizes must be a non-empty sequence of output sizes, got {output_sizes!r}")
        self.output_sizes, self.mode, self.ndim = list(output_sizes), mode, ndim
        self.device, self.variant, self.config = device, variant, config

    def forward(self, input):
        return _PYRAMID_MODES[self.mode](input, self.output_sizes, ndim=self.ndim, device=self.device,
                                         variant=self.variant, config=self.config)

    def composed(self) -> torch.nn.Module:
        """This layer in standard operators (what ``pool_tuner.onnx.export`` exports)."""
        return _Composition(_composed_pyramid, output_sizes=self.output_sizes, mode=self.mode, ndim=self.ndim)


class AdaptiveAvgMaxPool2d(_OwnModule, torch.nn.Module):
    """timm's ``AdaptiveAvgMaxPool2d`` (``mode="avg+max"``) and ``AdaptiveCatAvgMaxPool2d``
    (``mode="cat"``) on one fused kernel."""

    repr_fields = ("output_size", "mode")

    def __init__(self, output_size=1, mode="avg+max", *, device=None, variant=None, config=None):
        super().__init__()
        _avgmax.check_mode(mode)
        self.output_size, self.mode = output_size, mode
        self.device, self.variant, self.config = device, variant, config

    def forward(self, input):
        return adaptive_avgmax_pool2d(input, self.output_size, self.mode, device=self.device, variant=self.variant,
                                      config=self.config)

    def composed(self) -> torch.nn.Module:
        """This layer in standard operators (what ``pool_tuner.onnx.export`` exports)."""
        return _Composition(_composed_avgmax, output_size=self.output_size, mode=self.mode)


# --------------------------------------------------------------------------------------------
# Global pooling as timm's fast layers compute it (``x.mean``/``x.amax`` over the spatial dims).

#: GlobalPool2d's ``input_fmt``: the tensor's spatial dims and channel dim (timm's formats).
_INPUT_FORMATS = {"NCHW": ((2, 3), 1), "NHWC": ((1, 2), 3)}


def _avg_level(input, options: dict) -> list:
    return [adaptive_avg_pool2d(input, 1, **options)]


def _max_level(input, options: dict) -> list:
    return [adaptive_max_pool2d(input, 1, **options)]


def _avg_and_max_levels(input, options: dict) -> list:
    return _multi_level(_AVGMAX.name, input, 1, _encode_options(**options), "output_size")[0]


def _mean_gradient(grad, level, input, shape, dims):
    """``x.mean(dims, keepdim=True)``'s gradient, as PyTorch computes it: spread, then divided. The
    area is read off the spread gradient, not multiplied from the saved ``shape``: under
    ``torch.compile`` with symbolic sizes dynamo cannot do arithmetic on sizes saved on ``ctx``."""
    height, width = dims
    spread = grad.expand(shape)
    return spread / (spread.shape[height] * spread.shape[width])


def _amax_gradient(grad, level, input, shape, dims):
    """``x.amax(dims, keepdim=True)``'s gradient, as PyTorch computes it: split evenly among the
    positions that hold the maximum."""
    mask = input == level
    return (grad / mask.sum(dims, keepdim=True)) * mask


def _amax_keeping_nans(input, dims):
    """``x.amax(dims, keepdim=True)`` in operators whose ONNX form keeps PyTorch's NaN: ONNX leaves
    what ``ReduceMax`` makes of NaN open (onnxruntime skips NaNs), so a plane holding NaN is found
    apart (``IsNaN``, ``ReduceSum``) and set to NaN, as the decomposition's max windows are."""
    nans = torch.isnan(input).to(torch.float32).sum(dims, keepdim=True) > 0
    return torch.where(nans, float("nan"), input.amax(dims, keepdim=True))


@dataclasses.dataclass(frozen=True)
class _Reduction:
    """One level of a global pooling as timm computes it: the PyTorch reduction, its gradient, and
    the reduction in operators whose ONNX form gives PyTorch's results (what ONNX export traces)."""

    reduce: object
    gradient: object
    exported: object


def _mean(input, dims):
    return input.mean(dims, keepdim=True)  # ReduceMean sums: NaN and infinities come out as PyTorch's


_MEAN = _Reduction(_mean, _mean_gradient, _mean)
_AMAX = _Reduction(lambda input, dims: input.amax(dims, keepdim=True), _amax_gradient, _amax_keeping_nans)


@dataclasses.dataclass(frozen=True)
class _GlobalMode:
    """One of GlobalPool2d's modes: the op its levels are (at output size 1), those levels from
    pool_tuner's kernels (one read of the input), the reduction each level is, and how timm joins
    the levels (along ``dim``, the channels)."""

    operation: object
    levels: object
    reductions: tuple
    join: object


#: timm's fast layers: FastAdaptiveAvgPool, FastAdaptiveMaxPool, FastAdaptiveAvgMaxPool (which
#: halves each level before adding them, unlike AdaptiveAvgMaxPool2d) and FastAdaptiveCatAvgMaxPool.
GLOBAL_POOL_MODES = {
    "avg": _GlobalMode(find("avg", 2), _avg_level, (_MEAN,), lambda levels, dim: levels[0]),
    "max": _GlobalMode(find("max", 2), _max_level, (_AMAX,), lambda levels, dim: levels[0]),
    "avg+max": _GlobalMode(_AVGMAX, _avg_and_max_levels, (_MEAN, _AMAX),
                           lambda levels, dim: 0.5 * levels[0] + 0.5 * levels[1]),
    "cat": _GlobalMode(_AVGMAX, _avg_and_max_levels, (_MEAN, _AMAX), lambda levels, dim: torch.cat(levels, dim)),
}


def _timms_levels(reductions: tuple, input, output_size) -> list:
    return [reduction.reduce(input, (2, 3)) for reduction in reductions]


#: mode -> its levels as timm computes them, of a channels-first input (output size 1): what the
#: race of a new signature times against pool_tuner's kernel (``_pytorch_runs``).
_TIMMS_LEVELS = {mode: functools.partial(_timms_levels, spec.reductions) for mode, spec in GLOBAL_POOL_MODES.items()}


class _GlobalPooling(torch.autograd.Function):
    """The levels of a global pooling in ``input_fmt``'s layout, kept dims: the values from
    pool_tuner's kernels, the gradient timm's own -- mean's, and amax's, which splits a plane's
    gradient among tied maxima where pool_tuner's max kernels (PyTorch's ``adaptive_max_pool2d``)
    give it to the first."""

    @staticmethod
    def forward(ctx, input, mode: str, input_fmt: str, options: dict):
        spec = GLOBAL_POOL_MODES[mode]
        dims, channel = _INPUT_FORMATS[input_fmt]
        channels_first = input.movedim(channel, 1)
        levels = [level.movedim(1, channel) for level in spec.levels(channels_first, options)]
        ctx.dims, ctx.reductions, ctx.input_shape = dims, spec.reductions, input.shape
        ctx.save_for_backward(input if _AMAX in spec.reductions else None, *levels)
        return tuple(levels)

    @staticmethod
    def backward(ctx, *grads):
        """The levels' gradients added as autograd adds them in timm's computation: the last
        level's first (its reduction's node runs first), whose layout the sum keeps -- a
        channels-last input's amax gradient is channels-last, the mean's contiguous -- so that the
        gradient has the layout of timm's whichever side won the race (``_pytorch_runs``)."""
        input, *levels = ctx.saved_tensors
        parts = [reduction.gradient(grad, level, input, ctx.input_shape, ctx.dims)
                 for reduction, level, grad in zip(ctx.reductions, levels, grads)]
        return functools.reduce(operator.add, reversed(parts)), None, None, None


def global_pool2d(input, mode="avg", *, flatten=False, input_fmt="NCHW", device=None, variant=None, config=None):
    """Global pooling of a 4-d ``input`` as timm's fast layers compute it: the average
    (``mode="avg"``, ``x.mean``), the maximum (``"max"``, ``x.amax``), ``0.5 * avg + 0.5 * max``
    (``"avg+max"``) or both concatenated along the channels (``"cat"``) over the spatial dims of
    ``input_fmt`` (``"NCHW"`` or ``"NHWC"``), kept as size-1 dims or, with ``flatten``, dropped.
    avg and max come from one read of ``input``; the gradient is timm's (amax's splits among ties).

    timm's own reductions run instead -- with PyTorch's autograd -- under ONNX export (``ReduceMean``,
    ``ReduceMax``, a plane holding NaN set to NaN apart), and on a CPU tensor whose signature they
    won the race against pool_tuner's kernel (``_pytorch_runs``: ``pool_tuner.explain`` of the
    mode's op on the channels-first input, output size 1, says which won and the times)."""
    _check_global_pool_arguments(mode, input_fmt)
    _check_tensor(input, "input")
    if input.dim() != 4:
        raise ValueError(f"input must be 4-d ({input_fmt}) for global 2d pooling, got shape {tuple(input.shape)}")
    spec = GLOBAL_POOL_MODES[mode]
    channel = _INPUT_FORMATS[input_fmt][1]
    channels_first = input if channel == 1 else input.movedim(channel, 1)
    options = _encode_options(device, variant, config)
    # a plain eager call (the one _pytorch_runs may say yes to) is never an export: asked first
    if _pytorch_runs(spec.operation, channels_first, 1, options, _TIMMS_LEVELS[mode]):
        return _composed_global(input, mode, flatten, input_fmt)
    if _exported_to_onnx():
        return _composed_global(input, mode, flatten, input_fmt, exported=True)
    levels = _GlobalPooling.apply(input, mode, input_fmt, dict(device=device, variant=variant, config=config))
    return _joined_globally(spec, levels, flatten, channel)


def _composed_global(input, mode: str, flatten: bool, input_fmt: str, exported: bool = False):
    """``global_pool2d`` as timm computes it, in PyTorch's reductions; ``exported``: in their forms
    for ONNX export (``_Reduction.exported``)."""
    spec = GLOBAL_POOL_MODES[mode]
    dims, channel = _INPUT_FORMATS[input_fmt]
    levels = [(reduction.exported if exported else reduction.reduce)(input, dims) for reduction in spec.reductions]
    return _joined_globally(spec, levels, flatten, channel)


def _joined_globally(spec: _GlobalMode, levels: list, flatten: bool, channel: int):
    """The levels of a global pooling (size-1 dims kept), flattened where asked, joined as timm does."""
    if flatten:
        levels = [level.flatten(1) for level in levels]
    return spec.join(levels, 1 if flatten else channel)


def _check_global_pool_arguments(mode, input_fmt):
    if mode not in GLOBAL_POOL_MODES:
        raise ValueError(f"mode must be one of {tuple(GLOBAL_POOL_MODES)} (timm's fast pool types), got {mode!r}")
    if input_fmt not in _INPUT_FORMATS:
        raise ValueError(f"input_fmt must be one of {tuple(_INPUT_FORMATS)}, got {input_fmt!r}")


class GlobalPool2d(_OwnModule, torch.nn.Module):
    """timm's ``FastAdaptiveAvgPool``, ``FastAdaptiveMaxPool``, ``FastAdaptiveAvgMaxPool`` and
    ``FastAdaptiveCatAvgMaxPool`` (``mode`` ``"avg"``, ``"max"``, ``"avg+max"``, ``"cat"``) on
    pool_tuner's kernels: ``global_pool2d``."""

    repr_fields = ("mode", "flatten", "input_fmt")

    def __init__(self, mode="avg", *, flatten=False, input_fmt="NCHW", device=None, variant=None, config=None):
        super().__init__()
        _check_global_pool_arguments(mode, input_fmt)
        self.mode, self.flatten, self.input_fmt = mode, bool(flatten), input_fmt
        self.device, self.variant, self.config = device, variant, config

    def forward(self, input):
        return global_pool2d(input, self.mode, flatten=self.flatten, input_fmt=self.input_fmt, device=self.device,
                             variant=self.variant, config=self.config)

    def composed(self) -> torch.nn.Module:
        """This layer in timm's own reductions (what ``pool_tuner.onnx.export`` exports)."""
        return _Composition(_composed_global, mode=self.mode, flatten=self.flatten, input_fmt=self.input_fmt,
                            exported=True)


# --------------------------------------------------------------------------------------------
# replace_pooling(fuse=True): sibling adaptive poolings of one tensor run as one fused op.


def fused_adaptive_pools(input, levels, ndim: int) -> tuple:
    """The results of the adaptive poolings ``levels`` (``(kind, output_size)`` pairs) of ``input``
    over ``ndim`` axes, in order, from as few reads of ``input`` as the fused ops allow: an avg and a
    max pooling of one 2-d size as one avgmax op, else the avg levels as one pyramid and the max
    levels as another.  What ``replace_pooling(fuse=True)`` puts in place of sibling poolings."""
    spatial = tuple(input.shape[input.dim() - ndim:])
    resolved = [resolve_output_size(size, spatial) for _, size in levels]
    kinds = [kind for kind, _ in levels]
    avgmax = find("avgmax", 2)
    if ndim == avgmax.ndim and sorted(kinds) == sorted(avgmax.level_kinds(2)) and resolved[0] == resolved[1]:
        values, _ = _multi_level(avgmax.name, input, resolved[0], "", "output_size")
        by_kind = dict(zip(avgmax.level_kinds(2), values))
        return tuple(by_kind[kind] for kind in kinds)
    chosen = {}  # kind -> the positions of its levels in ``levels``
    for k, kind in enumerate(kinds):
        chosen.setdefault(kind, []).append(k)
    results = [None] * len(levels)
    for kind, positions in chosen.items():
        op = find(kind, ndim, pyramid=True).name
        values, _ = _multi_level(op, input, [resolved[k] for k in positions], "", "output_sizes")
        for k, value in zip(positions, values):
            results[k] = value
    return tuple(results)


#: PyTorch's functional adaptive poolings, by name, as torch.fx records them: (kind, ndim).
_FUNCTIONAL_POOLS = {name: (operation.kind, operation.ndim) for operation in _OPERATIONS.values()
                     for name in operation.fx_names}


def _pool_call(gm, node):
    """``(input node, kind, ndim, output_size)`` of a graph node that is one adaptive pooling
    without indices (a PyTorch or pool_tuner layer, or PyTorch's functional form), else None."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        pool = next((cls for cls in REPLACEMENTS if isinstance(module, cls)), None)
        if (pool is None or getattr(module, "return_indices", False) or len(node.args) != 1 or node.kwargs
                or _has_hooks(module)):  # a layer with hooks stays a layer, so that they still run
            return None
        ours = REPLACEMENTS[pool]
        return node.args[0], ours.kind, ours.ndim, module.output_size
    if node.op == "call_function" and getattr(node.target, "__module__", "") == "torch.nn.functional":
        found = _FUNCTIONAL_POOLS.get(getattr(node.target, "__name__", ""))
        if found is None:
            return None
        arguments = dict(zip(("input", "output_size", "return_indices"), node.args), **node.kwargs)
        if arguments.get("return_indices", False) or "output_size" not in arguments:
            return None
        return arguments["input"], found[0], found[1], arguments["output_size"]
    return None


def _fuse_graph(gm) -> list:
    """Fuse, in ``gm``'s graph, every group of two or more adaptive poolings of one tensor over the
    same axes into one ``fused_adaptive_pools`` call; returns the groups fused, each as its
    ``(kind, output_size)`` levels."""
    groups: dict = {}
    for node in gm.graph.nodes:
        call = _pool_call(gm, node)
        if call is not None and isinstance(call[0], torch.fx.Node):
            groups.setdefault((call[0], call[2]), []).append((node, call[1], call[3]))
    fused = []
    for (source, ndim), members in groups.items():
        if len(members) < 2:
            continue
        with gm.graph.inserting_before(members[0][0]):
            levels = tuple((kind, size) for _, kind, size in members)
            call = gm.graph.call_function(fused_adaptive_pools, (source, levels, ndim))
        for position, (node, _, _) in enumerate(members):
            with gm.graph.inserting_before(node):
                item = gm.graph.call_function(operator.getitem, (call, position))
            node.replace_all_uses_with(item)
            gm.graph.erase_node(node)
        fused.append(levels)
    if fused:
        gm.graph.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return fused


def _count_pools(module) -> int:
    return sum(isinstance(m, tuple(REPLACEMENTS)) for m in module.modules())


class _Tracer(torch.fx.Tracer):
    """torch.fx's tracer with pool_tuner's fused calls kept as single calls, and as leaves
    pool_tuner's modules (their forward is not PyTorch code to trace) and every module with hooks
    of its own (traced through, its hooks would run once on placeholders and be lost)."""

    def __init__(self):
        super().__init__(autowrap_functions=(fused_adaptive_pools,))

    def is_leaf_module(self, m, module_qualified_name) -> bool:
        return isinstance(m, _OwnModule) or _has_hooks(m) or super().is_leaf_module(m, module_qualified_name)


def _trace(module: torch.nn.Module):
    """``module`` as a torch.fx ``GraphModule``, or None where it does not trace (Python control
    flow on tensor values, say)."""
    tracer = _Tracer()
    try:
        graph = tracer.trace(module)
    except Exception:  # whatever the module's Python does with proxies: its children may trace
        return None
    return torch.fx.GraphModule(tracer.root, graph, type(module).__name__)


def _traced_differently_in_the_other_mode(module: torch.nn.Module, fused_gm) -> bool:
    """Whether ``module``'s forward traces to another graph with every submodule's mode flipped
    (training and eval): torch.fx runs the Python of ``if self.training:`` once, so a rewrite
    would keep the branch of the mode it was traced in.  ``fused_gm``: its trace in its own mode,
    fused (``_fuse_graph``), which the other mode's trace is fused as well to be compared with."""
    modes = {m: m.training for m in module.modules()}
    try:
        for m in modes:
            m.training = not modes[m]
        other = _trace(module)
    finally:
        for m, training in modes.items():
            m.training = training
    if other is None:
        return True
    _fuse_graph(other)
    return other.code != fused_gm.code


def _hook_state(module: torch.nn.Module) -> dict:
    """``module``'s own hook attributes by name: the dictionaries of its forward, backward and
    state-dict hooks, and the flag of which kind of backward hook it has."""
    return {name: value for name, value in vars(module).items() if "hook" in name}


def _has_hooks(module: torch.nn.Module) -> bool:
    """Whether hooks are registered on ``module`` itself (forward, backward or state-dict hooks)."""
    return any(isinstance(value, dict) and value for value in _hook_state(module).values())


def _carry_hooks(old: torch.nn.Module, new: torch.nn.Module) -> None:
    """The hooks registered on a module that ``replace_pooling`` replaces, on its replacement: the
    same dictionaries, so that the handles their registration returned still remove them."""
    new.__dict__.update(_hook_state(old))


def _no_record(name, module, replacement, reason):
    """What replace_pooling does with its decisions when nobody asked for them."""


def fuse_sibling_pools(model: torch.nn.Module, record=_no_record) -> torch.nn.Module:
    """Run sibling adaptive poolings of one tensor as one fused op: the torch.fx pass of
    ``replace_pooling(fuse=True)``.  Modules are visited bottom-up, so the smallest module that
    holds a group is the one rewritten: each is traced with torch.fx, and where the trace finds
    poolings to fuse the module is replaced by its rewritten ``GraphModule`` (same submodules and
    parameter names).  Modules that do not trace, or hold nothing to fuse, stay as they are;
    ``record(name, module, replacement, reason)`` hears of each module rewritten.  Returns the
    (new) model."""

    def visit(module, name):
        for child_name, child in list(module.named_children()):
            replacement = visit(child, f"{name}.{child_name}" if name else child_name)
            if replacement is not child:
                setattr(module, child_name, replacement)
        if isinstance(module, _OwnModule) or module.__class__.__module__.split(".")[0] == "torch":
            return module
        gm = _trace(module)
        fused = _fuse_graph(gm) if gm is not None else []
        if not fused:
            return module
        if _traced_differently_in_the_other_mode(module, gm):
            record(name, module, None, "its forward pools one tensor more than once, but differs between training "
                                       "and eval mode, which a torch.fx rewrite would fix at the mode it was "
                                       "traced in: left as it is")
            return module
        gm.train(module.training)
        _carry_hooks(module, gm)
        groups = "; ".join(", ".join(f"{kind} {size}" for kind, size in levels) for levels in fused)
        record(name, module, gm, f"its forward pools one tensor more than once ({groups}): torch.fx rewrote "
                                 f"each group as one fused_adaptive_pools call, one read of the tensor")
        return gm

    return visit(model, "")


def swap_layers(model: torch.nn.Module, swap) -> torch.nn.Module:
    """Replace, in place, every submodule ``m`` of ``model`` (``model`` itself included) by
    ``swap(qualified_name, m)``; returns the (new) root.  Shared by ``replace_pooling`` and
    ``pool_tuner.onnx``."""
    def swapped(name, module):
        replacement = swap(name, module)
        if replacement is not module:  # a swapped layer keeps its hooks
            _carry_hooks(module, replacement)
        return replacement

    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            replacement = swapped(f"{parent_name}.{name}" if parent_name else name, child)
            if replacement is not child:
                setattr(parent, name, replacement)
    return swapped("", model)


def _timm_swap(fuse: bool, options: dict, record):
    """``swap_layers``' swap for timm's pooling layers (``pool_tuner.torch_timm``)."""

    def swap(name, module):
        layer = _torch_timm.recognise(module)
        if layer is None:
            return module
        if isinstance(layer, str):
            record(name, module, None, layer)
            return module
        if layer.pools_twice and not fuse:
            record(name, module, None, f"{layer.reason}; replace_pooling runs avg and max of one tensor as "
                                       f"one fused op only with fuse=True")
            return module
        new = (GlobalPool2d(layer.mode, flatten=layer.flatten, input_fmt=layer.input_fmt, **options) if layer.fast
               else AdaptiveAvgMaxPool2d(layer.output_size, layer.mode, **options))
        new.train(module.training)
        record(name, module, new, layer.reason)
        return new

    return swap


def _pytorch_swap(options: dict, record):
    """``swap_layers``' swap for PyTorch's adaptive pooling layers (``REPLACEMENTS``)."""

    def swap(name, module):
        if isinstance(module, _OwnModule):
            return module
        cls = REPLACEMENTS.get(type(module))
        if cls is None:
            base = next((pool for pool in REPLACEMENTS if isinstance(module, pool)), None)
            if base is not None:
                record(name, module, None, f"a subclass of torch.nn.{base.__name__}: its forward may differ "
                                           f"from PyTorch's, so it is left as it is")
            return module
        args = (module.output_size, module.return_indices) if cls.returns_indices else (module.output_size,)
        new = cls(*args, **options)
        new.train(module.training)
        record(name, module, new, f"PyTorch's {type(module).__name__}: pool_tuner's drop-in, same arguments")
        return new

    return swap


def replace_pooling(model: torch.nn.Module, *, fuse=False, device=None, variant=None, config=None,
                    report=None) -> torch.nn.Module:
    """Swap every PyTorch adaptive pooling layer inside ``model`` (in place, ``model`` itself
    included) for pool_tuner's equivalent with the same arguments; returns the (new) model.
    Layers that are already pool_tuner's, and subclasses of PyTorch's, are left alone.

    timm's pooling layers (``SelectAdaptivePool2d``'s ``pool``: ``avgmax``, ``catavgmax`` and the
    ``fast`` ones) become ``AdaptiveAvgMaxPool2d`` or ``GlobalPool2d``, computing what timm's do;
    those pooling one tensor twice (avg and max) only with ``fuse=True``, which also runs sibling
    adaptive poolings of one tensor elsewhere (PSPNet's pyramid) as one fused op
    (``fuse_sibling_pools``).  On CPU tensors each swapped layer runs, per input signature, the
    faster of pool_tuner's kernel and PyTorch's own computation (timm's, for timm's layers),
    decided on the signature's first call (``pool_tuner.explain(op, shape, size)`` of the layer's
    op shows the race: ``measured_candidate``).

    ``report``, a list, gets one entry per layer swapped, module rewritten, or pooling layer left
    as it is, with the reason (``explain_pooling`` says what the entries hold)."""
    _check_model(model)
    options = dict(device=device, variant=variant, config=config)
    record = _no_record if report is None else functools.partial(_report_entry, report)
    model = swap_layers(model, _timm_swap(fuse, options, record))
    if fuse:
        model = fuse_sibling_pools(model, record)
    return swap_layers(model, _pytorch_swap(options, record))


def _check_model(model):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def _report_entry(report: list, name, module, replacement, reason):
    """Append ``explain_pooling``'s entry for one decision of ``replace_pooling`` to ``report``."""
    cls = type(module)
    if replacement is None:
        action, what = "kept", None
    elif isinstance(replacement, torch.fx.GraphModule):
        action, what = "fused", f"torch.fx.GraphModule of {cls.__qualname__}"
    else:
        action, what = "swapped", repr(replacement)
    report.append({"module": name, "type": f"{cls.__module__}.{cls.__qualname__}", "action": action,
                   "replacement": what, "reason": reason})


def explain_pooling(model: torch.nn.Module, *, fuse=False, device=None, variant=None, config=None) -> list:
    """What ``replace_pooling`` with these arguments would do to ``model``, which is left as it is
    (the swap runs on a copy): one dict per pooling layer or module, in the order replace_pooling
    meets them -- ``module`` (its qualified name, ``""`` for ``model``), ``type`` (its class),
    ``action`` (``"swapped"``: a pool_tuner layer takes its place; ``"fused"``: torch.fx rewrote
    its forward; ``"kept"``), ``replacement`` (what takes its place, or None) and ``reason``."""
    _check_model(model)
    report = []
    replace_pooling(copy.deepcopy(model), fuse=fuse, device=device, variant=variant, config=config, report=report)
    return report


# --------------------------------------------------------------------------------------------
# GeM pooling: ``pool_tuner.torch.adaptive_gem_pool{1,2,3}d`` and
# ``AdaptiveGeMPool{1,2,3}d``, with the gradient for the input and for ``p`` (pool_tuner.gem).
#
# The forward and backward passes are ``torch.library`` custom ops
# (``torch.ops.pool_tuner.adaptive_gem_pool2d(input, output_size, p, eps, options)`` and
# ``…_backward(grad_out, input, output, p, eps, options) -> (grad_input, grad_p)``) with fake
# implementations, so ``torch.compile(fullgraph=True)`` and ``torch.export`` see single nodes.
# ``p`` is a tensor of one element (a module's learnt ``nn.Parameter``), read on every call as a
# run-time kernel argument.  The double backward (``create_graph=True``) is PyTorch's composition
# ``adaptive_avg_pool(x.clamp(min=eps).pow(p), size).pow(1/p)``, differentiated by autograd; under
# ``torch.onnx.export`` the layers are that composition, in standard ONNX operators.  CPU tensors
# run through ``pool_tuner.torch_cpu``'s plans, CUDA tensors through ``pool_tuner.torch_cuda``'s
# (PyTorch's allocator and current stream), ``p`` and ``eps`` as the launches' run-time scalars: a
# CUDA ``p`` is read once per call (a synchronisation, as any host read of a device value is).


_GEM_FORWARD_SCHEMA = "(Tensor input, SymInt[] output_size, Tensor p, float eps, str options) -> Tensor"
_GEM_BACKWARD_SCHEMA = ("(Tensor grad_out, Tensor input, Tensor output, Tensor p, float eps, str options) "
                        "-> (Tensor, Tensor)")
#: ndim -> (GeM's forward custom op, its backward custom op)
_GEM_OPS: dict = {}

_GEM_AVERAGES = {1: torch.nn.functional.adaptive_avg_pool1d, 2: torch.nn.functional.adaptive_avg_pool2d,
              3: torch.nn.functional.adaptive_avg_pool3d}


def _gem_composition(input, output_size, p, eps: float):
    """GeM as PyTorch's four operations: what the double backward differentiates and ONNX exports."""
    ndim = len(output_size)
    return _GEM_AVERAGES[ndim](input.clamp(min=eps).pow(p), output_size).pow(1.0 / p)


def _gem_arguments(p: torch.Tensor, eps: float) -> dict:
    """``{"p", "eps"}`` as floats, checked (finite, > 0): p is read from its tensor."""
    return _gem.check_arguments(float(p.detach().reshape(())), eps)


def _numpy_array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a numpy array sharing its memory, where numpy has its dtype
    (bfloat16, which it lacks, widened to float32)."""
    t = t.detach()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def _layout_name(t: torch.Tensor, ndim: int) -> str:
    return LAYOUT_NAMES[ndim][int(_is_channels_last(t, ndim))]


def _gem_forward_cpu(op: str, input, output_size, arguments: dict, options: str):
    """GeM's forward on a CPU tensor: its ``torch_cpu`` plan, ``p`` and ``eps`` as this call's scalars."""
    found = _cpu_plan(op, "forward", [input], output_size, options)
    return _torch_cpu.run(found, [input], found.problem.with_arguments(arguments))[0]


def _gem_forward_cuda(op: str, input, output_size, arguments: dict, options: str):
    """GeM's forward on a CUDA tensor: its ``torch_cuda`` plan on PyTorch's current stream, ``p``
    and ``eps`` as this call's scalars."""
    found = _torch_cuda.plan_op(op, "forward", [input], output_size, options)
    return _torch_cuda.run(found, [input], found.problem.with_arguments(arguments))[0]


def _gem_backward_cpu(problem, grad_out, input, output, p, arguments: dict, options: str):
    """GeM's backward on CPU tensors: ``(grad_input, grad_p)``, ``grad_p`` like ``p``; the
    output-sized work in numpy slab by slab (``gem.backward_on_host``): PyTorch's small ops would
    wake its thread pool, which meets PoCL's workers on the same cores."""
    grad_input = _empty(list(input.shape), input, input.dtype, problem.channels_last, problem.ndim)
    device = _resolve_device(dict(_plans.options_of(options)).get("device"))
    grad_p = _gem.backward_on_host(device, problem, arguments, _numpy_array(grad_out), _numpy_array(output),
                                   input.data_ptr(), grad_input.data_ptr())
    return grad_input, torch.full_like(p, grad_p)


def _gem_backward_cuda(problem, grad_out, input, output, p, arguments: dict, options: str):
    """GeM's backward on CUDA tensors, the passes of the CPU path on PyTorch's current stream: the
    outputs' coefficients (output-sized, PyTorch's ops in the accumulation dtype), the
    input-gradient kernel, and ``dL/dp``, its input terms and output terms each summed on the
    device in a fixed order (deterministic): ``(grad_input, grad_p)``, ``grad_p`` like ``p``.

    A warm call is the p read, one launch of the kernel and a few output-sized PyTorch ops, with
    at most two output-sized temporaries in the accumulation dtype: the windows' areas come from
    ``_gem_window_areas`` (no host arithmetic, no copy to the device, which waits as a
    synchronisation does), and the output terms ``dL/dy * y * ln(y)`` are one ``xlogy`` and an
    in-place product, summed in the accumulation dtype (a float64 copy of each output-sized
    operand would be larger than a regional GeM's input in float16)."""
    ndim, channels_last = problem.ndim, problem.channels_last
    acc = torch.float64 if input.dtype == torch.float64 else torch.float32
    g, y = grad_out.detach(), output.detach().to(acc)
    output_terms = torch.xlogy(y, y).mul_(g).sum()
    coefficients = _gem.coefficient_values(g, y.pow(1 - arguments["p"]), arguments["p"],
                                           _gem_window_areas(problem, input.device, acc))
    del y
    coefficients = (coefficients.movedim(coefficients.dim() - ndim - 1, -1) if channels_last else coefficients)
    coefficients = coefficients.contiguous()
    index = input.device.index
    device = _cuda_backend.device_by_ordinal(0 if index is None else index, "input")
    _plans.check_device_option(device, dict(_plans.options_of(options)).get("device"), "input")
    _torch_cuda.check_context(device, input, "input")  # the input-gradient kernel is prepared per context
    grad_input = _empty(list(input.shape), input, input.dtype, channels_last, ndim)
    terms = torch.empty(_gem.input_gradient_terms(device, problem), dtype=acc, device=input.device)
    _gem.input_gradient_on_device(device, problem, arguments, _torch_cuda.current_raw_stream(input.device.index),
                                  input.data_ptr(), coefficients.data_ptr(), grad_input.data_ptr(), terms.data_ptr())
    grad_p = torch.sub(terms.sum(), output_terms, alpha=1 / arguments["p"])
    return grad_input, grad_p.to(device=p.device, dtype=p.dtype).reshape(p.shape)


#: (problem, device, dtype) -> the windows' areas of a GeM backward problem as a tensor there
_GEM_AREAS = _memo.table("torch.gem_window_areas")


def _gem_window_areas(problem, device: torch.device, dtype) -> torch.Tensor:
    """``gem.window_areas(problem)`` as a ``dtype`` tensor on ``device``, made on the problem's
    first backward there and kept with its other memos."""
    key = (problem, device, dtype)
    found = _GEM_AREAS.get(key)
    if found is None:
        found = _GEM_AREAS.put(problem, key, torch.from_numpy(_gem.window_areas(problem)).to(device=device, dtype=dtype))
    return found


#: device type -> GeM's (forward, backward) on tensors of that device
_GEM_PATHS = {"cpu": (_gem_forward_cpu, _gem_backward_cpu), "cuda": (_gem_forward_cuda, _gem_backward_cuda)}


def _gem_path(t: torch.Tensor):
    """GeM's ``(forward, backward)`` for ``t``'s device (the custom ops are registered for both)."""
    found = _GEM_PATHS.get(t.device.type)
    if found is None:
        raise ValueError(f"pool_tuner's GeM runs on CPU and CUDA tensors; input is on {t.device}")
    return found


def _gem_forward(ndim: int, input, output_size, arguments: dict, options: str):
    """GeM's forward on ``input``'s device, in the layout the fake implementation promises:
    PyTorch's average pooling's (``_channels_last_result``)."""
    result = _gem_path(input)[0](find("gem", ndim).name, input, tuple(output_size), arguments, options)
    return _in_layout(result, _channels_last_result(input, ndim), ndim)


#: (ndim, input's shape, strides and dtype, output's shape) -> GeM's backward problem
_GEM_BACKWARD_PROBLEMS = _memo.table("torch.gem_backward_problems")


def _gem_backward(ndim: int, grad_out, input, output, p, arguments: dict, options: str):
    """GeM's ``(grad_input, grad_p)`` on ``input``'s device, ``p`` and ``eps`` as ``arguments``;
    the problem validated on the signature's first backward, looked up after.  ``grad_input`` in
    the result's layout (``_gem_forward``), copied where the kernel wrote it in another (the layout
    it read the input in) -- also at output size 1, where PyTorch's average pooling, a mean there,
    gives a contiguous gradient: PyTorch's GeM composition keeps the result's layout, and a copy
    would double the memory GeM's backward takes."""
    key = (ndim, tuple(input.shape), input.stride(), input.dtype, tuple(output.shape))
    problem = _GEM_BACKWARD_PROBLEMS.get(key)
    if problem is None:
        problem = Problem.create(find("gem", ndim).name, tuple(input.shape), tuple(output.shape[output.dim() - ndim:]),
                                 str(input.dtype).removeprefix("torch."), _layout_name(input, ndim),
                                 direction="backward")
        _GEM_BACKWARD_PROBLEMS.put(problem, key, problem)
    channels_last = _problem_channels_last(problem)
    if problem.is_empty:  # no output, so no output depends on any input: zeros, and nothing to launch
        return _empty(list(input.shape), input, input.dtype, channels_last, ndim).zero_(), torch.zeros_like(p)
    if not problem.channels_last and not input.is_contiguous():  # read in place in either layout, else copied
        input = input.contiguous()
    grad_input, grad_p = _gem_path(input)[1](problem, grad_out, input, output, p, arguments, options)
    if problem.channels_last != channels_last:
        grad_input = _copied(grad_input, channels_last, ndim)
    return grad_input, grad_p


def _gem_composed_gradients(input, output_size, p, eps: float, grad_out):
    """``(grad_input, grad_p)`` through PyTorch's composition with its graph (None where the
    tensor needs none): the backward of a backward that is itself differentiated.  ``grad_input``
    in the layout of GeM's other gradient (``_gem_backward``), where the composition's follows the
    powers' (the input's)."""
    wanted = [t for t in (input, p) if t.requires_grad]
    found = iter(torch.autograd.grad(_gem_composition(input, output_size, p, eps), wanted, grad_out,
                                     create_graph=True) if wanted else ())
    grad_input, grad_p = (next(found) if t.requires_grad else None for t in (input, p))
    if grad_input is not None:
        ndim = len(output_size)
        grad_input = _in_layout(grad_input, _channels_last_result(input, ndim), ndim)
    return grad_input, grad_p


def _register_gem(ndim: int):
    operation = find("gem", ndim)
    op = operation.name

    def forward(input, output_size, p, eps, options):
        return _gem_forward(ndim, input, output_size, _gem_arguments(p, eps), options)

    def forward_fake(input, output_size, p, eps, options):
        shape = list(input.shape[: input.dim() - ndim]) + list(output_size)
        return _empty(shape, input, input.dtype, _channels_last_result(input, ndim), ndim)

    def backward(grad_out, input, output, p, eps, options):
        return _gem_backward(ndim, grad_out, input, output, p, _gem_arguments(p, eps), options)

    def backward_fake(grad_out, input, output, p, eps, options):
        return (_empty(list(input.shape), input, input.dtype, _channels_last_result(input, ndim), ndim),
                torch.empty_like(p))

    forward_op = torch.library.custom_op("pool_tuner::" + op, forward, mutates_args=(), device_types=("cpu", "cuda"),
                                         schema=_GEM_FORWARD_SCHEMA)
    forward_op.register_fake(forward_fake)
    backward_op = torch.library.custom_op("pool_tuner::" + BACKWARD.op_name(operation), backward, mutates_args=(),
                                          device_types=("cpu", "cuda"), schema=_GEM_BACKWARD_SCHEMA)
    backward_op.register_fake(backward_fake)

    def setup(ctx, inputs, output):
        input, output_size, p, ctx.eps, ctx.options = inputs
        ctx.output_size = list(output_size)
        ctx.save_for_backward(input, output, p)

    def gradient(ctx, grad_out):
        input, output, p = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the composition's graph, for the double backward
            grad_input, grad_p = _gem_composed_gradients(input, ctx.output_size, p, ctx.eps, grad_out)
        else:
            grad_input, grad_p = backward_op(grad_out, input, output, p, ctx.eps, _backward_options(ctx.options))
        return grad_input, None, grad_p, None, None

    forward_op.register_autograd(gradient, setup_context=setup)
    _GEM_OPS[ndim] = forward_op, backward_op


for _ndim in (1, 2, 3):
    _register_gem(_ndim)


class _EagerGeM(torch.autograd.Function):
    """The autograd of a plain eager GeM call that needs a gradient (``_gem_pool``), without the
    custom ops' dispatch layers: ``p`` is read once, by the forward, and the backward runs with
    that value -- ``p`` is saved for the backward, so it cannot have changed in between (autograd
    refuses a saved tensor changed in place) -- where the custom backward op reads it again, which
    on a CUDA tensor is one more synchronisation per training step.  A backward that is itself
    differentiated (``create_graph=True``) goes through the composition, as the custom op's does."""

    @staticmethod
    def forward(ctx, input, p, output_size, eps: float, options: str, ndim: int):
        arguments = _gem_arguments(p, eps)
        output = _gem_forward(ndim, input, output_size, arguments, options)
        ctx.save_for_backward(input, output, p)
        ctx.arguments, ctx.output_size, ctx.eps, ctx.ndim = arguments, list(output_size), eps, ndim
        ctx.options = _backward_options(options)
        return output

    @staticmethod
    def backward(ctx, grad_out):
        input, output, p = ctx.saved_tensors
        if _grad_enabled():
            grad_input, grad_p = _gem_composed_gradients(input, ctx.output_size, p, ctx.eps, grad_out)
        else:
            grad_input, grad_p = _gem_backward(ctx.ndim, grad_out, input, output, p, ctx.arguments, ctx.options)
        return grad_input, grad_p, None, None, None, None


def _gem_p(p, input: torch.Tensor) -> torch.Tensor:
    """``p`` as a tensor of one element: a number becomes one in the input's accumulation dtype."""
    if isinstance(p, torch.Tensor):
        if p.numel() != 1 or not p.is_floating_point():
            raise TypeError(f"p must be a number or a floating-point tensor of one element, got a {p.dtype} tensor "
                            f"of shape {tuple(p.shape)}")
        return p
    _gem.check_arguments(p, 1.0)
    return torch.tensor([float(p)], dtype=torch.float64 if input.dtype == torch.float64 else torch.float32,
                        device=input.device)


def _gem_pool(ndim: int, input, output_size, p, eps, options: str):
    output_size = _check_input(input, ndim, output_size)
    p = _gem_p(p, input)
    _gem.check_arguments(1.0, eps)
    if _exported_to_onnx():
        return _gem_composition(input, output_size, p, float(eps))
    if _plain_eager(input) and (input.is_cpu or input.is_cuda):  # without the custom ops' dispatch layers
        if _grad_enabled() and (input.requires_grad or p.requires_grad):
            return _EagerGeM.apply(input, p, output_size, float(eps), options, ndim)
        return _gem_forward(ndim, input, output_size, _gem_arguments(p, eps), options)
    _check_no_functorch_transform()
    return _GEM_OPS[ndim][0](input, output_size, p, float(eps), options)


def _make_gem_function(ndim: int):
    def adaptive_gem_pool(input, output_size, p=3.0, eps=1e-6, *, device=None, variant=None, config=None):
        return _gem_pool(ndim, input, output_size, p, eps, _encode_options(device, variant, config))

    adaptive_gem_pool.__name__ = adaptive_gem_pool.__qualname__ = find("gem", ndim).name
    adaptive_gem_pool.__doc__ = (
        f"Adaptive generalized-mean (GeM) pooling of a {ndim}d-pooled tensor: ``(mean over the window of "
        f"input.clamp(min=eps) ** p) ** (1/p)`` in one pass; ``p`` a number or a one-element tensor (its "
        f"gradient is computed), ``eps`` > 0; ``device=``, ``variant=``, ``config=`` as for pool_tuner's ops.")
    return adaptive_gem_pool


adaptive_gem_pool1d = _make_gem_function(1)
adaptive_gem_pool2d = _make_gem_function(2)
adaptive_gem_pool3d = _make_gem_function(3)
_GEM_FUNCTIONS = {1: adaptive_gem_pool1d, 2: adaptive_gem_pool2d, 3: adaptive_gem_pool3d}


class _AdaptiveGeMPool(_OwnModule, torch.nn.Module):
    """GeM pooling to ``output_size`` with exponent ``p`` -- an ``nn.Parameter`` of one element where
    ``p_trainable`` (learnt with the model, as in retrieval heads), else a buffer -- and floor ``eps``."""

    ndim: int
    repr_fields = ("output_size", "eps")

    def __init__(self, output_size, p=3.0, eps=1e-6, p_trainable=True, *, device=None, variant=None, config=None):
        super().__init__()
        _gem.check_arguments(p, eps)
        self.output_size, self.eps = output_size, float(eps)
        value = torch.full((1,), float(p))
        if p_trainable:
            self.p = torch.nn.Parameter(value)
        else:
            self.register_buffer("p", value)
        self.device, self.variant, self.config = device, variant, config

    def extra_repr(self) -> str:
        return f"p={float(self.p.detach().reshape(())):.4g}, " + super().extra_repr()

    def forward(self, input):
        return _GEM_FUNCTIONS[self.ndim](input, self.output_size, self.p, self.eps, device=self.device,
                                         variant=self.variant, config=self.config)

    def composed(self) -> torch.nn.Module:
        """This layer as PyTorch's composition (its ``p`` a copy): what ``pool_tuner.onnx.export``
        exports, in standard operators."""
        return _GeMComposition(self.ndim, self.output_size, self.p.detach().clone(), self.eps)


class _GeMComposition(torch.nn.Module):
    """GeM as PyTorch's four operations, ``p`` a constant buffer."""

    def __init__(self, ndim: int, output_size, p: torch.Tensor, eps: float):
        super().__init__()
        self.ndim, self.output_size, self.eps = ndim, output_size, eps
        self.register_buffer("p", p)

    def forward(self, input):
        return _gem_composition(input, _check_input(input, self.ndim, self.output_size), self.p, self.eps)


class AdaptiveGeMPool1d(_AdaptiveGeMPool):
    ndim = 1


class AdaptiveGeMPool2d(_AdaptiveGeMPool):
    ndim = 2


class AdaptiveGeMPool3d(_AdaptiveGeMPool):
    ndim = 3
