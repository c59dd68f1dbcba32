"""What ``dispatch.NEAREST_MAX_DISTANCE`` (and ``EXACT_SHAPE_ONLY``) changes on this device: the shapes
whose nearest shipped or user record lies beyond the bound (so the default rules decide them now),
and for those whose decision differs, the kernel time of the record's choice against the rules'
choice.  A problem of a class that takes only its own shape's records (``dispatch.nearest_bound``
0) is decided by the rules, with every other shape's record beyond its bound.

Shapes (float32): the suite's presets and untuned shapes (both directions where the op has a
backward), the layers of ``held_back.py`` and the problems of a dispatch grid (``--grid``, a
directory under ``benchmarks/dispatch_grid``; none with ``--grid ''``).  ``--bound`` (at most the
device type's ``NEAREST_MAX_DISTANCE``) also takes the shapes a smaller bound would change: those
whose nearest record lies beyond it.  Each changed shape is raced in ``--rounds`` rounds
of ``tuner.race`` (both choices launched interleaved on one queue, timed by the device, the median
of ``--repetitions`` launches each), and reported as the medians over rounds and the median and
quartiles of the round-by-round ratio rules / record.  The load average is printed before and after.

    python benchmarks/nearest_bound.py [--bound 2] [--grid pocl_cpu_amd_epyc_znver3] [--rounds 7] [--list-only]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

import held_back
from pool_tuner import backends, bench, cache, default_rules, dispatch, tuner
from pool_tuner.problem import LAYOUT_NAMES, Problem

GRID_DIR = Path(__file__).resolve().parent / "dispatch_grid"


def shapes(grid: str) -> list:
    """``(label, Problem)`` of every shape this benchmark looks at."""
    found = []
    for name, op, shape, size in bench.suite():
        for direction in ("forward", "backward"):
            if direction == "backward" and "max" in op:
                continue
            layout = LAYOUT_NAMES[len(shape) - 2][0]
            found.append((f"suite {name}", Problem.create(op, shape, size, "float32", layout, direction=direction)))
    for name in [*held_back.LAYERS, *held_back.BACKWARD_LAYERS]:
        op, shape, size, layout, direction = held_back.layer(name)
        found.append((f"held_back {name}", Problem.create(op, shape, size, "float32", layout, direction=direction)))
    if grid:
        table = cache.TuningCache(GRID_DIR / grid / "no_shipped_records", GRID_DIR / grid)
        found += [(f"grid {grid}", cache.problem_of(record)) for record in table.records().values()]
    return found


def record_choice(key: str, problem: Problem, device) -> dispatch.Choice:
    """The choice record ``key`` makes for ``problem`` (what dispatch ran before the bound)."""
    variant, params = dispatch._legal_winner(dispatch.tuning_cache().lookup(key), problem, device)
    return dispatch.Choice(variant, tuple(sorted(params.items())), "nearest", key)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bound", type=float, help="list and race the shapes whose nearest record lies beyond this "
                                                    "distance (default: this device type's bound)")
    parser.add_argument("--grid", default="pocl_cpu_amd_epyc_znver3")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repetitions", type=int, default=15)
    parser.add_argument("--list-only", action="store_true")
    args = parser.parse_args(argv)
    device = backends.default_device()
    shipped_bound = dispatch.NEAREST_MAX_DISTANCE[default_rules.device_type(device)]
    bound = shipped_bound if args.bound is None else args.bound
    print(f"device {device.info.describe()}; load average {os.getloadavg()}; bound {bound} "
          f"(dispatch.NEAREST_MAX_DISTANCE here: {shipped_bound})")
    if bound > shipped_bound:
        parser.error("--bound must not exceed this device type's dispatch.NEAREST_MAX_DISTANCE: dispatch names only "
                     "the records beyond that one")
    rng = np.random.default_rng(0)
    seen = set()
    for label, problem in shapes(args.grid):
        if problem in seen:
            continue
        seen.add(problem)
        rules = dispatch.default_choice(problem, device)
        now = dispatch.DISPATCHER._from_cache(problem, device)
        if now.source == "nearest" and now.distance > bound:
            record_key, distance = now.record_key, now.distance
        elif now.source == "default" and now.beyond_bound is not None:
            record_key, distance = now.beyond_bound
        else:
            continue
        record = record_choice(record_key, problem, device)
        same = (record.variant.name, record.params) == (rules.variant.name, rules.params)
        name = (f"{label}: {problem.op} {problem.direction} {problem.layout} "
                f"{'x'.join(map(str, problem.input_shape))}->{'x'.join(map(str, problem.output_shape[2:]))}")
        print(f"{name} at {distance:.2f} from {record_key.split('|')[5]}: record {record.variant.name} "
              f"{record.config}, rules {rules.variant.name} {rules.config}{' (the same)' if same else ''}")
        if same or args.list_only:
            continue
        rounds = [tuner.race(problem, device, [record, rules], repetitions=args.repetitions, rng=rng)
                  for _ in range(args.rounds)]
        ratios = [r / n for n, r in rounds]
        q1, median, q3 = np.percentile(ratios, [25, 50, 75])
        print(f"    record {np.median([n for n, _ in rounds]):.4f} ms, rules {np.median([r for _, r in rounds]):.4f} "
              f"ms; rules / record {median:.3f} (quartiles {q1:.3f}-{q3:.3f}, {len(ratios)} rounds); "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
    print(f"load average after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
