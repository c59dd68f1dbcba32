"""Run-time dispatch: which variant and configuration runs a problem, and the ready kernel for it.

Decision order (each step is reported by ``explain`` as ``source``):

1. ``forced``  -- ``variant=`` and/or ``config=`` given by the caller (validated);
2. ``cache``   -- a tuning-cache record of exactly this problem (op, direction, dtype, layout,
   shapes) and kernel code;
3. ``nearest`` -- a record of another shape of the same problem class (``Problem.problem_class``),
   op, direction, dtype, layout and rank, and the same kernel code, no farther than
   ``NEAREST_MAX_DISTANCE`` (``shape_distance``; ``nearest_bound``: a class of
   ``EXACT_SHAPE_ONLY``, CPU global pooling, takes no other shape's record); ``explain`` names the
   nearest record beyond it (``nearest_beyond_bound``) when the default rules decide;
4. ``measured`` -- a measured dispatch of exactly this problem on this very device
   (``cache.is_measured``: the variants' rule configurations and their neighbourhood timed on the
   problem, ``POOL_TUNER_BENCHMARK``, see ``pool_tuner.measured``); ranked below every tuned
   record of this shape, never a nearest shape for another problem, never carried to another
   device (a measurement is cheap to repeat there);
5. ``default`` -- the default-dispatch rules (``default_rules``, below).

Records travel between devices: a record counts for this device when its device is the same
(tier ``exact``), the same model under another driver or compiler target (``model``) or the same
family (``family``) -- ``cache.device_tier``.  The one rule that ranks the records that count
(``_rank``): a record of this exact shape before any other shape; then a tuning before a measured
dispatch; then the better tier; then, for
other shapes, the smaller distance (``shape_distance``); then the user's record before a shipped
one; then the smaller key, so that no decision depends on the order of files.  So the user's own
exact record beats everything, an exact shape at any tier beats every nearest shape, and nearest
shapes are searched on the best tier that has a legal one.  Each record's configuration is
re-validated for this problem on this device (``Variant.check_config`` with this device's limits)
and passed over when it is not legal; a record of this exact shape tuned on this very device that
is not legal here is stale or hand-edited, and says so with a ``CacheWarning``.

The caller may pass ``on_miss``, called when a problem has no record of its exact shape (at any
tier), or only a partial one from an interrupted tuning or a measured dispatch, before its decision
is memoised (``ops`` passes the tuner's ``tune_on_miss``: the tuning of ``POOL_TUNER_AUTOTUNE=1``,
which says so on the ``pool_tuner`` logger, or the measured dispatch of ``POOL_TUNER_BENCHMARK=1``,
so that this module needs nothing of the tuner, which builds on it); otherwise calls never block on
tuning or measuring.  A record of another driver counts as tuned: records travel so that a driver
update does not send every shape back to tuning.

The default is decided by the default-dispatch rules (``default_rules``: data, derived from a grid
of tuned problems on CPUs, written by hand for GPUs): the first rule that holds for the problem
and whose variant is legal fires, with its configuration over the variant's default; ``explain``
names the rule (``rule``) and where it comes from (``rule_evidence``: the grid problems it held, or
"by hand, not measured").

Decisions and built kernels are memoised in memory by one ``Dispatcher`` (the cache files are read
once, on the first miss of the memo), so repeated calls do no file-system access and no
recompilation; built kernels are keyed by the problem without its batch extent
(``Problem.kernel_key``), so a new batch size of a per-sample shape costs a grid, not a build.
``forget()`` clears all of it.  The module's functions are that dispatcher's methods.
Its tables are ``memo`` tables filed under the problem (built kernels under their per-sample
shape): bounded by the one memo limit, and a problem's decision, forced choices and launches are
evicted together.

Threads: lookups take no lock; building a kernel holds the dispatcher's build lock, so threads
that miss the same kernel at once build it once; the tuning cache is opened once.  After
``os.fork`` the child forgets everything (``memo`` empties the tables; the dependent memos and the
open tuning cache are dropped here), so that it builds its kernels in its own OpenCL context.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import types
import warnings

from . import cache as cache_mod
from . import default_rules, kernel_source, memo
from . import variants as variants_mod
from .problem import Problem

@dataclasses.dataclass(frozen=True)
class Choice:
    variant: variants_mod.Variant
    params: tuple  # sorted (name, value) pairs: hashable
    source: str
    record_key: str | None = None  # the cache record it came from (source cache/nearest)
    tier: str | None = None  # how that record's device relates to this one (cache.TIERS)
    origin: str | None = None  # where that record comes from (cache.ORIGINS)
    distance: float | None = None  # shape_distance from that record's problem (0 for source cache)
    rule: str | None = None  # the default rule that fired (source default)
    rule_config: str | None = None  # why that rule's own configuration did not run, or None
    rule_evidence: str | None = None  # where that rule comes from (measured, or by hand and not measured)
    beyond_bound: tuple | None = None  # (record key, distance) of the nearest legal record farther than the bound

    @property
    def config(self) -> dict:
        return dict(self.params)


@dataclasses.dataclass(frozen=True)
class Launch:
    """A built kernel, its grid, and the run-time arguments that callers append after the buffers
    (``Problem.scalars``): everything a call needs besides the buffers.  A variant of two passes
    (``Variant.second_pass``) adds the ``second`` launch, run after this one on the same arguments,
    and ``scratch_bytes``: both take a scratch buffer of that size after the results."""

    kernel: object
    groups: int
    block: tuple
    scalars: tuple
    second: Launch | None = None
    scratch_bytes: int = 0

    def passes(self) -> tuple:
        """The launches of one call, in order."""
        return (self,) if self.second is None else (self, self.second)


def default_choice(problem: Problem, device) -> Choice:
    """The default rules' decision (never the cache), for every op: what tuning compares its winner
    against."""
    decided = default_rules.decide(problem, device)
    return Choice(decided.variant, tuple(sorted(decided.params.items())), "default", rule=decided.rule.name,
                  rule_config=decided.config_note, rule_evidence=decided.rule.evidence)


def _legal_winner(record: dict, problem: Problem, device) -> tuple | None:
    """``(variant, complete params)`` of the record's winner if it is a known variant and legal for
    ``problem`` on ``device``, else None."""
    best = record["best"]
    variant = variants_mod.variants_for(problem.op, problem.direction).get(best.get("variant"))
    if variant is None:
        return None
    try:
        return variant, variant.check_config(best.get("params", {}), problem, device.info.limits)
    except (TypeError, ValueError):
        return None


def _choice_from_record(match: cache_mod.Match, problem: Problem, device, distance: float) -> Choice | None:
    """The decision ``match``'s record makes for ``problem`` on ``device``, or None where its winner
    is not legal there."""
    winner = _legal_winner(match.record, problem, device)
    if winner is None:
        return None
    variant, params = winner
    source = "measured" if cache_mod.is_measured(match.record) else "cache" if match.problem == problem else "nearest"
    return Choice(variant, tuple(sorted(params.items())), source, match.record["key"], match.tier, match.origin,
                  distance)


#: The farthest ``shape_distance`` at which a record of another shape still decides a problem
#: (``nearest``), per device type (``default_rules.device_type``); beyond it the default rules decide,
#: and ``explain`` names the nearest record passed over (``nearest_beyond_bound``).
#:
#: GPU: a tuned configuration is sized for its problem's planes -- ``global_blocks``'s team per
#: plane, whose rule sizes the team to the plane -- so it says something about planes up to a few
#: times larger or smaller, not 16 times: at 4 the H100's one global-pooling record (32x2048x7x7, a
#: team of 4) decides its channel-count neighbours (32x1280x7x7 at 0.66, 32x512x7x7 at 1.96) and
#: planes 4 times larger (32x480x14x14 at 2.23), not mobilenet's 28x28 planes (32x72x28x28 at 4.81,
#: 32x120x28x28 at 4.43), which the rule gives 16 times the team.  Argued, not measured: a GPU
#: must time those layers.
#:
#: CPU: timed on the shipped AMD EPYC records (``benchmarks/nearest_bound.py``), the rules ran 2.8
#: and 3.3 times slower than a record at 4.72 and 6.23, and no slower than it beyond 6.5 (on grid
#: problems, which the rules were fitted to); docs/benchmarks.md, "A bound on nearest-shape dispatch".
NEAREST_MAX_DISTANCE = types.MappingProxyType({"cpu": 6.5, "gpu": 4.0})
#: Problem classes whose records decide only their own shape, by device type.  CPU global pooling:
#: timed on the shipped AMD EPYC records (``benchmarks/nearest_bound.py``), the rules' kernel ran
#: faster than the nearest record's on all 9 global forward problems within the bound, 1.03 to 10
#: times (median 2), from 0.42 away (32x2048x8x8 from 32x2048x7x7: 2 times) to 3.79: a global
#: window is the whole plane, so what a tuning found for one plane size says little about another
#: (docs/benchmarks.md, "Nearest records for global pooling on a CPU").
EXACT_SHAPE_ONLY = types.MappingProxyType({"cpu": frozenset({"global"}), "gpu": frozenset()})


def nearest_bound(problem: Problem, device) -> float:
    """How far (``shape_distance``) a record of another shape may be and still decide ``problem``
    on ``device``: ``NEAREST_MAX_DISTANCE`` of the device's type, 0 for ``EXACT_SHAPE_ONLY``."""
    kind = default_rules.device_type(device)
    return 0.0 if problem.problem_class in EXACT_SHAPE_ONLY[kind] else NEAREST_MAX_DISTANCE[kind]


def _beyond_bound_reason(problem: Problem, device) -> str:
    """``explain``'s word on why a record beyond ``nearest_bound`` did not decide."""
    kind = default_rules.device_type(device)
    if problem.problem_class in EXACT_SHAPE_ONLY[kind]:
        return (f"{problem.problem_class} records decide only their own shape on a {kind} "
                f"(dispatch.EXACT_SHAPE_ONLY[{kind!r}]): the default rules decide")
    return f"farther than dispatch.NEAREST_MAX_DISTANCE[{kind!r}] ({NEAREST_MAX_DISTANCE[kind]}): the default rules decide"


def shape_distance(a: Problem, b: Problem) -> float:
    """How far apart two problems of one class are for speed: the Euclidean distance of the logs
    of their ``Problem.speed_features`` (windows per axis, plane sizes, planes, bytes moved)."""
    return math.dist([math.log(max(x, 1)) for x in a.speed_features],
                     [math.log(max(x, 1)) for x in b.speed_features])


def _rank(problem: Problem, match: cache_mod.Match, distance: float) -> tuple:
    """The sort key of the ranking rule in the module docstring (smaller is better)."""
    return (match.problem != problem, cache_mod.is_measured(match.record), list(cache_mod.TIERS).index(match.tier),
            distance, cache_mod.ORIGINS.index(match.origin), match.record["key"])


def _neighbours(problem: Problem, device, table: cache_mod.TuningCache) -> list:
    """``(match, distance)`` for every record that may decide ``problem`` on ``device``: this exact
    shape, or another shape of its class, whose device applies (any tier); a measured dispatch of
    this exact shape on this exact device -- best first."""
    ranked = []
    for match in table.matches(problem, device):
        if cache_mod.is_measured(match.record) and (match.problem != problem or match.tier != "exact"):
            continue
        if match.problem.problem_class == problem.problem_class:
            distance = shape_distance(problem, match.problem)
            ranked.append((_rank(problem, match, distance), match, distance))
    ranked.sort(key=lambda entry: entry[0])
    return [(match, distance) for _, match, distance in ranked]


def config_key(config: dict | None):
    """``config`` as a memo key, value types included: True == 1, but only one of them is a legal
    value, so a bad config never reuses a good one's validation.  Raises TypeError or
    AttributeError for what is not a dict of hashable values (the caller validates those)."""
    return None if config is None else tuple(sorted((name, type(value), value) for name, value in config.items()))


class Dispatcher:
    """The process's dispatch state: memoised decisions, validated forced choices, built kernels
    (per context and per-sample shape), their ``Launch``es (per context and problem) and the open
    tuning cache -- all cleared by ``forget()``."""

    def __init__(self):
        self._decisions = memo.table("dispatch.decisions")
        #: Validated forced choices: checking a configuration costs ~100 us, as much as a small kernel.
        self._forced = memo.table("dispatch.forced")
        self._kernels = memo.table("dispatch.kernels")
        self._launches = memo.table("dispatch.launches")
        self._tuning_cache: cache_mod.TuningCache | None = None
        #: Memo tables of other modules whose entries hold decisions made here (``torch_cuda``'s
        #: plans): ``forget`` empties them whole, whatever it forgets.
        self._dependent_memos: list = []
        #: Races of other kernels than pool_tuner's against the dispatched one, by (device id,
        #: problem): ``pool_tuner.torch``'s race of PyTorch's CPU kernel, for ``explain``.
        self._measured_candidates = memo.table("dispatch.measured_candidates")
        self._lock = threading.Lock()  # opening the tuning cache
        self._build_lock = threading.RLock()  # building a kernel

    def note_measured_candidate(self, problem: Problem, device, race: dict) -> None:
        """Remember how another kernel (``race["candidate"]``) fared against pool_tuner's on
        ``problem``, and which won, so that ``explain`` can say which runs."""
        self._measured_candidates.put(problem, (device.info.id, problem), race)

    def measured_candidate(self, problem: Problem, device) -> dict | None:
        return self._measured_candidates.peek((device.info.id, problem))

    def register_dependent_memo(self, table) -> None:
        """Have ``forget`` empty ``table`` too: its entries hold decisions of this dispatcher.

        ``table`` is a ``memo.table`` (the way to add a per-call table such as plans: file each
        entry under its ``Problem`` and it is also bounded by the memo limit and evicted with the
        problem's built kernel, see ``pool_tuner.memo``) or anything with a ``clear()`` method.
        A forked child starts with it empty."""
        self._dependent_memos.append(table)

    def tuning_cache(self) -> cache_mod.TuningCache:
        """The process-wide tuning cache (shipped database + user cache), opened on first use."""
        found = self._tuning_cache
        if found is None:
            with self._lock:
                if self._tuning_cache is None:
                    self._tuning_cache = cache_mod.TuningCache(kernel_source.shipped_cache_dir())
                found = self._tuning_cache
        return found

    def forget(self, problem: Problem | None = None, device=None) -> None:
        """Drop one problem's memoised decisions, forced choices and built kernels (on every
        device: ``device`` is accepted for the callers that name it), so its next call consults the
        cache again (after tuning it); with no arguments drop everything -- decisions, forced
        choices, built kernels -- and re-open the tuning cache (e.g. after ``POOL_TUNER_CACHE_DIR``
        changed).  Dependent memo tables (``register_dependent_memo``) are emptied either way."""
        for table in self._dependent_memos:
            table.clear()
        if problem is None:
            for table in (self._decisions, self._forced, self._kernels, self._launches, self._measured_candidates):
                table.clear()
            self._tuning_cache = None
        else:
            memo.evict(problem)

    def keep_only(self, problem: Problem, context, variant_name: str, params: dict) -> None:
        """Of the kernels built for ``problem`` (every batch size of its per-sample shape) keep
        only that of ``variant_name`` with ``params`` in ``context``, and drop the problem's
        launches and memoised decision: after a measurement, so that the candidates that lost do
        not stay built for as long as the problem is in use."""
        key = (context, problem.kernel_key, variant_name, tuple(sorted(params.items())))
        kept = self._kernels.peek(key)
        memo.evict(problem.kernel_key)
        memo.evict(problem)
        if kept is not None:
            self._kernels.put(problem.kernel_key, key, kept)

    def _after_fork_in_child(self) -> None:
        """A forked child: fresh locks, nothing memoised (``memo`` empties its own tables)."""
        self._lock, self._build_lock = threading.Lock(), threading.RLock()
        for table in self._dependent_memos:
            if isinstance(table, dict):  # a memo table's entries are kept alive by memo's own fork handler
                memo.keep_alive(dict(table))
            table.clear()
        self._tuning_cache = None

    def choose(self, problem: Problem, device, variant=None, config=None, *, on_miss=None,
               memoise: bool = True) -> Choice:
        """Decide variant and configuration for ``problem`` on ``device`` (validating forced ones).

        ``on_miss(problem, device)``, when given, is called once a problem has no exact record
        (or only a partial or measured one), before its decision is memoised; when it returns true
        (it tuned or measured the problem), the cache is consulted again.  ``memoise=False``
        decides without remembering (``explain``), so that a later call still gets its
        ``on_miss``."""
        if variant is not None or config is not None:
            return self._forced_choice(problem, device, variant, config)
        memo_key = (device.info.id, problem)
        choice = self._decisions.get(memo_key)
        if choice is None:
            choice = self._from_cache(problem, device)
            untuned = choice.source != "cache" or cache_mod.is_partial(self.tuning_cache().lookup(choice.record_key))
            if untuned and on_miss is not None and on_miss(problem, device):
                choice = self._from_cache(problem, device)
            if memoise:
                self._decisions.put(problem, memo_key, choice)
        return choice

    def _forced_choice(self, problem: Problem, device, variant, config) -> Choice:
        if variant is None:
            raise ValueError("config= needs variant= too: configurations belong to one variant")
        try:
            forced_key = (device.info.id, problem, variant, config_key(config))
            choice = self._forced.get(forced_key)
        except (TypeError, AttributeError):  # unhashable or not a dict: let validation explain
            forced_key, choice = None, None
        if choice is None:
            chosen = variants_mod.get_variant(problem.op, variant, problem.direction)
            params = chosen.check_config({} if config is None else config, problem, device.info.limits, forced=True)
            choice = Choice(chosen, tuple(sorted(params.items())), "forced")
            if forced_key is not None:
                self._forced.put(problem, forced_key, choice)
        return choice

    def _from_cache(self, problem: Problem, device) -> Choice:
        beyond_bound, bound = None, nearest_bound(problem, device)
        for match, distance in _neighbours(problem, device, self.tuning_cache()):
            if distance > bound:
                if (beyond_bound is None or distance < beyond_bound[1]) and _legal_winner(match.record, problem, device):
                    beyond_bound = (match.record["key"], distance)
                continue
            choice = _choice_from_record(match, problem, device, distance)
            if choice is not None:
                return choice
            if match.tier == "exact" and match.problem == problem:
                warnings.warn(f"tuning-cache record {match.record['key']} names a configuration that is not legal "
                              f"here; ignored", cache_mod.CacheWarning, stacklevel=3)
        return dataclasses.replace(default_choice(problem, device), beyond_bound=beyond_bound)

    def prepare(self, device, context, problem: Problem, choice: Choice) -> Launch:
        """The built kernel, grid and run-time arguments for ``choice`` (memoised per context, filed
        under ``problem``)."""
        key = (context, problem, choice.variant.name, choice.params)
        launch = self._launches.peek(key)  # choose marked the problem as used
        if launch is None:
            with self._build_lock:  # one build per kernel, however many threads miss it at once
                launch = self._launches.peek(key)
                if launch is None:
                    params, variant = choice.config, choice.variant
                    kernel = self._kernel(device, context, problem, choice)
                    second = variant.second_pass(params, problem)
                    if second is not None:
                        groups, block, defines = second
                        second = Launch(self._kernel(device, context, problem, choice, defines), groups, block,
                                        problem.scalars)
                    launch = self._launches.put(problem, key, Launch(
                        kernel, variant.groups(params, problem), variant.block(params), problem.scalars, second,
                        variant.scratch_bytes(params, problem)))
        return launch

    def _kernel(self, device, context, problem: Problem, choice: Choice, pass_defines: dict | None = None):
        """The built kernel of ``choice`` (of its second pass: with ``pass_defines``), shared by
        every batch size of ``problem``'s per-sample shape (memoised per context and
        ``Problem.kernel_key``, filed under the latter)."""
        key = self._kernel_key(context, problem, choice, pass_defines)
        kernel = self._kernels.get(key)
        if kernel is None:
            variant = choice.variant
            source = variant.program(choice.config, problem, pass_defines)
            kernel = self._keep(device, problem, choice, key, device.build(context, source, variant.kernel_name))
        return kernel

    def _keep(self, device, problem: Problem, choice: Choice, key, kernel):
        """Memoise ``kernel``, built for ``choice``, under ``key``, once it is known to launch with
        the configuration's work-group (ValueError if not)."""
        params, variant = choice.config, choice.variant
        block = variant.block(params)
        threads = block[0] * block[1]
        limit = kernel.max_work_group_size
        if threads > limit:
            raise ValueError(
                f"config {params} of variant {variant.name!r} needs work-groups of {threads}, but the "
                f"built kernel allows at most {limit} on {device.info.describe()}"
            )
        return self._kernels.put(problem.kernel_key, key, kernel)

    def build_together(self, device, context, problem: Problem, choices: list) -> dict:
        """Build the kernels of ``choices`` (configurations of ``problem``) at once, memoised as
        ``prepare`` builds them: as one program where the device's kernel language lets a program
        hold several variants (``kernel_source.render_together``: one compile for all), else one
        program each.  Returns ``{index in choices: error}`` for those that could not be built; a
        failed shared program is retried one program each, so one bad candidate costs no other."""
        failed = {}
        with self._build_lock:
            wanted = [(i, c, defines) for i, c in enumerate(choices) for defines in self._pass_defines(c, problem)
                      if self._kernels.peek(self._kernel_key(context, problem, c, defines)) is None]
            if len(wanted) > 1 and device.info.source_suffix in kernel_source.SHARED_PROGRAM_SUFFIXES:
                kernel_name = wanted[0][1].variant.kernel_name
                source = _one_program(problem, [(c, defines) for _, c, defines in wanted])
                try:
                    built = [device.build(context, source, kernel_source.together_name(kernel_name, position))
                             for position in range(len(wanted))]
                except Exception:  # noqa: BLE001 - each alone below, which names the culprit
                    built = None
                if built is not None:
                    for (i, choice, defines), kernel in zip(wanted, built):
                        try:
                            self._keep(device, problem, choice, self._kernel_key(context, problem, choice, defines),
                                       kernel)
                        except ValueError as exc:
                            failed[i] = exc
                    return failed
            for i, choice, defines in wanted:
                try:
                    self._kernel(device, context, problem, choice, defines)
                except Exception as exc:  # noqa: BLE001 - a candidate that cannot build is left out
                    failed[i] = exc
        return failed

    def shared_program(self, device, problem: Problem, choices: list) -> str | None:
        """The one program in which ``build_together`` builds ``choices`` when none of them is built
        yet, or None where the device's kernel language has no shared programs: what a caller may
        compile ahead, in another thread, into the compiler's cache (``dispatch_grid.py``)."""
        if device.info.source_suffix not in kernel_source.SHARED_PROGRAM_SUFFIXES:
            return None
        return _one_program(problem, [(c, defines) for c in choices for defines in self._pass_defines(c, problem)])

    @staticmethod
    def _pass_defines(choice: Choice, problem: Problem) -> list:
        """The extra defines of each pass of ``choice``: none for the first, the second's."""
        second = choice.variant.second_pass(choice.config, problem)
        return [{}] if second is None else [{}, second[2]]

    @staticmethod
    def _kernel_key(context, problem: Problem, choice: Choice, pass_defines: dict | None) -> tuple:
        """The memo key of the kernel of ``choice`` (of its second pass: with ``pass_defines``)."""
        return (context, problem.kernel_key, choice.variant.name, choice.params) + (
            (tuple(sorted(pass_defines.items())),) if pass_defines else ())


def _one_program(problem: Problem, kernels: list) -> str:
    """The one program of ``kernels``, ``(choice, pass defines)`` each, the ``i``-th kernel named
    ``kernel_source.together_name(kernel_name, i)`` (``kernel_source.render_together``)."""
    return kernel_source.render_together([c.variant.program(c.config, problem, defines) for c, defines in kernels],
                                         kernels[0][0].variant.kernel_name)


DISPATCHER = Dispatcher()
choose = DISPATCHER.choose
prepare = DISPATCHER.prepare
forget = DISPATCHER.forget
tuning_cache = DISPATCHER.tuning_cache
register_dependent_memo = DISPATCHER.register_dependent_memo
note_measured_candidate = DISPATCHER.note_measured_candidate
measured_candidate = DISPATCHER.measured_candidate

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=DISPATCHER._after_fork_in_child)


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
        "device": device.info.describe(),
        "cache_key": cache_mod.cache_key(problem, device),
        "record_key": choice.record_key,
        "tier": choice.tier,
        "record_origin": choice.origin,
        "problem_class": problem.problem_class,
        "distance": None if choice.distance is None else round(choice.distance, 3),
        "nearest_beyond_bound": None if choice.beyond_bound is None else {
            "record_key": choice.beyond_bound[0], "distance": round(choice.beyond_bound[1], 3),
            "why": _beyond_bound_reason(problem, device)},
        "rule": choice.rule,
        "rule_config": choice.rule_config,
        "rule_evidence": choice.rule_evidence,
        "measured": measured_times(DISPATCHER.tuning_cache().lookup(choice.record_key))
        if choice.source == "measured" else None,
        "index_bits": 64 if problem.index_64 else 32,
    }


def measured_times(record: dict | None) -> list | None:
    """The candidates of a measured dispatch's record, fastest first: ``{"variant", "params",
    "time_ms"}`` each (what ``explain`` shows under ``measured``); None for no record."""
    if record is None:
        return None
    return [dict(entry) for entry in [record["best"], *record.get("runners_up", [])]]


def record_tier(record: dict, device) -> str:
    """Whether a cache record can decide problems on ``device``, in one word: its tier
    (``cache.TIERS``: how its device relates to this one), or why it cannot -- ``"other device"``,
    ``"stale"`` (tuned on other kernel code) or ``"illegal"`` (its configuration cannot run its
    own problem here).  What ``cache show`` reports per record."""
    tuned = cache_mod.problem_of(record)
    if record["kernel_hash"] != cache_mod.record_kernel_hash(tuned, record["device"]):
        return "stale"
    tier = cache_mod.device_tier(record["device"], device)
    if tier is None:
        return "other device"
    return tier if _legal_winner(record, tuned, device) is not None else "illegal"
