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
* and max pooling along an axis is one ``Slice`` + ``ReduceMax`` per window, ``Concat``-ed.

NaN and infinities come out as PyTorch's, window by window.  The windows holding them are found
apart, by average pooling of 0/1 masks of where they are (``IsNaN``, ``Equal`` to ±inf; a window
holds one where its average is above 0):

* a pooling matrix has zeros outside each window, and ``0 * NaN`` and ``0 * inf`` are NaN, so one
  NaN or infinity would spread along a whole row of the product: when some axis is a matrix
  product, average pooling averages the input with its NaNs and infinities replaced by 0 (``Where``,
  which does not carry the unselected NaN), then sets the windows holding NaN, or both +inf and
  -inf, to NaN, and the other windows holding +inf (-inf) to +inf (-inf), as PyTorch's sum does.
  ``AveragePool`` sums each window itself and already gives that, so a layer whose axes are all
  fixed (or kept) pools its input as it is;
* ONNX leaves what ``MaxPool`` and ``ReduceMax`` make of NaN open (onnxruntime skips NaNs), so a max
  window holding NaN is set to NaN, as PyTorch's is.
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
    for axis, size in enumerate(output_size):  # every empty axis of length 0, the others of length 1
        x = x.narrow(lead + axis, 0, 1 if size else 0)
    return x.expand(*x.shape[:lead], *output_size)


def decompose(kind: str, ndim: int, x: torch.Tensor, output_size, layer: str) -> torch.Tensor:
    """Adaptive ``kind`` pooling of ``x`` (batched or batch-less, ``ndim`` pooled axes) to the
    resolved ``output_size``, in operators that export to standard ONNX, NaN and infinities
    included.  ``layer`` names the layer (or function) in errors."""
    # the TorchScript exporter (dynamo=False) traces sizes as tensors: their values at export fix
    # the windows, as its own translation of PyTorch's adaptive pooling fixes its kernel sizes;
    # the exported model refuses other pooled sizes (dynamic_axes naming a pooled axis), for which
    # its windows would be wrong, at run time: x reshaped to the sizes (which fails unless their
    # product is x's) times ones of the sizes expanded to x's shape (which fails unless each of x's
    # is the size or 1) passes those sizes alone, and changes no bit of x
    traced = any(isinstance(size, torch.Tensor) for size in x.shape[x.dim() - ndim:])
    spatial = tuple(int(size) if isinstance(size, torch.Tensor) else size for size in x.shape[x.dim() - ndim:])
    if traced:
        x = x.reshape(*x.shape[:x.dim() - ndim], *spatial) * torch.ones(spatial, dtype=x.dtype).expand(x.shape)
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
    operation = find(kind, ndim)
    fixed = [fixed_pool_equivalent(i, o) for i, o in zip(spatial, output_size)]
    if operation.selects:
        pooled = _pooled(operation, x, ndim, spatial, output_size, fixed)
        return torch.where(_windows_holding(torch.isnan(x), ndim, spatial, output_size, fixed), _NAN, pooled)
    if all(equivalent is not None or i == o for i, o, equivalent in zip(spatial, output_size, fixed)):
        return _pooled(operation, x, ndim, spatial, output_size, fixed)  # AveragePool sums NaN and inf as PyTorch
    # a pooling matrix would spread a NaN or an infinity along a row (0 * NaN, 0 * inf): average the
    # finite values, then set the windows holding NaN or infinities as PyTorch's sum does
    nan, positive, negative = torch.isnan(x), x == _INF, x == -_INF
    finite = torch.where(nan | positive | negative, torch.zeros_like(x), x)
    pooled = _pooled(operation, finite, ndim, spatial, output_size, fixed)
    nan, positive, negative = (_windows_holding(mask, ndim, spatial, output_size, fixed)
                               for mask in (nan, positive, negative))
    pooled = torch.where(positive, _INF, pooled)
    pooled = torch.where(negative, -_INF, pooled)
    return torch.where(nan | (positive & negative), _NAN, pooled)


_NAN, _INF = float("nan"), float("inf")
_AVG = {ndim: find("avg", ndim) for ndim in (1, 2, 3)}


def _windows_holding(mask: torch.Tensor, ndim: int, spatial: tuple, output_size: list, fixed: list) -> torch.Tensor:
    """Which windows hold a true entry of the boolean ``mask``: average pooling of it as 0/1 (finite,
    so exact on every path), above 0."""
    # float32 whatever the input's dtype: 1 / len of a long window underflows in float16
    return _pooled(_AVG[ndim], mask.to(torch.float32), ndim, spatial, output_size, fixed) > 0


def _pooled(operation, x: torch.Tensor, ndim: int, spatial: tuple, output_size: list, fixed: list) -> torch.Tensor:
    """Adaptive pooling of ``x`` by ``operation``, as fixed pooling, pooling matrices or window
    slices per axis (``fixed``: each axis's fixed equivalent or None); NaN and infinities as the
    operators make them."""
    batchless = x.dim() == ndim + 1
    if batchless:  # ONNX pooling operators take (N, C, ...)
        x = x.unsqueeze(0)
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
    return x.squeeze(0) if batchless else x
