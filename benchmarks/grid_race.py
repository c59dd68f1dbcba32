"""Race one variant's default against the winners a dispatch grid recorded, problem by problem, now
and interleaved: the evidence for a rule that names a variant the grid was tuned without.

A grid (``dispatch_grid.py``) is tuned in full, for hours; a variant added after it has no times
there.  Re-tuning the grid would take as long and, on a shared machine, mix that run's load with
the grid's.  This script instead takes the grid's problems that the variant can run (``--filter``:
direction, layout, global or not), and for each times, on device arrays and interleaved
(``common.interleave``), the grid record's winner (forced with ``variant=``/``config=``), the
variant's default, and the direction's fallback (``thread_per_output`` / ``thread_per_input``
default), or with ``--config`` that configuration.  Each candidate's result is checked against the
winner's first (a backward pass bit for bit, a forward one within float32 rounding).  It prints each
problem's times and the variant's slowdown against the winner (its time over the winner's), then
the geomean and worst of those slowdowns: the figures a rule's ``evidence`` records.

    python benchmarks/grid_race.py --grid benchmarks/dispatch_grid/pocl_cpu_amd_epyc_znver3/records.json \\
        --variant channels_gather --direction backward --layout channels_last --no-global [--rounds 5]
    python benchmarks/grid_race.py --grid ... --variant global_channels --direction forward --layout channels_last \
        --only-global --config '{"block_size_x": 256, "accumulators": 4, "channels_per_item": 16}'
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

import common
import pool_tuner as pt
from pool_tuner import backends, bench, reference
from pool_tuner.problem import Problem
from pool_tuner.variants import is_global, layout_of, variants_for

import held_back

FALLBACK = {"forward": "thread_per_output", "backward": "thread_per_input"}


def grid_problems(path: Path, direction: str, layout: str | None, no_global: bool, only_global: bool = False) -> list:
    """``(Problem, winner variant, winner params)`` of the grid's float32 problems that match."""
    records = json.loads(path.read_text())["records"]
    chosen = []
    for record in records.values():
        p = record["problem"]
        problem = Problem.create(p["op"], tuple(p["input_shape"]), tuple(p["output_shape"][2:]), p["dtype"],
                                 p["layout"], direction=p["direction"])
        if problem.direction != direction or (layout and layout_of(problem) != layout):
            continue
        if (no_global and is_global(problem)) or (only_global and not is_global(problem)):
            continue
        chosen.append((problem, record["best"]["variant"], record["best"]["params"]))
    return chosen


def race(problem: Problem, winner: tuple, variant: str, device, rounds: int, rng, config: dict | None = None) -> dict:
    kind, ndim = problem.operation.kind, problem.ndim
    layout = problem.layout
    size = problem.output_shape[-ndim:]
    x = rng.uniform(-2, 2, problem.input_shape).astype(np.float32)
    if problem.direction == "forward":
        function, args, last = getattr(pt, problem.op), (common.device_input(device, x, layout),), size
    else:  # a random upstream gradient (and, for max, the indices of x's maxima)
        grad = rng.uniform(-2, 2, problem.output_shape).astype(np.float32)
        args = (common.device_input(device, grad, layout),)
        if problem.operation.selects:
            _, indices = reference.forward(problem.op, x, size)
            args += (common.device_input(device, indices, layout),)
        function, last = getattr(pt, f"{problem.op}_backward"), problem.input_shape

    def call(name, config):
        return lambda: function(*args, last, variant=name, config=config)

    candidates = {"winner": bench.Candidate(call(*winner), device.queue.finish),
                  variant: bench.Candidate(call(variant, config or {}), device.queue.finish),
                  "fallback": bench.Candidate(call(FALLBACK[problem.direction], {}), device.queue.finish)}
    want = held_back.host_copy(candidates["winner"].call())
    # a forward average sums in another order in each variant and configuration: equal within float32
    same = np.array_equal if problem.direction == "backward" else (lambda a, b: np.allclose(a, b, rtol=1e-5, atol=1e-6))
    for name, candidate in candidates.items():
        if not same(held_back.host_copy(candidate.call()), want):
            raise AssertionError(f"{problem.op} {problem.input_shape}: {name} differs from the grid's winner")
    timings = common.interleave(candidates, rounds, 0.2, rng)
    return {"op": problem.op, "kind": kind, "input": list(problem.input_shape), "output": list(size),
            "layout": layout, "winner": {"variant": winner[0], "params": winner[1]},
            "ms": {k: timings.summary(k)["median"] for k in candidates},
            "slowdown": timings.ratio(variant, "winner")["of_medians"],
            "fallback_slowdown": timings.ratio("fallback", "winner")["of_medians"]}


def main() -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--grid", type=Path, required=True, help="a dispatch grid's records.json")
    parser.add_argument("--variant", required=True)
    parser.add_argument("--direction", default="backward", choices=("forward", "backward"))
    parser.add_argument("--layout", choices=("channels_first", "channels_last"))
    parser.add_argument("--no-global", action="store_true", help="leave out global pooling problems")
    parser.add_argument("--only-global", action="store_true", help="only global pooling problems")
    parser.add_argument("--config", type=json.loads, default={},
                        help="the variant's configuration as JSON (default: its default for each problem); "
                             "problems it is not legal for are left out")
    parser.add_argument("--rounds", type=int, default=5)
    common.add_output_argument(parser)
    args = parser.parse_args()
    device = backends.default_device()
    info = common.circumstances(device=device)
    print(common.describe_circumstances(info), flush=True)
    rng = np.random.default_rng()
    rows = []
    limits = device.info.limits
    for problem, *winner in grid_problems(args.grid, args.direction, args.layout, args.no_global,
                                                args.only_global):
        if not variants_for(problem.op, problem.direction)[args.variant].is_legal(args.config, problem, limits):
            continue
        rows.append(race(problem, tuple(winner), args.variant, device, args.rounds, rng, args.config))
        r = rows[-1]
        print(f"  {r['op']} {'x'.join(map(str, r['input']))} -> {'x'.join(map(str, r['output']))} {r['layout']}: "
              f"winner {r['winner']['variant']} {r['ms']['winner']:.3f} ms, {args.variant} {r['ms'][args.variant]:.3f} "
              f"({r['slowdown']:.2f}x), fallback {r['ms']['fallback']:.3f} ({r['fallback_slowdown']:.2f}x)", flush=True)
    slowdowns = [r["slowdown"] for r in rows]
    summary = {"problems": len(rows), "geomean": math.exp(sum(map(math.log, slowdowns)) / len(slowdowns)),
               "worst": max(slowdowns)} if rows else {"problems": 0}
    print(f"\n{args.variant} over the grid's winners: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else
                                                               f"{k} {v}" for k, v in summary.items()))
    return common.finish(info, {"circumstances": info, "problems": rows, "summary": summary}, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
