"""Run pytest files so that one faulting case never takes the others down.

A CUDA fault -- an illegal memory access in any kernel, pool_tuner's or PyTorch's -- leaves the
process's context unusable: every later CUDA call in that process fails, so in one pytest process a
single fault fails every case after it.  Here:

* a case marked ``own_process`` (one that can fault: more than 2^31 elements, CUDA graph capture,
  tuning on the CUDA tuning thread) runs in a pytest process of its own;
* the other cases, the quick ones, are dealt round-robin into shards, each one pytest process.
  Every file's shards start before any case of its own, so that no file's quick cases wait behind
  the long ones: of the ``jobs`` processes at a time, at most ``alone_jobs`` are cases of their
  own (each can hold gigabytes of GPU memory), and the shards, dealt among the files by their
  number of cases, take the other slots.  Both lists are ordered so that every test function comes
  up early (``interleaved``): a run cut off by its deadline has tried each.  This module, loaded
  into every process as a plugin (``-p isolated_tests``), writes each case's start and outcome to a file
  as it goes, and ends the session after a failure whose report names an error that poisons a
  CUDA context (``POISONING``).  A shard that stopped so, or died (a segfault, an abort), is started
  again on the cases it did not finish; the case it died in is counted ``crashed``;
* a case whose ``skip``/``skipif`` mark skips it (every case of the GPU files without a GPU) is
  counted skipped, with its reason, without starting a process for it;
* every process runs under one deadline: one still running then is killed, the case it was in is
  counted ``timed out`` and the cases after it ``not run``.

Up to ``jobs`` processes run at a time.  Per file, a summary line; per case, its outcome, in
``results.json`` under ``--out``, with each process's log beside it.  Every process builds its
CUDA kernels into one cubin directory (``POOL_TUNER_CUBIN_DIR``, ``--out``'s ``cubin/`` unless
the environment names one; see ``pool_tuner/backends/cuda_compile.py``), so that a kernel one
process compiled is read, not compiled again, by the others.

    python benchmarks/isolated_tests.py tests/test_cuda_gpu.py tests/test_cuda.py --out DIR [--jobs 4]
                                        [--alone-jobs 4] [--timeout 150]

Exit status 0 when every case passed or skipped.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The marker of cases that run in a process of their own (registered in setup.cfg).
OWN_PROCESS = "own_process"
#: Where the plugin writes its events (one JSON object a line); set by the runner.
EVENTS_ENV = "POOL_TUNER_ISOLATED_EVENTS"
#: Errors after which nothing more can run in the process's CUDA context (the driver's and the
#: runtime's names and messages for them).
POISONING = re.compile(r"illegal memory access|ILLEGAL_ADDRESS|unspecified launch failure|LAUNCH_FAILED|"
                       r"misaligned address|illegal instruction|device-side assert|CUDA_ERROR_ASSERT|"
                       r"context is destroyed|CONTEXT_IS_DESTROYED|hardware stack error|ECC error", re.IGNORECASE)
#: The cubin directory every process builds into (pool_tuner/backends/cuda_compile.py).
CUBIN_DIR_ENV = "POOL_TUNER_CUBIN_DIR"
#: The test seed (tests/conftest.py) every process is given, so that a failure can be replayed.
SEED_ENV = "POOL_TUNER_TEST_SEED"
#: Every outcome a case can end with, in the summary's order.
OUTCOMES = ("passed", "failed", "skipped", "crashed", "timed out", "not run")
#: pytest's options of every process: the project's addopts cleared (they ask for pytest-xdist's
#: workers; the processes here are the workers, and need no pytest-xdist), no cache files written
#: into the checkout.
PYTEST = ("-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-q", "-rN")


# ---------------------------------------------------------------------- the plugin (inside each pytest process)

_session = None


def _event(entry: dict) -> None:
    """Append ``entry`` to the events file, its ``nodeid`` prefixed with pytest's root directory
    (the argument that selects the case from any working directory)."""
    path = os.environ.get(EVENTS_ENV)
    if path:
        entry["nodeid"] = f"{_session.config.rootpath}/{entry['nodeid']}"
        with open(path, "a", encoding="utf-8") as events:
            events.write(json.dumps(entry) + "\n")


def pytest_sessionstart(session):
    global _session
    _session = session


def pytest_collection_finish(session):
    for item in session.items:
        _event({"nodeid": item.nodeid, "event": "collected", "alone": item.get_closest_marker(OWN_PROCESS) is not None,
                "skip": _skip_reason(item)})


def _skip_reason(item) -> str | None:
    """The reason of a ``skip`` mark, or of a ``skipif`` mark whose condition is True, on ``item``
    (conditions given as strings are left to pytest): a case that would only start a process to
    skip (every case of the GPU test files on a machine without a GPU)."""
    for mark in item.iter_markers("skip"):
        return mark.kwargs.get("reason", mark.args[0] if mark.args else "skipped")
    for mark in item.iter_markers("skipif"):
        conditions = mark.args or (mark.kwargs.get("condition"),)
        if any(isinstance(c, bool) and c for c in conditions):
            return mark.kwargs.get("reason", "skipif")
    return None


def pytest_runtest_logstart(nodeid, location):
    _event({"nodeid": nodeid, "event": "start"})


def pytest_runtest_logreport(report):
    text = report.longreprtext if report.failed else ""
    poisoned = bool(POISONING.search(text))
    _event({"nodeid": report.nodeid, "event": report.when, "outcome": report.outcome, "poisoned": poisoned,
            "message": text[-2000:]})
    if poisoned:
        _session.shouldstop = f"{report.nodeid} left the CUDA context unusable"


def pytest_runtest_logfinish(nodeid, location):
    _event({"nodeid": nodeid, "event": "finish"})


# ---------------------------------------------------------------------- the runner

@dataclasses.dataclass
class Case:
    nodeid: str
    outcome: str = "not run"
    message: str = ""


def collect(test_file: str, log_dir: Path, env: dict, timeout_s: float) -> tuple[list, list, dict, str]:
    """The node ids of ``test_file`` to run, marked ``own_process`` and not, the cases its marks
    skip (``_skip_reason``: run in no process), and pytest's output when it could not collect the
    file (an empty string when it could).  Ids carry pytest's root directory before pytest's own
    (``_event``)."""
    events_path = log_dir / "collection.events"
    events_path.unlink(missing_ok=True)
    try:
        proc = subprocess.run([sys.executable, *PYTEST, "-p", "isolated_tests", "--collect-only", test_file],
                              cwd=ROOT, env=dict(env, **{EVENTS_ENV: str(events_path)}), capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [], [], {}, f"collecting {test_file} took more than the {timeout_s:.0f} s left"
    alone, together, skipped = [], [], {}
    if events_path.exists():
        for line in events_path.read_text(encoding="utf-8").splitlines():
            entry = json.loads(line)
            if entry["skip"] is not None:
                skipped[entry["nodeid"]] = Case(entry["nodeid"], "skipped", entry["skip"])
            else:
                (alone if entry["alone"] else together).append(entry["nodeid"])
    return alone, together, skipped, "" if proc.returncode == 0 else (proc.stdout + proc.stderr)[-3000:]


def _outcome(reports: list) -> tuple[str, str]:
    """A case's outcome from its phase reports: failed if any phase failed, else skipped if one
    skipped, else passed."""
    for wanted in ("failed", "skipped"):
        for report in reports:
            if report["outcome"] == wanted:
                return wanted, report["message"]
    return "passed", ""


def run_shard(ids: list[str], log_dir: Path, name: str, env: dict, deadline: float) -> tuple[dict[str, Case], int]:
    """Run ``ids`` in pytest processes, one after another: each starts on the cases the one before
    did not finish (it stopped after a poisoning failure, or died).  Returns the cases and the
    number of processes."""
    cases = {nodeid: Case(nodeid) for nodeid in ids}
    remaining = list(ids)
    attempt = 0
    while remaining:
        attempt += 1
        events_path = log_dir / f"{name}-{attempt}.events"
        log_path = log_dir / f"{name}-{attempt}.log"
        events_path.unlink(missing_ok=True)
        timed_out = _run_until(remaining, log_path, dict(env, **{EVENTS_ENV: str(events_path)}), deadline)
        started, finished, reports = _read_events(events_path)
        for nodeid in finished:
            if nodeid in cases:
                cases[nodeid].outcome, cases[nodeid].message = _outcome(reports[nodeid])
        unfinished = [nodeid for nodeid in started if nodeid not in finished and nodeid in cases]
        for nodeid in unfinished:  # the case the process was in when it died or was killed
            cases[nodeid].outcome = "timed out" if timed_out else "crashed"
            cases[nodeid].message = f"see {log_path.name}"
        left = [nodeid for nodeid in remaining if nodeid not in finished and nodeid not in unfinished]
        if timed_out or len(left) == len(remaining):  # out of time, or the process ran nothing (see its log)
            for nodeid in left:
                cases[nodeid].message = f"see {log_path.name}" if log_path.exists() else "the deadline came first"
            break
        remaining = left
    return cases, attempt


#: The process groups of the pytest processes running now, and whether the runner was told to stop
#: (SIGTERM: its caller's timeout).
_running: set = set()
_stopped = threading.Event()


def _stop(signum, frame):
    """SIGTERM: kill every pytest process group still running and start no other (their processes
    live in groups of their own, out of reach of a signal to the runner's group)."""
    _stopped.set()
    for group in list(_running):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


def _run_until(ids: list[str], log_path: Path, env: dict, deadline: float) -> bool:
    """One pytest process on ``ids``, killed (its whole process group) at ``deadline`` or when the
    runner is stopped (it is not started after either); whether it was."""
    if _stopped.is_set() or time.monotonic() >= deadline:
        return True
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen([sys.executable, *PYTEST, "-p", "isolated_tests", *ids], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _running.add(proc.pid)
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.write("\n[isolated_tests] killed at the deadline\n")
            return True
        finally:
            _running.discard(proc.pid)
        return _stopped.is_set()


def _read_events(path: Path) -> tuple[list, set, dict]:
    started, finished, reports = [], set(), collections.defaultdict(list)
    if not path.exists():
        return started, finished, reports
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # the last line of a process killed while writing it
            continue
        if entry["event"] == "start":
            started.append(entry["nodeid"])
        elif entry["event"] == "finish":
            finished.add(entry["nodeid"])
        elif entry["event"] != "collected":
            reports[entry["nodeid"]].append(entry)
    return started, finished, reports


def shards(ids: list[str], jobs: int) -> list[list[str]]:
    """``ids`` dealt round-robin into at most ``jobs`` non-empty shards."""
    return [part for part in (ids[i::jobs] for i in range(jobs)) if part]


def taking_turns(groups: list[list]) -> list:
    """The first item of each group, then the second of each, and so on."""
    return [group[rank] for rank in range(max(map(len, groups), default=0)) for group in groups if rank < len(group)]


def interleaved(ids: list[str]) -> list[str]:
    """``ids`` with their test functions taking turns, each function's cases in their order: a run
    cut off part way has tried every test function, not the first ones only."""
    by_function = collections.defaultdict(list)
    for nodeid in ids:
        by_function[nodeid.split("[", 1)[0]].append(nodeid)
    return taking_turns(list(by_function.values()))


def shard_counts(together: dict, slots: int) -> dict:
    """How many of ``slots`` shards each file of ``together`` (file -> its quick cases) gets: one
    each at least, the rest by their number of cases (largest remainders first)."""
    files = [f for f, ids in together.items() if ids]
    if not files:
        return {}
    slots = max(slots, len(files))
    total = sum(len(together[f]) for f in files)
    shares = {f: (slots - len(files)) * len(together[f]) / total for f in files}
    counts = {f: 1 + int(shares[f]) for f in files}
    for f in sorted(files, key=lambda f: int(shares[f]) - shares[f])[:slots - sum(counts.values())]:
        counts[f] += 1
    return counts


def run_files(test_files: list[str], out: Path, jobs: int, timeout_s: float, env: dict | None = None,
              alone_jobs: int | None = None) -> dict:
    """Run ``test_files`` (see the module docstring): ``jobs`` processes at a time, at most
    ``alone_jobs`` (default ``jobs``) of them cases of their own; returns ``{file: {"cases": [...],
    "summary": line, "collection_error": text}}``."""
    started = time.monotonic()
    deadline = started + timeout_s
    alone_jobs = jobs if alone_jobs is None else min(alone_jobs, jobs)
    env = dict(os.environ if env is None else env)
    # one seed for every process (tests/conftest.py draws the inputs from it): a failure replays
    env.setdefault(SEED_ENV, str(random.randrange(2**31)))
    env.setdefault(CUBIN_DIR_ENV, str(out.resolve() / "cubin"))
    # the plugin (this module) last: benchmarks/ holds scripts whose names a test must not import
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", ""), str(ROOT / "benchmarks")]))
    out.mkdir(parents=True, exist_ok=True)
    collected = {}
    for test_file in test_files:
        log_dir = out / Path(test_file).stem
        log_dir.mkdir(parents=True, exist_ok=True)
        alone, together, skipped, error = collect(test_file, log_dir, env, max(1.0, deadline - time.monotonic()))
        if error:
            (log_dir / "collection.log").write_text(error, encoding="utf-8")
        collected[test_file] = (log_dir, interleaved(alone), interleaved(together), skipped, error)
    any_alone = any(alone for _, alone, _, _, _ in collected.values())
    counts = shard_counts({f: together for f, (_, _, together, _, _) in collected.items()},
                          jobs - alone_jobs if any_alone and jobs > alone_jobs else jobs)
    quick = [(test_file, part, f"shard-{i}") for test_file, (_, _, together, _, _) in collected.items()
             for i, part in enumerate(shards(together, counts.get(test_file, 1)))]
    # the cases of their own after every shard, the files taking turns
    own = taking_turns([[(test_file, [nodeid], f"alone-{i}") for i, nodeid in enumerate(alone)]
                        for test_file, (_, alone, _, _, _) in collected.items()])
    alone_slots = threading.BoundedSemaphore(alone_jobs)

    def run_alone(ids, log_dir, name):
        with alone_slots:
            return run_shard(ids, log_dir, name, env, deadline)

    futures = collections.defaultdict(list)
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for test_file, ids, name in quick:
            futures[test_file].append(pool.submit(run_shard, ids, collected[test_file][0], name, env, deadline))
        for test_file, ids, name in own:
            futures[test_file].append(pool.submit(run_alone, ids, collected[test_file][0], name))
        results = {}
        for test_file, (log_dir, alone, together, skipped, error) in collected.items():
            ran = {}
            processes = 0
            for future in futures[test_file]:
                shard_cases, shard_processes = future.result()
                ran.update(shard_cases)
                processes += shard_processes
            ordered = list(skipped.values()) + [ran[nodeid] for nodeid in (*alone, *together)]
            note = f"{SEED_ENV}={env[SEED_ENV]}" + ("; collection failed, see collection.log" if error else "")
            cases = [dict(dataclasses.asdict(c), nodeid=display_id(c.nodeid)) for c in ordered]
            results[test_file] = {"cases": cases, "collection_error": error,
                                  "summary": summary_line(test_file, ordered, processes, time.monotonic() - started,
                                                          note)}
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return results


def display_id(nodeid: str) -> str:
    """A case's id relative to the project root where it lies under it (as ``results.json`` names it)."""
    return nodeid.removeprefix(f"{ROOT}/")


def summary_line(test_file: str, cases: list, processes: int, seconds: float, note: str = "") -> str:
    counts = collections.Counter(case.outcome for case in cases)
    parts = ", ".join(f"{counts[outcome]} {outcome}" for outcome in OUTCOMES if counts[outcome])
    return (f"{test_file}: {len(cases)} cases: {parts or 'none'} ({processes} pytest processes, done at {seconds:.0f} s)"
            + (f"; {note}" if note else ""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="test files, relative to the project root")
    parser.add_argument("--out", required=True, help="directory for results.json and the processes' logs")
    parser.add_argument("--jobs", type=int, default=4, help="pytest processes at a time (default: %(default)s)")
    parser.add_argument("--alone-jobs", type=int, default=4,
                        help="of those, processes of a case of its own at a time (default: %(default)s): each may "
                             "hold gigabytes of GPU memory")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds for everything (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.alone_jobs < 1:
        parser.error(f"--alone-jobs must be at least 1, got {args.alone_jobs}")
    signal.signal(signal.SIGTERM, _stop)
    results = run_files(args.files, Path(args.out), args.jobs, args.timeout, alone_jobs=args.alone_jobs)
    bad = 0
    for result in results.values():
        print(result["summary"])
        bad += bool(result["collection_error"])
        for case in result["cases"]:
            if case["outcome"] not in ("passed", "skipped"):
                bad += 1
                print(f"  {case['outcome']}: {case['nodeid']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
