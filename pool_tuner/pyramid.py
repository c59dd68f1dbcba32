"""Multi-level pooling: several output sizes (levels) of one input from one pass over it.

The cut-point method.  Along one axis, take every level's window bounds as cut points (with 0 and
the input size); the cells between consecutive cuts tile the axis, and every window of every level
-- overlapping windows included -- starts and ends on cuts, so it is a run of whole cells.  The
Cartesian product of the axes' cells tiles a plane into boxes, and every window of every level is a
box of whole cells.  So a kernel reduces each cell once (a sum, or a maximum and its position) and
finishes every output of every level by combining the cells of its window:

* average: the sum of the window's cell sums over the window's area -- the same numbers as the
  level pooled alone, added in another order;
* max: the cell whose maximum beats the others', ties going to the earlier position (NaN: the
  later), as reduce_merge does (kernels/reduction.h).  A window's row-major order is its plane
  positions' order, so comparing positions is the position rule exactly: values and indices are
  those of the level pooled alone.

Results.  A multi-level op's values are one buffer, level after level; each level's part is that
level's result in the problem's memory order (contiguous or channels-last), so every level is a
view of the buffer without copies.  A max level's indices are laid out the same way in a second
buffer that holds the max levels only.  ``layout(problem)`` gives the offsets; ``views`` and
``pack`` go between the buffer and the per-level arrays.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .shapes import c_strides
from .windows import pooling_windows


def cuts(in_size: int, out_sizes) -> np.ndarray:
    """The cut points of one axis: 0, ``in_size`` and every window bound of every output size
    (sorted, int64).  Consecutive cuts bound the cells."""
    points = {0, in_size}
    for out_size in out_sizes:
        if out_size:
            starts, ends = pooling_windows(in_size, out_size)
            points.update(starts.tolist())
            points.update(ends.tolist())
    return np.array(sorted(points), dtype=np.int64)


def window_cells(axis_cuts: np.ndarray, in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(first, end)``: output ``o`` of an axis pools exactly the cells ``[first[o], end[o])``."""
    starts, ends = pooling_windows(in_size, out_size)
    return np.searchsorted(axis_cuts, starts), np.searchsorted(axis_cuts, ends)


@dataclasses.dataclass(frozen=True)
class LevelLayout:
    """Where each level lives in a multi-level op's buffers, per plane: level ``l`` has ``sizes[l]``
    outputs per plane at value offset ``value_bases[l]`` (times the plane count), and -- a max
    level (``selects[l]``) -- its indices at ``index_bases[l]`` of the index buffer (-1 for an avg
    level)."""

    selects: tuple
    spatial: tuple
    sizes: tuple
    value_bases: tuple
    index_bases: tuple
    values_per_plane: int
    indices_per_plane: int


def level_layout(level_ops: tuple, spatial: tuple) -> LevelLayout:
    """The layout of levels that are these single-level operations (``Operation.level_ops``), of
    these pooled sizes (tuples of ints)."""
    sizes = tuple(math.prod(s) for s in spatial)
    selects = tuple(level.selects for level in level_ops)
    value_bases, index_bases, value, index = [], [], 0, 0
    for level_selects, size in zip(selects, sizes):
        value_bases.append(value)
        index_bases.append(index if level_selects else -1)
        value += size
        index += size if level_selects else 0
    return LevelLayout(selects, spatial, sizes, tuple(value_bases), tuple(index_bases), value, index)


def layout(problem) -> LevelLayout:
    """The level layout of a multi-level problem (pooled sizes unpadded, as the levels' results)."""
    spatial = problem.operation.levels_of(problem.input_shape, problem.output_shape)
    return level_layout(problem.operation.level_ops(len(spatial)), spatial)


def level_memory_shape(problem, spatial: tuple) -> tuple:
    """The memory shape of one level's result: its logical shape in the problem's memory order."""
    return problem.memory_shape(problem.input_shape[:len(problem.input_shape) - problem.ndim] + tuple(spatial))


def views(problem, values, indices=None, *, strided_view=None) -> tuple[list, list]:
    """The per-level results inside a multi-level op's flat ``values`` (and ``indices``) buffers:
    ``(values per level, indices per max level)``, each with the logical (channels-first) axes.
    numpy arrays and tensors are viewed directly; ``strided_view(flat_part, shape, strides)``
    makes the channels-last views of device arrays."""
    lay, planes = layout(problem), problem.planes
    batch = problem.input_shape[:len(problem.input_shape) - problem.ndim]
    out_values, out_indices = [], []
    for level, (selects, spatial, size) in enumerate(zip(lay.selects, lay.spatial, lay.sizes)):
        memory = level_memory_shape(problem, spatial)
        parts = [(values, lay.value_bases[level], out_values)]
        if selects and indices is not None:
            parts.append((indices, lay.index_bases[level], out_indices))
        for flat, base, into in parts:
            part = flat[planes * base: planes * (base + size)]
            into.append(logical_view(part, memory, batch + tuple(spatial), problem, strided_view))
    return out_values, out_indices


def logical_view(part, memory_shape, logical_shape, problem, strided_view=None):
    """A flat result ``part`` stored as ``memory_shape`` in the problem's memory order, seen with
    the logical (channels-first) axes ``logical_shape``; ``strided_view`` as for ``views``."""
    if not problem.channels_last:
        return part.reshape(logical_shape)
    if strided_view is not None:
        c = len(logical_shape) - problem.ndim - 1
        strides = list(c_strides(memory_shape, part.dtype.itemsize))
        strides.insert(c, strides.pop())
        return strided_view(part, logical_shape, tuple(strides))
    shaped = part.reshape(memory_shape)
    c = len(logical_shape) - problem.ndim - 1
    if hasattr(shaped, "movedim"):  # a tensor
        return shaped.movedim(-1, c)
    return np.moveaxis(shaped, -1, c)


def pack(problem, arrays, positions=False, dtype=None) -> np.ndarray:
    """The flat buffer of per-level numpy ``arrays`` (logical axes) in the problem's memory order:
    every level's values, or with ``positions`` the indices of the selecting (max) levels."""
    lay, planes = layout(problem), problem.planes
    chosen = [level for level, selects in enumerate(lay.selects) if selects or not positions]
    total = planes * (lay.indices_per_plane if positions else lay.values_per_plane)
    flat = np.empty(total, dtype=dtype if dtype is not None else arrays[0].dtype)
    bases = lay.index_bases if positions else lay.value_bases
    for level, array in zip(chosen, arrays):
        part = flat[planes * bases[level]: planes * (bases[level] + lay.sizes[level])]
        memory = np.asarray(array)
        if problem.channels_last:
            memory = np.moveaxis(memory, memory.ndim - problem.ndim - 1, -1)
        part.reshape(memory.shape)[...] = memory
    return flat


def kernel_defines(problem) -> dict:
    """The level defines of a multi-level problem's kernels (kernels/pyramid.h): the level count,
    the per-plane value and index counts, and per level its sizes, bases and kind as initialisers
    of constant tables."""
    lay = layout(problem)
    padded = [(1,) * (3 - problem.ndim) + tuple(s) for s in lay.spatial]
    return {
        "N_LEVELS": len(padded),
        "VALUES_PER_PLANE": lay.values_per_plane,
        "INDICES_PER_PLANE": lay.indices_per_plane,
        "LEVEL_OUT_T": _table(s[0] for s in padded),
        "LEVEL_OUT_H": _table(s[1] for s in padded),
        "LEVEL_OUT_W": _table(s[2] for s in padded),
        "LEVEL_VALUE_BASE": _table(lay.value_bases),
        "LEVEL_INDEX_BASE": _table(lay.index_bases),
        "LEVEL_IS_MEAN": _table(int(not selects) for selects in lay.selects),
    }


def cell_defines(problem) -> dict:
    """The cut-point tables of the cell variants: per axis its cuts, and per level and output its
    window's first and end cell, each level's outputs from ``LEVEL_WINDOW_BASE_<axis>``."""
    lay = layout(problem)
    padded = [(1,) * (3 - problem.ndim) + tuple(s) for s in lay.spatial]
    defines = {}
    for axis, name in enumerate("THW"):
        in_size = problem.in_spatial[axis]
        axis_cuts = cuts(in_size, [s[axis] for s in padded])
        firsts, ends, bases = [], [], []
        for spatial in padded:
            bases.append(len(firsts))
            if spatial[axis]:
                first, end = window_cells(axis_cuts, in_size, spatial[axis])
                firsts += first.tolist()
                ends += end.tolist()
        defines[f"N_CELLS_{name}"] = len(axis_cuts) - 1
        defines[f"CUTS_{name}"] = _table(axis_cuts.tolist())
        defines[f"WINDOW_FIRST_CELL_{name}"] = _table(firsts or [0])
        defines[f"WINDOW_END_CELL_{name}"] = _table(ends or [0])
        defines[f"LEVEL_WINDOW_BASE_{name}"] = _table(bases)
    listed = list(windows(problem))
    if _merges(listed) <= UNROLLED_MERGES_LIMIT:
        defines["LEVEL_WINDOWS(X)"] = " ".join(f"X({', '.join(map(str, w))})" for w in listed)
        w_cuts = axis_cuts  # the last axis of the loop above: W
        defines["CELLS_W(X)"] = " ".join(f"X({k}, {w_cuts[k]}, {w_cuts[k + 1]})" for k in range(len(w_cuts) - 1))
    return defines


#: A plane whose windows merge at most this many cells in all gets its windows as a list of
#: constants (``LEVEL_WINDOWS``), which the work-item-per-plane kernels finish in straight-line code.
UNROLLED_MERGES_LIMIT = 2048


def windows(problem):
    """Every output of every level as ``(level, q, t_first, t_end, h_first, h_end, w_first, w_end,
    area)``: its position ``q`` in its level's plane, the cells of its window along each axis and
    the window's element count -- the combine as data (kernels/pyramid.h, ``LEVEL_WINDOWS``)."""
    lay = layout(problem)
    padded = [(1,) * (3 - problem.ndim) + tuple(s) for s in lay.spatial]
    axis_cuts = [cuts(problem.in_spatial[axis], [s[axis] for s in padded]) for axis in range(3)]
    for level, spatial in enumerate(padded):
        if not math.prod(spatial):
            continue
        per_axis = [window_cells(axis_cuts[axis], problem.in_spatial[axis], spatial[axis]) for axis in range(3)]
        for q, (ot, oh, ow) in enumerate(np.ndindex(*spatial)):
            bounds = [(int(per_axis[axis][0][o]), int(per_axis[axis][1][o])) for axis, o in enumerate((ot, oh, ow))]
            area = math.prod(int(axis_cuts[axis][end] - axis_cuts[axis][first])
                             for axis, (first, end) in enumerate(bounds))
            yield (level, q, *(b for pair in bounds for b in pair), area)


def cell_merges(problem) -> int:
    """Cells combined by the outputs of every level of one plane: the work of the combine."""
    return _merges(windows(problem))


def _merges(listed) -> int:
    return sum((t_end - t_first) * (h_end - h_first) * (w_end - w_first)
               for _, _, t_first, t_end, h_first, h_end, w_first, w_end, _ in listed)


def cell_counts(problem) -> tuple:
    """Cells along each axis (T, H, W) of a multi-level problem."""
    lay = layout(problem)
    padded = [(1,) * (3 - problem.ndim) + tuple(s) for s in lay.spatial]
    return tuple(len(cuts(problem.in_spatial[axis], [s[axis] for s in padded])) - 1 for axis in range(3))


def cell_count(problem) -> int:
    """Cells per plane: the product of every axis's cell count."""
    return math.prod(cell_counts(problem))


def table_entries(problem) -> int:
    """Entries of the constant tables of ``cell_defines`` (cuts and window cells of every axis)."""
    lay = layout(problem)
    padded = [(1,) * (3 - problem.ndim) + tuple(s) for s in lay.spatial]
    return sum(len(cuts(problem.in_spatial[axis], [s[axis] for s in padded])) + 2 * sum(s[axis] for s in padded)
               for axis in range(3))


def _table(values) -> str:
    """A C initialiser list: ``{1, 2, 3}``."""
    return "{" + ", ".join(str(int(v)) for v in values) + "}"
