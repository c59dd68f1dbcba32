"""The kernel variants: their search spaces (as data), defaults, legality rules and launch shapes.

A variant is one way of mapping the outputs of a pooling problem onto work-items.  Each declares
its tuning parameters and their candidate values the way Kernel Tuner's examples do -- a dict of
lists -- plus a default configuration, a rule saying which configurations are legal for a given
problem on a given device, and the launch geometry (number of work-groups, work-group shape).
The tuner searches the space; dispatch validates whatever it is about to launch against
``check_config`` so a stale or hand-edited cache record can never launch an illegal kernel.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from .problem import Problem, check_op
from .windows import pooling_windows


@dataclasses.dataclass(frozen=True)
class DeviceLimits:
    """The device properties that decide whether a configuration can launch."""

    max_work_group_size: int
    local_mem_size: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def max_window(in_size: int, out_size: int) -> int:
    """Largest window along one axis (0 for an empty output)."""
    starts, ends = pooling_windows(in_size, out_size)
    return int((ends - starts).max(initial=0))


def _max_tile_extent(in_size: int, out_size: int, tile: int) -> int:
    """Largest input extent covered by the windows of ``tile`` consecutive outputs, over all tiles."""
    starts, ends = pooling_windows(in_size, out_size)
    first = np.arange(0, out_size, tile)
    last = np.minimum(first + tile, out_size) - 1
    return int((ends[last] - starts[first]).max(initial=0))


class Variant:
    """Base class; subclasses fill in the class attributes and the three methods."""

    name: str
    summary: str
    template = "pool_forward.c"
    kernel_name = "pool_forward"
    #: Tuning parameters and their candidate values, in Kernel Tuner's form.
    search_space: dict
    #: The configuration used when nothing was tuned (see ``dispatch``).
    default: dict

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

    # ------------------------------------------------------------------ shared logic

    def configurations(self):
        """Every point of the search space (legal or not), as dicts."""
        names = list(self.search_space)
        for values in itertools.product(*(self.search_space[n] for n in names)):
            yield dict(zip(names, values))

    def illegal_reason(self, params: dict, problem: Problem, limits: DeviceLimits) -> str | None:
        """Why ``params`` cannot run ``problem`` on a device with ``limits``; None when it can."""
        threads = math.prod(self.block(params))
        if threads > limits.max_work_group_size:
            return f"work-group of {threads} exceeds the device limit {limits.max_work_group_size}"
        local = self.local_mem_bytes(params, problem)
        if local > limits.local_mem_size:
            return f"needs {local} bytes of local memory, the device has {limits.local_mem_size}"
        return None

    def check_config(self, config, problem: Problem, limits: DeviceLimits, name: str = "config") -> dict:
        """Validate a user- or cache-supplied configuration; return it complete (defaults filled)."""
        if not isinstance(config, dict):
            raise TypeError(f"{name} must be a dict of tuning parameters, got {type(config).__name__}")
        unknown = sorted(set(config) - set(self.search_space))
        if unknown:
            raise ValueError(
                f"{name} has unknown parameters {unknown} for variant {self.name!r}; "
                f"allowed: {sorted(self.search_space)}"
            )
        params = {**self.default, **config}
        for key, value in params.items():
            if isinstance(value, bool) or value not in self.search_space[key]:
                raise ValueError(
                    f"{name}[{key!r}] must be one of {list(self.search_space[key])} for variant "
                    f"{self.name!r}, got {value!r}"
                )
        reason = self.extra_rule(params) or self.illegal_reason(params, problem, limits)
        if reason:
            raise ValueError(f"{name} {params} is not legal for variant {self.name!r} here: {reason}")
        return {k: int(v) for k, v in params.items()}

    def extra_rule(self, params: dict) -> str | None:
        """Relations between parameters that the search space alone does not express."""
        return None

    def defines(self, params: dict, problem: Problem) -> dict:
        """Every ``#define`` of this variant's kernel for ``problem``, tuning parameters last."""
        return {
            **problem.defines(),
            f"VARIANT_{self.name.upper()}": 1,
            **self.extra_defines(params, problem),
            **params,
        }


class ThreadPerOutput(Variant):
    name = "thread_per_output"
    summary = "each work-item reduces outputs_per_thread whole windows; neighbours write neighbours"
    search_space = {
        "block_size_x": [32, 64, 128, 256, 512, 1024],
        "outputs_per_thread": [1, 2, 4, 8],
    }
    default = {"block_size_x": 256, "outputs_per_thread": 1}

    def groups(self, params, problem):
        per_group = params["block_size_x"] * params["outputs_per_thread"]
        return _ceil_div(math.prod(problem.output_shape), per_group)


class BlockPerRow(Variant):
    name = "block_per_row"
    summary = "a work-group per output row; threads_per_output lanes split each window and tree-reduce"
    search_space = {
        "block_size_x": [32, 64, 128, 256, 512, 1024],
        "threads_per_output": [1, 2, 4, 8, 16, 32, 64],
    }
    default = {"block_size_x": 64, "threads_per_output": 4}

    def extra_rule(self, params):
        if params["threads_per_output"] > params["block_size_x"]:
            return "threads_per_output must not exceed block_size_x"
        return None

    def groups(self, params, problem):
        _, oh, _ = problem.out_spatial
        return problem.planes * problem.out_spatial[0] * oh

    def local_mem_bytes(self, params, problem):
        if params["threads_per_output"] == 1:
            return 0
        return params["block_size_x"] * np.dtype(problem.dtype).itemsize


class SmemTiled(Variant):
    name = "smem_tiled"
    summary = "a work-group stages the input under a tile of outputs in local memory, then reduces the tile"
    search_space = {
        "block_size_x": [4, 8, 16, 32, 64],
        "block_size_y": [1, 2, 4, 8, 16],
        "tile_x": [1, 2, 4],
        "tile_y": [1, 2, 4],
    }
    default = {"block_size_x": 8, "block_size_y": 8, "tile_x": 1, "tile_y": 1}

    @staticmethod
    def tile(params):
        return params["block_size_y"] * params["tile_y"], params["block_size_x"] * params["tile_x"]

    def stage_extent(self, params, problem) -> tuple[int, int, int]:
        (it, ih, iw), (ot, oh, ow) = problem.in_spatial, problem.out_spatial
        tile_h, tile_w = self.tile(params)
        return (max_window(it, ot), _max_tile_extent(ih, oh, tile_h), _max_tile_extent(iw, ow, tile_w))

    def groups(self, params, problem):
        _, oh, ow = problem.out_spatial
        tile_h, tile_w = self.tile(params)
        return problem.planes * problem.out_spatial[0] * _ceil_div(oh, tile_h) * _ceil_div(ow, tile_w)

    def local_mem_bytes(self, params, problem):
        return math.prod(self.stage_extent(params, problem)) * np.dtype(problem.dtype).itemsize

    def extra_defines(self, params, problem):
        st, sh, sw = self.stage_extent(params, problem)
        return {"STAGE_T": st, "STAGE_H": sh, "STAGE_W": sw}


_FORWARD = (ThreadPerOutput(), BlockPerRow(), SmemTiled())
#: (op, direction) -> {variant name: Variant}; every implemented op of ``problem.IMPLEMENTED``.
REGISTRY = {
    (op, "forward"): {v.name: v for v in _FORWARD}
    for op in ("adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d")
}


def variants_for(op: str, direction: str = "forward") -> dict:
    check_op(op, direction)
    return REGISTRY[(op, direction)]


def get_variant(op: str, name, direction: str = "forward", argument: str = "variant") -> Variant:
    table = variants_for(op, direction)
    if not isinstance(name, str) or name not in table:
        raise ValueError(f"{argument} must be one of {sorted(table)} for {op}, got {name!r}")
    return table[name]
