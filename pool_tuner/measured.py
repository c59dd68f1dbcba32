"""Measured dispatch: time the variants on a problem that no tuning covers, keep the fastest.

Like ``torch.backends.cudnn.benchmark``, and off by default: with ``POOL_TUNER_BENCHMARK=1`` (read
once, on first use) or ``pool_tuner.benchmark_mode(True)``, the first call of a signature whose
problem has no tuned record of its exact shape (``explain`` would say ``nearest`` or ``default``)
times each legal variant's rule configuration on the problem, refines the fastest, and runs the
winner from then on.

* Three stages (``measure``), each one build of its candidates and one interleaved race that
  includes the best so far:
  ``variants`` -- every variant of the op and direction that can run the problem, each with the
  configuration the default rules give it (the first rule for that variant that holds for the
  problem, over the variant's default), else its default; and where a nearest shape's tuned
  record decides the problem, that choice too (``candidates``);
  ``refine`` -- the one-parameter changes of the ``REFINE_VARIANTS`` fastest variants'
  configurations (``refinements``): a rule's configuration is fitted to a grid of other shapes,
  and on a CPU a work-group size or outputs per work-item alone can make a variant several times
  faster on the problem at hand;
  ``combine`` -- the changes that helped, together (``combined``).
  A few dozen builds and launches at most: a neighbourhood, not a search of the space (``tune``).
* The first call pays for it: each stage's candidates are built together
  (``dispatch.build_together``: one program for all where the kernel language allows, CUDA; one
  per variant on OpenCL C, see ``kernel_source.render_together``), then launched interleaved on
  the device's own queue, rounds of one launch each, medians (``time_interleaved``; at least
  ``MIN_ROUNDS`` rounds, more while within ``BUDGET_S``; a candidate whose warm-up launch took
  more than ``PRUNE`` times the fastest is not timed further).
* Never on the caller's data: the candidates run on scratch buffers of the problem's shape with
  random inputs (``scratch_arguments``), made and freed here; the caller's output is written once,
  by the winner, after the choice.  The choice is made before the first result is returned and then
  memoised, so a signature gives the same bits on every later call of the process.
* The winner is stored in the user cache as a *measured* record (``cache.is_measured``): its best
  and runners-up are the candidates with their times and stages, its ``measured`` field says how
  they were timed.  It decides its own problem on its own device, in this process and later ones (with the
  mode on or off, like any record of the user cache); any tuning of the problem outranks and
  replaces it (``cache.replaces``, ``dispatch._rank``), and ``POOL_TUNER_AUTOTUNE=1`` still tunes
  a problem that only has one.  ``explain`` names it: ``source`` ``measured`` and the candidates'
  times under ``measured``.

The mode is the process's (not a thread's): ``benchmark_mode`` sets it, and as a context manager
restores the previous mode on exit.  Signatures already called keep their decision when the mode
changes.  Measuring runs on the calling thread, one problem at a time per process; a thread that
waited for another's measurement of the same problem uses it.
"""

from __future__ import annotations

import numbers
import os
import threading
import time
import warnings

import numpy as np

from . import cache as cache_mod
from . import default_rules, dispatch, memo, pyramid, switches
from .problem import Problem
from .variants import variants_for
from .windows import pooling_windows

#: Set to "1" to measure, on a call's first use, a problem that no tuning covers.
BENCHMARK_ENV = "POOL_TUNER_BENCHMARK"
#: Rounds of interleaved launches (one per candidate each) timed at least, and at most.
MIN_ROUNDS, MAX_ROUNDS = 3, 15
#: Seconds of timing after which no further round starts (once MIN_ROUNDS are done).
BUDGET_S = 0.5
#: A candidate whose warm-up launch took more than this many times the fastest one's is not timed
#: further (``time_interleaved``): it cannot win, and slow candidates are most of a measurement's time.
PRUNE = 4.0
#: How many of the fastest variants the refinement stage refines, and how many one-parameter
#: changes of each it times at most.
REFINE_VARIANTS, REFINE_LIMIT = 2, 12

_mode: bool | None = None  # None: BENCHMARK_ENV not read yet
_mode_lock = threading.Lock()
#: Held while a problem is measured (one at a time, so that measurements do not time each other).
_MEASURING = threading.Lock()


def _after_fork_in_child() -> None:
    global _mode_lock, _MEASURING
    _mode_lock, _MEASURING = threading.Lock(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _from_environment() -> bool:
    """Whether BENCHMARK_ENV asks for the mode (``switches.switch``: off by default)."""
    return switches.switch(BENCHMARK_ENV, False, "measured dispatch", stacklevel=4)


def enabled() -> bool:
    """Whether measured dispatch is on: as last set by ``benchmark_mode``, else BENCHMARK_ENV
    (read on the first call of this function)."""
    global _mode
    if _mode is None:
        with _mode_lock:
            if _mode is None:
                _mode = _from_environment()
    return _mode


class BenchmarkMode:
    """What ``benchmark_mode`` returns: true when the mode is on; as a context manager, it restores
    the mode that was in force before the ``benchmark_mode`` call when the block ends."""

    def __init__(self, previous: bool, current: bool):
        self._previous, self._current = previous, current

    def __bool__(self) -> bool:
        return self._current

    def __eq__(self, other) -> bool:
        """Equal to the bool it is (``benchmark_mode() == False``, ``== 0`` where the mode is off)."""
        return self._current == other if isinstance(other, (numbers.Integral, BenchmarkMode)) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._current)

    def __repr__(self) -> str:
        return f"benchmark_mode({self._current})"

    def __enter__(self) -> BenchmarkMode:
        return self

    def __exit__(self, *exc_info) -> None:
        global _mode
        _mode = self._previous


def benchmark_mode(enabled_: bool | None = None) -> BenchmarkMode:
    """Measured dispatch for problems no tuning covers (like ``torch.backends.cudnn.benchmark``;
    see ``pool_tuner.measured``): ``benchmark_mode()`` says whether it is on (the result is true
    or false); ``benchmark_mode(True)`` / ``(False)`` turns it on or off for the process, and
    ``with benchmark_mode(True): ...`` for the block only.  Off by default; ``POOL_TUNER_BENCHMARK=1``
    turns it on from the start."""
    global _mode
    if enabled_ is not None and not isinstance(enabled_, bool):
        raise TypeError(f"benchmark_mode takes True, False or nothing, got {enabled_!r}")
    previous = enabled()
    if enabled_ is not None:
        _mode = enabled_
    return BenchmarkMode(previous, enabled())


def candidates(problem: Problem, device) -> list:
    """The choices a measurement times (``dispatch.Choice``, source ``measured``; ``rule`` the rule
    that gave the configuration, or None): every variant that can run ``problem`` on ``device``,
    with the configuration of the first default rule for that variant that holds for the problem
    (over the variant's default), else -- no such rule, or its configuration not legal here -- the
    variant's default.  Where a tuned record of a nearest shape decides the problem, its choice is
    a candidate too (``record_key`` names the record), so that measuring never runs something
    slower than what would have run without it."""
    values = default_rules.features(problem)
    rules = default_rules.rules(default_rules.device_type(device))
    found = []
    for variant in variants_for(problem.op, problem.direction).values():
        if not variant.is_legal({}, problem, device.info.limits):
            continue
        rule = next((r for r in rules if r.variant == variant.name and r.holds(values)), None)
        try:
            params = variant.check_config(dict(rule.config) if rule else {}, problem, device.info.limits)
        except ValueError:
            rule, params = None, variant.check_config({}, problem, device.info.limits)
        found.append(dispatch.Choice(variant, tuple(sorted(params.items())), "measured",
                                     rule=None if rule is None else rule.name))
    untuned = dispatch.choose(problem, device, memoise=False)
    if untuned.source == "nearest" and all((c.variant.name, c.params) != (untuned.variant.name, untuned.params)
                                           for c in found):
        found.append(dispatch.Choice(untuned.variant, untuned.params, "measured", record_key=untuned.record_key))
    return found


def _storage(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values in the device format of ``dtype`` (bfloat16 as its uint16 bits)."""
    if dtype == "bfloat16":
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(dtype)


def _first_positions(in_sizes: tuple, out_sizes: tuple) -> np.ndarray:
    """For each output of a pooled plane, the flat position (``h*W + w``) of the first element of
    its window: valid max indices, as a constant input would give them."""
    starts = np.meshgrid(*(pooling_windows(i, o)[0] for i, o in zip(in_sizes, out_sizes)), indexing="ij")
    return np.ravel_multi_index(starts, in_sizes).astype(np.int64)


def scratch_arguments(problem: Problem, rng) -> list:
    """Host arrays for the kernel's buffers of ``problem`` (in memory order, as ``ops`` passes
    them): random inputs (never the caller's), uninitialised outputs, valid indices for a max
    backward."""
    batch = problem.input_shape[:len(problem.input_shape) - problem.ndim]
    in_sizes = problem.input_shape[-problem.ndim:]
    selects, multi_level = problem.operation.selects, problem.operation.multi_level

    def random(count):
        return _storage(rng.uniform(-2.0, 2.0, count).astype(np.float32), problem.dtype)

    def logical_to_memory(array):
        if problem.channels_last:
            array = np.moveaxis(array, array.ndim - problem.ndim - 1, -1)
        return np.ascontiguousarray(array)

    def indices(out_sizes):
        return np.broadcast_to(_first_positions(in_sizes, tuple(out_sizes)), batch + tuple(out_sizes))

    storage = np.uint16 if problem.dtype == "bfloat16" else np.dtype(problem.dtype)
    input_memory = problem.memory_shape(problem.input_shape)
    if multi_level:
        lay = pyramid.layout(problem)
        values, positions = problem.planes * lay.values_per_plane, problem.planes * lay.indices_per_plane
        if problem.flow.reads_input:
            return [random(input_memory).reshape(input_memory), np.empty(values, storage)] + (
                [np.empty(positions, np.int64)] if selects else [])
        max_levels = [indices(spatial) for spatial, level_selects in zip(lay.spatial, lay.selects) if level_selects]
        return [random(values)] + ([pyramid.pack(problem, max_levels, positions=True)] if selects else []) + [
            np.empty(input_memory, storage)]
    output_memory = problem.memory_shape(problem.output_shape)
    if problem.flow.reads_input:
        return [random(input_memory).reshape(input_memory), np.empty(output_memory, storage)] + (
            [np.empty(output_memory, np.int64)] if selects else [])
    out_sizes = problem.output_shape[-problem.ndim:]
    return [random(output_memory).reshape(output_memory)] + (
        [logical_to_memory(indices(out_sizes))] if selects else []) + [np.empty(input_memory, storage)]


def time_interleaved(device, queue, launches: list, arguments: list, min_rounds: int, max_rounds: int | None = None,
                     budget_s: float | None = None, prune: float | None = None) -> tuple[list, int]:
    """Median kernel time (ms) of each ``dispatch.Launch`` on device ``arguments``, timed by the
    device (a timed ``launch``) in rounds of one launch of each, after one warm-up launch of each:
    ``min_rounds`` rounds, then more up to ``max_rounds`` while ``budget_s`` seconds of timing
    have not passed.  Interleaving makes a noisy machine hurt every candidate alike.  With
    ``prune``, a launch whose warm-up took more than ``prune`` times the fastest warm-up runs no
    rounds, and its warm-up time is its time: the device's timer leaves out the build that a
    first launch may include (PoCL generates a kernel's code then).  Returns the times and the
    number of rounds.  A launch of two passes (``dispatch.Launch.passes``) is timed as the sum of
    both, on a scratch buffer of its own."""
    scratch = [[device.empty((-(-launch.scratch_bytes // 8),), np.int64, queue)] if launch.scratch_bytes else []
               for launch in launches]

    def timed(i: int) -> float:
        launch = launches[i]
        return sum(device.launch(queue, step.kernel, step.groups, step.block,
                                 (*arguments, *scratch[i], *launch.scalars), timed=True) for step in launch.passes())

    warm = [timed(i) for i in range(len(launches))]
    timed_ones = [i for i, t in enumerate(warm) if prune is None or t <= prune * min(warm)]
    times = {i: [] for i in timed_ones}
    started, rounds = time.perf_counter(), 0
    while rounds < min_rounds or (rounds < (max_rounds or min_rounds)
                                  and time.perf_counter() - started < (budget_s or 0.0)):
        for i in timed_ones:
            times[i].append(timed(i))
        rounds += 1
    return [float(np.median(times[i])) if i in times else float(warm[i]) for i in range(len(launches))], rounds


def refinements(problem: Problem, device, choice) -> list:
    """One-parameter changes of ``choice``'s configuration (each other value of each parameter of
    its variant's search space, the rest kept) that are legal for ``problem`` on ``device``: the
    neighbourhood the refinement stage times, at most ``REFINE_LIMIT``."""
    variant, base = choice.variant, choice.config
    found = []
    for name, values in variant.search_space.items():
        for value in values:
            if value != base[name] and variant.is_legal(dict(base, **{name: value}), problem, device.info.limits):
                params = variant.check_config(dict(base, **{name: value}), problem, device.info.limits)
                found.append(dispatch.Choice(variant, tuple(sorted(params.items())), "measured"))
    return found[:REFINE_LIMIT]


def combined(problem: Problem, device, base, timed: list) -> list:
    """The configuration taking, for each parameter, the value of the fastest one-parameter change
    of ``base`` that beat it (``timed``: ``(choice, ms)`` of ``base`` and its changes), when it is a
    new, legal configuration: the combination of the changes that helped one at a time."""
    base_ms = next((ms for choice, ms in timed if choice == base), None)
    if base_ms is None:  # it did not run in that race
        return []
    params = base.config
    for name in base.variant.search_space:
        better = [(ms, choice.config[name]) for choice, ms in timed
                  if choice.variant is base.variant and ms < base_ms and choice.config[name] != base.config[name]]
        if better:
            params = dict(params, **{name: min(better)[1]})
    if params == base.config or sum(params[k] != base.config[k] for k in params) < 2:
        return []
    if not base.variant.is_legal(params, problem, device.info.limits):
        return []
    return [dispatch.Choice(base.variant, tuple(sorted(params.items())), "measured")]


class _Stages:
    """The measurement's state across its stages: what ran (entries), what failed, the rounds."""

    def __init__(self, problem: Problem, device, rng):
        self.problem, self.device, self.queue = problem, device, device.queue
        self.arguments = None
        self.rng = rng
        self.entries, self.failures, self.rounds = [], [], []
        self.build_seconds = 0.0

    def race(self, choices: list, stage: str) -> list:
        """Build ``choices`` together and time them interleaved; ``(choice, ms)`` of those that ran,
        each also kept as an entry of ``stage``."""
        started = time.perf_counter()
        context = self.queue.context
        failed = dispatch.DISPATCHER.build_together(self.device, context, self.problem, choices)
        launches, ready = [], []
        for i, choice in enumerate(choices):
            if i not in failed:
                try:
                    launches.append(dispatch.prepare(self.device, context, self.problem, choice))
                    ready.append(choice)
                except Exception as exc:  # noqa: BLE001 - a candidate that cannot launch is left out
                    failed[i] = exc
        self.failures += [{"variant": choices[i].variant.name, "params": choices[i].config, "stage": stage,
                           "error": f"{type(e).__name__}: {e}"} for i, e in sorted(failed.items())]
        self.build_seconds += time.perf_counter() - started
        if not launches:
            return []
        if self.arguments is None:
            self.arguments = [self.device.to_device(a, self.queue) for a in scratch_arguments(self.problem, self.rng)]
        times, rounds = time_interleaved(self.device, self.queue, launches, self.arguments, MIN_ROUNDS, MAX_ROUNDS,
                                         BUDGET_S, PRUNE)
        self.rounds.append(rounds)
        self.entries += [{"variant": c.variant.name, "params": c.config, "time_ms": t, "stage": stage,
                          **({"rule": c.rule} if stage == "variants" else {}),
                          **({"record": c.record_key} if c.record_key else {})} for c, t in zip(ready, times)]
        return list(zip(ready, times))

    def record(self, timed: list, started: float) -> dict:
        """The measured record (not stored) whose best is the fastest of ``timed`` (the last race's
        ``(choice, ms)``), every other entry a runner-up, fastest first."""
        best, best_ms = min(timed, key=lambda entry: entry[1])
        winner = next(e for e in reversed(self.entries) if (e["variant"], e["params"], e["time_ms"]) ==
                      (best.variant.name, best.config, best_ms))
        others = sorted((e for e in self.entries if e is not winner), key=lambda entry: entry["time_ms"])
        measured = {
            "rounds": self.rounds,
            "build_seconds": round(self.build_seconds, 3),
            "seconds": round(time.perf_counter() - started, 3),
        }
        code = cache_mod.record_kernel_hash(self.problem, self.device.info.fingerprint)
        return cache_mod.make_record(self.problem, self.device.info.fingerprint, code, best=winner,
                                     runners_up=others, extra={"measured": measured, "failures": self.failures})


def measure(problem: Problem, device, rng=None) -> dict | None:
    """Time ``problem``'s candidates on ``device`` (module docstring) and return the measured
    record of the fastest -- not stored -- or None when no candidate could be built and run (each
    such failure is in the record's ``failures``, and a ``RuntimeWarning`` when none ran).

    Three stages, each one build of its candidates (``dispatch.build_together``) and one
    interleaved race that includes the best so far: ``variants`` -- every candidate
    (``candidates``); ``refine`` -- the one-parameter changes (``refinements``) of the
    ``REFINE_VARIANTS`` fastest variants' configurations; ``combine`` -- for each of those, the
    changes that helped taken together (``combined``).  The winner is the fastest of the last race."""
    started = time.perf_counter()
    stages = _Stages(problem, device, rng or np.random.default_rng())
    timed = stages.race(candidates(problem, device), "variants")
    if not timed:
        warnings.warn(f"measured dispatch of {problem} on {device.info.describe()}: no candidate could be built "
                      f"({stages.failures}); the default rules decide", RuntimeWarning, stacklevel=3)
        return None
    leaders = []
    for choice, _ in sorted(timed, key=lambda entry: entry[1]):
        if all(choice.variant is not leader.variant for leader in leaders):
            leaders.append(choice)
    leaders = leaders[:REFINE_VARIANTS]
    changes = [change for leader in leaders for change in refinements(problem, device, leader)]
    timed = (stages.race(leaders + changes, "refine") if changes else []) or timed  # (none ran: the last race stands)
    combinations = [combination for leader in leaders for combination in combined(problem, device, leader, timed)]
    best = min(timed, key=lambda entry: entry[1])[0]
    timed = (stages.race([best] + combinations, "combine") if combinations else []) or timed
    return stages.record(timed, started)


def neighbourhoods(problem: Problem, device, variants: list | None = None) -> list:
    """What ``measure_neighbourhoods`` times: every candidate (of ``variants`` only, where given)
    and each one's one-parameter changes, in that order."""
    chosen = [c for c in candidates(problem, device) if variants is None or c.variant.name in variants]
    return chosen + [change for choice in chosen for change in refinements(problem, device, choice)]


def measure_neighbourhoods(problem: Problem, device, rng=None, variants: list | None = None) -> dict | None:
    """Like ``measure``, but in one stage, ``neighbourhoods``: every candidate (``candidates``) and
    the one-parameter changes of each (``refinements``), built together (one program on CUDA: one
    compile for them all) and timed in one interleaved race.  Every variant is refined, not only
    the fastest few, so each variant's time is near its best on the problem: what the default rules
    are derived from (``benchmarks/dispatch_grid.py --measure``), where ``measure`` serves a call.
    ``variants``: only these variants' (names; a quick check).  None when nothing could be built
    and run.  The built kernels are memoised until the race prepares them, so they must fit the
    memo's limit (``memo.limit``): a ValueError says so before anything is built, where they would
    otherwise be evicted and built again one program each."""
    started = time.perf_counter()
    stages = _Stages(problem, device, rng or np.random.default_rng())
    chosen = neighbourhoods(problem, device, variants)
    kernels = sum(1 if c.variant.second_pass(c.config, problem) is None else 2 for c in chosen)
    if kernels > memo.limit():
        raise ValueError(f"measuring {problem} builds {kernels} kernels, more than the memo's limit of {memo.limit()} "
                         f"holds: raise it ({memo.LIMIT_ENV} or pool_tuner.memo.set_limit)")
    timed = stages.race(chosen, "neighbourhoods")
    return stages.record(timed, started) if timed else None


def measure_on_miss(problem: Problem, device) -> bool:
    """The calls' measured dispatch (the tuner's ``tune_on_miss`` with the mode on): measure
    ``problem`` on ``device`` when no tuning or measurement of it decides it, store the record, and
    return True (dispatch then reads it); False when there was nothing to measure or nothing ran.
    A measurement that fails (scratch buffers that do not fit beside the caller's, a device
    error) is a ``RuntimeWarning`` and leaves the decision to the cache and rules: the mode is an
    optimisation, never a reason for a call to fail."""
    with _MEASURING:
        if dispatch.choose(problem, device, memoise=False).source in ("cache", "measured"):
            return True  # decided by a tuning, or measured by another thread while this one waited
        try:
            record = measure(problem, device)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            warnings.warn(f"measured dispatch of {problem} on {device.info.describe()} failed ({type(exc).__name__}: "
                          f"{exc}); the untuned decision stands", RuntimeWarning, stacklevel=2)
            return False
        if record is None:
            return False
        dispatch.tuning_cache().store(record)
        best = record["best"]
        dispatch.DISPATCHER.keep_only(problem, device.queue.context, best["variant"], best["params"])
    return True
