"""The public multi-level functions: a pooling pyramid, and avg+max, from one read of the input.

``adaptive_{avg,max}_pool_pyramid(x, output_sizes)`` pool ``x`` to every size of ``output_sizes``
(PSPNet's pyramid pooling: 1, 2, 3, 6; SPP-Net: 1, 2, 4) and return one result per level, each
exactly what ``adaptive_{avg,max}_pool{n}d`` gives for that size (max: the same values and indices;
avg: the same means up to the order of addition).  ``adaptive_avgmax_pool2d`` is timm's ``avgmax``
(``mode="avg+max"``: ``(avg + max) / 2``) and ``catavgmax`` (``mode="cat"``: both concatenated
along the channels).  Their kernels read each input element once for every level
(pool_tuner.pyramid), and their backward passes write each input gradient once, adding every
level's contribution in level order.

Arrays are as for the single-level functions (numpy in -> numpy out; device arrays stay on their
device).  A pyramid's results are views of one buffer (pool_tuner.pyramid), in the input's memory
layout; avgmax joins its two levels into one result (pool_tuner.avgmax).  The backward passes take
device gradients (and indices) stored in one memory order, contiguous or channels-last, and copy
them level by level -- avgmax's: split -- into the flat buffers their kernels read, on the device.
"""

from __future__ import annotations

import numbers

import numpy as np

from . import avgmax, ops, plans, pyramid
from .operations import find
from .problem import LAYOUT_NAMES, OPS, Problem
from .shapes import check_int

def pyramid_rank(shape, output_sizes, ndim) -> int:
    """The number of pooled axes of a pyramid call: ``ndim`` when given, else the length of a
    tuple among ``output_sizes``, else ``len(shape) - 2`` (an ``(N, C, ...)`` input)."""
    if ndim is not None:
        ndim = check_int(ndim, "ndim")
        if ndim not in (1, 2, 3):
            raise ValueError(f"ndim must be 1, 2 or 3 (the number of pooled axes), got {ndim}")
        return ndim
    if isinstance(output_sizes, (str, bytes, bytearray)) or not hasattr(output_sizes, "__len__"):
        raise TypeError(f"output_sizes must be a non-empty sequence of output sizes (each an int or a tuple of "
                        f"ints/None), got {type(output_sizes).__name__} {output_sizes!r}")
    lengths = {len(s) for s in output_sizes if not isinstance(s, numbers.Integral) and hasattr(s, "__len__")}
    if len(lengths) > 1:
        raise ValueError(f"output_sizes must have tuples of one length (the pooled axes), got {output_sizes!r}")
    if lengths:
        return lengths.pop()
    rank = len(shape) - 2
    if rank not in (1, 2, 3):
        raise ValueError(f"x of shape {tuple(shape)} is not (N, C, L), (N, C, H, W) or (N, C, T, H, W); pass ndim= "
                         f"(the number of pooled axes)")
    return rank


def _pyramid_op(kind: str, ndim: int) -> str:
    return find(kind, ndim, pyramid=True).name


def _sizes_key(output_sizes):
    """A pyramid's output sizes as a tuple of tuples (a hashable plan key), entries unchanged."""
    if isinstance(output_sizes, (list, tuple)):
        return tuple(tuple(s) if isinstance(s, list) else s for s in output_sizes)
    return output_sizes


def _forward(op: str, x, output_size, device, variant, config) -> tuple:
    """Run a multi-level forward: ``(plan, flat values, flat indices or None)`` (pyramid.layout)."""
    plan = ops._plan(op, "forward", [x], output_size, device, variant, config, ("x",))
    results = ops._run(plan, [x], ("x",))
    return plan, results[0], results[1] if len(results) > 1 else None


def _views(plan, values, indices) -> tuple[list, list]:
    """``(values per level, indices per max level)`` of a multi-level forward's flat results."""
    strided_view = None if isinstance(values, np.ndarray) else plan.device.arrays.strided_view
    return pyramid.views(plan.problem, values, indices, strided_view=strided_view)


def adaptive_avg_pool_pyramid(x, output_sizes, *, ndim=None, device=None, variant=None, config=None) -> list:
    """Adaptive average pooling of ``x`` to every size of ``output_sizes`` (each an int or ``ndim``
    ints/None), from one read of ``x``: a list of results, one per size.  ``ndim`` (1, 2, 3): the
    pooled axes, by default the length of a tuple size, else ``x.ndim - 2``."""
    rank = pyramid_rank(getattr(x, "shape", ()), output_sizes, ndim)
    plan, values, _ = _forward(_pyramid_op("avg", rank), x, _sizes_key(output_sizes), device, variant, config)
    return ops._delivered(plan, _views(plan, values, None)[0], x)


def adaptive_max_pool_pyramid(x, output_sizes, return_indices=False, *, ndim=None, device=None, variant=None,
                              config=None):
    """Adaptive max pooling of ``x`` to every size of ``output_sizes``, from one read of ``x``: a list
    of results, one per size, and with ``return_indices=True`` also the list of their int64 indices
    (PyTorch's: positions within each pooled plane; NaN wins, the last NaN; ties the first)."""
    rank = pyramid_rank(getattr(x, "shape", ()), output_sizes, ndim)
    plan, values, indices = _forward(_pyramid_op("max", rank), x, _sizes_key(output_sizes), device, variant, config)
    values, indices = (ops._delivered(plan, levels, x) for levels in _views(plan, values, indices))
    return (values, indices) if return_indices else values


def adaptive_avgmax_pool2d(x, output_size, mode="avg+max", return_indices=False, *, device=None, variant=None,
                           config=None):
    """timm's ``adaptive_avgmax_pool2d`` (``mode="avg+max"``: ``(avg + max) / 2``) and
    ``adaptive_catavgmax_pool2d`` (``mode="cat"``: avg and max concatenated along the channel
    axis) from one read of ``x``, joined as pool_tuner.avgmax says.  ``return_indices=True`` also
    returns the max pooling's int64 indices, which ``adaptive_avgmax_pool2d_backward`` takes."""
    avgmax.check_mode(mode)
    plan, values, indices = _forward(avgmax.OP, x, output_size, device, variant, config)
    (avg, mx), (indices,) = _views(plan, values, indices)
    if isinstance(values, np.ndarray):
        result = avgmax.join_numpy(avg, mx, mode)
    else:
        result, indices = ops._delivered(plan, [avgmax.join_device(plan.problem, plan.device, values, mode), indices],
                                         x)
    return (result, indices) if return_indices else result


# ------------------------------------------------------------------------------------- backward


def _check_grads(grad_outs, expected: int, name: str = "grad_outs", owner=False, like=None) -> list:
    """A list of arrays, one per level, all numpy arrays or all device arrays of one device (the
    first one's, or ``owner``'s when given: None for numpy) and one context (``like``'s, the
    call's first array, when given; else the first one's)."""
    if isinstance(grad_outs, np.ndarray) or not isinstance(grad_outs, (list, tuple)):
        raise TypeError(f"{name} must be a list of arrays, one per level, got {type(grad_outs).__name__}")
    if expected is not None and len(grad_outs) != expected:
        raise ValueError(f"{name} must hold {expected} arrays (one per level), got {len(grad_outs)}")
    if owner is False and grad_outs:
        owner = plans.device_of(grad_outs[0])
    for level, grad in enumerate(grad_outs):
        if owner is None and not isinstance(grad, np.ndarray):
            raise TypeError(f"{name}[{level}] must be a numpy.ndarray like grad_outs[0], got {type(grad).__name__}")
        if owner is not None and plans.device_of(grad) is not owner:
            raise TypeError(f"{name}[{level}] must be a device array on {owner.info.describe()} like grad_outs[0], got "
                            f"{type(grad).__name__}")
        if owner is not None and (level or like is not None):
            plans.check_same_context(owner, grad, f"{name}[{level}]", *((grad_outs[0], f"{name}[0]") if like is None
                                                                       else (like, "the call's gradient")))
    return list(grad_outs)


def _backward(op: str, grads: list, indices, input_shape, device, variant, config):
    """The input gradient of a multi-level op from every level's gradient (and the max levels'
    indices): packed into the flat buffers its kernel reads -- numpy arrays on the host, device
    arrays on their device (the result stays there)."""
    ndim, labels = OPS[op].ndim, [f"grad_outs[{level}]" for level in range(len(grads))]
    problem = _backward_problem(op, [g.shape for g in grads], [ops.memory_layout(g, ndim) for g in grads],
                                plans.numpy_spec(grads[0]).dtype, input_shape, labels)
    owner = plans.device_of(grads[0])
    if owner is not None:
        _check_memory_order(problem, grads, labels)
    return _run_backward(problem, _pack(problem, grads, owner), indices, owner, device, variant, config, grads[0])


def _backward_problem(op: str, shapes: list, layouts: list, dtype, input_shape, labels: list) -> Problem:
    """The backward problem of gradients of ``shapes`` (one per level, ``labels`` in errors) whose
    memory has ``layouts``."""
    operation = OPS[op]
    if isinstance(input_shape, (str, bytes)) or not hasattr(input_shape, "__len__"):
        raise TypeError(f"input_shape must be a tuple of ints, got {type(input_shape).__name__}")
    input_shape = tuple(input_shape)
    batch_rank = len(input_shape) - operation.ndim
    for label, shape in zip(labels, shapes):
        if tuple(shape[:batch_rank]) != input_shape[:batch_rank] or len(shape) != len(input_shape):
            raise ValueError(f"{label} must have shape {input_shape[:batch_rank]} + ({operation.ndim} output sizes) to "
                             f"match input_shape {input_shape}, got {tuple(shape)}")
    sizes = tuple(tuple(shape[batch_rank:]) for shape in shapes)
    channels_last = LAYOUT_NAMES[operation.ndim][1]
    # A level whose memory reads both ways (1x1, one channel) counts as contiguous: any other level decides.
    layout = channels_last if channels_last in layouts else LAYOUT_NAMES[operation.ndim][0]
    return Problem.create(op, input_shape, sizes if operation.pyramid else sizes[0], dtype, layout,
                          direction="backward", shape_name="input_shape")


def _run_backward(problem: Problem, flat_grads, indices, owner, device, variant, config, like):
    """Run a multi-level backward on its flat level gradients (and the max levels' indices); the
    result is the kind of array ``like`` (the caller's gradient) is."""
    arrays = [flat_grads]
    if problem.operation.selects:
        arrays.append(_pack_indices(problem, indices, owner, like))
    plan = ops._plan(problem.op, "backward", arrays, (problem.input_shape, problem.output_size, problem.layout), device,
                     variant, config, ("grad_outs",))
    return ops._delivered(plan, ops._run(plan, arrays, ("grad_outs", "indices")), like)[0]


def _pack_indices(problem: Problem, indices, owner, like):
    """The max levels' indices, checked (int64, shaped as their gradients, in the context of
    ``like``, the first gradient; numpy ones inside their windows, device arrays are not read
    back) and packed."""
    lay = pyramid.layout(problem)
    max_sizes = [tuple(size) for size, selects in zip(lay.spatial, lay.selects) if selects]
    indices = _check_grads(indices, len(max_sizes), "indices", owner, like)
    single = problem.operation.selecting_level.name
    for level, (array, size) in enumerate(zip(indices, max_sizes)):
        if plans.numpy_spec(array).dtype != np.int64:
            raise TypeError(f"indices[{level}] must have dtype int64, got {array.dtype}")
        if tuple(array.shape) != problem.input_shape[:len(problem.input_shape) - problem.ndim] + size:
            raise ValueError(f"indices[{level}] must have the shape of its gradient, got {array.shape}")
        if owner is None and array.size:
            ops._check_indices_in_windows(array, Problem.create(single, problem.input_shape, size))
    if owner is not None:
        _check_memory_order(problem, indices, [f"indices[{level}]" for level in range(len(indices))])
    return _pack(problem, indices, owner, positions=True)


def _check_memory_order(problem: Problem, arrays: list, labels: list) -> None:
    """Device arrays are packed as they lie in memory, never copied into another layout: each must
    be stored in the problem's memory order (contiguous or channels-last, as the levels are).
    ``labels``: each array's name in errors."""
    for label, array in zip(labels, arrays):
        spec = plans.numpy_spec(array)
        if array.size and not plans.same_strides(spec.shape, spec.strides, plans.element_strides(problem, spec.shape)):
            raise ValueError(f"{label} must be stored {problem.layout} like the other levels (device arrays "
                             f"are not copied into another layout); got strides {spec.strides} (in elements) for "
                             f"shape {spec.shape}")


def _pack(problem: Problem, arrays: list, owner, positions=False):
    """``pyramid.pack`` of numpy arrays; device arrays (each contiguous in the problem's memory
    order, checked by the caller) are copied level by level into one flat array on their device."""
    if owner is None:
        return pyramid.pack(problem, arrays, positions=positions)
    lay, planes = pyramid.layout(problem), problem.planes
    chosen = [level for level, selects in enumerate(lay.selects) if selects or not positions]
    bases = lay.index_bases if positions else lay.value_bases
    total = planes * (lay.indices_per_plane if positions else lay.values_per_plane)
    first = owner.arrays.wrap_input(arrays[0], "grad_outs[0]")
    queue = owner.arrays.queue_of(first)
    flat = owner.empty((total,), first.dtype, queue)
    for level, array in zip(chosen, arrays):
        array = owner.arrays.wrap_input(array, "indices" if positions else "grad_outs")
        count = planes * lay.sizes[level]
        if count:
            memory = owner.arrays.strided_view(array, (count,), (array.dtype.itemsize,))
            owner.copy(flat[planes * bases[level]: planes * bases[level] + count], memory, queue)
    return flat


def adaptive_avg_pool_pyramid_backward(grad_outs, input_shape, *, ndim=None, device=None, variant=None, config=None):
    """Gradient of ``adaptive_avg_pool_pyramid`` with respect to its input: ``grad_outs`` holds one
    gradient per level (numpy arrays, or device arrays of one device and memory order) (their shapes give the levels' sizes); each input gradient is written
    once, the levels' shares added in level order (no atomics: bit-identical across runs).
    ``ndim``: the pooled axes, by default ``len(input_shape) - 2``."""
    grads = _check_grads(grad_outs, None)
    ndim = _backward_rank(grads, input_shape, ndim)
    return _backward(_pyramid_op("avg", ndim), grads, None, input_shape, device, variant, config)


def adaptive_max_pool_pyramid_backward(grad_outs, indices, input_shape, *, ndim=None, device=None, variant=None,
                                       config=None):
    """Gradient of ``adaptive_max_pool_pyramid``: ``grad_outs`` and ``indices`` hold one array per
    level, all numpy or all device arrays (the indices as the forward pass returned them)."""
    grads = _check_grads(grad_outs, None)
    ndim = _backward_rank(grads, input_shape, ndim)
    return _backward(_pyramid_op("max", ndim), grads, indices, input_shape, device, variant, config)


def adaptive_avgmax_pool2d_backward(grad_out, indices, input_shape, mode="avg+max", *, device=None, variant=None,
                                    config=None):
    """Gradient of ``adaptive_avgmax_pool2d`` (of the same ``mode``), with the indices that
    ``return_indices=True`` gave: numpy arrays, or device arrays (``grad_out`` stored as the
    input was, the result on its device)."""
    op = avgmax.OP
    avgmax.check_mode(mode)
    owner = plans.device_of(grad_out)
    if owner is None and not isinstance(grad_out, np.ndarray):
        raise TypeError(f"grad_out must be a numpy.ndarray or a device array, got {type(grad_out).__name__}")
    level_shape = tuple(grad_out.shape)
    if mode == "cat":
        if len(level_shape) not in (3, 4) or level_shape[-3] % 2:
            raise ValueError(f"grad_out must be the gradient of the mode='cat' result (twice the channels), got shape "
                             f"{level_shape}")
        level_shape = level_shape[:-3] + (level_shape[-3] // 2,) + level_shape[-2:]
    indices = list(indices) if isinstance(indices, (list, tuple)) else [indices]
    if owner is None:
        return _backward(op, avgmax.split_numpy(grad_out, mode), indices, input_shape, device, variant, config)
    problem = _backward_problem(op, [level_shape] * 2, [ops.memory_layout(grad_out, 2)],
                                plans.numpy_spec(grad_out).dtype, input_shape, ["grad_out"] * 2)
    _check_memory_order(problem, [grad_out], ["grad_out"])
    flat_grads = avgmax.split_device(problem, owner, grad_out, mode)
    return _run_backward(problem, flat_grads, indices, owner, device, variant, config, grad_out)


def _backward_rank(grads: list, input_shape, ndim) -> int:
    """The pooled axes of a pyramid backward: ``ndim``, by default ``len(input_shape) - 2`` (an
    ``(N, C, ...)`` input)."""
    if not grads:
        raise ValueError("grad_outs must hold at least one gradient (one per level)")
    if ndim is not None:
        return pyramid_rank((), (), ndim)
    rank = len(tuple(input_shape)) - 2 if hasattr(input_shape, "__len__") else 0
    if rank not in (1, 2, 3):
        raise ValueError(f"input_shape must be (N, C, L), (N, C, H, W) or (N, C, T, H, W), got {input_shape!r}")
    return rank


__all__ = [
    "adaptive_avg_pool_pyramid",
    "adaptive_avg_pool_pyramid_backward",
    "adaptive_avgmax_pool2d",
    "adaptive_avgmax_pool2d_backward",
    "adaptive_max_pool_pyramid",
    "adaptive_max_pool_pyramid_backward",
]
