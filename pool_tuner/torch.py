"""PyTorch integration: autograd Functions, functional forms and ``nn.Module``s.

Drop-in replacements for ``torch.nn.AdaptiveAvgPool{1,2,3}d`` / ``AdaptiveMaxPool{1,2,3}d`` and
``torch.nn.functional.adaptive_{avg,max}_pool{1,2,3}d`` that run pool_tuner's kernels, forward and
backward::

    import pool_tuner.torch as ptt
    pool = ptt.AdaptiveAvgPool2d((5, 7))          # repr: AdaptiveAvgPool2d(output_size=(5, 7))
    y = ptt.adaptive_max_pool2d(x, 3, return_indices=True)

* Same constructor arguments, ``repr`` and results as PyTorch's (the modules subclass PyTorch's,
  so ``isinstance(m, torch.nn.AdaptiveAvgPool2d)`` holds); keyword-only ``device=``/``variant=``/
  ``config=`` choose the pool_tuner device and force the forward kernel (gradients use the
  dispatched backward kernels of the same device).
* Gradients come from pool_tuner's deterministic gather kernels (no atomics), so they are
  bit-identical across runs and work under ``torch.use_deterministic_algorithms(True)``.
* Double backward: the avg backward ("adaptive unpooling") is linear and its adjoint is the
  forward, so its own backward runs the forward kernel; the max backward's backward is a gather
  by index.  ``gradcheck`` and ``gradgradcheck`` pass for all six ops (max: on tie-free inputs).
* CPU tensors cross to numpy without copies (bfloat16 through its int16 bits and
  ``ml_dtypes.bfloat16``); channels-last inputs (``torch.channels_last``/``channels_last_3d``)
  give channels-last results; other strides are copied to contiguous by pool_tuner.  CUDA
  tensors go through ``pool_tuner.torch_cuda``: results from PyTorch's caching allocator, kernels
  launched on PyTorch's current stream, from any thread and inside CUDA graph capture.
* Indices are int64 positions within each pooled plane/volume, exactly as PyTorch's.

Importing ``pool_tuner`` never imports torch; importing this module does.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import ops as _ops
from . import torch_cuda as _torch_cuda

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
]

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


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


def _to_array(t: torch.Tensor):
    """The numpy array pool_tuner's ops take for CPU tensor ``t``, sharing its memory (bfloat16 as
    ``ml_dtypes.bfloat16``; pool_tuner copies other strides than contiguous and channels-last
    itself)."""
    t = t.detach().resolve_conj().resolve_neg()  # no-ops for ordinary tensors
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_bfloat16())
    return t.numpy()


def _to_tensor(array, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """A tensor sharing ``array``'s memory: a numpy result of a CPU call as a tensor with
    ``dtype`` (default: ``like``'s dtype); a CUDA call's results already are tensors."""
    if isinstance(array, torch.Tensor):
        return array
    dtype = like.dtype if dtype is None else dtype
    if dtype == torch.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _call(fn, tensors, *args, **kwargs):
    """Run pool_tuner ``fn`` on ``tensors`` and ``args``: CPU tensors as numpy views through
    ``fn`` itself; CUDA tensors through ``pool_tuner.torch_cuda`` (PyTorch's allocator and current
    stream, any thread, CUDA graphs), which returns tensors."""
    if tensors[0].is_cuda:
        return _torch_cuda.call(fn, tensors, args[0], kwargs)
    return fn(*[_to_array(t) for t in tensors], *args, **kwargs)


# --------------------------------------------------------------------------------------------
# Autograd Functions
#
# ``opts`` holds the pool_tuner keyword arguments of the forward kernel (``device``,
# ``variant``, ``config``); every other kernel of the graph gets ``device`` only (a forced
# variant or config names a forward kernel of one shape).


def _backward_opts(opts: dict) -> dict:
    return {"device": opts.get("device")}


def _op(kind: str, ndim: int, backward: bool = False):
    return getattr(_ops, f"adaptive_{kind}_pool{ndim}d" + ("_backward" if backward else ""))


class _AvgPool(torch.autograd.Function):
    """y = adaptive_avg_pool(x); dx = adaptive_avg_pool_backward(dy)."""

    @staticmethod
    def forward(x, ndim, output_size, opts):
        return _to_tensor(_call(_op("avg", ndim), [x], output_size, **opts), x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.ndim, _, ctx.opts = inputs
        ctx.input_shape = tuple(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = _AvgUnpool.apply(grad_out, ctx.ndim, ctx.input_shape, _backward_opts(ctx.opts))
        return grad_in, None, None, None


class _AvgUnpool(torch.autograd.Function):
    """The avg backward as a differentiable op: linear in ``grad_out``, with the forward pooling
    (to the output size of ``grad_out``) as its adjoint -- so double backward runs the forward."""

    @staticmethod
    def forward(grad_out, ndim, input_shape, opts):
        return _to_tensor(_call(_op("avg", ndim, backward=True), [grad_out], input_shape, **opts), grad_out)

    @staticmethod
    def setup_context(ctx, inputs, output):
        grad_out, ctx.ndim, _, ctx.opts = inputs
        ctx.output_size = tuple(grad_out.shape[grad_out.dim() - ctx.ndim:])

    @staticmethod
    def backward(ctx, grad_grad_in):
        grad_grad_out = _AvgPool.apply(grad_grad_in, ctx.ndim, ctx.output_size, ctx.opts)
        return grad_grad_out, None, None, None


class _MaxPool(torch.autograd.Function):
    """(y, indices) = adaptive_max_pool(x); dx = adaptive_max_pool_backward(dy, indices)."""

    @staticmethod
    def forward(x, ndim, output_size, opts):
        values, indices = _call(_op("max", ndim), [x], output_size, True, **opts)
        return _to_tensor(values, x), _to_tensor(indices, x, torch.int64)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.ndim, _, ctx.opts = inputs
        ctx.input_shape = tuple(x.shape)
        ctx.save_for_backward(output[1])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, grad_out, _grad_indices):
        (indices,) = ctx.saved_tensors
        grad_in = _MaxUnpool.apply(grad_out, indices, ctx.ndim, ctx.input_shape, _backward_opts(ctx.opts))
        return grad_in, None, None, None


class _MaxUnpool(torch.autograd.Function):
    """The max backward as a differentiable op: linear in ``grad_out``; its adjoint gathers
    ``grad_grad_in`` at the indices, plane by plane (pure index math, deterministic)."""

    @staticmethod
    def forward(grad_out, indices, ndim, input_shape, opts):
        grad_in = _call(_op("max", ndim, backward=True), [grad_out, indices], input_shape, **opts)
        return _to_tensor(grad_in, grad_out)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, indices, ctx.ndim, input_shape, _ = inputs
        ctx.input_shape = tuple(input_shape)
        ctx.save_for_backward(indices)

    @staticmethod
    def backward(ctx, grad_grad_in):
        (indices,) = ctx.saved_tensors
        batch = ctx.input_shape[: len(ctx.input_shape) - ctx.ndim]
        plane = math.prod(ctx.input_shape[len(batch):])
        flat_in = grad_grad_in.reshape(batch + (plane,))
        flat_idx = indices.reshape(batch + (math.prod(indices.shape[len(batch):]),))
        grad_grad_out = torch.gather(flat_in, -1, flat_idx).reshape(indices.shape)
        return grad_grad_out, None, None, None, None


# --------------------------------------------------------------------------------------------
# Functional forms (torch.nn.functional's signatures, plus pool_tuner's keyword arguments)


def _options(device, variant, config) -> dict:
    return {"device": device, "variant": variant, "config": config}


def _eager(fn):
    """Keep ``torch.compile`` out of pool_tuner's host code: it runs eagerly, between graphs."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return fn if disable is None else disable(fn)


@_eager
def _avg(ndim, input, output_size, opts):
    _check_tensor(input, "input")
    return _AvgPool.apply(input, ndim, output_size, opts)


@_eager
def _max(ndim, input, output_size, return_indices, opts):
    _check_tensor(input, "input")
    values, indices = _MaxPool.apply(input, ndim, output_size, opts)
    return (values, indices) if return_indices else values


def adaptive_avg_pool1d(input, output_size, *, device=None, variant=None, config=None):
    """``torch.nn.functional.adaptive_avg_pool1d`` on pool_tuner's kernels; ``device=`` (a
    pool_tuner device id), ``variant=`` and ``config=`` are passed to ``pool_tuner.adaptive_avg_pool1d``."""
    return _avg(1, input, output_size, _options(device, variant, config))


def adaptive_avg_pool2d(input, output_size, *, device=None, variant=None, config=None):
    """``torch.nn.functional.adaptive_avg_pool2d`` on pool_tuner's kernels (see ``adaptive_avg_pool1d``)."""
    return _avg(2, input, output_size, _options(device, variant, config))


def adaptive_avg_pool3d(input, output_size, *, device=None, variant=None, config=None):
    """``torch.nn.functional.adaptive_avg_pool3d`` on pool_tuner's kernels (see ``adaptive_avg_pool1d``)."""
    return _avg(3, input, output_size, _options(device, variant, config))


def adaptive_max_pool1d(input, output_size, return_indices=False, *, device=None, variant=None, config=None):
    """``torch.nn.functional.adaptive_max_pool1d`` on pool_tuner's kernels: returns the pooled
    values, and with ``return_indices=True`` also their int64 indices, as PyTorch."""
    return _max(1, input, output_size, return_indices, _options(device, variant, config))


def adaptive_max_pool2d(input, output_size, return_indices=False, *, device=None, variant=None, config=None):
    """``torch.nn.functional.adaptive_max_pool2d`` on pool_tuner's kernels (see ``adaptive_max_pool1d``)."""
    return _max(2, input, output_size, return_indices, _options(device, variant, config))


def adaptive_max_pool3d(input, output_size, return_indices=False, *, device=None, variant=None, config=None):
    """``torch.nn.functional.adaptive_max_pool3d`` on pool_tuner's kernels (see ``adaptive_max_pool1d``)."""
    return _max(3, input, output_size, return_indices, _options(device, variant, config))


# --------------------------------------------------------------------------------------------
# Modules: subclasses of PyTorch's, so constructor arguments, attributes, repr and isinstance
# checks are PyTorch's own.


class _PoolTunerOptions:
    """Keyword-only pool_tuner options of a module, shown in its repr only when set."""

    def _set_options(self, device, variant, config):
        self.device, self.variant, self.config = device, variant, config

    def _options(self) -> dict:
        return _options(self.device, self.variant, self.config)

    def extra_repr(self) -> str:
        text = super().extra_repr()
        for name in ("device", "variant", "config"):
            if getattr(self, name) is not None:
                text += f", {name}={getattr(self, name)!r}"
        return text


class AdaptiveAvgPool1d(_PoolTunerOptions, torch.nn.AdaptiveAvgPool1d):
    """``torch.nn.AdaptiveAvgPool1d`` on pool_tuner's kernels."""

    def __init__(self, output_size, *, device=None, variant=None, config=None):
        super().__init__(output_size)
        self._set_options(device, variant, config)

    def forward(self, input):
        return _avg(1, input, self.output_size, self._options())


class AdaptiveAvgPool2d(_PoolTunerOptions, torch.nn.AdaptiveAvgPool2d):
    """``torch.nn.AdaptiveAvgPool2d`` on pool_tuner's kernels."""

    def __init__(self, output_size, *, device=None, variant=None, config=None):
        super().__init__(output_size)
        self._set_options(device, variant, config)

    def forward(self, input):
        return _avg(2, input, self.output_size, self._options())


class AdaptiveAvgPool3d(_PoolTunerOptions, torch.nn.AdaptiveAvgPool3d):
    """``torch.nn.AdaptiveAvgPool3d`` on pool_tuner's kernels."""

    def __init__(self, output_size, *, device=None, variant=None, config=None):
        super().__init__(output_size)
        self._set_options(device, variant, config)

    def forward(self, input):
        return _avg(3, input, self.output_size, self._options())


class AdaptiveMaxPool1d(_PoolTunerOptions, torch.nn.AdaptiveMaxPool1d):
    """``torch.nn.AdaptiveMaxPool1d`` on pool_tuner's kernels."""

    def __init__(self, output_size, return_indices=False, *, device=None, variant=None, config=None):
        super().__init__(output_size, return_indices)
        self._set_options(device, variant, config)

    def forward(self, input):
        return _max(1, input, self.output_size, self.return_indices, self._options())


class AdaptiveMaxPool2d(_PoolTunerOptions, torch.nn.AdaptiveMaxPool2d):
    """``torch.nn.AdaptiveMaxPool2d`` on pool_tuner's kernels."""

    def __init__(self, output_size, return_indices=False, *, device=None, variant=None, config=None):
        super().__init__(output_size, return_indices)
        self._set_options(device, variant, config)

    def forward(self, input):
        return _max(2, input, self.output_size, self.return_indices, self._options())


class AdaptiveMaxPool3d(_PoolTunerOptions, torch.nn.AdaptiveMaxPool3d):
    """``torch.nn.AdaptiveMaxPool3d`` on pool_tuner's kernels."""

    def __init__(self, output_size, return_indices=False, *, device=None, variant=None, config=None):
        super().__init__(output_size, return_indices)
        self._set_options(device, variant, config)

    def forward(self, input):
        return _max(3, input, self.output_size, self.return_indices, self._options())


_REPLACEMENTS = {
    torch.nn.AdaptiveAvgPool1d: AdaptiveAvgPool1d,
    torch.nn.AdaptiveAvgPool2d: AdaptiveAvgPool2d,
    torch.nn.AdaptiveAvgPool3d: AdaptiveAvgPool3d,
    torch.nn.AdaptiveMaxPool1d: AdaptiveMaxPool1d,
    torch.nn.AdaptiveMaxPool2d: AdaptiveMaxPool2d,
    torch.nn.AdaptiveMaxPool3d: AdaptiveMaxPool3d,
}


def replace_pooling(model: torch.nn.Module, *, device=None, variant=None, config=None) -> torch.nn.Module:
    """Swap every PyTorch adaptive pooling layer inside ``model`` (in place, ``model`` itself
    included) for pool_tuner's equivalent with the same arguments; returns the (new) model.
    Layers that are already pool_tuner's, and subclasses of PyTorch's, are left alone."""

    def swap(module):
        cls = _REPLACEMENTS.get(type(module))
        if cls is None:
            return module
        args = (module.output_size,) if cls.__name__.startswith("AdaptiveAvg") else (module.output_size, module.return_indices)
        new = cls(*args, device=device, variant=variant, config=config)
        new.train(module.training)
        return new

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            replacement = swap(child)
            if replacement is not child:
                setattr(parent, name, replacement)
    return swap(model)
