"""GeM pooling for PyTorch: ``pool_tuner.torch.adaptive_gem_pool{1,2,3}d`` and
``AdaptiveGeMPool{1,2,3}d``, with the gradient for the input and for ``p`` (pool_tuner.gem).

The forward and backward passes are ``torch.library`` custom ops
(``torch.ops.pool_tuner.adaptive_gem_pool2d(input, output_size, p, eps, options)`` and
``…_backward(grad_out, input, output, p, eps, options) -> (grad_input, grad_p)``) with fake
implementations, so ``torch.compile(fullgraph=True)`` and ``torch.export`` see single nodes.
``p`` is a tensor of one element (a module's learnt ``nn.Parameter``), read on every call as a
run-time kernel argument.  The double backward (``create_graph=True``) is PyTorch's composition
``adaptive_avg_pool(x.clamp(min=eps).pow(p), size).pow(1/p)``, differentiated by autograd; under
``torch.onnx.export`` the layers are that composition, in standard ONNX operators.  CPU tensors
run on pool_tuner's kernels; CUDA tensors are refused with a message (not implemented yet).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import gem as _gem
from . import torch_cpu as _torch_cpu
from .backends import resolve_device
from .operations import BACKWARD, find
from .problem import LAYOUT_NAMES, Problem
from .torch import (
    _backward_options,
    _check_input,
    _check_no_functorch_transform,
    _decode_options,
    _empty,
    _encode_options,
    _exported_to_onnx,
    _in_layout,
    _is_channels_last,
    _OwnModule,
)

__all__ = ["AdaptiveGeMPool1d", "AdaptiveGeMPool2d", "AdaptiveGeMPool3d",
           "adaptive_gem_pool1d", "adaptive_gem_pool2d", "adaptive_gem_pool3d"]

_FORWARD_SCHEMA = "(Tensor input, SymInt[] output_size, Tensor p, float eps, str options) -> Tensor"
_BACKWARD_SCHEMA = ("(Tensor grad_out, Tensor input, Tensor output, Tensor p, float eps, str options) "
                    "-> (Tensor, Tensor)")
#: ndim -> (forward custom op, backward custom op)
_OPS: dict = {}

_AVG_POOLS = {1: torch.nn.functional.adaptive_avg_pool1d, 2: torch.nn.functional.adaptive_avg_pool2d,
              3: torch.nn.functional.adaptive_avg_pool3d}


def composition(input, output_size, p, eps: float):
    """GeM as PyTorch's four operations: what the double backward differentiates and ONNX exports."""
    ndim = len(output_size)
    return _AVG_POOLS[ndim](input.clamp(min=eps).pow(p), output_size).pow(1.0 / p)


def _p_value(p: torch.Tensor, eps: float) -> dict:
    """``{"p", "eps"}`` as floats, checked (finite, > 0): p is read from its tensor."""
    if p.is_cuda:
        raise NotImplementedError("pool_tuner's GeM runs on CPU tensors only for now (p is on a CUDA device)")
    return _gem.check_arguments(float(p.detach().reshape(())), eps)


def _check_cpu(t: torch.Tensor, name: str) -> None:
    if t.is_cuda:
        raise NotImplementedError(f"pool_tuner's GeM runs on CPU tensors only for now; {name} is on {t.device}")


def _layout_of(t: torch.Tensor, ndim: int) -> str:
    return LAYOUT_NAMES[ndim][int(_is_channels_last(t, ndim))]


def _register(ndim: int):
    operation = find("gem", ndim)
    op = operation.name

    def forward(input, output_size, p, eps, options):
        _check_cpu(input, "input")
        arguments = _p_value(p, eps)
        found = _torch_cpu.plan(op, "forward", [input], tuple(output_size), _decode_options(options))
        (result,) = _torch_cpu.run(found, [input], found.problem.with_arguments(arguments))
        return _in_layout(result, _is_channels_last(input, ndim), ndim)

    def forward_fake(input, output_size, p, eps, options):
        shape = list(input.shape[: input.dim() - ndim]) + list(output_size)
        return _empty(shape, input, input.dtype, _is_channels_last(input, ndim), ndim)

    def backward(grad_out, input, output, p, eps, options):
        _check_cpu(input, "input")
        arguments = _p_value(p, eps)
        channels_last = _is_channels_last(input, ndim)
        if not channels_last and not input.is_contiguous():
            input = input.contiguous()
        acc = torch.float64 if input.dtype == torch.float64 else torch.float32
        problem = Problem.create(op, tuple(input.shape), tuple(output.shape[output.dim() - ndim:]),
                                 str(input.dtype).removeprefix("torch."), _layout_of(input, ndim), direction="backward")
        # dL/dm of each window mean m = y**p (output-sized), in the input's layout
        mean_grad = _empty(list(grad_out.shape), input, acc, channels_last, ndim)
        mean_grad.copy_(_gem._mean_gradient(grad_out.to(acc), output.to(acc), arguments["p"]))
        if _gem.plane_shares(problem):
            device, shares = resolve_device(dict(_decode_options(options)).get("device")), mean_grad
            grad_input = _empty(list(input.shape), input, input.dtype, channels_last, ndim)
        else:
            found = _torch_cpu.plan(op, "backward", [mean_grad], tuple(input.shape), _decode_options(options))
            (shares,) = _torch_cpu.run(found, [mean_grad])
            device = found.device
            grad_input = shares if shares.dtype == input.dtype else _empty(list(input.shape), input, input.dtype,
                                                                           channels_last, ndim)
        terms = _gem.input_gradient(device, problem, arguments, input.data_ptr(), shares.data_ptr(),
                                    grad_input.data_ptr())
        grad_p = math.fsum(np.asarray(terms, np.float64).tolist())
        g64, y64 = grad_out.to(torch.float64), output.to(torch.float64)
        grad_p += float(-(g64 * y64 * y64.log()).sum()) / arguments["p"]
        return grad_input, torch.full_like(p, grad_p)

    def backward_fake(grad_out, input, output, p, eps, options):
        return (_empty(list(input.shape), input, input.dtype, _is_channels_last(input, ndim), ndim),
                torch.empty_like(p))

    forward_op = torch.library.custom_op("pool_tuner::" + op, forward, mutates_args=(), device_types=("cpu", "cuda"),
                                         schema=_FORWARD_SCHEMA)
    forward_op.register_fake(forward_fake)
    backward_op = torch.library.custom_op("pool_tuner::" + BACKWARD.op_name(operation), backward, mutates_args=(),
                                          device_types=("cpu", "cuda"), schema=_BACKWARD_SCHEMA)
    backward_op.register_fake(backward_fake)

    def setup(ctx, inputs, output):
        input, output_size, p, ctx.eps, ctx.options = inputs
        ctx.output_size = list(output_size)
        ctx.save_for_backward(input, output, p)

    def gradient(ctx, grad_out):
        input, output, p = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the composition's graph, for the double backward
            wanted = [t for t in (input, p) if t.requires_grad]
            found = iter(torch.autograd.grad(composition(input, ctx.output_size, p, ctx.eps), wanted, grad_out,
                                             create_graph=True) if wanted else ())
            grad_input, grad_p = (next(found) if t.requires_grad else None for t in (input, p))
        else:
            grad_input, grad_p = backward_op(grad_out, input, output, p, ctx.eps, _backward_options(ctx.options))
        return grad_input, None, grad_p, None, None

    forward_op.register_autograd(gradient, setup_context=setup)
    _OPS[ndim] = forward_op, backward_op


for _ndim in (1, 2, 3):
    _register(_ndim)


def _as_p(p, input: torch.Tensor) -> torch.Tensor:
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
    p = _as_p(p, input)
    _gem.check_arguments(1.0, eps)
    if _exported_to_onnx():
        return composition(input, output_size, p, float(eps))
    _check_no_functorch_transform()
    return _OPS[ndim][0](input, output_size, p, float(eps), options)


def _make_function(ndim: int):
    def adaptive_gem_pool(input, output_size, p=3.0, eps=1e-6, *, device=None, variant=None, config=None):
        return _gem_pool(ndim, input, output_size, p, eps, _encode_options(device, variant, config))

    adaptive_gem_pool.__name__ = adaptive_gem_pool.__qualname__ = find("gem", ndim).name
    adaptive_gem_pool.__doc__ = (
        f"Adaptive generalized-mean (GeM) pooling of a {ndim}d-pooled tensor: ``(mean over the window of "
        f"input.clamp(min=eps) ** p) ** (1/p)`` in one pass; ``p`` a number or a one-element tensor (its "
        f"gradient is computed), ``eps`` > 0; ``device=``, ``variant=``, ``config=`` as for pool_tuner's ops.")
    return adaptive_gem_pool


adaptive_gem_pool1d = _make_function(1)
adaptive_gem_pool2d = _make_function(2)
adaptive_gem_pool3d = _make_function(3)
_FUNCTIONS = {1: adaptive_gem_pool1d, 2: adaptive_gem_pool2d, 3: adaptive_gem_pool3d}


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
        return _FUNCTIONS[self.ndim](input, self.output_size, self.p, self.eps, device=self.device,
                                     variant=self.variant, config=self.config)


class AdaptiveGeMPool1d(_AdaptiveGeMPool):
    ndim = 1


class AdaptiveGeMPool2d(_AdaptiveGeMPool):
    ndim = 2


class AdaptiveGeMPool3d(_AdaptiveGeMPool):
    ndim = 3
