"""Fleet tuning against tuning one problem after another, on this machine.

    python benchmarks/fleet_tuning.py [--rounds 2] [--max-fevals 1] [--out FILE]

The same problems with the same budget, tuned three ways, in alternating order every round:

* sequential: ``pool_tuner.tune`` on every problem in turn, in one process pinned to CPU 0;
* fleet: ``pool_tuner.tune_many`` through a Ray cluster of two nodes, pinned to CPU 0 and CPU 1
  (``taskset``), whose tunings run at once;
* once at the end, the fleet again with the second node killed (SIGKILL to all its processes) a
  moment after it starts a tuning: every problem must still reach the cache.

Every node and the sequential tuner run PoCL with one thread (``POCL_MAX_PTHREAD_COUNT=1``), so all
of them are the same device model and write records under the same keys, and with PoCL's kernel
cache off, so no run reuses another's compiled kernels.  The fleet's time is the whole
``tune_many`` call (connecting, asking the nodes for their devices, tuning, storing); the cluster is
started before it, as a fleet is up before anyone tunes on it.  The sequential time is the loop of
``tune`` calls.  The records of each fleet run are compared with the sequential run's
(``fleet.timing_free``: everything but what clocks decide).  The driver's overhead per problem is
measured from the fleet's outcomes: from a task's end on its node to its record stored by the
driver (transfer and store), and from a task's end to the next task's start on that node
(scheduling).

The problems: the benchmark suite (``presets``) less its three largest layers (``pspnet_ppm``,
``se_block``, ``audio_1d``: 16 to 67 million elements, whose references and kernels on one thread
each take minutes of a loaded 2-core machine), both directions, every variant sampled
``--max-fevals`` times (Kernel Tuner's ``random_sample``): a tuning as a user runs it, on a smaller
budget.  The machine's load average is recorded before and after each run:
other work on the two CPUs moves every number.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from ray_cluster import LocalCluster, node_env  # noqa: E402

import pool_tuner  # noqa: E402
from pool_tuner import cache as cache_mod  # noqa: E402
from pool_tuner import fleet, presets  # noqa: E402
from pool_tuner.problem import Problem  # noqa: E402

#: PoCL's kernel cache off: each run compiles what it tunes.
ENV = {"POCL_KERNEL_CACHE": "0"}
LEFT_OUT = ("pspnet_ppm", "se_block", "audio_1d")

SEQUENTIAL = """
import json, sys, time
from pathlib import Path
from pool_tuner import cache as cache_mod, tuner
from pool_tuner.problem import Problem
spec = json.loads(sys.argv[1])
table = cache_mod.TuningCache(Path(spec["shipped"]), Path(spec["cache"]))
problems = [Problem(op, d, dt, lay, tuple(i), tuple(o)) for op, d, dt, lay, i, o in spec["problems"]]
started = time.perf_counter()
for p in problems:
    tuner.tune(p.op, p.input_shape, p.output_shape[-p.ndim:], p.dtype, p.layout, direction=p.direction,
               tuning_cache=table, **spec["budget"])
print(json.dumps({"seconds": time.perf_counter() - started}))
"""


def problems() -> list:
    """The problems, each once (coord_attention's 56xNone and Nonex56 are one problem on 56x56)."""
    return list(dict.fromkeys(Problem.create(op, shape, out, direction=direction)
                              for name, shapes in presets.PRESETS.items() if name not in LEFT_OUT
                              for op, shape, out in shapes for direction in ("forward", "backward")))


def fields(problem: Problem) -> list:
    return [problem.op, problem.direction, problem.dtype, problem.layout, list(problem.input_shape),
            list(problem.output_shape)]


def run_sequential(work: Path, todo: list, budget: dict) -> dict:
    spec = {"shipped": str(work / "shipped"), "cache": str(work / "cache"), "budget": budget,
            "problems": [fields(p) for p in todo]}
    load = os.getloadavg()[0]
    proc = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", SEQUENTIAL, json.dumps(spec)],
                          env=node_env(1, ENV), capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"the sequential tuning failed:\n{proc.stderr[-3000:]}")
    return {"seconds": json.loads(proc.stdout.splitlines()[-1])["seconds"], "load_before": load,
            "load_after": os.getloadavg()[0], "records": read(work / "cache")}


def run_fleet(work: Path, todo: list, budget: dict, kill_second: bool = False) -> dict:
    cluster = LocalCluster(work, ENV)
    try:
        cluster.start(1, head=True, cpus="0")
        second = cluster.start(1, cpus="1")
        killer = threading.Thread(target=cluster.kill_once_it_tunes, args=(second,)) if kill_second else None
        os.environ.update(node_env(1, ENV))  # the driver connects as the nodes do
        load = os.getloadavg()[0]
        started = time.perf_counter()
        if killer:
            killer.start()
        report = fleet.tune_many(todo, ray_address=cluster.address, progress=False,
                                 tuning_cache=cache_mod.TuningCache(work / "shipped", work / "cache"), **budget)
        seconds = time.perf_counter() - started
        if killer:
            killer.join()
    finally:
        cluster.stop()
    tuned = [o for o in report.outcomes if o.tuned]
    by_node: dict = {}
    for o in sorted(tuned, key=lambda o: o.entered):
        by_node.setdefault(o.node, []).append(o)
    gaps = [later.entered - earlier.finished for runs in by_node.values() for earlier, later in zip(runs, runs[1:])]
    return {"seconds": seconds, "load_before": load, "load_after": os.getloadavg()[0],
            "records": read(work / "cache"), "tuned": len(tuned), "failed": len(report.outcomes) - len(tuned),
            "retried": sum(o.attempts > 1 for o in report.outcomes), "nodes_used": len(by_node),
            "store_ms": [1000 * (o.stored_at - o.finished) for o in tuned], "schedule_ms": [1000 * g for g in gaps],
            "summary": report.summary()}


def read(directory: Path) -> dict:
    path = directory / cache_mod.USER_FILE
    return json.loads(path.read_text())["records"] if path.exists() else {}


def agree(ours: dict, theirs: dict) -> dict:
    """How far two runs' records agree: the same keys, and each the same apart from timings."""
    same = [k for k in ours if k in theirs and fleet.timing_free(ours[k]) == fleet.timing_free(theirs[k])]
    return {"keys_equal": set(ours) == set(theirs), "records": len(ours), "timing_free_equal": len(same),
            "winner_equal": sum(ours[k]["best"]["variant"] == theirs[k]["best"]["variant"]
                                and ours[k]["best"]["params"] == theirs[k]["best"]["params"] for k in same)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of sequential and fleet tuning (default 2)")
    parser.add_argument("--max-fevals", type=int, default=1, help="configurations sampled per variant (default 1)")
    parser.add_argument("--out", default="benchmarks/results/fleet_tuning.json", help="where the JSON goes")
    args = parser.parse_args(argv)
    budget = {"strategy": "random_sample", "max_fevals": args.max_fevals}
    todo = problems()
    runs = {"sequential": [], "fleet": []}
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="pt_fleet_bench_") as scratch:
        for round_ in range(args.rounds):
            order = ("sequential", "fleet") if round_ % 2 == 0 else ("fleet", "sequential")
            for kind in order:
                work = Path(scratch) / f"{kind}{round_}"
                work.mkdir()
                run = (run_sequential if kind == "sequential" else run_fleet)(work, todo, budget)
                runs[kind].append(run)
                print(f"round {round_ + 1} {kind}: {run['seconds']:.1f} s (load {run['load_before']:.1f} -> "
                      f"{run['load_after']:.1f})", file=sys.stderr, flush=True)
        work = Path(scratch) / "killed"
        work.mkdir()
        killed = run_fleet(work, todo, budget, kill_second=True)
        print(killed["summary"], file=sys.stderr)
    seq = float(np.median([r["seconds"] for r in runs["sequential"]]))
    par = float(np.median([r["seconds"] for r in runs["fleet"]]))
    reference = runs["sequential"][0]["records"]
    store_ms = [ms for r in runs["fleet"] for ms in r["store_ms"]]
    schedule_ms = [ms for r in runs["fleet"] for ms in r["schedule_ms"]]
    result = {
        "problems": len(todo), "budget": budget, "rounds": args.rounds,
        "sequential_s": [r["seconds"] for r in runs["sequential"]], "fleet_s": [r["seconds"] for r in runs["fleet"]],
        "ratio_of_medians": par / seq,
        "ratio_per_round": [f["seconds"] / s["seconds"] for f, s in zip(runs["fleet"], runs["sequential"])],
        "loads": {kind: [(r["load_before"], r["load_after"]) for r in rs] for kind, rs in runs.items()},
        "fleet_nodes_used": [r["nodes_used"] for r in runs["fleet"]],
        "agreement_with_first_sequential": {
            **{f"sequential{i}": agree(r["records"], reference) for i, r in enumerate(runs["sequential"][1:], 1)},
            **{f"fleet{i}": agree(r["records"], reference) for i, r in enumerate(runs["fleet"])},
            "killed": agree(killed["records"], reference)},
        "killed_run": {k: killed[k] for k in ("seconds", "tuned", "failed", "retried", "load_before", "load_after")}
        | {"lost": len(todo) - len(killed["records"])},
        "driver_overhead_ms": {"store_median": float(np.median(store_ms)), "store_max": float(np.max(store_ms)),
                               "schedule_median": float(np.median(schedule_ms)),
                               "schedule_max": float(np.max(schedule_ms)),
                               "per_problem_median": float(np.median(store_ms) + np.median(schedule_ms))},
        "load_average_start": list(load_start), "load_average_end": list(os.getloadavg()),
        "pool_tuner": pool_tuner.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("loads",)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
