"""ONNX export of adaptive pooling as exact decompositions into standard ONNX operators.

PyTorch refuses to export ``nn.AdaptiveAvgPool*d``/``AdaptiveMaxPool*d`` to ONNX unless every
output size divides its input size, and ONNX runtimes cannot run pool_tuner's kernels.  Both
have exact equivalents in standard operators, because adaptive pooling is separable per axis
(the mean/max over a box is the mean/max along one axis of the mean/max along the others) and
along one axis its windows are fixed integers once the input size is known:

* an axis whose windows all have one size and one stride (``pool_tuner.fixed_pool_equivalent``,
  every divisible case and some others) is ordinary pooling: ``AveragePool``/``MaxPool``, one op
  for the whole layer when every axis is like that;
* otherwise, average pooling along an axis is a product with a constant ``O x I`` pooling matrix
  (row ``o`` holds ``1/len`` over window ``o``): ``P_H · X · P_Wᵀ`` in 2d (``MatMul``);
* and max pooling along an axis is one ``Slice`` + ``ReduceMax`` per window, ``Concat``-ed.

``export(model, args, f)`` exports a copy of ``model`` whose PyTorch and pool_tuner adaptive
pooling layers are replaced by these decompositions; pool_tuner's layers and functional forms
also decompose themselves under a plain ``torch.onnx.export``.  The pooled input sizes must be
static (batch and channel sizes may be dynamic).  ``onnx`` and ``onnxscript`` (the exporter) are
imported only by ``export``: ``pip install "pool-tuner[onnx]"``.
"""

from __future__ import annotations

import copy
import numbers

import torch

from .shapes import resolve_output_size
from .torch import REPLACEMENTS, _PoolTunerModule, swap_layers
from .windows import fixed_pool_equivalent, pooling_windows

__all__ = ["export"]


def _pooling_matrix(in_size: int, out_size: int, dtype) -> torch.Tensor:
    """``P`` of shape (out_size, in_size): ``P @ v`` averages each window of ``v``."""
    starts, ends = pooling_windows(in_size, out_size)
    matrix = torch.zeros(out_size, in_size, dtype=torch.float64)
    for o, (start, end) in enumerate(zip(starts.tolist(), ends.tolist())):
        matrix[o, start:end] = 1.0 / (end - start)
    return matrix.to(dtype)


def _average_along(x: torch.Tensor, dim: int, in_size: int, out_size: int) -> torch.Tensor:
    """Average pooling of ``x`` along ``dim`` (a pooled axis) as a matrix product."""
    matrix = _pooling_matrix(in_size, out_size, x.dtype)
    if dim == x.dim() - 1:
        return x @ matrix.T
    if dim == x.dim() - 2:
        return matrix @ x
    rest = x.shape[dim + 1:]
    return (matrix @ x.flatten(dim + 1)).unflatten(-1, rest)


def _max_along(x: torch.Tensor, dim: int, in_size: int, out_size: int) -> torch.Tensor:
    """Max pooling of ``x`` along ``dim`` as one slice and reduction per window."""
    starts, ends = pooling_windows(in_size, out_size)
    return torch.cat([x.narrow(dim, start, end - start).amax(dim, keepdim=True)
                      for start, end in zip(starts.tolist(), ends.tolist())], dim)


def _fixed_pool(kind: str, ndim: int, x: torch.Tensor, kernel, stride) -> torch.Tensor:
    pool = getattr(torch.nn.functional, f"{kind}_pool{ndim}d")
    return pool(x, kernel_size=tuple(kernel), stride=tuple(stride))


def decompose(kind: str, ndim: int, x: torch.Tensor, output_size, layer: str) -> torch.Tensor:
    """Adaptive ``kind`` pooling of ``x`` (batched or batch-less, ``ndim`` pooled axes) to the
    resolved ``output_size``, in operators that export to standard ONNX.  ``layer`` names the
    layer (or function) in errors."""
    spatial = tuple(x.shape[x.dim() - ndim:])
    for axis, size in enumerate(spatial):
        if not isinstance(size, numbers.Integral):  # a SymInt: a dynamic size under torch.export
            raise ValueError(
                f"{layer}: pooled input size {axis} is dynamic ({size}); adaptive pooling decomposes into ONNX "
                f"operators only for static pooled sizes (windows depend on the input size): make only the "
                f"batch and channel dimensions dynamic"
            )
    output_size = [int(size) for size in output_size]
    batchless = x.dim() == ndim + 1
    if batchless:  # ONNX pooling operators take (N, C, ...)
        x = x.unsqueeze(0)
    fixed = [fixed_pool_equivalent(i, o) for i, o in zip(spatial, output_size)]
    if all(fixed):
        x = _fixed_pool(kind, ndim, x, [f[0] for f in fixed], [f[1] for f in fixed])
    else:
        for axis, (in_size, out_size, equivalent) in enumerate(zip(spatial, output_size, fixed)):
            if in_size == out_size:
                continue
            dim = x.dim() - ndim + axis
            if equivalent is not None:
                kernel, stride = [1] * ndim, [1] * ndim
                kernel[axis], stride[axis] = equivalent[0], equivalent[1]
                x = _fixed_pool(kind, ndim, x, kernel, stride)
            elif kind == "avg":
                x = _average_along(x, dim, in_size, out_size)
            else:
                x = _max_along(x, dim, in_size, out_size)
    return x.squeeze(0) if batchless else x


class DecomposedPool(torch.nn.Module):
    """An adaptive pooling layer as its ONNX-exportable decomposition (see ``decompose``);
    ``name`` is the qualified name of the layer it stands for."""

    def __init__(self, kind: str, ndim: int, output_size, name: str):
        super().__init__()
        self.kind, self.ndim, self.output_size, self.name = kind, ndim, output_size, name

    def forward(self, input):
        spatial = tuple(input.shape[input.dim() - self.ndim:])
        output_size = resolve_output_size(self.output_size, spatial, f"{self.name}.output_size")
        return decompose(self.kind, self.ndim, input, output_size, f"layer {self.name!r}")

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.ndim}d, output_size={self.output_size!r}, name={self.name!r}"


#: pool_tuner's and PyTorch's layer classes -> (kind, ndim)
_KNOWN = {cls: (ours.kind, ours.ndim) for cls, ours in REPLACEMENTS.items()}
_KNOWN.update({ours: (ours.kind, ours.ndim) for ours in REPLACEMENTS.values()})
_ADAPTIVE_BASES = tuple(REPLACEMENTS)


def _decomposed(name: str, module: torch.nn.Module) -> torch.nn.Module:
    known = _KNOWN.get(type(module))
    if known is None:
        if isinstance(module, _ADAPTIVE_BASES + (_PoolTunerModule,)):
            raise TypeError(
                f"layer {name or '<root>'!r} is a {type(module).__module__}.{type(module).__qualname__}, a subclass "
                f"of an adaptive pooling layer that pool_tuner.onnx does not know (its forward may differ); "
                f"known layers: torch.nn.Adaptive{{Avg,Max}}Pool{{1,2,3}}d and pool_tuner.torch's"
            )
        return module
    if getattr(module, "return_indices", False):
        raise ValueError(
            f"layer {name or '<root>'!r} ({type(module).__name__}) has return_indices=True: pool_tuner.onnx exports "
            f"max pooling values only; construct it with return_indices=False for export"
        )
    kind, ndim = known
    return DecomposedPool(kind, ndim, module.output_size, name or "<root>")


def decomposed(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` with every adaptive pooling layer (PyTorch's or pool_tuner's)
    replaced by its ``DecomposedPool``; ``model`` itself is untouched."""
    return swap_layers(copy.deepcopy(model), _decomposed)


def export(model: torch.nn.Module, args: tuple, f=None, *, kwargs=None, dynamic_shapes=None, **options):
    """Export ``model`` to ONNX with every adaptive pooling layer (PyTorch's, including the
    non-divisible sizes PyTorch's exporter refuses, and pool_tuner's) as an exact decomposition
    into standard ONNX operators; returns the ``torch.onnx.ONNXProgram``, saved to ``f`` if given.

    ``args``/``kwargs``/``dynamic_shapes`` are ``torch.export.export``'s; ``options`` go to
    ``torch.onnx.export`` (e.g. ``opset_version``).  Raises ``ValueError``/``TypeError`` naming the
    layer for a pooled size that is dynamic, a max layer with ``return_indices=True``, or a
    subclass of an adaptive pooling layer it does not know."""
    _require("onnx")
    _require("onnxscript")
    program = torch.export.export(decomposed(model), tuple(args), kwargs, dynamic_shapes=dynamic_shapes)
    onnx_program = torch.onnx.export(program, f, **options)
    return onnx_program


def _require(package: str):
    try:
        __import__(package)
    except ModuleNotFoundError as error:
        if error.name != package:
            raise
        raise ImportError(
            f"pool_tuner.onnx.export needs {package}, which is not installed: pip install \"pool-tuner[onnx]\""
        ) from error
