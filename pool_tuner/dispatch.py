"""Run-time dispatch: which variant and configuration runs a problem, and the ready kernel for it.

Decision order (each step is reported by ``explain`` as ``source``):

1. ``forced``  -- ``variant=`` and/or ``config=`` given by the caller (validated);
2. ``cache``   -- a tuning-cache record for exactly this problem, device and kernel code;
3. ``nearest`` -- the record of the nearest tuned shape (same device, op, dtype, layout and kernel
   code; distance = Euclidean distance of the log sizes), its configuration re-validated as legal
   for this shape; records that are not legal here are passed over;
4. ``default`` -- the documented heuristic below.

The caller may pass ``on_miss``, called when a problem has no exact record, or only a partial one
from an interrupted tuning, before its decision is memoised (``ops`` passes the tune-on-miss of
``POOL_TUNER_AUTOTUNE=1``, which says so on the ``pool_tuner`` logger, so that this module needs
nothing of the tuner, which builds on it); otherwise calls never block on tuning.

The heuristic default, always with the variant's default configuration for the problem
(``Variant.default_for``): on CPU devices, global pooling (every output size 1) goes to the
global-pooling variants where they measured faster on PoCL -- every backward pass to
``global_broadcast`` (a write stream: as fast as ``plane_scatter`` on large planes, faster on 7x7
ones, and legal in every dtype), channels-first average pooling to ``global_planes`` (lanes over
contiguous planes; faster than ``thread_per_output`` from 7x7 to 64x64 planes), and channels-last
pooling to ``global_channels`` (faster than ``channels_vector`` from 7x7 to 56x56 planes, average
and max); channels-first max pooling stays with ``thread_per_output``, whose unrolled small
windows and row lanes were faster.  Otherwise backward passes use ``plane_scatter`` on CPU devices
where it is legal (float32/float64: a work-item per plane, whose sequential scatter runs at memory
speed on a CPU), else ``thread_per_input``; channels-last forward passes use ``channels_vector`` (contiguous
channels per work-item); on CPU devices, channels-first average pooling with more than one output
row per plane and no upsampling along the rows' axes (T, H) goes to ``thread_per_row`` where it is
legal (input rows within its private-row limit): whole input rows per work-item, vectorised, 2-5x
faster than ``thread_per_output`` on PoCL for the suite's vgg16, alexnet and pyramid-pooling
layers, and slower for global pooling, max pooling and upsampling; on GPUs, windows of at least
``LARGE_WINDOW`` elements with short output rows (global pooling, squeeze-excitation, pyramid
pooling's coarse levels) go to ``block_per_row``, where several lanes share each window;
everything else goes to ``thread_per_output`` -- on CPUs, where work-group barriers are expensive,
one work-item per output vectorises best.

Decisions and built kernels are memoised in memory by one ``Dispatcher`` (the cache files are read
once, on the first miss of the memo), so repeated calls do no file-system access and no
recompilation; ``forget()`` clears all of it.  The module's functions are that dispatcher's methods.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

from . import cache as cache_mod
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
    record_key: str | None = None  # the cache record it came from (source cache/nearest)

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


def heuristic_default(problem: Problem, device) -> variants_mod.Variant:
    """The variant used when nothing was tuned (see the module docstring)."""
    table = variants_mod.variants_for(problem.op, problem.direction)
    if device.is_cpu and variants_mod.is_global(problem):
        if problem.direction == "backward":
            return table["global_broadcast"]
        if problem.channels_last:
            return table["global_channels"]
        if problem.kind == "avg":
            return table["global_planes"]
    if problem.direction == "backward":
        scatter = table["plane_scatter"]
        if device.is_cpu and scatter.is_legal({}, problem, device.limits):
            return scatter
        return table["thread_per_input"]
    if problem.channels_last:
        return table["channels_vector"]
    (ot, oh, _), (it, ih, _) = problem.out_spatial, problem.in_spatial
    if (device.is_cpu and problem.kind == "avg" and ot * oh > 1 and ot <= it and oh <= ih
            and table["thread_per_row"].is_legal({}, problem, device.limits)):
        return table["thread_per_row"]
    if device.is_gpu and _largest_window(problem) >= LARGE_WINDOW and problem.out_spatial[-1] <= SHORT_ROW:
        return table["block_per_row"]
    return table["thread_per_output"]


def default_choice(problem: Problem, device) -> Choice:
    """The heuristic default (never the cache): what tuning compares its winner against."""
    chosen = heuristic_default(problem, device)
    params = chosen.check_config({}, problem, device.limits, name=f"default config of {chosen.name}")
    return Choice(chosen, tuple(sorted(params.items())), "default")


def _choice_from_record(record: dict, problem: Problem, device, source: str) -> Choice | None:
    """The record's winner if it is a known variant and legal for ``problem`` here, else None."""
    best = record["best"]
    table = variants_mod.variants_for(problem.op, problem.direction)
    variant = table.get(best.get("variant"))
    if variant is None:
        return None
    try:
        params = variant.check_config(best.get("params", {}), problem, device.limits)
    except (TypeError, ValueError):
        return None
    return Choice(variant, tuple(sorted(params.items())), source, record["key"])


def _log_distance(a, b) -> float:
    return math.sqrt(sum((math.log(max(x, 1)) - math.log(max(y, 1))) ** 2 for x, y in zip(a, b)))


def _neighbours(problem: Problem, device, table) -> list:
    """Records of other shapes of the same op on the same device and kernel code, nearest first."""
    fingerprint, code = device.fingerprint, cache_mod.kernel_hash(problem)
    wanted = {"op": problem.op, "direction": problem.direction, "dtype": problem.dtype, "layout": problem.layout}

    def same_family(record):
        p = record["problem"]
        return (record["device"] == fingerprint and record["kernel_hash"] == code
                and all(p.get(k) == v for k, v in wanted.items())
                and len(p.get("input_shape", ())) == len(problem.input_shape))

    scored = []
    for record in table.candidates(same_family):
        p = record["problem"]
        distance = _log_distance(list(problem.input_shape) + list(problem.output_shape),
                                 list(p["input_shape"]) + list(p["output_shape"]))
        scored.append((distance, record))
    scored.sort(key=lambda pair: pair[0])
    return scored


def config_key(config: dict | None):
    """``config`` as a memo key, value types included: True == 1, but only one of them is a legal
    value, so a bad config never reuses a good one's validation.  Raises TypeError or
    AttributeError for what is not a dict of hashable values (the caller validates those)."""
    return None if config is None else tuple(sorted((name, type(value), value) for name, value in config.items()))


class Dispatcher:
    """The process's dispatch state: memoised decisions, validated forced choices, built kernels
    (``Launch`` per context) and the open tuning cache -- all cleared by ``forget()``."""

    def __init__(self):
        self._decisions: dict = {}
        #: Validated forced choices: checking a configuration costs ~100 us, as much as a small kernel.
        self._forced: dict = {}
        self._launches: dict = {}
        self._tuning_cache: cache_mod.TuningCache | None = None
        #: Memo tables of other modules whose entries hold decisions made here (``torch_cuda``'s
        #: plans): ``forget`` empties them whole, whatever it forgets.
        self._dependent_memos: list = []

    def register_dependent_memo(self, table: dict) -> None:
        """Have ``forget`` empty ``table`` too: its entries hold decisions of this dispatcher."""
        self._dependent_memos.append(table)

    def tuning_cache(self) -> cache_mod.TuningCache:
        """The process-wide tuning cache (shipped database + user cache), opened on first use."""
        if self._tuning_cache is None:
            self._tuning_cache = cache_mod.TuningCache(kernel_source.shipped_cache_dir())
        return self._tuning_cache

    def forget(self, problem: Problem | None = None, device=None) -> None:
        """Drop one problem's memoised decision on ``device``, so its next call consults the cache
        again (after tuning it); with no arguments drop everything -- decisions, forced choices,
        built kernels -- and re-open the tuning cache (e.g. after ``POOL_TUNER_CACHE_DIR`` changed).
        Dependent memo tables (``register_dependent_memo``) are emptied either way."""
        for table in self._dependent_memos:
            table.clear()
        if problem is None:
            self._decisions.clear()
            self._forced.clear()
            self._launches.clear()
            self._tuning_cache = None
        else:
            self._decisions.pop((device.id, problem), None)

    def choose(self, problem: Problem, device, variant=None, config=None, *, on_miss=None,
               memoise: bool = True) -> Choice:
        """Decide variant and configuration for ``problem`` on ``device`` (validating forced ones).

        ``on_miss(problem, device)``, when given, is called once a problem has no exact record,
        before its decision is memoised; when it returns true (it tuned the problem), the cache is
        consulted again.  ``memoise=False`` decides without remembering (``explain``), so that a
        later call still gets its ``on_miss``."""
        if variant is not None or config is not None:
            return self._forced_choice(problem, device, variant, config)
        memo_key = (device.id, problem)
        choice = self._decisions.get(memo_key)
        if choice is None:
            choice = self._from_cache(problem, device)
            untuned = choice.source != "cache" or cache_mod.is_partial(self.tuning_cache().lookup(choice.record_key))
            if untuned and on_miss is not None and on_miss(problem, device):
                choice = self._from_cache(problem, device)
            if memoise:
                self._decisions[memo_key] = choice
        return choice

    def _forced_choice(self, problem: Problem, device, variant, config) -> Choice:
        if variant is None:
            raise ValueError("config= needs variant= too: configurations belong to one variant")
        try:
            forced_key = (device.id, problem, variant, config_key(config))
            choice = self._forced.get(forced_key)
        except (TypeError, AttributeError):  # unhashable or not a dict: let validation explain
            forced_key, choice = None, None
        if choice is None:
            chosen = variants_mod.get_variant(problem.op, variant, problem.direction)
            params = chosen.check_config({} if config is None else config, problem, device.limits)
            choice = Choice(chosen, tuple(sorted(params.items())), "forced")
            if forced_key is not None:
                self._forced[forced_key] = choice
        return choice

    def _from_cache(self, problem: Problem, device) -> Choice:
        table = self.tuning_cache()
        key = cache_mod.cache_key(problem, device)
        record = table.lookup(key)
        if record is not None:
            choice = _choice_from_record(record, problem, device, "cache")
            if choice is not None:
                return choice
            warnings.warn(f"tuning-cache record {key} names a configuration that is not legal here; ignored",
                          cache_mod.CacheWarning, stacklevel=3)
        for _distance, neighbour in _neighbours(problem, device, table):
            choice = _choice_from_record(neighbour, problem, device, "nearest")
            if choice is not None:
                return choice
        return default_choice(problem, device)

    def prepare(self, device, context, problem: Problem, choice: Choice) -> Launch:
        """The built kernel and grid for ``choice`` (memoised per context)."""
        key = (context, problem, choice.variant.name, choice.params)
        launch = self._launches.get(key)
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
            launch = self._launches[key] = Launch(kernel, variant.groups(params, problem), block)
        return launch


DISPATCHER = Dispatcher()
choose = DISPATCHER.choose
prepare = DISPATCHER.prepare
forget = DISPATCHER.forget
tuning_cache = DISPATCHER.tuning_cache
register_dependent_memo = DISPATCHER.register_dependent_memo


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
        "cache_key": cache_mod.cache_key(problem, device),
        "record_key": choice.record_key,
        "index_bits": 64 if problem.index_64 else 32,
    }
