"""Fleet tuning: many problems tuned on the devices of a Ray cluster, merged into one cache.

Tuning is per device and per shape, so a model zoo served on several kinds of device is thousands
of tunings, more than one machine does in a night.  Kernel Tuner's own parallel runner spreads the
configurations of one problem; here the unit of work is the problem: each tuning of one problem on
one device model is a Ray task.

How the pieces fit:

* A *device model* is one device fingerprint (``DeviceInfo.fingerprint``), the unit a cache key names:
  records tuned on one node apply exactly on every node with the same fingerprint.  Its hash is
  the ``dev=`` part of cache keys.
* Each node says which devices it has as Ray custom resources, ``pool_tuner_device:<hash>`` with
  the number of such devices, given when the node starts (``ray start --resources "$(pool-tuner
  devices --ray-resources)"``, from ``node_resources``).  A tuning task asks for one unit, so Ray
  never runs two tunings on one device: Kernel Tuner's timings would measure each other.  Where a
  node has several devices of one model, the task takes the first free one under a node-local
  file lock (``_claim_device``).
* The driver asks every such node what its resources stand for (``_node_devices``, a task pinned
  to the node): the whole fingerprint, which the resource name only hashes, and a check that the
  node really has the devices it advertises -- before any tuning starts.
* Each problem is submitted once per device model chosen (``device_filter``; default every model
  in the cluster).  Results come back as they finish (``ray.wait``) and are stored at once in the
  driver's tuning cache (``TuningCache.store``: locked, atomic), so a driver interrupted or a
  cluster lost keeps everything that finished.  The workers store nothing themselves.
* Faults: a task whose node dies is retried by Ray (``max_retries``) on another node with the same
  resource, i.e. the same device model.  A node that turns out not to hold the device it advertises
  raises ``DeviceNotHere``, which Ray retries too (``retry_exceptions``); a tuning that fails on its
  own (every configuration failed) is not retried: it would fail again.  Where no live node has a
  model any more, its queued tasks would wait for ever, so they are cancelled and reported.  The
  attempts of each task are counted by a small actor on the driver's node (``_Ledger``): Ray's
  retries are otherwise invisible to the driver.
* Ctrl-C on the driver cancels every task that has not started and keeps what was stored
  (``_cancel_queued`` says why running tasks are left alone).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import socket
import sys
import tempfile
import time
import warnings

from . import backends
from . import cache as cache_mod
from . import dispatch
from .problem import Problem
from .variants import get_variant

#: The prefix of the Ray custom resources that stand for pool_tuner devices.
RESOURCE_PREFIX = "pool_tuner_device:"
#: How to install what the fleet needs, for the message of a missing Ray.
INSTALL_HINT = 'pip install "pool-tuner[ray]"'
#: Ray's retries of a task whose node died (or did not hold its device), by default.
DEFAULT_MAX_RETRIES = 3
#: Seconds the driver waits for a result before it checks that every model still has a live node.
POLL_SECONDS = 2.0
#: Seconds the discovery of the nodes' devices may take (each node starts a worker process).
DISCOVERY_TIMEOUT_S = 120.0


class DeviceNotHere(RuntimeError):
    """The node a task was sent to has no free device of the task's model: it advertises a device
    it does not have.  Ray retries the task (``retry_exceptions``), possibly on another node."""


def require_ray(option: str):
    """Import Ray, or say which option needs it and how to install it (``RuntimeError``)."""
    try:
        import ray
    except ImportError:
        raise RuntimeError(f"{option} needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def model_hash(fingerprint: dict) -> str:
    """The hash that names a device model: the ``dev=`` part of the cache keys of its records."""
    return cache_mod._fingerprint_hash(fingerprint)


def resource_name(fingerprint: dict) -> str:
    """The Ray custom resource that stands for one device of this fingerprint."""
    return RESOURCE_PREFIX + model_hash(fingerprint)


def fleet_devices() -> list:
    """The devices a node offers to the fleet: every device but simulators (Oclgrind), which are
    exact but far too slow to time anything."""
    return [d for d in backends.all_devices() if not d.info.is_simulator]


def node_resources() -> dict:
    """This machine's devices as Ray custom resources, ``{"pool_tuner_device:<hash>": count}``:
    what ``ray start --resources`` takes for a node of the fleet."""
    counts = collections.Counter(resource_name(d.info.fingerprint) for d in fleet_devices())
    return dict(sorted(counts.items()))


def timing_free(record: dict) -> dict:
    """What two tunings of one problem on one device model agree on, whoever ran them: the record
    without what clocks decide -- every ``time_ms``, the date, the tuning's seconds, and which
    configuration of each variant won and how the variants rank, kept only as the set of variants
    with a winner.  The problem, device, kernel code, default configuration, failures and the
    number of configurations verified remain.  Compares a fleet's records with a local tuning's."""
    kept = {k: v for k, v in record.items() if k not in ("date", "tuning_seconds", "best", "runners_up", "default")}
    kept["variants_tuned"] = sorted(entry["variant"] for entry in [record["best"], *record.get("runners_up", [])])
    if "default" in record:
        kept["default"] = {k: v for k, v in record["default"].items() if k != "time_ms"}
    return kept


# ---------------------------------------------------------------------------------------- on the nodes

def _node_devices(advertised: dict) -> dict:
    """On one node (a task pinned to it): ``{hash: {"fingerprint", "count"}}`` of the node's fleet
    devices, after checking that it has every device its resources ``advertised``."""
    found: dict = {}
    for device in fleet_devices():
        fingerprint = device.info.fingerprint
        entry = found.setdefault(model_hash(fingerprint), {"fingerprint": fingerprint, "count": 0})
        entry["count"] += 1
    for name, count in advertised.items():
        have = found.get(name[len(RESOURCE_PREFIX):], {}).get("count", 0)
        if have < count:
            raise RuntimeError(f"node {socket.gethostname()} advertises {count:g} x {name} but has {have} such device(s); "
                               f"start it with --resources '{json.dumps(node_resources())}' "
                               f"(`pool-tuner devices --ray-resources` there)")
    return found


@contextlib.contextmanager
def _claim_device(model: str, node: str):
    """The first device of ``model`` on this node that no other tuning holds, held (a file lock in
    the temporary directory, named after the Ray node ``node``: several nodes may share a machine)
    until the block ends.  Ray's resources already keep the number of tunings per node within the
    number of devices; the lock says which device each one takes."""
    import filelock

    devices = [d for d in fleet_devices() if model_hash(d.info.fingerprint) == model]
    for number, device in enumerate(devices):
        lock = filelock.FileLock(os.path.join(tempfile.gettempdir(), f"pool_tuner_fleet_{node}_{model}_{number}.lock"))
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            continue
        try:
            yield device
        finally:
            lock.release()
        return
    raise DeviceNotHere(f"{socket.gethostname()} has {len(devices)} device(s) of model {model}, none of them free")


def _tune_problem(problem: Problem, model: str, options: dict, ledger, index: int) -> dict:
    """The task: tune ``problem`` on a device of ``model`` here and send back its record and when
    it ran (the driver stores the record; this node's cache is left alone)."""
    import ray

    from .tuner import tune

    entered = time.time()
    node = ray.get_runtime_context().get_node_id()
    ray.get(ledger.started.remote(index, node))
    with _claim_device(model, node) as device:
        result = tune(problem.op, problem.input_shape, problem.output_shape[-problem.ndim:], problem.dtype,
                      problem.layout, device, direction=problem.direction, store=False, **options)
    return {"record": result.record, "device": device.info.describe(), "host": socket.gethostname(), "node": node,
            "entered": entered, "finished": time.time(), "seconds": result.seconds}


class _Ledger:
    """An actor on the driver's node that counts the attempts of every task (Ray retries a task
    without telling its owner) and where each ran."""

    def __init__(self):
        self._nodes = collections.defaultdict(list)

    def started(self, index: int, node: str) -> None:
        self._nodes[index].append(node)

    def attempts(self) -> dict:
        return dict(self._nodes)


# ---------------------------------------------------------------------------------------- the driver

@dataclasses.dataclass
class DeviceModel:
    """One device model of the cluster: its fingerprint, how it is shown, and where it is."""

    hash: str
    fingerprint: dict
    label: str
    #: Node ids that have it, and how many such devices each has.
    nodes: dict

    @property
    def resource(self) -> str:
        return RESOURCE_PREFIX + self.hash


@dataclasses.dataclass
class Outcome:
    """One problem on one device model: its record (None if it failed) or its error."""

    problem: Problem
    model: str
    record: dict | None = None
    error: str | None = None
    #: How many times a node started it (more than one: Ray retried it).
    attempts: int = 0
    #: Where the last attempt ran (Ray ``node`` id, ``host``, ``device``), seconds of tuning, and the
    #: wall-clock times at which the task began on its node, finished there, and its record was
    #: stored by the driver (the scheduling and transfer overheads, measured).
    node: str | None = None
    host: str | None = None
    device: str | None = None
    seconds: float | None = None
    entered: float | None = None
    finished: float | None = None
    stored_at: float | None = None
    #: Whether the driver's cache took the record (``TuningCache.store``).
    stored: bool = False

    @property
    def tuned(self) -> bool:
        return self.record is not None


@dataclasses.dataclass
class FleetReport:
    """What a fleet run did: an ``Outcome`` per problem and device model, the models, the cache."""

    outcomes: list
    models: dict
    cache_path: str
    seconds: float

    def summary(self) -> str:
        """Tuned, retried and failed per device model, then every failure with its error."""
        lines = [f"fleet tuning: {sum(o.tuned for o in self.outcomes)} of {len(self.outcomes)} tunings done in "
                 f"{self.seconds:.1f} s, stored in {self.cache_path}"]
        for model in self.models.values():
            mine = [o for o in self.outcomes if o.model == model.hash]
            lines.append(f"  {model.label}: {sum(o.tuned for o in mine)} tuned, "
                         f"{sum(o.attempts > 1 for o in mine)} retried, {sum(not o.tuned for o in mine)} failed "
                         f"({len(model.nodes)} node(s))")
        for o in self.outcomes:
            if not o.tuned:
                lines.append(f"  FAILED {_title(o.problem)} on {self.models[o.model].label}: {o.error}")
        return "\n".join(lines)


def _title(problem: Problem) -> str:
    return (f"{problem.op} {problem.direction} {problem.dtype} {problem.layout} "
            f"{'x'.join(map(str, problem.input_shape))} -> {'x'.join(map(str, problem.output_shape))}")


def _label(fingerprint: dict, model: str) -> str:
    units = fingerprint.get("compute_units")
    return f"{fingerprint.get('name', fingerprint.get('backend'))}" + (f", {units} CU" if units else "") + f" [{model}]"


def check_problems(problems, variants=None, name: str = "problems") -> list:
    """``problems`` as a list of ``Problem``s, refused before any work if it is not one, holds an
    empty output, or ``variants`` names a variant that one of them does not have."""
    if isinstance(problems, (str, bytes)) or not hasattr(problems, "__iter__"):
        raise TypeError(f"{name} must be a sequence of pool_tuner.problem.Problem, got {type(problems).__name__}")
    problems = list(problems)
    if not problems:
        raise ValueError(f"{name} is empty: nothing to tune")
    for i, problem in enumerate(problems):
        if not isinstance(problem, Problem):
            raise TypeError(f"{name}[{i}] must be a pool_tuner.problem.Problem (Problem.create(...)), "
                            f"got {type(problem).__name__}")
        if problem.is_empty:
            raise ValueError(f"{name}[{i}] has an empty output {problem.output_shape}: nothing to tune")
        for variant in variants or ():
            get_variant(problem.op, variant, problem.direction, argument="variants")
    return list(dict.fromkeys(problems))


def select_models(models: dict, device_filter: str | None, option: str = "device_filter") -> dict:
    """The models ``device_filter`` asks for: comma-separated terms, each a fingerprint hash, a
    device type (``cpu``, ``gpu``) or part of a device name (any case); None: every model.  A term
    that matches no model of the cluster is a ``ValueError`` naming the models there are."""
    if device_filter is None:
        return dict(models)
    _check_filter(device_filter, option)
    chosen = {}
    for term in (t.strip() for t in device_filter.split(",")):
        hits = {h: m for h, m in models.items()
                if term.lower() in (h, str(m.fingerprint.get("type", "")).lower())
                or term.lower() in str(m.fingerprint.get("name", "")).lower()}
        if not term or not hits:
            raise ValueError(f"{option} term {term!r} matches no device model of the cluster; the models are: "
                             + "; ".join(m.label for m in models.values()))
        chosen.update(hits)
    return chosen


def _check_filter(device_filter, option: str = "device_filter") -> None:
    if device_filter is not None and (not isinstance(device_filter, str) or not device_filter.strip()):
        raise ValueError(f"{option} must be comma-separated fingerprint hashes, device types or parts of device "
                         f"names, got {device_filter!r}")


def discover(ray) -> dict:
    """``{hash: DeviceModel}`` of the connected cluster's live nodes, each node asked what its
    ``pool_tuner_device`` resources stand for (``_node_devices``)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive") and any(r.startswith(RESOURCE_PREFIX) for r in n["Resources"])]
    if not nodes:
        raise RuntimeError("no node of the Ray cluster offers a pool_tuner device: start each node with "
                           "ray start ... --resources \"$(pool-tuner devices --ray-resources)\"")
    probe = ray.remote(_node_devices)
    asked = [probe.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
             .remote({r: v for r, v in n["Resources"].items() if r.startswith(RESOURCE_PREFIX)}) for n in nodes]
    ray.wait(asked, num_returns=len(asked), timeout=DISCOVERY_TIMEOUT_S)
    models: dict = {}
    for node, ref in zip(nodes, asked):
        try:
            listing = ray.get(ref, timeout=0)
        except (ray.exceptions.TaskUnschedulableError, ray.exceptions.GetTimeoutError, ray.exceptions.WorkerCrashedError,
                ray.exceptions.NodeDiedError) as lost:  # the node died, or is dying: it tunes nothing
            ray.cancel(ref)
            warnings.warn(f"Ray node {node['NodeManagerAddress']} ({node['NodeID'][:8]}) did not say which devices it has "
                          f"and is left out: {_one_line(lost)}", RuntimeWarning, stacklevel=3)
            continue
        except ray.exceptions.RayTaskError as wrong:  # it advertises a device it does not have
            raise RuntimeError(_one_line(wrong.cause if getattr(wrong, "cause", None) is not None else wrong)) from None
        for model, entry in listing.items():
            count = int(node["Resources"].get(RESOURCE_PREFIX + model, 0))
            if count:
                found = models.setdefault(model, DeviceModel(model, entry["fingerprint"],
                                                             _label(entry["fingerprint"], model), {}))
                found.nodes[node["NodeID"]] = count
    if not models:
        raise RuntimeError("no node of the Ray cluster that offers a pool_tuner device answered")
    return models


def _live_models(ray) -> set:
    return {r[len(RESOURCE_PREFIX):] for n in ray.nodes() if n.get("Alive") for r in n["Resources"]
            if r.startswith(RESOURCE_PREFIX)}


@contextlib.contextmanager
def _connected(ray, address: str | None):
    """Connected to the cluster at ``address`` for the block: Ray's ``"auto"`` or ``host:port``
    (``ray://`` for Ray Client), or None / ``"local"`` for a new local cluster whose one node offers
    this machine's devices.  A connection the caller made already is used (``address`` None) and
    left open."""
    if ray.is_initialized():
        if address is not None:
            raise ValueError(f"ray_address {address!r} was given, but this process is connected to a Ray cluster "
                             f"already; pass ray_address=None to tune on that one")
        yield
        return
    if address in (None, "local"):
        ray.init(address="local", resources=node_resources(), include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def tune_many(problems, *, ray_address: str | None = None, device_filter: str | None = None, variants=None,
              strategy=None, max_fevals=None, time_limit=None, max_retries: int = DEFAULT_MAX_RETRIES,
              tuning_cache=None, progress: bool = True) -> FleetReport:
    """Tune every problem on every device model of a Ray cluster (or those ``device_filter`` names;
    ``select_models``), storing each record in this process's tuning cache as it arrives.

    ``ray_address``: None or ``"local"`` starts a local cluster of this machine's devices, ``"auto"``
    joins the cluster started on this machine, ``"host:port"`` another; where this process has
    initialised Ray already, None uses that connection.  ``variants``, ``strategy``, ``max_fevals``
    and ``time_limit`` are ``tune``'s, for every problem.  ``max_retries``: how often Ray runs a task
    again after its node died.  ``progress``: a tqdm bar per device model on stderr.  See the module
    docstring for the scheduling and the faults; ``FleetReport.summary`` says what happened.
    Ctrl-C cancels what has not started and raises ``KeyboardInterrupt`` saying what was kept."""
    from .tuner import check_search_options

    ray = require_ray("tune_many")
    if ray_address is not None and not isinstance(ray_address, str):
        raise TypeError(f"ray_address must be None, 'local', 'auto' or a Ray address string, got {ray_address!r}")
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")
    check_search_options(strategy, max_fevals, time_limit)
    if variants is not None and (isinstance(variants, str) or not all(isinstance(v, str) for v in variants)):
        raise TypeError(f"variants must be a list of variant names, got {variants!r}")
    problems = check_problems(problems, variants)
    _check_filter(device_filter)
    options = dict(variants=None if variants is None else list(variants), strategy=strategy, max_fevals=max_fevals,
                   time_limit=time_limit)
    tc = tuning_cache or dispatch.tuning_cache()
    with _connected(ray, ray_address):
        ledger = _ledger(ray)  # its worker starts while the nodes are asked for their devices
        models = select_models(discover(ray), device_filter)
        report = _run(ray, problems, models, options, max_retries, tc, progress, ledger)
    dispatch.forget()  # this process's calls see the new records
    return report


def _ledger(ray):
    """A ``_Ledger`` on the driver's node, which lives as long as the driver."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return ray.remote(_Ledger).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()


def _run(ray, problems: list, models: dict, options: dict, max_retries: int, tc, progress: bool,
         ledger) -> FleetReport:
    """Submit a task per problem and model, store each result as it arrives (see ``tune_many``)."""
    from tqdm import tqdm

    started = time.perf_counter()
    task = ray.remote(_tune_problem)
    outcomes, pending = [], {}
    for model in models.values():
        runner = task.options(num_cpus=0, resources={model.resource: 1}, max_retries=max_retries,
                              retry_exceptions=[DeviceNotHere], name=f"pool_tuner tune on {model.hash}")
        for problem in problems:
            pending[runner.remote(problem, model.hash, options, ledger, len(outcomes))] = len(outcomes)
            outcomes.append(Outcome(problem, model.hash))
    bars = {h: tqdm(total=len(problems), desc=m.label, unit="problem", position=i, disable=not progress,
                    file=sys.stderr, leave=True) for i, (h, m) in enumerate(models.items())}
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_SECONDS)
            if not done:
                for outcome in _cancel_orphans(ray, pending, outcomes):
                    bars[outcome.model].update(1)
                continue
            for ref in done:
                outcome = outcomes[pending.pop(ref)]
                _collect(ray, ref, outcome, tc)
                bars[outcome.model].update(1)
                if not outcome.tuned:
                    bars[outcome.model].set_postfix_str(f"{sum(not o.tuned for o in outcomes if o.model == outcome.model)} "
                                                        f"failed")
    except KeyboardInterrupt:
        running = _cancel_queued(ray, pending, ledger)
        kept = sum(o.tuned for o in outcomes)
        raise KeyboardInterrupt(f"{kept} of {len(outcomes)} fleet tunings finished and kept in {tc.path()}; "
                                f"{len(pending) - running} queued cancelled, {running} running dropped") from None
    finally:
        for bar in bars.values():
            bar.close()
    for index, nodes in ray.get(ledger.attempts.remote()).items():
        outcomes[index].attempts = len(nodes)
    ray.kill(ledger)
    return FleetReport(outcomes, models, str(tc.path()), time.perf_counter() - started)


def _collect(ray, ref, outcome: Outcome, tc) -> None:
    """The result of one finished task into ``outcome``, its record stored in ``tc`` at once."""
    try:
        result = ray.get(ref)
    except ray.exceptions.RayTaskError as failed:  # the tuning raised: its own error, in one line
        cause = failed.cause if getattr(failed, "cause", None) is not None else failed
        outcome.error = _one_line(cause)
        return
    except ray.exceptions.RayError as lost:  # the node died more often than max_retries, or cancelled
        outcome.error = _one_line(lost)
        return
    outcome.record = result["record"]
    outcome.stored = tc.store(result["record"])
    outcome.stored_at = time.time()
    for field in ("node", "host", "device", "seconds", "entered", "finished"):
        setattr(outcome, field, result[field])


def _cancel_queued(ray, pending: dict, ledger) -> int:
    """Cancel the tasks that have not started (``ray.cancel``) and return how many are running.
    Running ones are not cancelled: Ray (2.60) can abort the driver when a cancellation crosses a
    task's completion (ray-project/ray#54846).  Their results are dropped: the driver's connection
    ends with it, and with it the job and its workers, when ``tune_many`` made the connection."""
    started = ray.get(ledger.attempts.remote(), timeout=30)
    for ref, index in pending.items():
        if index not in started:
            ray.cancel(ref)
    return sum(index in started for index in pending.values())


def _one_line(error: BaseException, limit: int = 300) -> str:
    """An error as its type and the first line of its message, at most ``limit`` characters."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _cancel_orphans(ray, pending: dict, outcomes: list) -> list:
    """Cancel the tasks of models that no live node has any more, which Ray would keep queued for
    ever; return their outcomes."""
    live, orphans = _live_models(ray), []
    for ref, index in list(pending.items()):
        if outcomes[index].model not in live:
            ray.cancel(ref)
            outcomes[index].error = f"no live node of the cluster has device model {outcomes[index].model} any more"
            orphans.append(outcomes[index])
            del pending[ref]
    return orphans


__all__ = ["DeviceNotHere", "FleetReport", "Outcome", "DeviceModel", "node_resources", "resource_name", "tune_many",
           "select_models", "require_ray", "timing_free"]
