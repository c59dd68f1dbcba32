"""One command for a GPU lease: everything that needs a GPU, each step under its own timeout, all
within one budget, everything written under one folder, and a one-page report at the end.

GPU machines are lent rarely and for minutes (docs/gpu.md): a lease is spent running this, not
debugging it.  The steps, in the order of what a lease must not miss:

1. ``tests``: tests/test_cuda_gpu.py and tests/test_cuda.py through ``isolated_tests.py`` (the
   quick cases of both files in shards first, that start again after a fault; the cases that can
   fault or need gigabytes in processes of their own beside them, ``ALONE_JOBS`` at a time; every
   test function tried early, so a cut-off run is a sample of all of them), a summary line per
   file.  It does not finish in one session (about 1900 quick cases and 120 of their own, 5-45 s
   each): what it did not reach is listed ``not run``;
2. ``suite_float32``: ``pool-tuner bench``, the suite's presets and the held-out (untuned) layers
   against PyTorch, forward and backward, each problem kept as soon as it is measured
   (``bench_rows.jsonl``), so a step cut off still reports what it measured;
3. ``global_pooling``: benchmarks/global_pooling.py on the layers of the issue's global-pooling
   targets, then a few huge planes: PyTorch, ``pool_tuner.torch`` and the kernels alone
   (global_blocks among them) against the copy floor;
4. ``call_overhead``: benchmarks/cuda_call_overhead.py;
5. ``gem``: benchmarks/gem.py, fused GeM against PyTorch's four-op composition;
   ``models``: benchmarks/models.py --device cuda, two cases of each model;
6. ``suite_float16``: the suite's forward passes in float16;
7. ``memory``: benchmarks/memory_growth.py;
8. ``dispatch_grid`` and ``derive_rules``: the grid within its budget (adding to the GPU's grid data
   in the checkout), then the ``gpu`` rules derived from it, written to ``default_rules.json``
   (``derived_from`` names the grid's directory, which names the GPU);
9. ``tune_float32``, ``tune_float16``: ``pool-tuner tune --preset all``, the records then exported
   to ``tuning_cache/cuda_<arch>.json``.

Every step builds its kernels into the session's one cubin directory (``POOL_TUNER_CUBIN_DIR``,
``<work>/cubin``): a kernel one step (or test process) compiled, the next reads.

The budget (``--budget``, 560 s) covers the whole command: ``START_UP_S`` for the start, each fixed
step's timeout (``TIMEOUTS``), the report's ``RESERVE_S``; the tuning steps (the grid and the two
tunings) come last and share what is left when each starts (``TUNING_SHARES``), so a lease's
remaining time, not a fixed number, cuts them short; the plan is refused before anything runs when
the fixed timeouts leave them less than ``MIN_TUNING_S``.  A step that fails or runs out of time is
reported so, and the next one runs.  ``--dry-run`` runs
every step here, on this machine's default device and tiny sizes (the CUDA test files skip without
a GPU; the steps that need one are expected to fail): its exit status is 0 when the plumbing works.

    python benchmarks/gpu_session.py [--out DIR] [--work DIR] [--budget 560] [--jobs 14] [--only STEPS]
                                     [--timeout STEP=SECONDS ...] [--dry-run]

Each step writes into the session's working folder (``--work``, else a new temporary directory);
after each step the output folder (``--out``, else ``$OUT``, else a new temporary directory) gets
``report.md``, what each step did so far, and ``session.tar.gz``, the working folder (compiled
kernels left out): two files, as few as a lease's ``$OUT`` brings back, and a session cut off by its
lease's limit still leaves what it had done.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
#: The budget of a session, and of a dry run: a lease's command may run 600 s; this leaves the rest
#: for what the command runs before (installing the checkout), the last step's ``STOP_GRACE_S`` and
#: packing.  A lease has 900 s of device time in all, its start taking about 30 s: a second,
#: shorter command fits after this one (docs/gpu.md).
BUDGET_S = 560.0
#: Seconds of the budget kept for what precedes the first step -- the interpreter's start, the
#: imports, nvidia-smi, copying the grid data -- ...
START_UP_S = 10.0
#: ... and for the report after the last.
RESERVE_S = 5.0
#: Seconds a step has to end after SIGTERM at its timeout, before SIGKILL.
STOP_GRACE_S = 10.0
#: A step is not started with less than this left (it would only be killed).
MIN_STEP_S = 10.0
#: Seconds each step of a fixed length may take on a GPU, from the first run of this script on an
#: H100 (docs/benchmarks.md): the steps cut short there get more (gem, global_pooling's huge
#: planes), the test step the most, as what a lease must not miss; the steps that finished early
#: (memory, derive_rules) less.  Those whose work does not fit take what fits (tests, the suites).
TIMEOUTS = {"tests": 160, "suite_float32": 70, "global_pooling": 60, "call_overhead": 20, "gem": 40, "models": 50,
            "suite_float16": 35, "memory": 15, "derive_rules": 10}
#: ... and here, in a dry run (a shared machine: generous).
DRY_RUN_TIMEOUTS = {"tests": 60, "suite_float32": 30, "global_pooling": 60, "call_overhead": 25, "gem": 30,
                    "models": 30, "suite_float16": 30, "memory": 25, "derive_rules": 20}
#: Test processes at a time (a GPU machine's 16 cores, nvcc dominating the quick cases), and of
#: them, cases of their own at a time (each holds about 8-12 GB of GPU memory).
JOBS = 14
ALONE_JOBS = 4
#: The tuning steps, last: each may take this share of the time left when it starts, less the
#: timeouts of the fixed steps after it (derive_rules), so that they are cut short by what remains
#: of the budget, not by a number fixed beforehand (tuning costs about 0.65 s per configuration:
#: nvcc).  The last takes all that is left.
TUNING_SHARES = {"dispatch_grid": 0.7, "tune_float32": 0.6, "tune_float16": 1.0}
#: The budget must leave the tuning steps together at least this much after the fixed steps.
MIN_TUNING_S = 60.0
#: Seconds of a step's timeout kept for what follows its own budget: the tests' runner writing its
#: results, the grid finishing the problem in progress.
WIND_DOWN_S = 10
#: The session's working folder packed into the output folder, and its name inside the archive.
PACKED = "session.tar.gz"
SESSION_DIR = "session"
#: The session's cubin directory under its working folder (left out of the packed folder).
CUBIN_DIR = "cubin"
#: The GPU's grid (``dispatch_grid.py --grid-file``), measured (``--measure``) to fit the grid step.
GPU_GRID = BENCHMARKS / "dispatch_grid" / "gpu_grid.json"
#: The test files that need a GPU.
GPU_TEST_FILES = ("tests/test_cuda_gpu.py", "tests/test_cuda.py")


@dataclasses.dataclass
class Step:
    """One command of the session.  ``command`` is the argv, or a function of the step's timeout
    returning it when it depends on what an earlier step wrote or on the time it is given.
    ``timeout_s``: its timeout; or with ``share`` (the tuning steps, ``TUNING_SHARES``) that share
    of the time left when it starts (``step_timeout``).  ``conclude(step_dir, log_text)`` reads
    what the step wrote, writes what follows from it, and returns the key figures for the report.
    ``needs_gpu``: the step cannot work without a CUDA GPU (in a dry run its failure is expected)."""

    name: str
    command: list | Callable[[float], list]
    timeout_s: float | None
    conclude: Callable[[Path, str], list] = lambda step_dir, log: last_lines(log)
    env: dict = dataclasses.field(default_factory=dict)
    needs_gpu: bool = False
    share: float | None = None


@dataclasses.dataclass
class Outcome:
    name: str
    status: str  # "ok", "failed (exit N)", "timed out", "not started: ..."
    seconds: float
    figures: list
    log: str
    command: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def last_lines(log: str, count: int = 3) -> list:
    """The last ``count`` non-empty lines of a log: the figures of a step that prints its summary last."""
    return [line.rstrip() for line in log.splitlines() if line.strip()][-count:]


def python(*args) -> list:
    return [sys.executable, *map(str, args)]


# ---------------------------------------------------------------------- what each step leaves

def tests_figures(step_dir: Path, log: str) -> list:
    results = step_dir / "results.json"
    if not results.exists():
        return last_lines(log)
    lines = []
    for result in json.loads(results.read_text()).values():
        lines.append(result["summary"])
        bad = [c for c in result["cases"] if c["outcome"] not in ("passed", "skipped")]
        lines += [f"{c['outcome']}: {c['nodeid']}" for c in bad[:15]]
        if len(bad) > 15:
            lines.append(f"... and {len(bad) - 15} more (results.json)")
    return lines


def suite_figures(step_dir: Path, log: str) -> list:
    """The suite's geomeans from ``bench.json``; from a run cut off before writing it, those of the
    problems it finished (``bench_rows.jsonl``)."""
    from pool_tuner import bench

    path = step_dir / "bench.json"
    if not path.exists():
        rows_path = step_dir / bench.ROWS_FILE
        rows = [json.loads(line) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
        if not rows:
            return last_lines(log)
        lines = [f"cut off after {len(rows)} problems ({bench.ROWS_FILE}; floors from the streams timed before)"]
        for direction in dict.fromkeys(row["direction"] for row in rows):
            picked = [row for row in rows if row["direction"] == direction]
            lines.append(f"{direction}, {len(picked)} problems: geomean "
                         f"{bench.geomean(r['speedup_vs_torch'] for r in picked):.2f}x PyTorch, tuned/default "
                         f"{bench.geomean(r['tuned_vs_default'] for r in picked):.2f}x, "
                         f"{bench.geomean(r['times_floor'] for r in picked):.2f}x the copy floor")
        return lines
    report = json.loads(path.read_text())
    lines = [f"{report['device']}; copy {report['copy_gbs']:.0f} GB/s"]
    for label, summary in report["summary"].items():
        lines.append(f"{label}: geomean {summary['geomean_speedup_vs_torch']:.2f}x PyTorch, tuned/default "
                     f"{summary['geomean_tuned_vs_default']:.2f}x, {summary['geomean_times_floor']:.2f}x the copy floor")
    return lines


def memory_figures(step_dir: Path, log: str) -> list:
    """The summary table memory_growth.py prints (after the line ``Summary``)."""
    lines = log.splitlines()
    if "Summary" not in lines:
        return last_lines(log)
    table = lines[lines.index("Summary") + 1:]
    return table[:table.index("")] if "" in table else table


def export_records(step_dir: Path, log: str, work: Path) -> list:
    """The tuned records (the step's cache) merged into ``tuning_cache/<device>.json`` under ``work``:
    ``cuda_sm_<arch>`` for a CUDA GPU, ``<backend>_<type>`` elsewhere."""
    from pool_tuner import cache

    source = step_dir / "cache" / cache.USER_FILE
    if not source.exists():
        return last_lines(log) + ["no records written"]
    records = json.loads(source.read_text())["records"]
    devices = {json.dumps(r["device"], sort_keys=True) for r in records.values()}
    lines = last_lines(log, 2)
    for device in map(json.loads, sorted(devices)):
        name = (f"cuda_sm_{device['compute_capability'].replace('.', '')}" if device.get("backend") == "cuda"
                else f"{device.get('backend')}_{device.get('type', 'device')}")
        target = work / "tuning_cache" / f"{name}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        count = cache.merge_files([source], target)
        lines.append(f"{count} records of {device.get('name')} merged into {target.relative_to(work)}")
    return lines


def grid_data_dir(work: Path) -> Path:
    """The device directory the ``dispatch_grid`` step worked in (its log's first line names it),
    among the grids of other GPUs that ``seed_grid`` copied beside it."""
    log = work / "dispatch_grid" / "log.txt"
    found = re.search(r"; data: (.+)/records\.json$", log.read_text(), re.MULTILINE) if log.exists() else None
    if found is None:
        raise FileNotFoundError(f"the dispatch_grid step's log ({log}) names no grid data")
    return Path(found.group(1))


def seed_grid(work: Path) -> None:
    """Copy the GPUs' grid data of the checkout (``benchmarks/dispatch_grid/cuda_*``, what earlier
    leases measured) into ``work``: ``dispatch_grid.py`` skips the problems already there, so each
    lease's budget adds to the grid."""
    for directory in (BENCHMARKS / "dispatch_grid").glob("cuda_*"):
        shutil.copytree(directory, work / "dispatch_grid" / directory.name, dirs_exist_ok=True)


# ---------------------------------------------------------------------- the steps

def steps(work: Path, dry_run: bool, jobs: int, timeouts: dict | None = None) -> list:
    """The session's steps: on a GPU (``cuda:0``), or tiny on this machine's default device for
    ``dry_run``; each with its timeout of ``TIMEOUTS`` (``DRY_RUN_TIMEOUTS``) or ``timeouts``, the
    tuning steps with their share of the time left (``TUNING_SHARES``) unless ``timeouts`` names
    them."""
    timeout = {**(DRY_RUN_TIMEOUTS if dry_run else TIMEOUTS), **(timeouts or {})}
    share = {name: None if name in timeout else part for name, part in TUNING_SHARES.items()}
    device = [] if dry_run else ["--device", "cuda:0"]
    cli = python("-m", "pool_tuner.cli")
    if dry_run:  # one shape, one round, the variants that run every problem; a few huge planes
        suite = {dtype: ["--preset", "upsample_area", "--direction", "forward", "--repeat", "1", "--stream-mib", "1"]
                 for dtype in ("float32", "float16")}
        global_pooling = ["--shape", "2x8x7x7", "--shape", "2x8x9x9:NHWC", "--shape", "1x2x512x512", "--repeat", "1"]
        overhead = ["--preset", "upsample_area", "--no-tiny", "--calls", "5", "--repeat", "1"]
        models = ["--models", "resnet18", "--cases", "infer_b1", "--rounds", "1"]
        gem = ["--shapes", "2x8x7x7", "--outputs", "1", "--dtypes", "float32", "--rounds", "1", "--loop-s", "0.01"]
        memory = ["--api", "numpy", "--shapes", "4", "--every", "2", "--pocl-cache", "cold"]
        grid = ["--measure", "--grid-file", GPU_GRID, "--limit", "1", "--variants", "thread_per_output,thread_per_input"]
        tune = ["--preset", "upsample_area", "--direction", "forward", "--variants", "thread_per_output",
                "--max-fevals", "1", "--time-limit", "0.5"]
    else:
        suite = {"float32": ["--direction", "both", "--repeat", "3"],
                 "float16": ["--direction", "forward", "--repeat", "3"]}
        global_pooling = ["--issue-layers", "--split-layers", "--repeat", "5"]
        overhead = ["--calls", "100", "--repeat", "5"]
        models = ["--cases", "infer_b64,train_b32", "--rounds", "3", "--loop-s", "0.1"]
        gem = ["--outputs", "1,3", "--rounds", "3", "--loop-s", "0.1"]
        memory = ["--api", "numpy", "--shapes", "20", "--every", "10", "--pocl-cache", "cold"]
        grid = ["--measure", "--grid-file", GPU_GRID]
        tune = ["--preset", "all", "--direction", "both", "--strategy", "random_sample", "--max-fevals", "4",
                "--time-limit", "2"]
    tune_cache = {"POOL_TUNER_CACHE_DIR": str(work / "tune" / "cache")}

    def suite_step(dtype):
        return Step(f"suite_{dtype}", cli + ["bench", *device, "--dtype", dtype, "--out", work / f"suite_{dtype}",
                                            *suite[dtype]], timeout[f"suite_{dtype}"], suite_figures)

    return [
        Step("tests", python(BENCHMARKS / "isolated_tests.py", *GPU_TEST_FILES, "--out", work / "tests", "--jobs", jobs,
                             "--alone-jobs", min(ALONE_JOBS, jobs), "--timeout", timeout["tests"] - WIND_DOWN_S),
             timeout["tests"], tests_figures),
        suite_step("float32"),
        Step("global_pooling", python(BENCHMARKS / "global_pooling.py", *device, *global_pooling),
             timeout["global_pooling"], lambda step_dir, log: last_lines(log, 10)),
        Step("call_overhead", python(BENCHMARKS / "cuda_call_overhead.py", *overhead, "--json",
                                     work / "call_overhead" / "call_overhead.json"), timeout["call_overhead"],
             needs_gpu=True),
        Step("gem", python(BENCHMARKS / "gem.py", *device, *gem, "--out", work / "gem" / "gem.json"), timeout["gem"],
             lambda step_dir, log: last_lines(log, 10)),
        Step("models", python(BENCHMARKS / "models.py", "--device", "cuda", *models, "--out",
                              work / "models" / "models.json"), timeout["models"], needs_gpu=True),
        suite_step("float16"),
        Step("memory", python(BENCHMARKS / "memory_growth.py", *memory, "--out", work / "memory" / "memory.json"),
             timeout["memory"], memory_figures),
        Step("dispatch_grid", lambda seconds: python(
            BENCHMARKS / "dispatch_grid.py", *device, "--data-root", work / "dispatch_grid", *grid, "--budget",
            max(seconds - WIND_DOWN_S, 1)), timeout.get("dispatch_grid"), share=share["dispatch_grid"]),
        Step("derive_rules", lambda seconds: python(BENCHMARKS / "derive_rules.py", "--data-dir", grid_data_dir(work),
                                                    "--device-type", "cpu" if dry_run else "gpu",
                                                    "--rules-out", work / "default_rules.json"),
             timeout["derive_rules"], lambda step_dir, log: last_lines(log, 2)),
        *[Step(f"tune_{dtype}", cli + ["tune", *device, "--dtype", dtype, "--quiet", *tune],
               timeout.get(f"tune_{dtype}"), lambda step_dir, log: export_records(work / "tune", log, work),
               env=tune_cache, share=share[f"tune_{dtype}"])
          for dtype in ("float32", "float16")],
    ]


def step_timeout(step: Step, left: float, later_fixed: float) -> float:
    """The timeout of ``step`` started with ``left`` seconds of the budget left (the report's
    reserve already taken), ``later_fixed`` of them promised to the fixed steps after it: its own
    timeout, or a tuning step's share of what the later steps leave -- at most what is left."""
    if step.share is None:
        return min(step.timeout_s, left)
    return max(left - later_fixed, 0.0) * step.share


def plan_problem(chosen: list, budget: float) -> str | None:
    """Why the steps ``chosen`` cannot fit ``budget``, or None: the fixed steps' timeouts, the
    start-up and the report's reserve must leave the tuning steps (if any) ``MIN_TUNING_S``."""
    fixed = sum(step.timeout_s for step in chosen if step.share is None)
    tuning = MIN_TUNING_S if any(step.share is not None for step in chosen) else 0.0
    needed = fixed + START_UP_S + RESERVE_S + tuning
    if needed <= budget:
        return None
    return (f"the steps need {needed:.0f} s ({fixed:.0f} s of fixed timeouts, {START_UP_S + RESERVE_S:.0f} s to start "
            f"and report{f', {tuning:.0f} s for tuning' if tuning else ''}), more than the budget of {budget:.0f} s")


# ---------------------------------------------------------------------- running them

def run_step(step: Step, work: Path, deadline: float, later_fixed: float = 0.0) -> Outcome:
    """Run ``step`` under its timeout (``step_timeout``), its output in its log; ``later_fixed``:
    the seconds promised to the fixed steps after it."""
    step_dir = work / step.name
    step_dir.mkdir(parents=True, exist_ok=True)
    log_path = step_dir / "log.txt"
    left = deadline - time.monotonic() - RESERVE_S
    timeout = step_timeout(step, left, later_fixed)
    if timeout < MIN_STEP_S:
        return Outcome(step.name, f"not started: {left:.0f} s of the budget left", 0.0, [], "", "")
    started = time.monotonic()
    try:
        command = [str(part) for part in (step.command(timeout) if callable(step.command) else step.command)]
    except Exception as exc:  # noqa: BLE001 - what the step needs from an earlier one is missing
        return Outcome(step.name, f"not started: {exc}", 0.0, [], "", "")
    env = dict(os.environ, PYTHONUNBUFFERED="1", POOL_TUNER_CUBIN_DIR=str(work / CUBIN_DIR), **step.env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            status = "ok" if proc.wait(timeout=timeout) == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            stop(proc)
            status = f"timed out after {timeout:.0f} s"
    seconds = time.monotonic() - started
    text = log_path.read_text(encoding="utf-8", errors="replace")
    try:
        figures = step.conclude(step_dir, text)
    except Exception as exc:  # noqa: BLE001 - a report with the reason beats no report
        figures = [f"could not read the step's results: {type(exc).__name__}: {exc}"] + last_lines(text)
    return Outcome(step.name, status, seconds, figures, str(log_path.relative_to(work)), shlex.join(command))


def stop(proc) -> None:
    """End a step at its timeout: SIGTERM to its process group (``isolated_tests.py`` then kills the
    pytest processes it started in groups of their own), SIGKILL after ``STOP_GRACE_S``."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def machine() -> str:
    """The GPUs ``nvidia-smi`` lists, or that it lists none."""
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "no nvidia-smi: no NVIDIA GPU here"
    return "; ".join(proc.stdout.split("\n")[:-1]) or "nvidia-smi lists no GPU"


def report(outcomes: list, pending: list, dry_run: bool, budget: float, seconds: float, needs_gpu: set,
           gpus: str) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [f"# GPU session{' (dry run)' if dry_run else ''}, {when}", "",
             f"- machine: {gpus}", f"- command: `{shlex.join(sys.argv)}`",
             f"- budget {budget:.0f} s, {seconds:.0f} s so far; the logs named here are in `{PACKED}` "
             f"(`tar xzf {PACKED}`: `{SESSION_DIR}/<step>/...`)", "",
             "| step | status | seconds | log |", "|---|---|---|---|"]
    for o in outcomes:
        note = " (needs a CUDA GPU: expected in a dry run)" if dry_run and o.name in needs_gpu and not o.ok else ""
        lines.append(f"| {o.name} | {o.status}{note} | {o.seconds:.0f} | {o.log} |")
    lines += [f"| {name} | not run yet |  |  |" for name in pending]
    for o in outcomes:
        lines += ["", f"## {o.name}: {o.status}", ""]
        if o.command:
            lines.append(f"`{o.command}`")
            lines.append("")
        lines += [f"    {figure}" for figure in o.figures] or ["(no figures)"]
    return "\n".join(lines) + "\n"


def default_out() -> Path:
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(tempfile.mkdtemp(prefix="gpu_session_out_"))


def pack(work: Path, out: Path) -> None:
    """``out/session.tar.gz``: the working folder as ``session/``, without compiled kernels (the
    session's ``cubin/``, and the tuning cache's) and lock files; written to a temporary name, then
    renamed."""
    def keep(member):
        parts = Path(member.name).parts
        return None if CUBIN_DIR in parts or member.name.endswith(".lock") else member

    partial = out / f".{PACKED}.partial"
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(work, arcname=SESSION_DIR, filter=keep)
    os.replace(partial, out / PACKED)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for report.md and session.tar.gz (default: $OUT, else a new temporary "
                                      "directory)")
    parser.add_argument("--work", help="the session's working folder (default: a new temporary directory)")
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help="seconds for the whole session, start-up included (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=JOBS, help="test processes at a time (default: %(default)s; "
                                                                 f"at most {ALONE_JOBS} of them a case of its own)")
    parser.add_argument("--only", help="comma-separated step names to run (default: every step)")
    parser.add_argument("--timeout", action="append", default=[], metavar="STEP=SECONDS",
                        help="a step's timeout instead of its default, repeatable (a lease for the grid alone: "
                             "--only dispatch_grid,derive_rules --timeout dispatch_grid=420)")
    parser.add_argument("--dry-run", action="store_true",
                        help="every step here on this machine's default device and tiny sizes: checks the plumbing")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    budget = args.budget
    if budget <= 0:
        parser.error(f"--budget must be a positive number of seconds, got {budget}")
    every = [s.name for s in steps(Path(), args.dry_run, args.jobs)]
    timeouts = {}
    for given in args.timeout:
        name, _, seconds = given.partition("=")
        if name not in every or not re.fullmatch(r"\d+", seconds) or int(seconds) <= WIND_DOWN_S:
            parser.error(f"--timeout takes STEP=SECONDS, a step of {', '.join(every)} and more than {WIND_DOWN_S} "
                         f"seconds, got {given!r}")
        timeouts[name] = int(seconds)
    names = args.only.split(",") if args.only else every
    unknown = sorted(set(names) - set(every))
    if unknown:
        parser.error(f"--only: no step {', '.join(unknown)}; the steps are {', '.join(every)}")
    out = Path(args.out) if args.out else default_out()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu_session_"))
    for folder in (out, work):
        folder.mkdir(parents=True, exist_ok=True)
    out, work = out.resolve(), work.resolve()
    chosen = [s for s in steps(work, args.dry_run, args.jobs, timeouts) if s.name in names]
    problem = plan_problem(chosen, budget)
    if problem:
        parser.error(f"{problem}: give a larger --budget, smaller --timeout values or fewer steps (--only)")
    started = time.monotonic()
    deadline = started + budget - START_UP_S
    if not args.dry_run:
        seed_grid(work)
    needs_gpu = {s.name for s in chosen if s.needs_gpu}
    gpus = machine()
    outcomes = []
    for done, step in enumerate(chosen, 1):
        print(f"[gpu_session] {step.name} ...", flush=True)
        later_fixed = sum(s.timeout_s for s in chosen[done:] if s.share is None)
        outcomes.append(run_step(step, work, deadline, later_fixed))
        print(f"[gpu_session] {step.name}: {outcomes[-1].status} ({outcomes[-1].seconds:.0f} s)", flush=True)
        text = report(outcomes, [s.name for s in chosen[done:]], args.dry_run, budget, time.monotonic() - started,
                      needs_gpu, gpus)
        (out / "report.md").write_text(text, encoding="utf-8")
        pack(work, out)
    print(text)
    print(f"[gpu_session] {out / 'report.md'}, {out / PACKED} (the working folder {work})")
    failed = [o for o in outcomes if not o.ok and not (args.dry_run and o.name in needs_gpu)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
