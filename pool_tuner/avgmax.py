"""timm's two ways of joining avgmax's levels, and the split of their gradient into the levels'.

``adaptive_avgmax_pool2d`` (pool_tuner.fused) pools an average and a max level from one read of
the input; timm then joins them, as ``mode`` says:

* ``"avg+max"`` (timm's ``avgmax``): ``0.5 * (avg + max)``, the sum rounded to the dtype first;
* ``"cat"`` (timm's ``catavgmax``): both concatenated along the channels.

The backward pass undoes the join: each level's gradient is half the joined gradient, or its own
channels of it.  numpy arrays are joined and split by numpy; device arrays by the kernels of
``kernels/avgmax_join.c`` on their queue, with the same roundings, so both give the same bits.
The kernels work on memory order: the levels of avgmax's flat buffer (pool_tuner.pyramid) are
stored as the input is, channels-first or channels-last, and so is what they join.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from . import kernel_source, ops, plans, pyramid
from .problem import DTYPES, LAYOUT_NAMES, Problem

#: The op whose levels are joined.
OP = "adaptive_avgmax_pool2d"
#: timm's ``avgmax`` and ``catavgmax``.
MODES = ("avg+max", "cat")
#: The kernels of ``kernels/avgmax_join.c``: ``<join|split>_<mean|cat>``.
KERNELS = ("join_mean", "join_cat", "split_mean", "split_cat")
#: Work-items per work-group of the join kernels (at most the device's limit).
JOIN_BLOCK = 256


def check_mode(mode) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} (timm's avgmax and catavgmax), got {mode!r}")
    return mode


def joined_shape(problem: Problem, mode: str) -> tuple:
    """The logical shape of the joined result: a level's, with twice the channels for ``cat``."""
    level = list(problem.output_shape)
    if mode == "cat":
        level[-3] *= 2
    return tuple(level)


def join_numpy(avg: np.ndarray, mx: np.ndarray, mode: str) -> np.ndarray:
    """The joined result of two numpy levels (logical axes)."""
    if mode == "avg+max":
        return (avg + mx) * np.asarray(0.5, dtype=avg.dtype)
    return np.concatenate([avg, mx], axis=avg.ndim - 3)


def split_numpy(grad: np.ndarray, mode: str) -> list:
    """The levels' gradients from the joined result's numpy gradient (logical axes), stored as
    ``grad`` is (a channels-last ``grad`` gives channels-last levels, as on device arrays)."""
    if mode == "avg+max":
        half = grad * np.asarray(0.5, dtype=grad.dtype)
        return [half, half]
    channels = grad.shape[-3] // 2
    levels = [grad[..., :channels, :, :], grad[..., channels:, :, :]]
    if ops.memory_layout(grad, 2) == LAYOUT_NAMES[2][1]:
        levels = [np.moveaxis(np.ascontiguousarray(np.moveaxis(level, -3, -1)), -1, -3) for level in levels]
    return levels


def join_device(problem: Problem, device, levels, mode: str):
    """The joined result of avgmax's flat device buffer ``levels``, on its queue, in the input's
    layout (viewed as pool_tuner.pyramid views the levels themselves)."""
    shape = joined_shape(problem, mode)
    queue = device.arrays.queue_of(levels)
    joined = device.empty((math.prod(shape),), levels.dtype, queue,
                          ops.stored_fill(plans.result_fill(problem.dtype, False), problem.dtype))
    _launch(problem, device, queue, "join", mode, levels, joined)
    return pyramid.logical_view(joined, problem.memory_shape(shape), shape, problem, device.arrays.strided_view)


def split_device(problem: Problem, device, grad, mode: str):
    """avgmax's flat buffer of level gradients (what its backward kernels read) from the joined
    result's gradient ``grad`` (a device array stored in the problem's memory order)."""
    queue = device.arrays.queue_of(grad)
    grad = device.arrays.wrap_input(grad, "grad_out")
    levels = device.empty((pyramid.layout(problem).values_per_plane * problem.planes,), grad.dtype, queue,
                          ops.stored_fill(plans.result_fill(problem.dtype, False), problem.dtype))
    _launch(problem, device, queue, "split", mode, grad, levels)
    return levels


def _launch(problem: Problem, device, queue, step: str, mode: str, source, destination) -> None:
    """Run the kernel ``<step>_<mean|cat>`` of ``mode`` from ``source`` into ``destination`` (both
    in memory order): over the ``count`` outputs of one level (mean) or the ``2 * count`` joined
    elements (cat, rows of ``row`` elements of each level)."""
    count = problem.planes * pyramid.layout(problem).sizes[0]
    if mode == "avg+max":
        name, elements, scalars = "mean", count, (np.int64(count),)
    else:
        # A cat row: a sample's channels and positions (channels-first) or one position's channels.
        row = problem.channels * (1 if problem.channels_last else pyramid.layout(problem).sizes[0])
        name, elements, scalars = "cat", 2 * count, (np.int64(count), np.int64(row))
    if not elements:
        return
    block = min(JOIN_BLOCK, device.info.limits.max_work_group_size)
    kernel = device.build(queue.context, program(problem.dtype, block), f"{step}_{name}")
    event = device.launch(queue, kernel, -(-elements // block), (block,), (source, destination) + scalars)
    for array in (source, destination):
        device.arrays.track(array, event)


@functools.cache
def program(dtype: str, block: int) -> str:
    """The join kernels' program for one storage dtype and work-group size."""
    defines = {DTYPES[dtype]: 1, "INDEX_64": 1, "JOIN_BLOCK": block}
    return kernel_source.format_defines(defines) + kernel_source.read("prelude.h") + kernel_source.read(
        "avgmax_join.c")
