"""Autotuning with Kernel Tuner: search every variant's space, verify every configuration against the
float64 reference, race the winners against the default, and store the result in the tuning cache.

How failures are kept from aborting a run: Kernel Tuner raises on a configuration that fails to
compile, to launch (other than "too many resources") or to verify.  Our kernel-source generator
notes which configuration is being built; when ``tune_kernel`` raises, that configuration is
recorded as failed, excluded through the restrictions, and the run resumes from Kernel Tuner's
own (temporary) cache file, so nothing measured so far is repeated.  Failed configurations are
never selected.

Timing: Kernel Tuner's per-configuration ``times`` are reduced to their median.  The final
comparison -- each variant's best against the default configuration -- is re-measured by
``race``: interleaved launches on one queue, medians of many repetitions, so a noisy machine hurts
every candidate alike.  The default configuration races too, so the stored winner is never a
configuration of the default's variant that lost to it.  A search restricted with ``variants=``
to other variants stores the best of those, as asked, even if the default beat it; the reported
speed-up over the default (``TuneResult.speedup_over_default``, the CLI's last line) shows that.

Interruption (Ctrl-C): ``KeyboardInterrupt`` reaches us from inside Kernel Tuner's loop or a
PyOpenCL call, which neither catches it.  Kernel Tuner appends every configuration it measured to
its cache file as it goes, so the interrupted variant's measurements are read back from there;
``tune`` then stores the best configuration measured so far -- over the variants searched whole and
the interrupted one -- as a record marked ``"partial"`` (what was covered, timed by Kernel Tuner
alone, never raced against the default), unless the cache already holds a full tuning of the shape,
and raises ``TuningInterrupted``.  A later full tuning of the shape replaces a partial record; a
partial one never replaces a full one (``cache``).

Threads: tuning runs one problem at a time per process (``_TUNING``): Kernel Tuner's runs would
otherwise time each other's kernels on the same device, and two calls that miss the same shape
with ``POOL_TUNER_AUTOTUNE=1`` tune it once.  Where a device's tuning runs is its backend's
(``device_tuning.run``): an OpenCL tuning runs on the calling thread, every CUDA tuning on the
process's one CUDA tuning thread while the caller waits (``backends/cuda_tuning.py``: Kernel Tuner's
PyCUDA backend works on one thread only).  A device that cannot be tuned in this process
(``TuningUnavailable``: no nvcc, a driver older than the nvcc) makes ``tune`` raise and
``tune_on_miss`` warn and use the untuned decision.  Tuning changes nothing process-wide: Kernel Tuner's
cache file and the sources it writes of failing configurations go to a scratch directory of the
run (``_kernel_tuner_scratch``), never to the working directory, which stays where the
application's other threads expect it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import sys
import tempfile
import threading
import time
import warnings

import numpy as np

from . import backends, device_tuning, dispatch, measured, pyramid, reference, switches
from .backends.base import TuningUnavailable
from . import cache as cache_mod
from .problem import ELEMENT_BYTES, Problem, check_fits
from .variants import variants_for

#: Set to "1" to tune, on a call's first use, a problem that has no exact record (``tune_on_miss``).
AUTOTUNE_ENV = "POOL_TUNER_AUTOTUNE"
#: Search spaces with at most this many legal points are searched exhaustively by default.
BRUTE_FORCE_LIMIT = 30
#: Default budget for larger spaces: random sampling of this many configurations per variant.
DEFAULT_MAX_FEVALS = 24
#: Default time budget per variant, in seconds (sampling strategies only).
DEFAULT_TIME_LIMIT = 20.0
#: Kernel Tuner launches per configuration (median taken) and race repetitions per candidate.
ITERATIONS = 9
RACE_REPETITIONS = 25

#: Held while a problem is tuned (see the module docstring).
_TUNING = threading.RLock()


def _after_fork_in_child() -> None:
    """A forked child gets a free tuning lock: a thread of the parent may have held it."""
    global _TUNING
    _TUNING = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

#: Where ``autotune`` says that a call is tuning its shape, at WARNING level (``_speaker``).
log = logging.getLogger("pool_tuner")

#: Verification tolerances per dtype (float16/bfloat16: a few units of their epsilon).
TOLERANCES = {
    "float32": dict(rtol=1e-5, atol=1e-6),
    "float64": dict(rtol=1e-12, atol=1e-12),
    "float16": dict(rtol=2e-3, atol=2e-3),
    "bfloat16": dict(rtol=1.6e-2, atol=1.6e-2),
}


@dataclasses.dataclass
class VariantResult:
    variant: str
    best_params: dict | None
    best_time_ms: float | None  # race median of the best configuration (Kernel Tuner's in a partial result)
    evaluated: int
    failures: list  # [{"params": ..., "error": ...}]
    seconds: float
    #: Why the variant cannot run the problem at all (its refusal of its default configuration), or None.
    not_applicable: str | None = None
    #: Whether the time limit ended the search before its evaluation budget (``time_limit``).
    cut_short: bool = False


@dataclasses.dataclass
class TuneResult:
    problem: Problem
    device: str
    variants: list  # of VariantResult
    best_variant: str
    best_params: dict
    best_time_ms: float
    default_variant: str
    default_params: dict
    default_time_ms: float
    seconds: float
    cache_key: str
    stored: bool
    #: What an interrupted tuning covered (the record's ``"partial"`` field), None for a full one.
    partial: dict | None = None
    #: Why the record was not stored (``stored`` False), or None.
    not_stored: str | None = None
    #: The cache record of this tuning, as ``store`` writes it (also when it was not stored): what a
    #: fleet worker sends back to the driver, which stores it in its own cache (``fleet``).
    record: dict | None = None

    @property
    def speedup_over_default(self) -> float | None:
        """Default time over the winner's (None for a partial result: the default was not timed)."""
        return None if self.default_time_ms is None else self.default_time_ms / self.best_time_ms

    @property
    def kept_default(self) -> bool:
        """Whether the winner is the default rules' choice itself."""
        return (self.best_variant, self.best_params) == (self.default_variant, self.default_params)


class TuningInterrupted(KeyboardInterrupt):
    """Ctrl-C while tuning.  ``tune`` stored what had been measured first (see the module
    docstring); ``result`` is that partial ``TuneResult``, or None when nothing had been measured."""

    def __init__(self, message: str, result: TuneResult | None = None):
        super().__init__(message)
        self.result = result


class _SearchInterrupted(KeyboardInterrupt):
    """Ctrl-C during one variant's search, carrying ``tune_variant``'s result over what it measured."""

    def __init__(self, measured: tuple):
        super().__init__()
        self.measured = measured


def _space_key(params: dict) -> tuple:
    return tuple(sorted(params.items()))


@dataclasses.dataclass
class Case:
    """Kernel arguments for one problem (host arrays in memory order, outputs NaN-poisoned) and
    the reference answers, in Kernel Tuner's form (None for arguments that are not outputs)."""

    args: list
    answer: list
    dtype: str

    def verify(self, answer, result_host, atol=None) -> bool:
        for expected, got in zip(self.answer, result_host):
            if expected is None:
                continue
            got = np.asarray(got).reshape(expected.shape)
            if expected.dtype == np.int64:
                if not np.array_equal(got, expected):
                    return False
                continue
            got = _widen(got, self.dtype)
            if np.isnan(got).any() or not np.allclose(got, expected, **TOLERANCES[self.dtype]):
                return False
        return True


def _widen(values: np.ndarray, dtype: str) -> np.ndarray:
    """Device-format floats as float64 (bfloat16 travels as uint16 bits)."""
    if dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return values.astype(np.float64)


def _narrow(values: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values in the device format of ``dtype`` (bfloat16 as uint16 bits, truncated)."""
    if dtype == "bfloat16":
        return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(dtype)


def make_case(problem: Problem, rng) -> Case:
    """Random inputs (never zero) for ``problem``, poisoned outputs and the reference answers."""
    def memory(a):
        if problem.channels_last:
            a = np.moveaxis(a, len(problem.input_shape) - problem.ndim - 1, -1)
        return np.ascontiguousarray(a)

    def random(shape):
        device_values = _narrow(rng.uniform(0.5, 2.0, shape) * rng.choice([-1.0, 1.0], shape), problem.dtype)
        return device_values, _widen(device_values, problem.dtype)

    poison = _narrow(np.full(1, np.nan), problem.dtype)[0]
    if problem.operation.multi_level:
        return _multi_level_case(problem, random, poison, rng)
    output_size = problem.output_size
    if problem.flow.reads_input:
        x, x_exact = random(problem.input_shape)
        out = np.full(problem.memory_shape(problem.output_shape), poison)
        if not problem.operation.selects:
            expected = reference.forward(problem.op, x_exact, output_size)
            return Case([memory(x), out], [None, memory(expected)], problem.dtype)
        values, indices = reference.forward(problem.op, x_exact, output_size)
        poisoned_indices = np.full(out.shape, np.iinfo(np.int64).min)
        return Case([memory(x), out, poisoned_indices], [None, memory(values), memory(indices)], problem.dtype)
    grad, grad_exact = random(problem.output_shape)
    grad_in = np.full(problem.memory_shape(problem.input_shape), poison)
    if not problem.operation.selects:
        expected = reference.backward(problem.op, grad_exact, problem.input_shape)
        return Case([memory(grad), grad_in], [None, memory(expected)], problem.dtype)
    _, indices = reference.forward(problem.op, rng.standard_normal(problem.input_shape), output_size)
    expected = reference.backward(problem.op, grad_exact, problem.input_shape, indices)
    return Case([memory(grad), memory(indices), grad_in], [None, None, memory(expected)], problem.dtype)


def _multi_level_case(problem: Problem, random, poison, rng) -> Case:
    """``make_case`` of a multi-level op: every level's values (and the max levels' indices) in the
    flat buffers its kernels use (pool_tuner.pyramid)."""
    layout = pyramid.layout(problem)
    planes = problem.planes
    values_shape, indices_shape = (planes * layout.values_per_plane,), (planes * layout.indices_per_plane,)
    selects = problem.operation.selects
    memory_order = functools.partial(np.moveaxis, source=len(problem.input_shape) - problem.ndim - 1, destination=-1)

    def memory(a):
        return np.ascontiguousarray(memory_order(a) if problem.channels_last else a)

    if problem.flow.reads_input:
        x, x_exact = random(problem.input_shape)
        values, indices = reference.forward(problem.op, x_exact, problem.output_size)
        args = [memory(x), np.full(values_shape, poison)]
        answer = [None, pyramid.pack(problem, values)]
        if selects:
            args.append(np.full(indices_shape, np.iinfo(np.int64).min))
            answer.append(pyramid.pack(problem, indices, positions=True))
        return Case(args, answer, problem.dtype)
    _, indices = reference.forward(problem.op, rng.standard_normal(problem.input_shape), problem.output_size)
    per_level = [random(problem.input_shape[:len(problem.input_shape) - problem.ndim] + tuple(spatial))
                 for spatial in layout.spatial]
    expected = reference.backward(problem.op, [exact for _, exact in per_level], problem.input_shape, indices)
    args = [pyramid.pack(problem, [device for device, _ in per_level])]
    if selects:
        args.append(pyramid.pack(problem, indices, positions=True))
    args.append(np.full(problem.memory_shape(problem.input_shape), poison))
    return Case(args, [None] * (len(args) - 1) + [memory(expected)], problem.dtype)


def _search_plan(n_legal: int, strategy=None, max_fevals=None) -> tuple[str, int]:
    """The Kernel Tuner strategy for a space of ``n_legal`` legal configurations and how many of them
    it evaluates at most.  By default small spaces are searched whole (``brute_force``; budgets then
    have nothing to bound), larger ones sampled (``random_sample``, ``DEFAULT_MAX_FEVALS``)."""
    if strategy is None:
        strategy = "brute_force" if n_legal <= BRUTE_FORCE_LIMIT else "random_sample"
    if strategy == "brute_force":
        return strategy, n_legal
    return strategy, min(max_fevals or DEFAULT_MAX_FEVALS, n_legal)


def check_search_options(strategy=None, max_fevals=None, time_limit=None,
                         names=("strategy", "max_fevals", "time_limit")) -> None:
    """Refuse search options that would fail only after minutes of tuning (an unknown strategy, a
    budget of nothing) or that Kernel Tuner would take silently (a negative or NaN time limit, under
    which every configuration fails).  ``names`` are the options as the caller spells them (the
    command line's ``--max-fevals``)."""
    strategy_name, fevals_name, limit_name = names
    if strategy is not None:
        from kernel_tuner.interface import strategy_map

        if strategy not in strategy_map:
            raise ValueError(f"{strategy_name} must be a Kernel Tuner strategy, one of {sorted(strategy_map)}; "
                             f"got {strategy!r}")
    if max_fevals is not None and (isinstance(max_fevals, bool) or not isinstance(max_fevals, int) or max_fevals < 1):
        raise ValueError(f"{fevals_name} must be a positive integer, got {max_fevals!r}")
    if time_limit is not None and (isinstance(time_limit, bool) or not isinstance(time_limit, (int, float))
                                   or not math.isfinite(time_limit) or time_limit <= 0):
        raise ValueError(f"{limit_name} must be a positive number of seconds, got {time_limit!r}")
    if strategy == "brute_force" and (max_fevals or time_limit):
        raise ValueError(f"{fevals_name}/{limit_name} need a sampling strategy (e.g. {strategy_name} random_sample); "
                         f"brute_force evaluates every configuration")


def check_tunable(problem: Problem, device, variants: list, names=("input_shape", "output_size", "variants")) -> None:
    """Refuse, before anything is built, a problem that ``device`` cannot tune: one whose
    buffers (its inputs and results, which a tuning run holds together) do not fit the device
    (``problem.check_fits`` for the results), or that none of ``variants`` (the variant objects to
    search, at least one) can run there, each with its reason.  ``names``: the problem's input
    shape, its output size and the variants as the caller spells them (the command line's
    ``--input``, ``--output``, ``--variants``)."""
    shape_name, size_name, variants_name = names
    if not variants:
        raise ValueError(f"{variants_name} must name at least one variant to tune")
    check_fits(problem, device, (size_name, shape_name))
    info = device.info
    values, _ = problem.operation.output_counts(problem.input_shape, problem.output_shape)
    read = (math.prod(problem.input_shape) if problem.flow.reads_input else values) * ELEMENT_BYTES[problem.dtype]
    if read > info.max_allocation_bytes:
        raise ValueError(f"{shape_name} {problem.input_shape}: the problem's input ({read / 2**30:.3g} GiB) is more than "
                         f"{info.describe()} can hold in one buffer ({info.max_allocation_bytes / 2**30:.3g} GiB)")
    limits = info.limits
    if not any(variant.legal_configurations(problem, limits) for variant in variants):
        reasons = "; ".join(f"{v.name}: {_refusal(v, problem, limits)}" for v in variants)
        what = f"{problem.op} {problem.direction} {problem.input_shape} -> {problem.output_shape} {problem.layout}"
        raise ValueError(f"{variants_name}: no variant can run {what} on {info.describe()} ({reasons})")


def tune_variant(variant, problem: Problem, device, *, strategy=None, max_fevals=None, time_limit=None,
                 iterations=ITERATIONS, rng=None, quiet=True) -> tuple[dict | None, float | None, int, list]:
    """Search one variant's space with Kernel Tuner, where the device tunes (``device_tuning.run``).
    Returns ``(best params, Kernel Tuner's median time in ms, configurations evaluated, failures)``."""
    return device_tuning.run(device, lambda: _tune_variant(variant, problem, device, strategy, max_fevals, time_limit,
                                                          iterations, rng, quiet))


def _tune_variant(variant, problem: Problem, device, strategy, max_fevals, time_limit, iterations, rng,
                  quiet) -> tuple[dict | None, float | None, int, list]:
    from kernel_tuner import tune_kernel

    rng = rng or np.random.default_rng()
    # Kernel Tuner launches one kernel per configuration: configurations of two passes
    # (Variant.second_pass) are left to the race, where the default may be one.
    legal = [p for p in variant.legal_configurations(problem, device.info.limits)
             if variant.second_pass(p, problem) is None]
    if not legal:
        return None, None, 0, []
    legal_keys = {_space_key(p) for p in legal}
    case = make_case(problem, rng)

    failures: dict = {}
    building = {}

    def generate(params):
        building["params"] = {k: int(v) for k, v in params.items()}
        return variant.program(building["params"], problem)

    names = list(variant.search_space)

    def restriction(params):
        if not isinstance(params, dict):  # a one-parameter space: Kernel Tuner passes the bare value
            params = {names[0]: params}
        key = _space_key({k: int(v) for k, v in params.items()})
        return key in legal_keys and key not in failures

    if strategy == "brute_force" and (max_fevals or time_limit):
        raise ValueError("max_fevals/time_limit need a sampling strategy (e.g. strategy='random_sample'); "
                         "brute_force evaluates every configuration")
    strategy, evaluations = _search_plan(len(legal), strategy, max_fevals)
    options = {}
    if strategy != "brute_force":
        options["max_fevals"] = evaluations
        options["time_limit"] = time_limit or DEFAULT_TIME_LIMIT

    results = []
    with tempfile.TemporaryDirectory(prefix="pool_tuner_kt_") as scratch, _kernel_tuner_scratch(scratch):
        kt_cache = os.path.join(scratch, "kernel_tuner_cache.json")
        try:
            while len(failures) < len(legal):
                building.clear()
                try:
                    results, _env = tune_kernel(
                        variant.kernel_name, generate, lambda p: (variant.groups(p, problem), 1),
                        [*case.args, *problem.scalars], {k: list(v) for k, v in variant.search_space.items()},
                        grid_div_x=[], grid_div_y=[], restrictions=restriction,
                        answer=[*case.answer, *(None for _ in problem.scalars)], verify=case.verify,
                        **device_tuning.kernel_tuner_arguments(device), defines={}, iterations=iterations,
                        strategy=strategy, strategy_options=options or None, cache=kt_cache, quiet=quiet,
                        verbose=False,
                    )
                    break
                except Exception as exc:  # noqa: BLE001 - any failure of one configuration
                    params = building.get("params")
                    if params is None or _space_key(params) in failures:
                        raise
                    failures[_space_key(params)] = f"{type(exc).__name__}: {exc}".strip()[:500]
        except KeyboardInterrupt:
            raise _SearchInterrupted(_best_measured(_measured_so_far(kt_cache), variant, failures)) from None
    return _best_measured(results, variant, failures)


def _measured_so_far(kt_cache: str) -> list:
    """The configurations in Kernel Tuner's cache file, which it appends to after each one (and
    leaves unclosed when interrupted, which its reader allows); none if there is no readable file."""
    from kernel_tuner.util import read_cache

    try:
        return list(read_cache(kt_cache, open_cache=False)["cache"].values())
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _best_measured(results: list, variant, failures: dict) -> tuple[dict | None, float | None, int, list]:
    """``tune_variant``'s result over Kernel Tuner's ``results``: the best of the configurations
    measured and not failed, by their median time."""
    measured = [r for r in results if isinstance(r.get("times"), list) and r.get("times")
                and _space_key({k: int(r[k]) for k in variant.search_space}) not in failures]
    failure_list = [{"params": dict(k), "error": e} for k, e in failures.items()]
    if not measured:
        return None, None, len(results), failure_list
    best = min(measured, key=lambda r: float(np.median(r["times"])))
    best_params = {k: int(best[k]) for k in variant.search_space}
    return best_params, float(np.median(best["times"])), len(measured), failure_list


@contextlib.contextmanager
def _kernel_tuner_scratch(directory: str):
    """Have Kernel Tuner put its temporary files (the source of a configuration that fails to
    compile, kept for its error message) in ``directory``: it names them with
    ``kernel_tuner.util.get_temp_filename``, in the working directory.  Replacing that function for
    the run (tuning runs one at a time, ``_TUNING``) keeps them out of the application's directory
    without ``os.chdir``, which would move every thread's working directory."""
    from kernel_tuner import util

    def in_scratch(suffix=None):
        handle, path = tempfile.mkstemp(suffix=suffix, prefix="temp_", dir=directory)
        os.close(handle)
        return path

    original = util.get_temp_filename
    util.get_temp_filename = in_scratch
    try:
        yield
    finally:
        util.get_temp_filename = original


def race(problem: Problem, device, choices: list, repetitions: int = RACE_REPETITIONS, rng=None) -> list:
    """Median kernel time (ms) of each choice, launched interleaved on one queue and timed by the
    device (a timed ``launch``), where the device tunes (``device_tuning.run``)."""
    return device_tuning.run(device, lambda: _race(problem, device, choices, repetitions, rng))


def _race(problem: Problem, device, choices: list, repetitions: int, rng) -> list:
    rng = rng or np.random.default_rng()
    queue = device.queue
    arrays = [device.to_device(a, queue) for a in make_case(problem, rng).args]
    launches = [dispatch.prepare(device, queue.context, problem, c) for c in choices]
    return measured.time_interleaved(device, queue, launches, arrays, repetitions)[0]


def tune(op, input_shape, output_size, dtype="float32", layout=None, device=None, *, direction="forward", variants=None,
         strategy=None, max_fevals=None, time_limit=None, iterations=ITERATIONS, store=True,
         tuning_cache=None, quiet=True, progress=None) -> TuneResult:
    """Tune every variant (or ``variants``) of ``op`` for one problem on one device and store the
    winner in the tuning cache.  See the module docstring for how failures and timing are handled.

    ``strategy`` is a Kernel Tuner strategy name (default: ``brute_force`` for spaces of at most
    ``BRUTE_FORCE_LIMIT`` legal points, else ``random_sample``); ``max_fevals`` and ``time_limit``
    (seconds per variant) bound the sampling strategies.  ``progress(variant_name)`` is called after
    each variant is searched.  One problem is tuned at a time per process (the module docstring)."""
    dev = backends.resolve_device(device)

    def one_at_a_time():
        with _TUNING:
            return _tune(op, input_shape, output_size, dtype, layout, dev, direction=direction, variants=variants,
                         strategy=strategy, max_fevals=max_fevals, time_limit=time_limit, iterations=iterations,
                         store=store, tuning_cache=tuning_cache, quiet=quiet, progress=progress)

    return device_tuning.run(dev, one_at_a_time)


def _tune(op, input_shape, output_size, dtype, layout, device, *, direction, variants, strategy, max_fevals,
          time_limit, iterations, store, tuning_cache, quiet, progress) -> TuneResult:
    started = time.perf_counter()
    check_search_options(strategy, max_fevals, time_limit)
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be a positive integer (timed runs per configuration), got {iterations!r}")
    dev = backends.resolve_device(device)
    problem = Problem.create(op, input_shape, output_size, dtype, layout, direction=direction)
    if problem.is_empty:
        raise ValueError(f"output_size {output_size!r} gives an empty output {problem.output_shape}: nothing to tune")
    table = variants_for(problem.op, problem.direction)
    if not table:
        raise ValueError(f"{op} {direction} runs no variant but its own kernel ({problem.operation.backward_kernel}) in "
                         f"one configuration: nothing to tune")
    if isinstance(variants, str):  # list("smem_tiled") would be its letters
        raise TypeError(f"variants must be a list of variant names, got the str {variants!r} (write [{variants!r}])")
    names = list(table) if variants is None else list(variants)
    for name in names:
        if name not in table:
            raise ValueError(f"variants must name variants of {op} {direction}, one of {sorted(table)}; got {name!r}")
    check_tunable(problem, dev, [table[name] for name in names])
    rng = np.random.default_rng()
    tc = tuning_cache or dispatch.tuning_cache()
    default = dispatch.default_choice(problem, dev)
    options = dict(strategy=strategy, max_fevals=max_fevals, time_limit=time_limit, iterations=iterations, rng=rng,
                   quiet=quiet)

    results = []
    try:
        for name in names:
            results.append(_search(table[name], problem, dev, options))
            if progress is not None:
                progress(name)
        tuned = [r for r in results if r.best_params is not None]
        if not tuned:
            refused = {r.variant: r.not_applicable for r in results if r.not_applicable}
            raise RuntimeError(f"no configuration of any variant ran correctly for {problem} on {dev.info.describe()}; "
                               f"failures: {[f for r in results for f in r.failures][:3]}"
                               + (f"; not applicable here: {refused}" if refused else ""))
        candidates = [dispatch.Choice(table[r.variant], _space_key(r.best_params), "cache") for r in tuned]
        times = race(problem, dev, candidates + [default], rng=rng)
    except KeyboardInterrupt as stop:
        interrupted = getattr(stop, "result", None)  # the variant whose search was cut short
        raise _keep_partial(problem, dev, names, results, interrupted, default, tc if store else None,
                            started) from None
    default_ms = times[-1]
    for r, t in zip(tuned, times):
        r.best_time_ms = t
        # The default is a point of its variant's space, raced alongside: if the search's pick lost
        # to it, the default is that variant's best.
        if r.variant == default.variant.name and default_ms < t:
            r.best_params, r.best_time_ms = default.config, default_ms
    default_entry = {"variant": default.variant.name, "params": default.config, "time_ms": default_ms}
    return _finish(problem, dev, results, default, default_entry, tc if store else None, started)


def _search(variant, problem: Problem, dev, options: dict) -> VariantResult:
    """One variant's search as a ``VariantResult`` (best time: Kernel Tuner's median, until raced)."""
    t0 = time.perf_counter()
    limits = dev.info.limits
    if not variant.legal_configurations(problem, limits):
        return VariantResult(variant.name, None, None, 0, [], 0.0, not_applicable=_refusal(variant, problem, limits))
    try:
        params, kt_ms, evaluated, failures = tune_variant(variant, problem, dev, **options)
        seconds = time.perf_counter() - t0
        strategy, budget = _search_plan(len(variant.legal_configurations(problem, limits)), options["strategy"],
                                        options["max_fevals"])
        cut_short = (strategy != "brute_force" and evaluated + len(failures) < budget
                     and seconds >= (options["time_limit"] or DEFAULT_TIME_LIMIT))
        return VariantResult(variant.name, params, kt_ms, evaluated, failures, seconds, cut_short=cut_short)
    except (ValueError, TypeError):  # our own argument errors (e.g. a budget with brute_force)
        raise
    except _SearchInterrupted as stop:
        stop.result = VariantResult(variant.name, *stop.measured, time.perf_counter() - t0)
        raise
    except Exception as exc:  # the search itself broke: the other variants still count
        error = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"tuning variant {variant.name!r} of {problem.op} {problem.direction} failed and is left out: "
                      f"{error}", RuntimeWarning, stacklevel=3)
        params, kt_ms, evaluated, failures = None, None, 0, [{"params": None, "error": error}]
    return VariantResult(variant.name, params, kt_ms, evaluated, failures, time.perf_counter() - t0)


def _refusal(variant, problem: Problem, limits) -> str:
    """Why ``variant`` has no legal configuration for ``problem``: its refusal of its default
    configuration (variants refuse a problem as a whole, e.g. plane_reduce all but global pooling)."""
    return (variant.refusal(dict(variant.default_for(problem)), problem, limits)
            or "no configuration of its search space is legal for this problem")


def _finish(problem: Problem, dev, results: list, default, default_entry: dict, tc, started: float,
            partial: dict | None = None) -> TuneResult:
    """Store the best of ``results`` (in ``tc``, unless it is None) and return the ``TuneResult``."""
    tuned = sorted((r for r in results if r.best_params is not None), key=lambda r: r.best_time_ms)
    winner = tuned[0]
    key = cache_mod.cache_key(problem, dev)
    record = cache_mod.make_record(
        problem, dev.info.fingerprint, cache_mod.record_kernel_hash(problem, dev.info.fingerprint),
        best={"variant": winner.variant, "params": winner.best_params, "time_ms": winner.best_time_ms},
        runners_up=[{"variant": r.variant, "params": r.best_params, "time_ms": r.best_time_ms} for r in tuned[1:]],
        extra={"default": default_entry,
               "failures": [dict(f, variant=r.variant) for r in results for f in r.failures],
               "tuning_seconds": round(time.perf_counter() - started, 3),
               "verified": sum(r.evaluated for r in tuned),
               **({} if partial is None else {"partial": partial})},
    )
    stored, not_stored = False, "not asked to store"
    if tc is not None:
        stored = tc.store(record)
        dispatch.forget(problem, dev)
        existing = tc.lookup(key)
        not_stored = (None if stored else "the cache could not be written" if existing is None
                      or cache_mod.replaces(record, existing, faster_only=False)
                      else "the cache holds a tuning of this problem that verified more (variants, configurations)")
    return TuneResult(problem, dev.info.describe(), results, winner.variant, winner.best_params, winner.best_time_ms,
                      default.variant.name, default.config, default_entry["time_ms"], time.perf_counter() - started,
                      key, stored, partial, not_stored, record)


def _title(problem: Problem) -> str:
    """``adaptive_avg_pool2d forward float32 NCHW 2x3x5x7 -> 2x3x3x4``: the problem, for messages."""
    return (f"{problem.op} {problem.direction} {problem.dtype} {problem.layout} "
            f"{'x'.join(map(str, problem.input_shape))} -> {'x'.join(map(str, problem.output_shape))}")


def _keep_partial(problem: Problem, dev, names: list, results: list, interrupted: VariantResult | None, default, tc,
                  started: float) -> TuningInterrupted:
    """After Ctrl-C: store the best configuration measured so far as a partial record (unless the
    cache holds a full tuning of the problem) and return the ``TuningInterrupted`` to raise."""
    what = _title(problem)
    searched = [r.variant for r in results]
    results = results + ([interrupted] if interrupted is not None else [])
    if not any(r.best_params is not None for r in results):
        return TuningInterrupted(f"tuning {what} was interrupted before a configuration had been measured; "
                                 f"nothing of it stored")
    partial = {
        "variants_searched": searched,
        "variant_interrupted": None if interrupted is None else interrupted.variant,
        "variants_not_searched": names[len(results):],
        "timing": "Kernel Tuner's medians; not raced against the default",
    }
    existing = None if tc is None else tc.lookup(cache_mod.cache_key(problem, dev))
    if existing is not None and not cache_mod.is_partial(existing):
        tc = None  # a full tuning is worth more than an interrupted one
    default_entry = {"variant": default.variant.name, "params": default.config, "time_ms": None}
    result = _finish(problem, dev, results, default, default_entry, tc, started, partial)
    if result.stored:
        kept = (f"stored the best configuration measured so far ({result.best_variant} {result.best_params}, "
                f"{result.best_time_ms:.4f} ms) as a partial record, "
                f"{len(searched)} of {len(names)} variants searched whole")
    elif existing is not None and tc is None:
        kept = "the cache's full tuning of it is kept"
    else:
        kept = "its partial result was not stored"
    return TuningInterrupted(f"tuning {what} was interrupted: {kept}", result)


def autotune(problem: Problem, device) -> None:
    """Tune ``problem`` on ``device`` for a call that found no record (``POOL_TUNER_AUTOTUNE=1``),
    saying on the ``pool_tuner`` logger, before and after, what the call is waiting for: tuning is
    seconds to minutes of compiling and timing, and a call that blocks that long without a word
    looks hung.  Runs once per shape and process (dispatch memoises the decision)."""
    what = _title(problem)
    say = _speaker()
    variants = variants_for(problem.op, problem.direction).values()
    legal = [len(v.legal_configurations(problem, device.info.limits)) for v in variants]
    searched = sum(_search_plan(n)[1] for n in legal)
    say("%s=%s and no tuning record for %s on %s: tuning it now, before this call returns -- up to %d "
        "configurations of %d variants to compile, time and verify (on PoCL's CPU device about half a second each)",
        AUTOTUNE_ENV, os.environ.get(AUTOTUNE_ENV), what, device.info.describe(), searched, sum(1 for n in legal if n))
    result = tune(problem.op, problem.input_shape, problem.output_size, problem.dtype,
                  problem.layout, device, direction=problem.direction)
    say("tuned %s in %.1f s: %s %s (kernel %.4f ms), %s", what, result.seconds, result.best_variant,
        result.best_params, result.best_time_ms,
        "stored in the tuning cache" if result.stored else f"not stored ({result.not_stored})")


def _speaker():
    """How ``autotune`` speaks for the whole of one call: through the ``pool_tuner`` logger where the
    application has configured logging, else one ``pool_tuner: ...`` line on stderr.  Decided once,
    because a library imported during the tuning may configure the root logger, which would change
    the second line's format from the first's."""
    if log.hasHandlers():
        return log.warning

    def to_stderr(message, *args):
        print(f"{log.name}: {message % args}", file=sys.stderr)

    return to_stderr


def autotune_enabled() -> bool:
    """Whether AUTOTUNE_ENV asks for autotuning (``switches.switch``: off by default)."""
    return switches.switch(AUTOTUNE_ENV, False, "autotuning", stacklevel=3)


def tune_on_miss(problem: Problem, device) -> bool:
    """The calls' tune-on-miss (``dispatch.choose``'s ``on_miss``): with ``POOL_TUNER_AUTOTUNE=1``
    tune ``problem`` on ``device`` (``autotune``) and return True; else, with measured dispatch on
    (``POOL_TUNER_BENCHMARK=1``, ``pool_tuner.benchmark_mode``), measure it
    (``measured.measure_on_miss``); else return False.  Dispatch memoises the decision that
    follows, so a problem is tuned or measured once per process."""
    if not autotune_enabled():
        return measured.enabled() and measured.measure_on_miss(problem, device)
    # What the cache held when this call missed: read before waiting for the tuning thread or
    # lock, so that a tuning of the same problem by another call meanwhile is recognised.
    seen = dispatch.tuning_cache().lookup(cache_mod.cache_key(problem, device))
    try:
        return device_tuning.run(device, lambda: _tune_on_miss(problem, device, seen))
    except TuningUnavailable as why:
        log.warning("pool_tuner: POOL_TUNER_AUTOTUNE=1, but %s; using the untuned decision", why)
        return False


def _tune_on_miss(problem: Problem, device, seen) -> bool:
    key = cache_mod.cache_key(problem, device)
    with _TUNING:
        record = dispatch.tuning_cache().lookup(key)
        if record is not seen and record is not None and not cache_mod.is_partial(record):
            return True  # another thread tuned it while this one waited
        try:
            device_tuning.kernel_tuner_arguments(device)
        except RuntimeError as why:  # a device that cannot be tuned in this process
            log.warning("pool_tuner: POOL_TUNER_AUTOTUNE=1, but %s; using the untuned decision", why)
            return False
        autotune(problem, device)
    return True


__all__ = ["autotune", "autotune_enabled", "tune", "tune_on_miss", "TuneResult", "TuningInterrupted", "VariantResult", "race",
           "AUTOTUNE_ENV"]
