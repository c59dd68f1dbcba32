"""A plan's computation on the host, for a process in which its device's kernels cannot run.

A forked child of a process that used PoCL's threaded CPU driver inherits none of the driver's
worker threads, so every kernel it enqueues there waits forever (docs/design.md, "The user's
process").  pool_tuner does not change PoCL's environment to get a driver that would work there (the
user's own OpenCL code would see it too), so in such a child a call on host memory -- numpy arrays,
CPU tensors -- is computed by this module instead of a kernel: the float64 reference
(``pool_tuner.reference``) over the same buffers in the same memory order, rounded once to the
result's dtype.  Max values and indices are those of the kernels exactly; averages and gradients
agree with them to the rounding of the last bit (the kernels accumulate in float32).  ``pool_tuner.explain`` names the fallback (``host_fallback``) wherever it applies.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np

from . import pyramid, reference
from .problem import ITEMSIZE, Problem
from .windows import pooling_windows


class HostFallback:
    """Runs like the device's ``prepare``d launch: called with the addresses of the inputs then the
    results (``nbytes`` each, in the problem's memory order) and the call's run-time scalars
    (GeM's ``p`` and ``eps``; None: their defaults), returns once the results are written."""

    __slots__ = ("problem", "results", "nbytes", "n_inputs")

    def __init__(self, problem: Problem, results: tuple, nbytes: tuple, n_inputs: int):
        self.problem, self.results, self.nbytes, self.n_inputs = problem, results, nbytes, n_inputs

    def __call__(self, stream, *addresses, scalars: tuple | None = None) -> None:
        problem = self.problem
        dtypes = [problem.dtype] + ["int64"] * (self.n_inputs - 1) + [r.dtype for r in self.results]
        flat = [_host_array(a, n, d) for a, n, d in zip(addresses, self.nbytes, dtypes)]
        inputs, outputs = flat[:self.n_inputs], flat[self.n_inputs:]
        if problem.flow.reads_input:
            _forward(problem, inputs[0], outputs, problem.arguments_of(scalars))
        else:
            _backward(problem, inputs, outputs[0])


def _forward(problem: Problem, x_flat, outputs, arguments: dict) -> None:
    x = _to_float64(_logical(x_flat, problem.input_shape, problem), problem.dtype)
    computed = reference.forward(problem.op, x, problem.output_size, **arguments)
    if problem.operation.multi_level:
        values, indices = computed
        out_values, out_indices = pyramid.views(problem, outputs[0], outputs[1] if len(outputs) > 1 else None)
        for level, out in zip(values, out_values):
            _store(out, level, problem.dtype)
        for level, out in zip(indices, out_indices):
            out[...] = level
        return
    values, indices = computed if problem.operation.selects else (computed, None)
    _store(_logical(outputs[0], problem.output_shape, problem), values, problem.dtype)
    if indices is not None:
        _logical(outputs[1], problem.output_shape, problem)[...] = indices


def _backward(problem: Problem, inputs, grad_in_flat) -> None:
    grads_flat = _to_float64(inputs[0], problem.dtype)
    indices_flat = inputs[1] if len(inputs) > 1 else None
    if problem.operation.multi_level:
        grads, indices = pyramid.views(problem, grads_flat, indices_flat)
        grad_in = reference.backward(problem.op, grads, problem.input_shape, indices or None)
    else:
        grad = _logical(grads_flat, problem.output_shape, problem)
        indices = None if indices_flat is None else _logical(indices_flat, problem.output_shape, problem)
        grad_in = reference.backward(problem.op, grad, problem.input_shape, indices)
    _store(_logical(grad_in_flat, problem.input_shape, problem), grad_in, problem.dtype)


def gem_input_gradient(problem: Problem, arguments: dict, x_address: int, coefficients_address: int,
                       grad_address: int) -> float:
    """GeM's input-gradient pass (``kernels/operators/gem_input_gradient.c``) on the host, in
    float64 over the same memory: each input gathers the coefficients of the outputs whose windows
    hold it, writes its gradient, and the input part of ``dL/dp`` is returned as one term."""
    numel = math.prod(problem.input_shape)
    acc = "float64" if problem.dtype == "float64" else "float32"
    x_flat = _host_array(x_address, numel * ITEMSIZE[problem.dtype], problem.dtype)
    x = _to_float64(_logical(x_flat, problem.input_shape, problem), problem.dtype)
    coefficients_flat = _host_array(coefficients_address, math.prod(problem.output_shape) * ITEMSIZE[acc], acc)
    share = _logical(coefficients_flat, problem.output_shape, problem).astype(np.float64)
    for axis in range(len(problem.input_shape) - problem.ndim, len(problem.input_shape)):
        starts, ends = pooling_windows(problem.input_shape[axis], problem.output_shape[axis])
        holds = np.arange(problem.input_shape[axis]) - starts[:, None]  # output o holds input i
        membership = ((holds >= 0) & (np.arange(problem.input_shape[axis]) < ends[:, None])).astype(np.float64)
        share = np.moveaxis(np.tensordot(share, membership, axes=([axis], [0])), -1, axis)
    p, eps = arguments["p"], arguments["eps"]
    clamped = np.maximum(x, eps)
    power = clamped ** p
    grad = np.where(x >= eps, share * p * power / clamped, 0.0)
    grad_flat = _host_array(grad_address, numel * ITEMSIZE[problem.dtype], problem.dtype)
    _store(_logical(grad_flat, problem.input_shape, problem), grad, problem.dtype)
    return float(np.sum(share * power * np.log(clamped)))


def _host_array(address: int, nbytes: int, dtype: str) -> np.ndarray:
    """The ``nbytes`` at ``address`` as a flat array (bfloat16 as its uint16 bits)."""
    storage = np.dtype(np.uint16 if dtype == "bfloat16" else dtype)
    if nbytes == 0:
        return np.empty(0, storage)
    return np.frombuffer((ctypes.c_char * nbytes).from_address(address), storage)


def _logical(flat: np.ndarray, logical_shape: tuple, problem: Problem) -> np.ndarray:
    """A flat buffer in the problem's memory order seen with the logical (channels-first) axes."""
    shaped = flat.reshape(problem.memory_shape(logical_shape))
    if not problem.channels_last:
        return shaped
    return np.moveaxis(shaped, -1, len(logical_shape) - problem.ndim - 1)


def _to_float64(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":  # the high half of a float32
        return (array.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return array.astype(np.float64)


def _store(out: np.ndarray, values: np.ndarray, dtype: str) -> None:
    """Write float64 ``values`` into ``out``, rounded once to ``dtype`` (bfloat16: to nearest
    even, NaN kept NaN)."""
    if dtype != "bfloat16":
        out[...] = values
        return
    bits = values.astype(np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    out[...] = np.where(np.isnan(values), np.uint16(0x7FC0), rounded)
