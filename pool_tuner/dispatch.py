"""Run-time dispatch: which variant and configuration runs a problem, and the ready kernel for it.

Decision order (each step is reported by ``explain`` as ``source``):

1. ``forced``  -- ``variant=`` and/or ``config=`` given by the caller (validated);
2. ``default`` -- the documented heuristic below.

The heuristic default: windows of at least ``LARGE_WINDOW`` elements with short output rows
(global pooling, squeeze-excitation, pyramid pooling's coarse levels) go to ``block_per_row`` with
its default configuration, where several lanes share each window; everything else goes to
``thread_per_output`` with its default configuration.

Decisions and built kernels are memoised in memory, so repeated calls do no file-system access and
no recompilation.
"""

from __future__ import annotations

import dataclasses
import math

from . import kernel_source
from . import variants as variants_mod
from .problem import Problem

LARGE_WINDOW = 32
SHORT_ROW = 4


@dataclasses.dataclass(frozen=True)
class Choice:
    variant: variants_mod.Variant
    params: tuple  # sorted (name, value) pairs: hashable
    source: str

    @property
    def config(self) -> dict:
        return dict(self.params)


@dataclasses.dataclass(frozen=True)
class Launch:
    """A built kernel and its grid: everything a call needs besides the buffers."""

    kernel: object
    groups: int
    block: tuple


def _largest_window(problem: Problem) -> int:
    return math.prod(variants_mod.max_window(i, o) for i, o in zip(problem.in_spatial, problem.out_spatial))


def heuristic_default(problem: Problem) -> variants_mod.Variant:
    table = variants_mod.variants_for(problem.op, problem.direction)
    if _largest_window(problem) >= LARGE_WINDOW and problem.out_spatial[-1] <= SHORT_ROW:
        return table["block_per_row"]
    return table["thread_per_output"]


def choose(problem: Problem, device, variant=None, config=None) -> Choice:
    """Decide variant and configuration for ``problem`` on ``device`` (validating forced ones)."""
    if variant is not None or config is not None:
        if variant is None:
            raise ValueError("config= needs variant= too: configurations belong to one variant")
        chosen = variants_mod.get_variant(problem.op, variant, problem.direction)
        params = chosen.check_config({} if config is None else config, problem, device.limits)
        return Choice(chosen, tuple(sorted(params.items())), "forced")
    chosen = heuristic_default(problem)
    params = chosen.check_config({}, problem, device.limits, name=f"default config of {chosen.name}")
    return Choice(chosen, tuple(sorted(params.items())), "default")


_LAUNCHES: dict = {}


def prepare(device, context, problem: Problem, choice: Choice) -> Launch:
    """The built kernel and grid for ``choice`` (memoised per context)."""
    key = (context, problem, choice.variant.name, choice.params)
    launch = _LAUNCHES.get(key)
    if launch is None:
        params = choice.config
        variant = choice.variant
        source = kernel_source.render(variant.template, variant.defines(params, problem))
        kernel = device.build(context, source, variant.kernel_name)
        block = variant.block(params)
        threads = block[0] * block[1]
        limit = device.kernel_work_group_limit(kernel)
        if threads > limit:
            raise ValueError(
                f"config {params} of variant {variant.name!r} needs work-groups of {threads}, but the "
                f"built kernel allows at most {limit} on {device.describe()}"
            )
        launch = _LAUNCHES[key] = Launch(kernel, variant.groups(params, problem), block)
    return launch


def describe(problem: Problem, device, choice: Choice) -> dict:
    return {
        "op": problem.op,
        "direction": problem.direction,
        "dtype": problem.dtype,
        "layout": problem.layout,
        "input_shape": list(problem.input_shape),
        "output_shape": list(problem.output_shape),
        "variant": choice.variant.name,
        "params": choice.config,
        "source": choice.source,
        "device": device.describe(),
        "index_bits": 64 if problem.index_64 else 32,
    }
