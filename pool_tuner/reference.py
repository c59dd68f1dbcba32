"""The float64 numpy oracle of adaptive pooling: forward and backward, avg, max and GeM, 1d/2d/3d.

Every kernel, variant, dtype and layout of the library is checked against this module (docs/design.md,
Quality bars), so it is written to be *obviously* right rather than fast: plain Python loops over the
output windows, computed in float64 from the exact integer windows of
:func:`pool_tuner.windows.pooling_windows`.  The only vectorisation is *within* one window, over all
``(N, C)`` planes at once.  The backward passes are written as their scatter definitions (loop over
outputs, add into their windows); in particular the avg backward deliberately does not use the
inverse-window gather that the kernels use, so that it can serve as their independent check.

Inputs are logical channels-first arrays, ``(N, C, *spatial)`` or batch-less ``(C, *spatial)``,
with ``ndim`` (1, 2 or 3) pooled trailing axes.  Arguments are validated with
:mod:`pool_tuner.shapes`, so bad input raises the same ``TypeError``/``ValueError`` as the public API.
"""

from __future__ import annotations

import itertools

import numpy as np

from pool_tuner.operations import OPERATIONS
from pool_tuner.shapes import check_int, resolve_output_size, split_input_shape
from pool_tuner.windows import pooling_windows

__all__ = [
    "forward",
    "backward",
    "adaptive_avg_pool",
    "adaptive_max_pool",
    "adaptive_avg_pool_backward",
    "adaptive_max_pool_backward",
    "adaptive_gem_pool",
    "adaptive_gem_pool_backward",
]


def _check_ndim(ndim) -> int:
    ndim = check_int(ndim, "ndim")
    if ndim not in (1, 2, 3):
        raise ValueError(f"ndim must be 1, 2 or 3 (the number of pooled axes), got {ndim}")
    return ndim


def _as_float64(a, name: str) -> np.ndarray:
    """``a`` as a float64 ndarray; rejects non-real-numeric dtypes (bool, complex, object, ...)."""
    arr = np.asarray(a)
    if arr.dtype.name == "bfloat16":  # ml_dtypes' bfloat16 widens exactly to float32
        arr = arr.astype(np.float32)
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"{name} must be a real floating-point (or integer) array, got dtype {arr.dtype}")
    return arr.astype(np.float64, copy=False)


def _windows(in_spatial, out_spatial):
    """Per axis, the list of ``(start, end)`` input windows of each output index."""
    result = []
    for i, o in zip(in_spatial, out_spatial):
        starts, ends = pooling_windows(i, o)
        result.append([(int(s), int(e)) for s, e in zip(starts, ends)])
    return result


def _outputs(in_spatial, out_spatial):
    """Yield ``(out_index, window_slices, window_starts, window_shape)`` for every output position,
    ``out_index`` being a tuple of per-axis output indices in row-major order."""
    per_axis = _windows(in_spatial, out_spatial)
    for out_index in itertools.product(*(range(o) for o in out_spatial)):
        bounds = [per_axis[axis][o] for axis, o in enumerate(out_index)]
        slices = tuple(slice(s, e) for s, e in bounds)
        starts = tuple(s for s, _ in bounds)
        shape = tuple(e - s for s, e in bounds)
        yield out_index, slices, starts, shape


def adaptive_avg_pool(x, output_size, ndim: int) -> np.ndarray:
    """Adaptive average pooling of ``x`` over its last ``ndim`` axes, in float64."""
    ndim = _check_ndim(ndim)
    x = _as_float64(x, "x")
    batch, in_spatial = split_input_shape(x.shape, ndim, "x")
    out_spatial = resolve_output_size(output_size, in_spatial)
    out = np.empty(batch + out_spatial, dtype=np.float64)
    lead = (Ellipsis,)
    for out_index, slices, _, _ in _outputs(in_spatial, out_spatial):
        window = x[lead + slices]
        out[lead + out_index] = window.mean(axis=tuple(range(-ndim, 0)))
    return out


def adaptive_max_pool(x, output_size, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """Adaptive max pooling of ``x`` over its last ``ndim`` axes.

    Returns ``(values, indices)``: float64 maxima and int64 indices flattened within the pooled
    plane/volume (``h*W + w``, ``t*H*W + h*W + w``).  A window holding NaN yields NaN and the index
    of its last NaN in row-major window order (PyTorch's scan takes every NaN it meets); ties (and
    all ``-inf`` windows) yield the first position of the maximum in row-major window order.
    """
    ndim = _check_ndim(ndim)
    x = _as_float64(x, "x")
    batch, in_spatial = split_input_shape(x.shape, ndim, "x")
    out_spatial = resolve_output_size(output_size, in_spatial)
    values = np.empty(batch + out_spatial, dtype=np.float64)
    indices = np.empty(batch + out_spatial, dtype=np.int64)
    lead = (Ellipsis,)
    for out_index, slices, starts, shape in _outputs(in_spatial, out_spatial):
        area = int(np.prod(shape))
        # Row-major flattening of the window: position k is the k-th element in window order.
        flat = x[lead + slices].reshape(batch + (area,))
        isnan = np.isnan(flat)
        has_nan = isnan.any(axis=-1)
        last_nan = area - 1 - np.argmax(isnan[..., ::-1], axis=-1)  # last True
        # Explicitly the first occurrence of the maximum, ignoring NaNs (they are handled above).
        # An all -inf window gives max -inf and so position 0.
        no_nan = np.where(isnan, -np.inf, flat)
        peak = no_nan.max(axis=-1, keepdims=True)
        first_max = np.argmax(no_nan == peak, axis=-1)
        local = np.where(has_nan, last_nan, first_max)
        # Window-local flat position -> coordinates in the pooled plane/volume -> flat index there.
        coords = np.unravel_index(local, shape)
        flat_index = np.zeros(local.shape, dtype=np.int64)
        for axis in range(ndim):
            flat_index = flat_index * in_spatial[axis] + (coords[axis] + starts[axis])
        values[lead + out_index] = np.take_along_axis(flat, local[..., None], axis=-1)[..., 0]
        indices[lead + out_index] = flat_index
    return values, indices


def _check_grad_out(grad_out, input_shape, ndim: int):
    """Validate ``grad_out`` against ``input_shape``; return ``(grad_out, batch, in_spatial,
    out_spatial)``."""
    grad_out = _as_float64(grad_out, "grad_out")
    batch, in_spatial = split_input_shape(input_shape, ndim, "input_shape")
    if grad_out.ndim != len(batch) + ndim:
        raise ValueError(
            f"grad_out must have the rank of input_shape ({len(batch) + ndim}), got shape {grad_out.shape}"
        )
    if grad_out.shape[: len(batch)] != batch:
        raise ValueError(
            f"grad_out must have the batch/channel dims {batch} of input_shape, got shape {grad_out.shape}"
        )
    out_spatial = resolve_output_size(grad_out.shape[len(batch) :], in_spatial, name="grad_out.shape[-ndim:]")
    return grad_out, batch, in_spatial, out_spatial


def adaptive_avg_pool_backward(grad_out, input_shape, ndim: int) -> np.ndarray:
    """Gradient of :func:`adaptive_avg_pool` w.r.t. its input, float64 of ``input_shape``.

    Scatter definition: ``grad_in[i] = sum over outputs o whose window holds i of
    grad_out[o] / area(o)``, computed by looping over the outputs and adding into each window.
    """
    ndim = _check_ndim(ndim)
    grad_out, batch, in_spatial, out_spatial = _check_grad_out(grad_out, input_shape, ndim)
    grad_in = np.zeros(batch + in_spatial, dtype=np.float64)
    lead = (Ellipsis,)
    for out_index, slices, _, shape in _outputs(in_spatial, out_spatial):
        area = int(np.prod(shape))
        share = grad_out[lead + out_index] / area
        grad_in[lead + slices] += share.reshape(share.shape + (1,) * ndim)
    return grad_in


def adaptive_max_pool_backward(grad_out, indices, input_shape, ndim: int) -> np.ndarray:
    """Gradient of :func:`adaptive_max_pool` w.r.t. its input, float64 of ``input_shape``.

    Scatter definition: ``grad_in[idx[o]] += grad_out[o]`` within each ``(n, c)`` plane/volume,
    ``indices`` being flattened within the pooled plane/volume as returned by the forward.
    """
    ndim = _check_ndim(ndim)
    grad_out, batch, in_spatial, _ = _check_grad_out(grad_out, input_shape, ndim)
    indices = np.asarray(indices)
    if indices.dtype.kind not in "iu":
        raise TypeError(f"indices must be an integer array, got dtype {indices.dtype}")
    if indices.shape != grad_out.shape:
        raise ValueError(f"indices must have the shape of grad_out {grad_out.shape}, got {indices.shape}")
    plane = int(np.prod(in_spatial))
    if indices.size and (indices.min() < 0 or indices.max() >= plane):
        raise ValueError(
            f"indices must lie in [0, {plane}) (flattened within the pooled dims {in_spatial}), "
            f"got values in [{indices.min()}, {indices.max()}]"
        )
    planes = int(np.prod(batch))
    grad_in = np.zeros((planes, plane), dtype=np.float64)
    idx = indices.astype(np.int64).reshape(planes, -1) if planes else np.zeros((0, 0), np.int64)
    grads = grad_out.reshape(idx.shape)
    for p in range(planes):
        np.add.at(grad_in[p], idx[p], grads[p])
    return grad_in.reshape(batch + in_spatial)


def adaptive_gem_pool(x, output_size, ndim: int, p: float = 3.0, eps: float = 1e-6) -> np.ndarray:
    """Adaptive generalized-mean (GeM) pooling, float64: ``(mean over the window of
    max(x, eps)**p) ** (1/p)`` (a NaN stays NaN, as with PyTorch's ``clamp(min=eps)``)."""
    x = _as_float64(x, "x")
    clamped = np.where(x < eps, eps, x)
    return adaptive_avg_pool(clamped ** p, output_size, ndim) ** (1.0 / p)


def adaptive_gem_pool_backward(grad_out, x, output_size, ndim: int, p: float = 3.0,
                               eps: float = 1e-6) -> tuple[np.ndarray, float]:
    """Gradients of :func:`adaptive_gem_pool` w.r.t. ``x`` and ``p``, float64, by the chain rule
    through its definition, written as a scatter over the outputs: with ``xc = max(x, eps)`` and
    ``m = mean(xc**p)`` over window ``o``, ``dy/dxc_i = y**(1-p) * xc_i**(p-1) / area`` (0 where
    ``x < eps``: the gradient of ``clamp(min=eps)``, which passes at ``x == eps``) and
    ``dy/dp = y * (-ln(m) / p**2 + mean(xc**p * ln(xc)) / (p * m))``."""
    ndim = _check_ndim(ndim)
    x = _as_float64(x, "x")
    grad_out = _as_float64(grad_out, "grad_out")
    batch, in_spatial = split_input_shape(x.shape, ndim, "x")
    out_spatial = resolve_output_size(output_size, in_spatial)
    clamped = np.where(x < eps, eps, x)
    grad_x = np.zeros(x.shape, dtype=np.float64)
    grad_p = 0.0
    lead = (Ellipsis,)
    axes = tuple(range(-ndim, 0))
    for out_index, slices, _, shape in _outputs(in_spatial, out_spatial):
        area = int(np.prod(shape))
        window = clamped[lead + slices]
        m = (window ** p).mean(axis=axes)
        y = m ** (1.0 / p)
        g = grad_out[lead + out_index]
        expand = (Ellipsis,) + (None,) * ndim
        grad_x[lead + slices] += (g * y ** (1 - p) / area)[expand] * window ** (p - 1)
        moment = (window ** p * np.log(window)).mean(axis=axes)
        grad_p += float(np.sum(g * y * (-np.log(m) / p ** 2 + moment / (p * m))))
    return np.where(x >= eps, grad_x, 0.0), grad_p


def forward(op: str, x, output_size, **arguments):
    """The reference of a public forward op by name.  One level: values, and for a selecting op
    (max) ``(values, indices)``.  A multi-level op: ``(values, indices)``, lists over its levels
    (indices of the max levels only), each level pooled on its own by its definition.
    ``arguments``: the values of the op's run-time arguments (GeM's ``p``, ``eps``) where not
    their defaults."""
    operation = OPERATIONS[op]
    if operation.arguments:
        return adaptive_gem_pool(x, output_size, operation.ndim, **{**dict(operation.arguments), **arguments})
    if not operation.multi_level:
        if operation.selects:
            return adaptive_max_pool(x, output_size, operation.ndim)
        return adaptive_avg_pool(x, output_size, operation.ndim)
    x = _as_float64(x, "x")
    levels = operation.resolve_levels(output_size, tuple(x.shape[x.ndim - operation.ndim:]))
    values, indices = [], []
    for level, spatial in zip(operation.level_ops(len(levels)), levels):
        pooled = forward(level.name, x, spatial)
        if level.selects:
            pooled, level_indices = pooled
            indices.append(level_indices)
        values.append(pooled)
    return values, indices


def backward(op: str, grad_out, input_shape, indices=None) -> np.ndarray:
    """The reference of a public backward op by name (``indices`` for a selecting op).  A
    multi-level op: ``grad_out`` and ``indices`` are lists over its levels (indices of the max
    levels), and the gradient is the sum of every level's, added in level order."""
    operation = OPERATIONS[op]
    if not operation.multi_level:
        if operation.selects:
            return adaptive_max_pool_backward(grad_out, indices, input_shape, operation.ndim)
        return adaptive_avg_pool_backward(grad_out, input_shape, operation.ndim)
    max_indices = iter(indices or ())
    total = None
    for level, grad in zip(operation.level_ops(len(grad_out)), grad_out):
        term = backward(level.name, grad, input_shape, next(max_indices) if level.selects else None)
        total = term if total is None else total + term
    return total
