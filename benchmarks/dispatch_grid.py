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

    python benchmarks/dispatch_grid.py                         # tune the grid on the default device
    python benchmarks/dispatch_grid.py --limit 20 --list       # see what it would tune
    python benchmarks/dispatch_grid.py --budget 240            # stop starting problems after 4 minutes
    python benchmarks/derive_rules.py                          # rebuild the rules from the data

The shipped data (``benchmarks/dispatch_grid/<device>/records.json``) is what the shipped rules
were derived from; run both scripts on another device to rebuild them there.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import sys
import time
from pathlib import Path

from tqdm import tqdm

import pool_tuner as pt
from pool_tuner import backends, cache
from pool_tuner.problem import Problem
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
    """``(op, input_shape, output_size, layout, direction)`` of every grid problem, float32."""
    problems = []
    for kind, direction, channels_last, regime in itertools.product(("avg", "max"), ("forward", "backward"),
                                                                   (False, True), REGIMES):
        layout = ("NHWC" if channels_last else "NCHW")
        for side, plane_counts in SIDES_2D.items():
            for batch, channels in plane_counts:
                problems.append((f"adaptive_{kind}_pool2d", (batch, channels, side, side),
                                 output_size(regime, (side, side)), layout, direction))
        if not channels_last and regime != "one_axis":
            problems.append((f"adaptive_{kind}_pool1d", (16, 256, 777), output_size(regime, (777,)), "NCL",
                             direction))
            problems.append((f"adaptive_{kind}_pool3d", (4, 128, 8, 14, 14), output_size(regime, (8, 14, 14)),
                             "NCDHW", direction))
    return problems


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="pool_tuner device id (default: the default device)")
    parser.add_argument("--limit", type=int, default=None, help="tune at most this many problems of the grid")
    parser.add_argument("--max-fevals", type=int, default=MAX_FEVALS, help="configurations per variant")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S, help="seconds per variant's search")
    parser.add_argument("--variants", help="comma-separated: tune only these, where a problem's op has them "
                                           "(a quick check; the rules need every variant's times)")
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
    device = backends.resolve_device(args.device)
    table = grid_cache(device, Path(args.data_root))
    only = args.variants.split(",") if args.variants else None
    # Done: a full record of the problem on this device, of whatever kernel code (the grid is the
    # evidence of its day; rebuild it whole with a fresh directory after kernel changes).
    done = {(cache.problem_of(r), json.dumps(r["device"], sort_keys=True)) for r in table.records().values()
            if not cache.is_partial(r)}
    this_device = json.dumps(device.info.fingerprint, sort_keys=True)
    todo = [(op, shape, out, layout, direction) for op, shape, out, layout, direction in grid()
            if (Problem.create(op, shape, out, layout=layout, direction=direction), this_device) not in done]
    if args.problems_of:
        theirs = {cache.problem_of(r) for r in json.loads(Path(args.problems_of).read_text())["records"].values()}
        todo = [entry for entry in todo if Problem.create(*entry[:3], layout=entry[3], direction=entry[4]) in theirs]
    random.Random(0).shuffle(todo)  # so that a run stopped early has sampled every part of the grid
    todo = todo[: args.limit]
    print(f"{len(grid())} grid problems, {len(todo)} to tune on {device.info.describe()}; data: {table.path()}")
    if args.list:
        print("\n".join(" ".join(map(str, entry)) for entry in todo))
        return 0
    started = time.perf_counter()
    done = 0
    try:
        for op, shape, out, layout, direction in tqdm(todo, unit="problem"):
            if args.budget is not None and time.perf_counter() - started > args.budget:
                print(f"\nthe budget of {args.budget:.0f} s is spent after {done} problems; run again to go on")
                break
            pt.tune(op, shape, out, layout=layout, direction=direction, device=device, max_fevals=args.max_fevals,
                    time_limit=args.time_limit, tuning_cache=table, variants=only and [
                        name for name in variants_for(op, direction) if name in only])
            done += 1
    except KeyboardInterrupt as stop:
        print(f"\nstopped after {done} problems: {stop}; run again to go on", file=sys.stderr)
        return 130
    print(f"tuned {done} problems in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
