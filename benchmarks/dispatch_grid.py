"""Tune a broad grid of problems on one device: the data that ``pool_tuner``'s default-dispatch rules
are derived from (``benchmarks/derive_rules.py``; docs/design.md, "Default rules").

The grid crosses what decides which kernel is fastest: op kind (avg, max), direction, layout
(channels-first, channels-last), the window regime (global, uniform windows, non-uniform windows,
one axis pooled, upsampling), the plane size and the number of planes, in 2d, with a smaller cross
in 1d and 3d.  Every problem is tuned as ``pool-tuner tune`` tunes it (every variant searched
within a small budget, the winners raced against each other and the default), and its record --
winner, runners-up, default, each variant's raced time -- goes to the grid's own cache file, not to
the user's cache.  Problems already in that file are skipped (whatever kernel code they were
tuned on), so a run can be stopped (Ctrl-C keeps the problem in progress as a partial record,
which a later run re-tunes) and resumed.

On a GPU, ``pool-tuner tune``'s way costs about 30 s a problem (Kernel Tuner runs nvcc once per
configuration), so a lease's minutes tune a handful.  ``--measure`` measures each problem as the
benchmark mode does (``pool_tuner.measured.measure_neighbourhoods``): every variant's rule
configuration and its one-parameter changes, built together (one nvcc run for all of a problem's
configurations), timed on the device in one interleaved race (device timers, several launches each,
medians), the record of every configuration's time kept; the next problems' programs compile in
other threads meanwhile (``--compile-ahead``).  With ``--grid-file`` the grid is a data
file of crosses instead of the broad grid below: ``dispatch_grid/gpu_grid.json`` is the GPU's,
sized for a lease and chosen where the ``gpu`` rules decide.

    python benchmarks/dispatch_grid.py                         # tune the grid on the default device
    python benchmarks/dispatch_grid.py --limit 20 --list       # see what it would tune
    python benchmarks/dispatch_grid.py --budget 240            # stop starting problems after 4 minutes
    python benchmarks/dispatch_grid.py --device cuda:0 --measure --grid-file benchmarks/dispatch_grid/gpu_grid.json
    python benchmarks/derive_rules.py                          # rebuild the rules from the data

The shipped data (``benchmarks/dispatch_grid/<device>/records.json``) is what the shipped rules
were derived from; run both scripts on another device to rebuild them there.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import random
import re
import sys
import time
from pathlib import Path

from tqdm import tqdm

import pool_tuner as pt
from pool_tuner import backends, cache, dispatch, measured, memo
from pool_tuner.problem import LAYOUT_NAMES, Problem
from pool_tuner.variants import variants_for
from pool_tuner.windows import fixed_pool_equivalent

GRID_DIR = Path(__file__).resolve().parent / "dispatch_grid"
#: Per-problem search budget: small, because the grid is broad; each variant still gets its
#: default and a few sampled configurations, and the race settles the winner.
MAX_FEVALS = 4
TIME_LIMIT_S = 3.0
#: Plane sides (2d) and, for each, the (batch, channels) of a problem with few planes and with
#: many: few planes is where splitting a plane over work-items matters.
SIDES_2D = {7: ((2, 64), (32, 512)), 24: ((2, 64), (16, 256)), 56: ((2, 32), (8, 128))}
#: Memo entries (``pool_tuner.memo``) of a --measure run: more than a problem's neighbourhood builds
#: (every variant's configuration and up to ``measured.REFINE_LIMIT`` changes of it, two kernels
#: where a configuration has a second pass).
MEMO_LIMIT = 512
#: Threads compiling the next problems' programs while one is timed (--compile-ahead): nvcc is
#: single-threaded, and a GPU machine has cores to spare.
COMPILE_AHEAD = max(1, min(8, (os.cpu_count() or 2) - 1))
REGIMES = ("global", "uniform", "non-uniform", "one_axis", "upsampling")


def output_extent(regime: str, side: int) -> int:
    """The output extent of one pooled axis of ``side`` inputs in ``regime``."""
    if regime == "global":
        return 1
    if regime == "uniform":  # windows of 4 (7 -> 7: windows of 1, the identity)
        return side // 4 if side % 4 == 0 else side
    if regime == "non-uniform":  # windows of two sizes: the first extent past a third of the side
        return next(o for o in range(side // 3 + 1, side) if fixed_pool_equivalent(side, o) is None)
    if regime == "upsampling":
        return side + side // 2 + 1
    raise ValueError(regime)


def output_size(regime: str, spatial: tuple) -> tuple:
    if regime == "one_axis":  # pool the last axis away, keep the others (coordinate attention)
        return tuple(spatial[:-1]) + (1,)
    return tuple(output_extent(regime, s) for s in spatial)


def grid() -> list:
    """``(op, input_shape, output_size, layout, direction, dtype)`` of every problem of the broad
    grid, float32."""
    problems = []
    for kind, direction, channels_last, regime in itertools.product(("avg", "max"), ("forward", "backward"),
                                                                   (False, True), REGIMES):
        layout = ("NHWC" if channels_last else "NCHW")
        for side, plane_counts in SIDES_2D.items():
            for batch, channels in plane_counts:
                problems.append((f"adaptive_{kind}_pool2d", (batch, channels, side, side),
                                 output_size(regime, (side, side)), layout, direction, "float32"))
        if not channels_last and regime != "one_axis":
            problems.append((f"adaptive_{kind}_pool1d", (16, 256, 777), output_size(regime, (777,)), "NCL",
                             direction, "float32"))
            problems.append((f"adaptive_{kind}_pool3d", (4, 128, 8, 14, 14), output_size(regime, (8, 14, 14)),
                             "NCDHW", direction, "float32"))
    return problems


def grid_from_file(path: Path) -> list:
    """The problems of a grid data file (``gpu_grid.json``), as ``grid`` gives them: each of its
    ``crosses`` is the product of its ``kinds``, ``directions``, ``layouts`` (``channels_first``,
    ``channels_last``), ``regimes`` (``REGIMES``), input ``shapes`` and ``dtypes``."""
    problems = []
    for cross in json.loads(Path(path).read_text())["crosses"]:
        for kind, direction, layout, regime, shape, dtype in itertools.product(
                cross["kinds"], cross["directions"], cross["layouts"], cross["regimes"], cross["shapes"],
                cross["dtypes"]):
            if regime not in REGIMES:
                raise ValueError(f"{path}: regime {regime!r} is none of {', '.join(REGIMES)}")
            rank = len(shape) - 2
            problems.append((f"adaptive_{kind}_pool{rank}d", tuple(shape), output_size(regime, tuple(shape[2:])),
                             LAYOUT_NAMES[rank][layout == "channels_last"], direction, dtype))
    return problems


def problem_of(entry: tuple) -> Problem:
    """The ``Problem`` of a grid entry (``grid``'s tuples)."""
    op, shape, out, layout, direction, dtype = entry
    return Problem.create(op, shape, out, dtype, layout, direction=direction)


def grid_cache(device, root: Path = GRID_DIR) -> cache.TuningCache:
    """The grid's own cache: ``<root>/<device slug>/records.json``, and nothing shipped under it."""
    directory = root / device_slug(device)
    directory.mkdir(parents=True, exist_ok=True)
    empty = directory / "no_shipped_records"
    empty.mkdir(exist_ok=True)
    return cache.TuningCache(shipped_dir=empty, user_dir=directory)


def device_slug(device) -> str:
    """The directory of a device's grid data: ``pocl_cpu`` for PoCL's CPU device (id
    ``opencl:pocl:0``); for a CUDA GPU its name, e.g. ``cuda_nvidia_h100_80gb_hbm3`` (GPUs of one
    backend differ more than CPUs of one OpenCL platform, and the rules derived from the data name
    the directory they came from)."""
    if device.info.backend == "cuda":
        return "cuda_" + re.sub(r"[^a-z0-9]+", "_", device.info.name.lower()).strip("_")
    backend_or_platform = device.info.id.split(":")[1] if device.info.id.count(":") == 2 else device.info.id.split(":")[0]
    return f"{backend_or_platform}_{device.info.fingerprint.get('type', 'device')}"


def compile_ahead(device, todo: list, only: list | None, threads: int):
    """Start compiling the one program of each problem of ``todo`` (``measured.neighbourhoods``,
    ``dispatch.DISPATCHER.shared_program``) into the compiler's cache, in order, in ``threads``
    threads: a problem's build then finds its program compiled, or waits for the thread compiling
    it (the cache's lock per program), instead of running nvcc while the device idles.  Returns the
    executor, or None where the device builds no shared programs (OpenCL).  A program that fails
    here fails again in the problem's build, which then builds its configurations one by one."""
    programs = []
    for entry in todo:
        problem = problem_of(entry)
        variants = only and [name for name in variants_for(problem.op, problem.direction) if name in only]
        program = dispatch.DISPATCHER.shared_program(device, problem, measured.neighbourhoods(problem, device, variants))
        if program is None:
            return None
        programs.append(program)
    executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="compile_ahead")
    for program in programs:
        executor.submit(device.compile, program)
    return executor


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="pool_tuner device id (default: the default device)")
    parser.add_argument("--limit", type=int, default=None, help="tune at most this many problems of the grid")
    parser.add_argument("--max-fevals", type=int, default=MAX_FEVALS, help="configurations per variant")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S, help="seconds per variant's search")
    parser.add_argument("--variants", help="comma-separated: tune only these, where a problem's op has them "
                                           "(a quick check; the rules need every variant's times)")
    parser.add_argument("--measure", action="store_true",
                        help="measure each problem as the benchmark mode does (one build of every variant's "
                             "neighbourhood, one race) instead of tuning it: minutes for a GPU grid, not hours")
    parser.add_argument("--compile-ahead", type=int, default=COMPILE_AHEAD, metavar="THREADS",
                        help="with --measure, where a problem's configurations build as one program (CUDA): "
                             "compile the next problems' programs in this many threads while one is timed "
                             "(0: none; default: %(default)s)")
    parser.add_argument("--grid-file", help="the grid as data (e.g. benchmarks/dispatch_grid/gpu_grid.json) "
                                            "instead of the broad grid")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds: start no problem after this long (the one in progress finishes)")
    parser.add_argument("--data-root", default=str(GRID_DIR),
                        help="directory holding each device's data directory (default: benchmarks/dispatch_grid)")
    parser.add_argument("--problems-of", metavar="RECORDS_JSON",
                        help="tune only the grid problems that this grid's records hold (another model's grid, "
                             "so that the two grids compare problem by problem)")
    parser.add_argument("--list", action="store_true", help="print the problems to tune and exit")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be a positive number of problems, got {args.limit}")
    if args.budget is not None and args.budget <= 0:
        parser.error(f"--budget must be a positive number of seconds, got {args.budget}")
    if args.grid_file is not None and not Path(args.grid_file).is_file():
        parser.error(f"--grid-file must be a grid data file, {args.grid_file!r} is none")
    entries = grid_from_file(Path(args.grid_file)) if args.grid_file else grid()
    if args.measure:  # a problem's whole neighbourhood is built at once, and must stay built until timed
        memo.set_limit(max(memo.limit(), MEMO_LIMIT))
    device = backends.resolve_device(args.device)
    table = grid_cache(device, Path(args.data_root))
    only = args.variants.split(",") if args.variants else None
    # Done: a full record of the problem on this device, of whatever kernel code (the grid is the
    # evidence of its day; rebuild it whole with a fresh directory after kernel changes).
    done = {(cache.problem_of(r), json.dumps(r["device"], sort_keys=True)) for r in table.records().values()
            if not cache.is_partial(r)}
    this_device = json.dumps(device.info.fingerprint, sort_keys=True)
    todo = [entry for entry in entries if (problem_of(entry), this_device) not in done]
    if args.problems_of:
        theirs = {cache.problem_of(r) for r in json.loads(Path(args.problems_of).read_text())["records"].values()}
        todo = [entry for entry in todo if problem_of(entry) in theirs]
    random.Random(0).shuffle(todo)  # so that a run stopped early has sampled every part of the grid
    todo = todo[: args.limit]
    print(f"{len(entries)} grid problems, {len(todo)} to {'measure' if args.measure else 'tune'} on "
          f"{device.info.describe()}; data: {table.path()}")
    if args.list:
        print("\n".join(" ".join(map(str, entry)) for entry in todo))
        return 0
    started = time.perf_counter()
    done = 0
    ahead = compile_ahead(device, todo, only, args.compile_ahead) if args.measure and args.compile_ahead else None
    try:
        for entry in tqdm(todo, unit="problem"):
            if args.budget is not None and time.perf_counter() - started > args.budget:
                print(f"\nthe budget of {args.budget:.0f} s is spent after {done} problems; run again to go on")
                break
            problem = problem_of(entry)
            variants = only and [name for name in variants_for(problem.op, problem.direction) if name in only]
            if args.measure:
                try:
                    record = measured.measure_neighbourhoods(problem, device, variants=variants)
                except Exception as exc:  # noqa: BLE001 - one problem's failure must not cost a lease the rest
                    print(f"\nmeasuring {problem} failed ({type(exc).__name__}: {exc}); going on", file=sys.stderr)
                    record = None
                if record is not None:
                    table.store(record)
            else:
                pt.tune(problem.op, problem.input_shape, problem.output_size, problem.dtype, problem.layout,
                        device=device, direction=problem.direction, max_fevals=args.max_fevals,
                        time_limit=args.time_limit, tuning_cache=table, variants=variants)
            done += 1
    except KeyboardInterrupt as stop:
        print(f"\nstopped after {done} problems: {stop}; run again to go on", file=sys.stderr)
        return 130
    finally:
        if ahead is not None:
            ahead.shutdown(wait=True, cancel_futures=True)
    print(f"{'measured' if args.measure else 'tuned'} {done} problems in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
