"""The kernel variants: their search spaces (as data), defaults, legality rules and launch shapes.

A variant is one way of mapping the outputs of a pooling problem onto work-items.  Each declares
its tuning parameters and their candidate values the way Kernel Tuner's examples do -- a dict of
lists -- plus a default configuration, a rule saying which configurations are legal for a given
problem on a given device, and the launch geometry (number of work-groups, work-group shape).
The tuner searches the space; dispatch validates whatever it is about to launch against
``check_config`` so a stale or hand-edited cache record can never launch an illegal kernel.
"""

from __future__ import annotations

import itertools
import numbers
import math
from typing import TYPE_CHECKING

import numpy as np

from . import kernel_source, memo, pyramid
from .problem import DIRECTIONS, OPS, Problem, check_op
from .windows import max_window, pooling_windows

if TYPE_CHECKING:  # the limits come with a device; variants only read them
    from .backends.base import DeviceLimits


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _max_tile_extent(in_size: int, out_size: int, tile: int) -> int:
    """Largest input extent covered by the windows of ``tile`` consecutive outputs, over all tiles."""
    starts, ends = pooling_windows(in_size, out_size)
    first = np.arange(0, out_size, tile)
    last = np.minimum(first + tile, out_size) - 1
    return int((ends[last] - starts[first]).max(initial=0))


#: Kernels unroll windows that fit a box of at most this many elements (SMALL_BOX_LIMIT in
#: kernels/windows.h; a test keeps the two equal).
SMALL_BOX_LIMIT = 256


@memo.per_owner("variants.max_windows")
def _max_windows(problem: Problem) -> tuple[int, int, int]:
    """The ``MAX_WINDOW_T``, ``_H``, ``_W`` defines the forward kernels are built with: the widest
    window along each axis (memoised, like ``_longest_run``)."""
    defines = problem.defines()
    return tuple(defines[f"MAX_WINDOW_{axis}"] for axis in "THW")


def _window_box(problem: Problem) -> int:
    """Elements of the box that the kernels unroll for every forward window."""
    return math.prod(_max_windows(problem))


@memo.per_owner("variants.longest_run")
def _longest_run(problem: Problem) -> int:
    """Longest run of a window that the forward kernels reduce in one go: a window row, or with one
    output column in channels-first memory a whole slab of rows (CONTIGUOUS_WINDOW_ROWS).
    Memoised: ``check_config`` asks twice per configuration (default and legality)."""
    (_, ih, iw), (_, oh, ow) = problem.in_spatial, problem.out_spatial
    if ow == 1 and not problem.channels_last:
        return max_window(ih, oh) * iw
    return max_window(iw, ow)


#: The kinds of device, in the default rules' words: ``cpu`` for CPU devices, ``gpu`` for all others.
DEVICE_TYPES = ("cpu", "gpu")
#: The memory layouts of a problem, in the default rules' words (``default_rules.features``).
LAYOUTS = ("channels_first", "channels_last")


def layout_of(problem: Problem) -> str:
    """The memory layout of ``problem`` in ``LAYOUTS``' words."""
    return LAYOUTS[problem.channels_last]


class Variant:
    """Base class; subclasses fill in the class attributes and the three methods."""

    name: str
    direction = "forward"
    summary: str
    #: Tuning parameters and their candidate values, in Kernel Tuner's form.
    search_space: dict
    #: The configuration used when nothing was tuned (see ``dispatch``).
    default: dict
    #: Whether the default configuration runs every problem of its direction (the default rules'
    #: last rule of each direction needs such a variant).
    runs_every_problem = False
    #: The kinds of device (``DeviceLimits.device_type``) the variant is shaped for: only there is it
    #: legal -- tuned, measured, named by a rule or a record, and covered by the kernel hash of the
    #: records tuned there (``cache.kernel_hash``).  Elsewhere it runs only when forced by name
    #: (``variant=``), which is how its tests run a GPU variant on PoCL.
    device_types = DEVICE_TYPES
    #: The memory layouts (``LAYOUTS``) whose problems the kernel is written for: only there is it
    #: legal -- even when forced by name, since its offsets assume the layout -- and only the
    #: records of problems in those layouts have its template in their kernel hash
    #: (``cache.kernel_hash``), so a variant for one layout leaves the other layout's records alone.
    layouts = LAYOUTS
    #: Whether the kernel takes its operator's run-time arguments after the plane count and passes
    #: them to the operator (``OP_PARAMS``, kernels/operators.h): only such variants are variants of an
    #: op whose operator has arguments (``Operation.arguments``, GeM's ``p`` and ``eps``).
    takes_arguments = False
    #: The operator headers (``Operation.operator_header``) whose own helpers the kernel calls, or None:
    #: it reaches its op through the ``OP_*`` definitions alone, which every operator gives.  A variant
    #: that names headers is a variant of their ops alone, and their default choice tries it first
    #: (``default_rules.decide``).
    operator_headers: tuple | None = None

    def fits(self, operation) -> bool:
        """Whether the kernel can run ``operation`` (an ``Operation``): it passes the operator's
        run-time arguments where there are any, and calls no other operator's helpers."""
        if operation.arguments and not self.takes_arguments:
            return False
        return self.operator_headers is None or operation.operator_header in self.operator_headers

    def block(self, params: dict) -> tuple[int, int]:
        """Work-group shape ``(x, y)``."""
        return (params["block_size_x"], params.get("block_size_y", 1))

    def groups(self, params: dict, problem: Problem) -> int:
        """Number of work-groups (the grid is one-dimensional; kernels decompose the group id)."""
        raise NotImplementedError

    def local_mem_bytes(self, params: dict, problem: Problem) -> int:
        return 0

    def extra_defines(self, params: dict, problem: Problem) -> dict:
        return {}

    def second_pass(self, params: dict, problem: Problem) -> tuple | None:
        """``(groups, block, defines)`` of a second launch that ``params`` needs after the first, on
        the same arguments -- the same kernel built with ``defines`` added -- or None (one pass,
        as every variant but a split ``global_blocks``).  Both passes take a scratch buffer of
        ``scratch_bytes`` after the results, which the caller allocates (``plans.Plan``)."""
        return None

    def scratch_bytes(self, params: dict, problem: Problem) -> int:
        """Bytes of the scratch buffer that ``second_pass`` needs (0: none)."""
        return 0

    # ------------------------------------------------------------------ shared logic

    @property
    def template(self) -> str:
        """The variant's kernel file, ``kernels/<direction>/<name>.c`` (``kernel_source``)."""
        return kernel_source.variant_file(self.direction, self.name)

    @property
    def kernel_name(self) -> str:
        return f"pool_{self.direction}"

    def configurations(self):
        """Every point of the search space (legal or not), as dicts."""
        names = list(self.search_space)
        for values in itertools.product(*(self.search_space[n] for n in names)):
            yield dict(zip(names, values))

    def illegal_reason(self, params: dict, problem: Problem, limits: DeviceLimits) -> str | None:
        """Why ``params`` cannot run ``problem`` on a device with ``limits``; None when it can."""
        lanes = params.get("row_lanes", 1)
        if lanes > 1 and lanes > _longest_run(problem):
            return "row_lanes must not exceed the longest contiguous run of a window (kernels/reduction.h)"
        threads = math.prod(self.block(params))
        if threads > limits.max_work_group_size:
            return f"work-group of {threads} exceeds the device limit {limits.max_work_group_size}"
        local = self.local_mem_bytes(params, problem)
        if local > limits.local_mem_size:
            return f"needs {local} bytes of local memory, the device has {limits.local_mem_size}"
        return None

    def check_config(self, config, problem: Problem, limits: DeviceLimits, name: str = "config",
                     forced: bool = False) -> dict:
        """Validate a user- or cache-supplied configuration; return it complete (defaults filled).
        ``forced`` (the caller named the variant) lifts the device-kind rule (``device_types``)
        alone: the kernel still has to be able to run the problem."""
        if not isinstance(config, dict):
            raise TypeError(f"{name} must be a dict of tuning parameters, got {type(config).__name__}")
        unknown = sorted(set(config) - set(self.search_space))
        if unknown:
            raise ValueError(
                f"{name} has unknown parameters {unknown} for variant {self.name!r}; "
                f"allowed: {sorted(self.search_space)}"
            )
        params = {**self.default_for(problem), **config}
        for key, value in params.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name}[{key!r}] must be an int, got {type(value).__name__} {value!r}")
            if value not in self.search_space[key]:
                raise ValueError(
                    f"{name}[{key!r}] must be one of {list(self.search_space[key])} for variant "
                    f"{self.name!r}, got {value!r}"
                )
        reason = self.refusal(params, problem, limits, forced)
        if reason:
            raise ValueError(f"{name} {params} is not legal for variant {self.name!r} here: {reason}")
        return {k: int(v) for k, v in params.items()}

    def refusal(self, params: dict, problem: Problem, limits, forced: bool = False) -> str | None:
        """Why configuration ``params`` cannot run ``problem`` on a device with ``limits`` (its own
        parameters' rule first, then the device kind's unless ``forced``, then the problem's), or
        None when it can."""
        return (self.extra_rule(params) or (None if forced else self.device_refusal(limits))
                or self.layout_refusal(problem) or self.illegal_reason(params, problem, limits))

    def layout_refusal(self, problem: Problem) -> str | None:
        """Why the variant cannot run a problem in ``problem``'s memory layout (``layouts``), or None."""
        if layout_of(problem) in self.layouts:
            return None
        return f"needs {' or '.join(self.layouts).replace('_', '-')} memory"

    def device_refusal(self, limits) -> str | None:
        """Why the variant is not legal on a device of ``limits``' kind (``device_types``), or None."""
        if limits.device_type in self.device_types:
            return None
        return (f"is shaped for {'/'.join(self.device_types)} devices and this is a {limits.device_type} device "
                f"(variant= forces it)")

    def default_for(self, problem: Problem) -> dict:
        """The default configuration for ``problem``: ``default``, unless a variant knows better."""
        return self.default

    def extra_rule(self, params: dict) -> str | None:
        """Relations between parameters that the search space alone does not express."""
        return None

    def is_legal(self, config: dict, problem: Problem, limits: DeviceLimits, forced: bool = False) -> bool:
        try:
            self.check_config(config, problem, limits, forced=forced)
        except ValueError:
            return False
        return True

    def legal_configurations(self, problem: Problem, limits: DeviceLimits, forced: bool = False) -> list:
        """Every legal point of the search space for ``problem``, complete, in search-space order
        (``forced``: as a call naming the variant, the device-kind rule lifted).  Each point already
        names every parameter with a value of its space, so only ``refusal`` is asked
        (``check_config``'s other checks are for configurations from users and caches)."""
        return [{k: int(v) for k, v in c.items()} for c in self.configurations()
                if self.refusal(c, problem, limits, forced) is None]

    def representative_configurations(self, problem: Problem, limits: DeviceLimits) -> dict:
        """``{label: config}``: the default, the first and the last legal point of the space and
        the last of two passes (``second_pass``), those that are legal, labelled ``default``,
        ``smallest``, ``largest`` and ``two-pass`` -- joined by ``+`` where they coincide
        (``default+smallest``).  What the checks of a variant's kernels compile and run (the CUDA
        compile check, Oclgrind, the device matrix).

        Legal as for a call naming the variant: the device-kind rule (``device_types``) is lifted,
        since such a call runs a variant on any device, so a variant shaped for one kind of device
        is checked on the others too."""
        legal = self.legal_configurations(problem, limits, forced=True)
        picks = ([("default", self.check_config({}, problem, limits, forced=True))]
                 if self.is_legal({}, problem, limits, forced=True) else [])
        if legal:
            picks += [("smallest", legal[0]), ("largest", legal[-1])]
        two_pass = [params for params in legal if self.second_pass(params, problem) is not None]
        if two_pass:
            picks.append(("two-pass", two_pass[-1]))
        merged: dict = {}
        for label, params in picks:
            key = tuple(sorted(params.items()))
            merged[key] = f"{merged[key]}+{label}" if key in merged else label
        return {label: dict(key) for key, label in merged.items()}

    def defines(self, params: dict, problem: Problem) -> dict:
        """Every ``#define`` of this variant's kernel for ``problem``, tuning parameters last."""
        return {
            **problem.defines(),
            **self.extra_defines(params, problem),
            **params,
        }

    def program(self, params: dict, problem: Problem, pass_defines: dict | None = None) -> str:
        """The rendered program of this variant's kernel for ``problem`` (of its second pass:
        with ``pass_defines``): its defines, then its files with the problem's operator header.
        Every build, tuning and compile check renders through here, so that no caller can pair a
        variant's file with another op's operator (GeM's programs without ``operators/gem.h``
        stop at operators.h's ``#error``)."""
        return kernel_source.render(self.template, {**self.defines(params, problem), **(pass_defines or {})},
                                    problem.operation.operator_header)


def _output_rows(problem: Problem) -> int:
    """Output rows (t, h) of one plane: the unit of work of the row variants."""
    ot, oh, _ = problem.out_spatial
    return ot * oh


def _input_rows(problem: Problem) -> int:
    """Input rows (t, h) of one plane: the unit of work of the backward row variant."""
    it, ih, _ = problem.in_spatial
    return it * ih


def _grid(per_plane: int, problem: Problem, per_group: int) -> int:
    """Work-groups of ``per_group`` work units that cover ``per_plane`` units in every plane."""
    return _ceil_div(problem.planes * per_plane, per_group)


def _partial_last_group(per_plane: int, problem: Problem, per_group: int) -> dict:
    """The ``PARTIAL_LAST_GROUP`` define of a ``_grid``: whether the grid can end inside a work-group,
    so that the kernel must check its work-items against the end.  The plane count is a kernel
    argument -- one build serves every batch size -- so this holds for every batch of whole samples
    (``problem.channels`` planes each): a grid over one sample that ends on a group boundary ends on
    one for every batch size, and one that does not already needs the check at batch size 1."""
    return {"PARTIAL_LAST_GROUP": int(problem.channels * per_plane % per_group != 0)}


def _acc_bytes(problem: Problem) -> int:
    """Size of the kernels' accumulator type ``acc_t``: float64 for float64, else float32."""
    return 8 if problem.dtype == "float64" else 4


def is_global(problem: Problem) -> bool:
    """Global pooling: every output extent is 1, so each output reduces its whole plane."""
    return problem.out_spatial == (1, 1, 1)


class _Tiled(Variant):
    """Shared by the forward and backward tiled variants: a 2-d work-group per tile of the
    written array, staging in local memory what the tile's windows read."""

    search_space = {
        "block_size_x": [4, 8, 16, 32, 64],
        "block_size_y": [1, 2, 4, 8, 16],
        "tile_x": [1, 2, 4],
        "tile_y": [1, 2, 4],
    }
    default = {"block_size_x": 8, "block_size_y": 8, "tile_x": 1, "tile_y": 1}

    def tiled_axes(self, problem):
        """``(written sizes, read sizes)`` of the (T, H, W) axes: the tile covers written
        elements, the stage holds what their windows read."""
        raise NotImplementedError

    @staticmethod
    def tile(params):
        return params["block_size_y"] * params["tile_y"], params["block_size_x"] * params["tile_x"]

    def stage_extent(self, params, problem) -> tuple[int, int, int]:
        (wt, wh, ww), (rt, rh, rw) = self.tiled_axes(problem)
        if 0 in (rt, rh, rw, wt, wh, ww):  # an empty side: nothing is staged (nor launched)
            return (0, 0, 0)
        tile_h, tile_w = self.tile(params)
        # Written index i reads the range pooling_windows(read size, written size)[i]: the windows
        # in the forward pass, the inverse windows in the backward pass.
        return (max_window(rt, wt), _max_tile_extent(rh, wh, tile_h), _max_tile_extent(rw, ww, tile_w))

    def groups(self, params, problem):
        (wt, wh, ww), _ = self.tiled_axes(problem)
        tile_h, tile_w = self.tile(params)
        return problem.planes * wt * _ceil_div(wh, tile_h) * _ceil_div(ww, tile_w)

    def local_mem_bytes(self, params, problem):
        per_element = _acc_bytes(problem)
        if problem.flow.reads_indices(problem.operation):
            per_element += 8  # the staged int64 indices
        return math.prod(self.stage_extent(params, problem)) * per_element

    def extra_defines(self, params, problem):
        st, sh, sw = self.stage_extent(params, problem)
        (wt, wh, ww), _ = self.tiled_axes(problem)
        return {"STAGE_T": st, "STAGE_H": sh, "STAGE_W": sw, "WRITE_T": wt, "WRITE_H": wh, "WRITE_W": ww}


class ThreadPerOutput(Variant):
    name = "thread_per_output"
    takes_arguments = True
    runs_every_problem = True
    summary = ("each work-item reduces `outputs_per_thread` whole windows, neighbouring work-items writing "
               "neighbouring outputs; `row_lanes` keeps independent partials along each window run")
    search_space = {
        "block_size_x": [32, 64, 128, 256, 512, 1024],
        "outputs_per_thread": [1, 2, 4, 8],
        "row_lanes": [1, 4, 8, 16],
    }
    default = {"block_size_x": 256, "outputs_per_thread": 1, "row_lanes": 1}
    #: Windows too large for the unrolled small-window path whose runs (kernels/reduction.h)
    #: have at least this many elements default to LONG_RUN_LANES lanes: on PoCL the tuner picked
    #: 8 or 16 lanes for such suite shapes, 2-4x faster than one lane (global, pyramid and 3-d head
    #: pooling).  Windows that fit the box run fastest unrolled, which needs one lane.
    LONG_RUN = 32
    LONG_RUN_LANES = 8

    def default_for(self, problem):
        if _window_box(problem) > SMALL_BOX_LIMIT and _longest_run(problem) >= self.LONG_RUN:
            return {**self.default, "row_lanes": self.LONG_RUN_LANES}
        return self.default

    def groups(self, params, problem):
        return _grid(math.prod(problem.out_spatial), problem, params["block_size_x"] * params["outputs_per_thread"])

    def extra_defines(self, params, problem):
        per_group = params["block_size_x"] * params["outputs_per_thread"]
        return _partial_last_group(math.prod(problem.out_spatial), problem, per_group)


class ThreadPerRow(Variant):
    name = "thread_per_row"
    takes_arguments = True
    summary = ("channels-first, separable: each work-item sums its output row's input rows column by column into "
               "a private row of partials, then reduces each output's window of columns")
    #: unrolled_columns = 1 sums each window's column partials in straight-line code over the widest
    #: window (average pooling only): faster on long 1-d rows, slower on some 2-d layers, so tuned.
    search_space = {"block_size_x": [1, 4, 16, 64, 256], "unrolled_columns": [0, 1]}
    default = {"block_size_x": 16, "unrolled_columns": 0}
    #: Bytes of the private row of column partials (kernels/forward/thread_per_row.c) a work-item may hold.
    ROW_BYTES_LIMIT = 16384
    #: Widest window (in columns) that unrolled_columns unrolls.
    UNROLLED_COLUMNS_LIMIT = 32

    @staticmethod
    def row_bytes(problem) -> int:
        per_column = _acc_bytes(problem) + (8 if problem.operation.selects else 0)  # value, selecting: position
        return problem.in_spatial[2] * per_column

    def illegal_reason(self, params, problem, limits):
        if problem.channels_last:
            return "needs channels-first memory (contiguous input rows)"
        if self.row_bytes(problem) > self.ROW_BYTES_LIMIT:
            return (f"input rows of {problem.in_spatial[2]} elements need {self.row_bytes(problem)} bytes of "
                    f"column partials per work-item; the limit is {self.ROW_BYTES_LIMIT}")
        if params["unrolled_columns"]:
            if problem.operation.selects:
                return "unrolled_columns is for average pooling (max pooling merges positions)"
            widest = _max_windows(problem)[2]
            if widest > self.UNROLLED_COLUMNS_LIMIT:
                return (f"unrolled_columns unrolls at most {self.UNROLLED_COLUMNS_LIMIT} columns; "
                        f"windows here are up to {widest} wide")
        return super().illegal_reason(params, problem, limits)

    def groups(self, params, problem):
        return _grid(_output_rows(problem), problem, params["block_size_x"])

    def extra_defines(self, params, problem):
        return _partial_last_group(_output_rows(problem), problem, params["block_size_x"])


class BlockPerRow(Variant):
    name = "block_per_row"
    takes_arguments = True
    summary = ("a work-group per output row; `threads_per_output` work-items split each window and tree-reduce it "
               "in local memory")
    search_space = {
        "block_size_x": [32, 64, 128, 256, 512, 1024],
        "threads_per_output": [1, 2, 4, 8, 16, 32, 64],
        "row_lanes": [1, 4, 8, 16],
    }
    default = {"block_size_x": 64, "threads_per_output": 4, "row_lanes": 1}

    def extra_rule(self, params):
        if params["threads_per_output"] > params["block_size_x"]:
            return "threads_per_output must not exceed block_size_x"
        return None

    def groups(self, params, problem):
        return problem.planes * _output_rows(problem)

    def local_mem_bytes(self, params, problem):
        if params["threads_per_output"] == 1:
            return 0
        # reduction_t: the accumulator and a position (at most 8 bytes), padded to 16.
        return params["block_size_x"] * 16


class _Global(Variant):
    """Shared by the global-pooling variants: legal only where every output extent is 1, and where
    ``channels_last`` is not None only in that memory layout."""

    channels_last: bool | None = None

    def illegal_reason(self, params, problem, limits):
        if not is_global(problem):
            return "only for global pooling (every output size 1)"
        if self.channels_last is not None and problem.channels_last != self.channels_last:
            return "needs channels-last memory" if self.channels_last else "needs channels-first memory (contiguous planes)"
        return super().illegal_reason(params, problem, limits)

    def extra_rule(self, params):
        """Where planes are split in parts (``split``), the parts are work-items of one work-group."""
        if params.get("split", 1) > params["block_size_x"]:
            return "split must not exceed block_size_x"
        return None


class PlaneReduce(_Global):
    name = "plane_reduce"
    takes_arguments = True
    summary = ("global pooling, channels-first: a work-group per plane, work-item j takes every `block_size_x`-th "
               "element from j, then one work-item merges the partials in order")
    search_space = {"block_size_x": [8, 16, 32, 64, 128, 256]}
    default = {"block_size_x": 64}

    channels_last = False

    def illegal_reason(self, params, problem, limits):
        reason = super().illegal_reason(params, problem, limits)
        if reason is None and params["block_size_x"] > math.prod(problem.in_spatial):
            return "block_size_x must not exceed the plane size (every work-item needs an element)"
        return reason

    def default_for(self, problem):
        """64 work-items, or the most that the plane has elements for."""
        plane = math.prod(problem.in_spatial)
        fitting = [b for b in self.search_space["block_size_x"] if b <= min(plane, self.default["block_size_x"])]
        return {"block_size_x": fitting[-1]} if fitting else self.default

    def groups(self, params, problem):
        return problem.planes

    def local_mem_bytes(self, params, problem):
        # A value (at most 8 bytes) and, for max, an index_t position (at most 8 bytes) per work-item.
        return params["block_size_x"] * (16 if problem.operation.selects else 8)


class GlobalPlanes(_Global):
    name = "global_planes"
    takes_arguments = True
    summary = ("global pooling, channels-first: `split` work-items per plane each reduce a contiguous part of it "
               "in `run_lanes` independent lanes, neighbouring work-items on neighbouring planes")
    channels_last = False
    search_space = {
        "block_size_x": [16, 64, 256, 1024],
        "run_lanes": [4, 8, 16, 32],
        "split": [1, 2, 4, 8, 16],
        "planes_per_item": [1, 2, 4],
    }
    default = {"block_size_x": 256, "run_lanes": 16, "split": 1, "planes_per_item": 1}
    #: The default splits planes until the launch has at least this many work-items (so that every
    #: compute unit of a device gets work when a problem has few planes).
    MIN_WORK_ITEMS = 1024
    #: Planes of fewer elements default to SHORT_PLANE_LANES lanes: with 16 lanes a 7x7 plane is
    #: three steps and a long tail; on PoCL 8 lanes were faster there and slower on larger planes.
    SHORT_PLANE = 64
    SHORT_PLANE_LANES = 8

    def default_for(self, problem):
        """``default`` with ``SHORT_PLANE_LANES`` lanes for short planes, its planes split in parts
        (of at least one lane step each) until the launch has ``MIN_WORK_ITEMS`` work-items."""
        plane = math.prod(problem.in_spatial)
        lanes = self.SHORT_PLANE_LANES if plane < self.SHORT_PLANE else self.default["run_lanes"]
        split = 1
        for candidate in self.search_space["split"]:
            if problem.planes * split >= self.MIN_WORK_ITEMS or plane < candidate * lanes:
                break
            split = candidate
        return {**self.default, "run_lanes": lanes, "split": split}

    def groups(self, params, problem):
        planes_per_group = params["block_size_x"] // params["split"] * params["planes_per_item"]
        return _ceil_div(problem.planes, planes_per_group)

    def local_mem_bytes(self, params, problem):
        if params["split"] == 1:
            return 0
        # A value (at most 8 bytes) and, for max, an index_t position (at most 8 bytes) per work-item.
        return params["block_size_x"] * (16 if problem.operation.selects else 8)


class GlobalChannels(_Global):
    name = "global_channels"
    takes_arguments = True
    summary = ("global pooling, channels-last: a work-item takes `channels_per_item` neighbouring channels of one "
               "batch entry, loaded as one contiguous run at each position, with `accumulators` partials per channel")
    channels_last = True
    search_space = {"block_size_x": [16, 64, 256, 1024], "accumulators": [1, 2, 4, 8],
                    "channels_per_item": [1, 4, 8, 16, 32, 64]}
    default = {"block_size_x": 16, "accumulators": 1, "channels_per_item": 8}
    #: The most 32-bit words of partial results a work-item keeps (``partial_words``): they live in
    #: registers, and past this CUDA's compiler spills them to local memory.
    REGISTER_WORDS = 64
    #: The default takes the widest channel run that divides the channels, of at most WIDEST_RUN
    #: channels for accumulating ops and WIDEST_SELECTING_RUN for selecting ones (whose second pass
    #: over the plane finds each channel's position) -- wider runs are more vector loads per position
    #: and fewer work-items to schedule, which PoCL runs faster ...
    WIDEST_RUN = 64
    WIDEST_SELECTING_RUN = 16
    #: ... as long as the launch keeps at least MIN_WORK_ITEMS work-items, so that a CPU's threads
    #: all get work-groups ...
    MIN_WORK_ITEMS = 32
    #: ... and, for accumulating ops, with at least CHAINS partials per work-item (accumulators x
    #: channels), so that a long plane's additions are not one chain of dependent vector adds.
    CHAINS = 32

    @staticmethod
    def partial_words(channels_per_item: int, accumulators: int, problem: Problem) -> int:
        """32-bit words of a work-item's partials: a value in the accumulation type per channel and
        accumulator, and for selecting ops a position (an ``index_t``) per channel."""
        value = 2 if problem.dtype == "float64" else 1
        position = (2 if problem.index_64 else 1) if problem.operation.selects else 0
        return channels_per_item * (accumulators * value + position)

    def illegal_reason(self, params, problem, limits):
        reason = super().illegal_reason(params, problem, limits)
        if reason is None and problem.channels % params["channels_per_item"]:
            return "channels_per_item must divide the number of channels"
        if reason is None and self.partial_words(params["channels_per_item"], params["accumulators"],
                                                 problem) > self.REGISTER_WORDS:
            return (f"channels_per_item x accumulators must keep the partials within {self.REGISTER_WORDS} "
                    f"32-bit words (registers) for this op and dtype")
        return reason

    def default_for(self, problem):
        """The widest channel run of at most ``WIDEST_RUN`` (selecting ops: ``WIDEST_SELECTING_RUN``)
        channels that divides the channels, leaves ``MIN_WORK_ITEMS`` work-items and fits
        ``REGISTER_WORDS`` (else the widest of at most the default's that divides them); accumulating
        ops with accumulators for ``CHAINS`` partials as far as the words allow, selecting ops one."""
        selects = problem.operation.selects
        widest = self.WIDEST_SELECTING_RUN if selects else self.WIDEST_RUN
        dividing = [n for n in self.search_space["channels_per_item"] if problem.channels % n == 0]
        roomy = [n for n in dividing if n <= widest and problem.planes // n >= self.MIN_WORK_ITEMS
                 and self.partial_words(n, 1, problem) <= self.REGISTER_WORDS]
        run = max(roomy, default=max(n for n in dividing if n <= self.default["channels_per_item"]))
        accumulators = 1 if selects else max(
            n for n in self.search_space["accumulators"]
            if n == 1 or (n * run <= self.CHAINS and self.partial_words(run, n, problem) <= self.REGISTER_WORDS))
        return {**self.default, "channels_per_item": run, "accumulators": accumulators}

    def groups(self, params, problem):
        return _ceil_div(problem.planes // params["channels_per_item"], params["block_size_x"])


class GlobalBlocks(_Global):
    name = "global_blocks"
    takes_arguments = True
    summary = ("global pooling, either layout, GPUs only: a team of `threads_per_plane` work-items per plane reads "
               "neighbouring positions (channels-first: `vector_width` at a time) at each step with `accumulators` "
               "loads in flight each, teams side by side in a work-group, merged by a tree in local memory, its "
               "last rounds within a warp with `warp_shuffle`; with `split`, each plane cut into parts over as many "
               "work-groups, merged in part order by a second pass")
    device_types = ("gpu",)
    #: vector_width first, so that the last legal configuration (compile_check's and Oclgrind's
    #: "largest") reads vectors wherever the problem allows them.
    search_space = {
        "vector_width": [1, 2, 4],
        "block_size_x": [64, 128, 256, 512, 1024],
        "threads_per_plane": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
        "accumulators": [1, 2, 4, 8],
        "warp_shuffle": [0, 1],
        "split": [1, 2, 4, 8, 16, 32, 64, 128],
    }
    default = {"block_size_x": 256, "threads_per_plane": 32, "accumulators": 4, "warp_shuffle": 1, "vector_width": 1,
               "split": 1}
    #: The default team gives each member about this many elements of its plane: enough loads per
    #: work-item to hide their latency, and the team as wide as the plane allows up to the work-group.
    ELEMENTS_PER_MEMBER = 8
    #: The default splits planes (``split``) while the launch has fewer work-groups than this --
    #: a few per multiprocessor of a large GPU (132 on an H100) -- ...
    MIN_GROUPS = 256
    #: ... and each part keeps at least this many elements, so that a part's reads outweigh its
    #: share of the second pass.  Neither number has been measured on a GPU yet.
    MIN_PART_ELEMENTS = 16384
    #: Channels-last, the default keeps at least this many teams side by side -- neighbouring
    #: channels, which a warp of 32 work-items then reads as one contiguous run at each step.
    MIN_CHANNELS_LAST_TEAMS = 32

    def extra_rule(self, params):
        if params["threads_per_plane"] > params["block_size_x"]:
            return "threads_per_plane must not exceed block_size_x"
        return None

    def illegal_reason(self, params, problem, limits):
        """Vectors (``vector_width`` > 1) are neighbouring positions of a channels-first plane whose
        length they divide, so that every plane starts on a vector boundary where the input does
        (the kernel tests the input's alignment and reads element by element where it is not)."""
        plane = math.prod(problem.in_spatial)
        width = params["vector_width"]
        if width > 1 and problem.channels_last:
            return "vector_width > 1 needs channels-first memory (a vector is neighbouring positions of one plane)"
        if plane % width:
            return f"vector_width must divide the plane size {plane}"
        if params["threads_per_plane"] * width > max(plane, 1):
            return (f"threads_per_plane must not exceed the plane size {plane} divided by vector_width {width} "
                    f"(every member needs an element)")
        if params["split"] > 1 and params["threads_per_plane"] * width * params["split"] > plane:
            return (f"split must not exceed the plane size {plane} divided by threads_per_plane * vector_width "
                    f"(every member of every part needs an element)")
        return super().illegal_reason(params, problem, limits)

    def default_for(self, problem):
        """``default`` with a team of the widest power of two, at most the work-group, that leaves
        each member ``ELEMENTS_PER_MEMBER`` elements (one member for planes smaller than that);
        channels-last, narrow enough for ``MIN_CHANNELS_LAST_TEAMS`` teams per work-group.  Its last
        merge rounds within a warp (``warp_shuffle``; a team of one has no rounds, so there it
        changes nothing); element by element (``vector_width`` 1): no GPU has measured the vector
        widths yet."""
        plane = math.prod(problem.in_spatial)
        widest = self.default["block_size_x"] // (self.MIN_CHANNELS_LAST_TEAMS if problem.channels_last else 1)
        fitting = [t for t in self.search_space["threads_per_plane"]
                   if t <= widest and t * self.ELEMENTS_PER_MEMBER <= plane]
        team = max(fitting, default=1)
        groups = _ceil_div(problem.planes, self.default["block_size_x"] // team)
        split = max(s for s in self.search_space["split"]
                    if s == 1 or (groups * s <= self.MIN_GROUPS and plane >= s * self.MIN_PART_ELEMENTS))
        return {**self.default, "threads_per_plane": team, "split": split}

    def groups(self, params, problem):
        return _ceil_div(problem.planes, params["block_size_x"] // params["threads_per_plane"]) * params["split"]

    def extra_defines(self, params, problem):
        return {"COMBINE_PASS": 0}

    def second_pass(self, params, problem):
        """A split plane's parts merged by a work-item per plane (kernels/forward/global_blocks.c)."""
        if params["split"] == 1:
            return None
        block = params["block_size_x"]
        return _ceil_div(problem.planes, block), (block, 1), {"COMBINE_PASS": 1}

    def scratch_bytes(self, params, problem):
        """A value and (selecting ops) a position of at most 8 bytes per part of every plane, each
        array padded to an even count."""
        if params["split"] == 1:
            return 0
        slots = _ceil_div(problem.planes * params["split"], 2) * 2
        return slots * 8 * (2 if problem.operation.selects else 1)

    def local_mem_bytes(self, params, problem):
        if params["threads_per_plane"] == 1:
            return 0
        # A value (at most 8 bytes) and, for max, an index_t position (at most 8 bytes) per work-item.
        return params["block_size_x"] * (16 if problem.operation.selects else 8)


class GlobalBroadcast(_Global):
    name = "global_broadcast"
    direction = "backward"
    summary = ("global pooling, either layout: every input gradient is its plane's term (avg: the share; max: the "
               "gradient at the index, 0 elsewhere), written once as a stream by `split` work-items per plane")
    search_space = {"block_size_x": [16, 64, 256, 1024], "split": [1, 2, 4, 8, 16]}
    default = {"block_size_x": 64, "split": 1}

    def groups(self, params, problem):
        return _ceil_div(problem.planes, params["block_size_x"] // params["split"])


class SmemTiled(_Tiled):
    name = "smem_tiled"
    takes_arguments = True
    summary = ("a work-group stages the input under a tile of outputs in local memory (overlapping windows read "
               "once), then reduces the tile")

    def tiled_axes(self, problem):
        return problem.out_spatial, problem.in_spatial


class ChannelsVector(Variant):
    name = "channels_vector"
    takes_arguments = True
    summary = ("channels-last only: a work-item reduces `vector_width` neighbouring channels of one output "
               "position")
    search_space = {
        "block_size_x": [32, 64, 128, 256],
        "vector_width": [1, 2, 4, 8, 16],
    }
    default = {"block_size_x": 64, "vector_width": 4}

    def illegal_reason(self, params, problem, limits):
        if not problem.channels_last:
            return "needs a channels-last input (it vectorises over neighbouring channels)"
        return super().illegal_reason(params, problem, limits)

    def groups(self, params, problem):
        positions = (problem.planes // max(problem.channels, 1)) * math.prod(problem.out_spatial)
        return _ceil_div(positions * _ceil_div(problem.channels, params["vector_width"]), params["block_size_x"])


class ThreadPerInput(Variant):
    name = "thread_per_input"
    direction = "backward"
    runs_every_problem = True
    summary = ("gather: each work-item sums the gradients of the outputs whose windows hold its "
               "`inputs_per_thread` inputs")
    search_space = {
        "block_size_x": [32, 64, 128, 256, 512, 1024],
        "inputs_per_thread": [1, 2, 4, 8],
    }
    default = {"block_size_x": 256, "inputs_per_thread": 1}

    def groups(self, params, problem):
        return _grid(math.prod(problem.in_spatial), problem, params["block_size_x"] * params["inputs_per_thread"])

    def extra_defines(self, params, problem):
        per_group = params["block_size_x"] * params["inputs_per_thread"]
        return _partial_last_group(math.prod(problem.in_spatial), problem, per_group)


class ChannelsGather(Variant):
    name = "channels_gather"
    direction = "backward"
    layouts = ("channels_last",)
    summary = ("gather, channels-last only: a work-item takes `channels_per_item` neighbouring channels of a tile of "
               "`rows_per_item` rows by `positions_per_item` positions along W, finds each covering output's area "
               "once for all its channels, sums each channel's terms with the channels as the contiguous inner "
               "loop, and stores a position's (row's) sums again for the next one inside the same windows")
    search_space = {"block_size_x": [1, 4, 16, 64, 256], "channels_per_item": [1, 2, 4, 8, 16, 32, 64, 128, 256],
                    "positions_per_item": [1, 2, 4, 8, 16, 32], "rows_per_item": [1, 2, 4, 8, 16, 32]}
    default = {"block_size_x": 16, "channels_per_item": 64, "positions_per_item": 1, "rows_per_item": 1}
    #: The most 32-bit words of sums a work-item keeps, one accumulation-type value per channel: they
    #: live in registers, and past this CUDA's compiler spills them to local memory.
    REGISTER_WORDS = 128

    def illegal_reason(self, params, problem, limits):
        if is_global(problem):
            return ("not for global pooling, whose gradient is one value per plane broadcast (global_broadcast), "
                    "and whose grad_out reads as channels-first")
        per_item = params["channels_per_item"]
        if per_item > 1 and per_item > problem.channels:
            return f"channels_per_item must not exceed the number of channels ({problem.channels})"
        words = 2 if problem.dtype == "float64" else 1
        if per_item * words > self.REGISTER_WORDS:
            return (f"channels_per_item must keep the sums within {self.REGISTER_WORDS} 32-bit words (registers): "
                    f"at most {self.REGISTER_WORDS // words} channels for {problem.dtype}")
        run = params["positions_per_item"]
        if run > 1 and run > problem.in_spatial[-1]:
            return f"positions_per_item must not exceed the input's width ({problem.in_spatial[-1]})"
        rows, height = params["rows_per_item"], _height(problem.in_spatial)
        if rows > 1 and rows > height:
            return f"rows_per_item must not exceed the input's height ({height})"
        return super().illegal_reason(params, problem, limits)

    #: The longest run of positions (rows) the default takes along an axis whose windows overlap.
    SHARED_RUN = 16

    def default_for(self, problem):
        """The widest channel run of at most the default's that divides the channels (no masked
        run), and along W (H) a run of positions (rows) where the average's windows overlap there
        (the output narrower than the input, not dividing it): each input then sums several
        outputs' terms, and inputs between two overlaps share their windows, so a run sums each
        set once.  Where windows do not overlap an input is one term, and a run only breaks the
        contiguous store order of neighbouring work-items: one position (row)."""
        widest = max(n for n in self.search_space["channels_per_item"]
                     if n <= self.default["channels_per_item"]
                     and (n == 1 or (n <= problem.channels and problem.channels % n == 0)))
        (height, out_height), (width, out_width) = ((_height(problem.in_spatial), _height(problem.out_spatial)),
                                                    (problem.in_spatial[-1], problem.out_spatial[-1]))
        return {**self.default, "channels_per_item": widest,
                "positions_per_item": self._shared_run("positions_per_item", width, out_width, problem),
                "rows_per_item": self._shared_run("rows_per_item", height, out_height, problem)}

    def _shared_run(self, parameter, extent, out_extent, problem):
        """``default_for``'s run along one axis of ``extent`` inputs and ``out_extent`` outputs."""
        if problem.operation.selects or not (0 < out_extent < extent and extent % out_extent):
            return 1
        return max(n for n in self.search_space[parameter] if n <= min(self.SHARED_RUN, extent))

    def groups(self, params, problem):
        slices = (problem.planes // max(problem.channels, 1)) * math.prod(problem.in_spatial[:-2])
        tiles = (slices * _ceil_div(_height(problem.in_spatial), params["rows_per_item"])
                 * _ceil_div(problem.in_spatial[-1], params["positions_per_item"]))
        return _ceil_div(tiles * _ceil_div(problem.channels, params["channels_per_item"]), params["block_size_x"])


def _height(spatial) -> int:
    """The extent along H of an input's or output's spatial sizes: 1 for one spatial dimension
    (kernels/windows.h pads the axes)."""
    return spatial[-2] if len(spatial) >= 2 else 1


class SmemTiledBackward(_Tiled):
    name = "smem_tiled"
    direction = "backward"
    summary = ("gather: a work-group stages the output gradients over a tile of inputs in local memory, then sums "
               "from there")

    def tiled_axes(self, problem):
        return problem.in_spatial, problem.out_spatial


class ThreadPerRowBackward(Variant):
    name = "thread_per_row"
    direction = "backward"
    summary = ("average pooling, channels-first, no input in more than two windows along W: each work-item writes "
               "one input row once, left to right, adding each input's terms in the gathers' order")
    search_space = {"block_size_x": [1, 4, 16, 64, 256]}
    default = {"block_size_x": 16}

    def illegal_reason(self, params, problem, limits):
        if problem.operation.selects:
            return "is for average pooling (its runs share one value)"
        if problem.channels_last:
            return "needs channels-first memory (contiguous input rows)"
        (_, _, iw), (_, _, ow) = problem.in_spatial, problem.out_spatial
        if ow and max_window(ow, iw) > 2:
            # max_window is exact up to EXACT_MAX_WINDOW_LIMIT outputs and an upper bound past it,
            # so a refusal of a very long row can be conservative, never wrong the other way.
            return "needs every input in at most two windows along W (W may grow by less than double)"
        return super().illegal_reason(params, problem, limits)

    def groups(self, params, problem):
        return _grid(_input_rows(problem), problem, params["block_size_x"])

    def extra_defines(self, params, problem):
        return _partial_last_group(_input_rows(problem), problem, params["block_size_x"])


class PlaneScatter(Variant):
    name = "plane_scatter"
    direction = "backward"
    summary = ("float32/float64: a work-item per plane adds each output's gradient over its window, outputs in "
               "order, so every input gets its terms in the gathers' order without atomics")
    search_space = {"block_size_x": [1, 4, 16, 64]}
    default = {"block_size_x": 16}

    def illegal_reason(self, params, problem, limits):
        if problem.dtype not in ("float32", "float64"):
            return "accumulates in the stored gradient, so it needs float32 or float64"
        return super().illegal_reason(params, problem, limits)

    def groups(self, params, problem):
        return _ceil_div(problem.planes, params["block_size_x"])


# ---------------------------------------------------------------------------- GeM's own forward variant
# GeM (kernels/operators/gem.h) runs the shared forward variants through its operator, whose
# run-time arguments (p, eps) they pass on (``takes_arguments``).  Its backward runs no variant: one
# pass of its own input-gradient kernel (Operation.backward_kernel, pool_tuner/gem.py) in a fixed
# configuration, so there is nothing to dispatch or tune.


class GemPlaneWindows(Variant):
    """GeM's own variant: no shared variant maps each input of a plane once for all the windows that
    hold it -- thread_per_output maps an input once per window, smem_tiled stages raw inputs and maps
    them per window -- nor maps a plane in vector code (gem.h's eight-wide helpers, which only GeM's
    operator has)."""

    name = "gem_plane_windows"
    takes_arguments = True
    operator_headers = ("operators/gem.h",)
    summary = ("GeM, small channels-first planes into few outputs: a work-item maps one whole plane (OpenCL: eight "
               "inputs at a time in vector code) and adds each input's power into the sums of the windows that hold "
               "it, neighbouring work-items on neighbouring planes")
    search_space = {"block_size_x": [16, 64, 256]}
    default = {"block_size_x": 64}
    layouts = ("channels_first",)
    #: The most inputs and outputs of a plane: the kernel unrolls the plane's inputs times its outputs.
    PLANE_LIMIT = 64
    OUTPUTS_LIMIT = 16

    def illegal_reason(self, params, problem, limits):
        if problem.channels_last:
            return "needs channels-first memory (contiguous planes)"
        if is_global(problem):
            return "not for global pooling (a plane's one window: gem_planes reduces it in contiguous lanes)"
        if math.prod(problem.in_spatial) > self.PLANE_LIMIT or math.prod(problem.out_spatial) > self.OUTPUTS_LIMIT:
            return (f"only for planes of at most {self.PLANE_LIMIT} inputs into at most {self.OUTPUTS_LIMIT} outputs "
                    f"(the kernel unrolls the plane)")
        return super().illegal_reason(params, problem, limits)

    def groups(self, params, problem):
        return _ceil_div(problem.planes, params["block_size_x"])

    def extra_defines(self, params, problem):
        return _partial_last_group(1, problem, params["block_size_x"])


class GemPlanes(_Global):
    """GeM's own global variant.  global_planes does the same reduction, but on PoCL its programs
    for GeM's map ran several times slower (docs/benchmarks.md): its helpers' map sits under
    per-work-item conditions (plane bounds, parts), where this kernel's straight loop maps in vector
    code (in OpenCL, eight elements at a time: gem.h's load8, which converts float16 in one
    instruction per eight values on x86)."""

    name = "gem_planes"
    takes_arguments = True
    operator_headers = ("operators/gem.h",)
    summary = ("GeM, global pooling, channels-first: a work-item maps and sums one whole plane in `run_lanes` "
               "independent lanes, neighbouring work-items on neighbouring planes")
    channels_last = False
    search_space = {"block_size_x": [16, 64, 256, 1024], "run_lanes": [4, 8, 16, 32]}
    default = {"block_size_x": 16, "run_lanes": 8}

    def groups(self, params, problem):
        return _ceil_div(problem.planes, params["block_size_x"])

    def extra_defines(self, params, problem):
        return _partial_last_group(1, problem, params["block_size_x"])


# ---------------------------------------------------------------------------- multi-level ops
# The variants of the multi-level ops (pool_tuner.pyramid, kernels/pyramid.h).  The cell variants
# reduce each cut-point cell of a plane once and combine the cells into every level's windows;
# pyramid_windows reduces every window whole and is legal for every problem.


class _CellVariant(Variant):
    """Shared by the cell variants: their programs get the cut-point tables, which must stay small
    enough for constant memory (``TABLE_ENTRIES_LIMIT`` int64 entries); a variant whose work-items
    keep a plane's cells in private memory (``private_cells``) takes at most ``PRIVATE_CELLS_LIMIT``."""

    TABLE_ENTRIES_LIMIT = 4096
    PRIVATE_CELLS_LIMIT = 256
    private_cells = False

    def illegal_reason(self, params, problem, limits):
        if pyramid.table_entries(problem) > self.TABLE_ENTRIES_LIMIT:
            return (f"its cut-point tables would have {pyramid.table_entries(problem)} entries; the limit is "
                    f"{self.TABLE_ENTRIES_LIMIT} (levels this fine are pooled by pyramid_windows)")
        if self.private_cells and pyramid.cell_count(problem) > self.PRIVATE_CELLS_LIMIT:
            return (f"planes here have {pyramid.cell_count(problem)} cells; a work-item keeps at most "
                    f"{self.PRIVATE_CELLS_LIMIT}")
        return super().illegal_reason(params, problem, limits)

    def extra_defines(self, params, problem):
        return pyramid.cell_defines(problem)

    @staticmethod
    def cell_bytes(problem) -> int:
        """Bytes of one cell's partial result: the value, a selecting op's position, avgmax's sum."""
        acc = _acc_bytes(problem)
        return acc + (8 if problem.operation.selects else 0) + (acc if problem.operation.also_mean else 0)


class PyramidCells(_CellVariant):
    name = "pyramid_cells"
    summary = ("multi-level: a work-group per plane reduces each cut-point cell once into local memory, then "
               "finishes every level's outputs from the cells of their windows")
    search_space = {"block_size_x": [8, 16, 32, 64, 128, 256]}
    default = {"block_size_x": 64}

    def groups(self, params, problem):
        return problem.planes

    def local_mem_bytes(self, params, problem):
        return pyramid.cell_count(problem) * self.cell_bytes(problem)


class PyramidColumns(_CellVariant):
    name = "pyramid_columns"
    summary = ("multi-level, channels-first: a work-group per plane, work-item w reducing input column w within "
               "each row of cells (neighbours read neighbours), then cells from columns, then every level's outputs")
    search_space = {"block_size_x": [8, 16, 32, 64, 128, 256]}
    default = {"block_size_x": 64}

    def illegal_reason(self, params, problem, limits):
        if problem.channels_last:
            return "needs channels-first memory (neighbouring columns are neighbours)"
        return super().illegal_reason(params, problem, limits)

    def groups(self, params, problem):
        return problem.planes

    def local_mem_bytes(self, params, problem):
        cells = pyramid.cell_count(problem)
        (_, _, iw) = problem.in_spatial
        column_parts = cells // pyramid.cell_counts(problem)[2] * iw
        return (cells + column_parts) * self.cell_bytes(problem)


class PyramidStream(_CellVariant):
    name = "pyramid_stream"
    summary = ("multi-level: a work-item per plane (neighbours on neighbouring planes) reads its plane once in "
               "memory order into its cells (private memory), then finishes every level's outputs")
    search_space = {"block_size_x": [1, 4, 16, 64, 256]}
    default = {"block_size_x": 16}
    private_cells = True

    def groups(self, params, problem):
        return _ceil_div(problem.planes, params["block_size_x"])


class PyramidChannels(_CellVariant):
    name = "pyramid_channels"
    summary = ("multi-level, channels-last: a work-item takes `channels_per_item` neighbouring channels of one "
               "batch entry, loaded as one contiguous run at each position into their cells (private memory), "
               "then finishes every level's outputs of each")
    search_space = {"block_size_x": [1, 4, 16, 64], "channels_per_item": [1, 2, 4, 8, 16, 32]}
    default = {"block_size_x": 16, "channels_per_item": 32}
    #: Shaped for CPUs: a work-item keeps up to ``LANES_LIMIT`` lanes in private memory, which a
    #: CPU's caches hold and a GPU's registers do not (nvcc spills its wider runs in float64); on a
    #: GPU it runs only when a call names it.
    device_types = ("cpu",)
    #: Cells times channels_per_item: the lanes a work-item keeps in private memory.
    LANES_LIMIT = 4096

    def illegal_reason(self, params, problem, limits):
        if not problem.channels_last:
            return "needs channels-last memory (neighbouring channels are neighbours)"
        per_item = params.get("channels_per_item", self.default["channels_per_item"])
        if problem.channels % per_item:
            return "channels_per_item must divide the number of channels"
        if pyramid.cell_count(problem) * per_item > self.LANES_LIMIT:
            return (f"planes here have {pyramid.cell_count(problem)} cells; a work-item keeps at most "
                    f"{self.LANES_LIMIT} lanes (cells x channels_per_item)")
        return super().illegal_reason(params, problem, limits)

    def default_for(self, problem):
        """The widest channel run of at most the default's that divides the channels and keeps the
        lanes within the limit (1 where none does: then the variant is not legal)."""
        cells = pyramid.cell_count(problem)
        fitting = [n for n in self.search_space["channels_per_item"] if n <= self.default["channels_per_item"]
                   and problem.channels % n == 0 and cells * n <= self.LANES_LIMIT]
        return {**self.default, "channels_per_item": max(fitting, default=1)}

    def groups(self, params, problem):
        return _ceil_div(problem.planes // params["channels_per_item"], params["block_size_x"])


class _PlaneRows(_CellVariant):
    """The ``pyramid_rows`` kernels of both directions: a work-item per plane walks its rows of
    cells, each one contiguous run per ``t`` -- so they need channels-first memory -- and keeps an
    input row in private memory (forward: as lanes; backward: a row of gradients) where the levels
    have more than one column."""

    #: Input columns a work-item may keep in private memory.
    LANES_LIMIT = 256
    private_cells = True

    def row_refusal(self, problem) -> str | None:
        if problem.channels_last:
            return "needs channels-first memory (a row of cells is a contiguous run)"
        if pyramid.cell_counts(problem)[2] > 1 and problem.in_spatial[2] > self.LANES_LIMIT:
            return (f"keeps an input row in private memory; rows here have {problem.in_spatial[2]} elements, the "
                    f"limit is {self.LANES_LIMIT}")
        return None

    def illegal_reason(self, params, problem, limits):
        return self.row_refusal(problem) or super().illegal_reason(params, problem, limits)

    def groups(self, params, problem):
        return _ceil_div(problem.planes, params["block_size_x"])


class PyramidRows(_PlaneRows):
    name = "pyramid_rows"
    summary = ("multi-level, channels-first: a work-item per plane reads each row of cells as contiguous runs "
               "into lanes (one per input column, or `cell_lanes` where every level has one column), lanes "
               "stepping together on contiguous loads, then every level's outputs")
    search_space = {"block_size_x": [1, 4, 16, 64], "cell_lanes": [4, 8, 16, 32]}
    default = {"block_size_x": 16, "cell_lanes": 8}

    def illegal_reason(self, params, problem, limits):
        if (not self.row_refusal(problem) and pyramid.cell_counts(problem)[2] > 1
                and params.get("cell_lanes", self.default["cell_lanes"]) != self.default["cell_lanes"]):
            return "cell_lanes applies only where every level has one column (here the lanes are the input's columns)"
        return super().illegal_reason(params, problem, limits)


class PyramidChannelsBackward(PyramidChannels):
    direction = "backward"
    summary = ("multi-level, channels-last: a work-item takes `channels_per_item` neighbouring channels of one "
               "batch entry, sums the average levels' terms once per cell and channel (private memory), then "
               "writes them position by position, each position's channels one contiguous run")


class PyramidStreamBackward(PyramidStream):
    direction = "backward"
    summary = ("multi-level: a work-item per plane (neighbours on neighbouring planes) sums the average levels' "
               "terms once per cell (private memory), then writes its plane in memory order")

    def local_mem_bytes(self, params, problem):
        return 0


class PyramidRowsBackward(_PlaneRows):
    name = "pyramid_rows"
    direction = "backward"
    summary = ("multi-level, channels-first: a work-item per plane sums the average levels' terms once per cell, "
               "writes each row of cells' input rows from one row of cell values, then rewrites once each input "
               "that max levels chose")
    search_space = {"block_size_x": [1, 4, 16, 64]}
    default = {"block_size_x": 16}


class PyramidWindows(Variant):
    name = "pyramid_windows"
    summary = "multi-level: a work-item per output of any level reduces its whole window (no cells; always legal)"
    search_space = {"block_size_x": [32, 64, 128, 256, 512]}
    default = {"block_size_x": 256}
    runs_every_problem = True

    def groups(self, params, problem):
        return _ceil_div(problem.planes * pyramid.layout(problem).values_per_plane, params["block_size_x"])


class PyramidGather(Variant):
    name = "pyramid_gather"
    direction = "backward"
    summary = ("multi-level gather: each work-item writes one input gradient once, adding every level's terms "
               "in level order")
    search_space = {"block_size_x": [32, 64, 128, 256, 512, 1024]}
    default = {"block_size_x": 256}
    runs_every_problem = True

    def groups(self, params, problem):
        return _ceil_div(problem.planes * math.prod(problem.in_spatial), params["block_size_x"])


class PyramidCellsBackward(_CellVariant):
    name = "pyramid_cells"
    direction = "backward"
    summary = ("multi-level: a work-group per plane sums the average levels' terms once per cell into local "
               "memory, then writes its plane row by row (a max level's terms gathered per input)")
    search_space = {"block_size_x": [8, 16, 32, 64, 128, 256]}
    default = {"block_size_x": 64}

    def groups(self, params, problem):
        return problem.planes

    def local_mem_bytes(self, params, problem):
        return pyramid.cell_count(problem) * _acc_bytes(problem)


_FORWARD = (ThreadPerOutput(), ThreadPerRow(), BlockPerRow(), PlaneReduce(), SmemTiled(), ChannelsVector(),
            GlobalPlanes(), GlobalChannels(), GlobalBlocks(), GemPlanes(), GemPlaneWindows())
_BACKWARD = (ThreadPerInput(), SmemTiledBackward(), PlaneScatter(), ThreadPerRowBackward(), GlobalBroadcast(),
             ChannelsGather())
_SINGLE_LEVEL = {"forward": _FORWARD, "backward": _BACKWARD}
_MULTI_LEVEL = {"forward": (PyramidCells(), PyramidColumns(), PyramidStream(), PyramidRows(), PyramidChannels(),
                            PyramidWindows()),
                "backward": (PyramidCellsBackward(), PyramidStreamBackward(), PyramidRowsBackward(),
                             PyramidChannelsBackward(), PyramidGather())}


def _variants_of(op: str, direction: str) -> tuple:
    """The variants of ``op``'s ``direction``: the multi-level ones for multi-level ops, else the
    single-level ones that fit its operator (``Variant.fits``)."""
    if OPS[op].multi_level:
        return _MULTI_LEVEL[direction]
    return tuple(v for v in _SINGLE_LEVEL[direction] if v.fits(OPS[op]))


#: (op, direction) -> {variant name: Variant}, for every op and direction.
REGISTRY = {
    (op, direction): {v.name: v for v in _variants_of(op, direction)}
    for op in OPS
    for direction in DIRECTIONS
}


def variants_for(op: str, direction: str = "forward") -> dict:
    check_op(op, direction)
    return REGISTRY[(op, direction)]


def get_variant(op: str, name, direction: str = "forward", argument: str = "variant") -> Variant:
    table = variants_for(op, direction)
    if not isinstance(name, str):
        raise TypeError(f"{argument} must be a variant's name (a str), one of {sorted(table)} for {op} {direction}, "
                        f"got {type(name).__name__} {name!r}")
    if name not in table:
        raise ValueError(f"{argument} must be one of {sorted(table)} for {op} {direction}, got {name!r}")
    return table[name]


def _values(values: list) -> str:
    return "/".join(str(v) for v in values)


def markdown_table() -> str:
    """The variants as a Markdown table -- direction, variant, idea (``summary``), tuning parameters
    with their candidate values and default -- rendered from the registry: the one source of the
    table that docs/design.md prints ("The variant table"; ``tests/test_readme.py`` keeps that copy
    true).  A variant whose default adapts to the problem (``default_for``) says so; design.md says how."""
    lines = ["| direction | variant | idea | tuning parameters: values (default) |", "|---|---|---|---|"]
    for direction, table in (("forward", _FORWARD), ("backward", _BACKWARD)):
        for variant in table:
            parameters = "; ".join(f"`{name}` {_values(values)} ({variant.default[name]})"
                                   for name, values in variant.search_space.items())
            if type(variant).default_for is not Variant.default_for:
                parameters += "; the default adapts to the problem"
            lines.append(f"| {direction} | `{variant.name}` | {variant.summary} | {parameters} |")
    return "\n".join(lines)
