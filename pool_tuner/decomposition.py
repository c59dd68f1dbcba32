"""Adaptive pooling as exact decompositions into standard operators, written in PyTorch: what
ONNX export traces (``pool_tuner.onnx``), and what ``pool_tuner.torch``'s functions and layers
trace instead of their kernels under ``torch.onnx.export``.  It sits below both, so the layers
reach it without importing the exporter that imports them.

Adaptive pooling is separable per axis (the mean/max over a box is the mean/max along one axis of
the mean/max along the others), and along one axis its windows are fixed integers once the input
size is known:

* an axis whose windows all have one size and one stride (``pool_tuner.fixed_pool_equivalent``,
  every divisible case and some others) is ordinary pooling: ``AveragePool``/``MaxPool``, one op
  for the whole layer when every axis is like that;
* otherwise, average pooling along an axis is a product with a constant ``O x I`` pooling matrix
  (row ``o`` holds ``1/len`` over window ``o``): ``P_H · X · P_Wᵀ`` in 2d (``MatMul``);
* and max pooling along an axis is one ``Slice`` + ``ReduceMax`` per window, ``Concat``-ed;
* ONNX leaves what ``MaxPool`` and ``ReduceMax`` make of NaN open (onnxruntime skips NaNs), so a max
  window holding NaN is found apart -- average pooling of where the NaNs are -- and set to NaN, as
  PyTorch's is.
"""

from __future__ import annotations

import numbers

import torch

from .operations import find
from .windows import fixed_pool_equivalent, pooling_windows

__all__ = ["decompose"]


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


def _fixed_pool(operation, x: torch.Tensor, kernel, stride) -> torch.Tensor:
    pool = getattr(torch.nn.functional, operation.fixed_pool)
    return pool(x, kernel_size=tuple(kernel), stride=tuple(stride))


def _empty(x: torch.Tensor, ndim: int, output_size: list) -> torch.Tensor:
    """The empty result of pooling ``x`` to ``output_size`` (an entry 0): a slice of ``x`` with no
    elements, expanded to the output's shape (``Slice``, ``Expand``)."""
    lead = x.dim() - ndim
    x = x.narrow(lead + output_size.index(0), 0, 0)
    for axis, size in enumerate(output_size):
        x = x.narrow(lead + axis, 0, 1) if size else x
    return x.expand(*x.shape[:lead], *output_size)


def decompose(kind: str, ndim: int, x: torch.Tensor, output_size, layer: str) -> torch.Tensor:
    """Adaptive ``kind`` pooling of ``x`` (batched or batch-less, ``ndim`` pooled axes) to the
    resolved ``output_size``, in operators that export to standard ONNX.  ``layer`` names the
    layer (or function) in errors."""
    # the TorchScript exporter (dynamo=False) traces sizes as tensors: their values at export fix
    # the windows, as its own translation of PyTorch's adaptive pooling fixes its kernel sizes
    spatial = tuple(int(size) if isinstance(size, torch.Tensor) else size for size in x.shape[x.dim() - ndim:])
    for axis, size in enumerate(spatial):
        if not isinstance(size, numbers.Integral):  # a SymInt: a dynamic size under torch.export
            raise ValueError(
                f"{layer}: pooled input size {axis} is dynamic ({size}); adaptive pooling decomposes into ONNX "
                f"operators only for static pooled sizes (windows depend on the input size): make only the "
                f"batch and channel dimensions dynamic"
            )
    output_size = [int(size) for size in output_size]
    if 0 in output_size:  # PyTorch's result is empty: no windows, only its shape
        return _empty(x, ndim, output_size)
    source = x
    batchless = x.dim() == ndim + 1
    if batchless:  # ONNX pooling operators take (N, C, ...)
        x = x.unsqueeze(0)
    operation = find(kind, ndim)
    fixed = [fixed_pool_equivalent(i, o) for i, o in zip(spatial, output_size)]
    if all(fixed):
        x = _fixed_pool(operation, x, [f[0] for f in fixed], [f[1] for f in fixed])
    else:
        for axis, (in_size, out_size, equivalent) in enumerate(zip(spatial, output_size, fixed)):
            if in_size == out_size:
                continue
            dim = x.dim() - ndim + axis
            if equivalent is not None:
                kernel, stride = [1] * ndim, [1] * ndim
                kernel[axis], stride[axis] = equivalent[0], equivalent[1]
                x = _fixed_pool(operation, x, kernel, stride)
            else:
                x = (_max_along if operation.selects else _average_along)(x, dim, in_size, out_size)
    x = x.squeeze(0) if batchless else x
    if operation.selects:
        nans = decompose("avg", ndim, torch.isnan(source).to(source.dtype), output_size, layer)
        x = torch.where(nans > 0, torch.full_like(x, float("nan")), x)
    return x
