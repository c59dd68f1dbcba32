"""First call at a new batch size against a warm call of that size: what a known layer costs the
first time it meets a batch size it has not run at.

A model's layer keeps its per-sample shape while the batch size changes (the last batch of an
epoch, a server's request sizes).  For one per-sample shape (default: 24 channels of 19x23 pooled
to 5x7), the layer is first warmed at one batch size, then called at ``--new`` other batch sizes in
turn: the first call at each is timed alone, then warm calls of that size (``pool_tuner.bench``'s
loops of calls back to back, medians of ``--rounds`` loops).  Reported per batch size and as the
median and largest ratio first / warm.  A ratio near 1 means a new batch size costs nothing extra;
a kernel built per batch size shows as a first call hundreds of times its warm call.

Builds hide behind PoCL's on-disk kernel cache: a program PoCL built once, in any process, is
loaded from ``POCL_CACHE_DIR`` the next time.  Each measurement therefore runs in a fresh process
(``--api``: the numpy API, the ``pool_tuner.torch`` module, each in its own) with its own PoCL cache
directory, in up to three states (``--pocl-cache``):

* ``cold``: an empty cache directory -- a user's first run on a machine, every build in full;
* ``disk``: the directory the ``cold`` run filled -- a later run of the same program, builds found
  on disk (programs PoCL loads instead of compiling);
* ``off``: ``POCL_KERNEL_CACHE=0`` -- PoCL neither reads nor writes a cache.

The column ``PoCL +programs`` counts the programs each first call added to the cache directory
(``cold``: builds PoCL compiled).

    python benchmarks/first_call.py [--api numpy,torch] [--pocl-cache cold,disk] [--shape 24x19x23:5x7]
                                    [--warm-batch 8] [--new 24] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import common

APIS = common.APIS
POCL_CACHE_STATES = ("cold", "disk", "off")


def pocl_programs(directory: Path) -> int:
    """Programs in PoCL's kernel cache directory (one ``program.bc`` each)."""
    return sum(1 for _ in directory.glob("*/*/program.bc"))


def child(args) -> dict:
    """One fresh process's measurement (the parent chose its PoCL cache state through the
    environment); returns the JSON-ready result."""
    import pool_tuner as pt
    from pool_tuner import bench

    channels, height, width = args.per_sample
    if args.api == "torch":
        import torch

        import pool_tuner.torch as ptt

        if args.threads:
            torch.set_num_threads(args.threads)
        layer = ptt.AdaptiveAvgPool2d(args.output_size)

        def make(batch):
            return torch.from_numpy(np.random.default_rng(batch).standard_normal(
                (batch, channels, height, width), dtype=np.float32))

        def call(x):
            return layer(x)
    else:
        def make(batch):
            return np.random.default_rng(batch).standard_normal((batch, channels, height, width), dtype=np.float32)

        def call(x):
            return pt.adaptive_avg_pool2d(x, args.output_size)

    cache_dir = Path(os.environ["POCL_CACHE_DIR"])
    new_batches = [b for b in range(1, args.new + 2) if b != args.warm_batch][:args.new]
    inputs = {b: make(b) for b in [args.warm_batch] + new_batches}
    for _ in range(5):
        call(inputs[args.warm_batch])
    explained = pt.explain("adaptive_avg_pool2d", inputs[args.warm_batch].shape, args.output_size)
    rows = []
    for batch in new_batches:
        x = inputs[batch]
        programs = pocl_programs(cache_dir)
        start = time.perf_counter()
        call(x)
        first_ms = (time.perf_counter() - start) * 1e3
        added = pocl_programs(cache_dir) - programs
        candidate = bench.Candidate(lambda x=x: call(x), lambda: None)
        calls = common.calls_for(candidate, args.loop_ms * 1e-3)
        warm_ms = float(np.median([bench.time_loop(candidate, calls) for _ in range(args.rounds)]))
        rows.append({"batch": batch, "first_ms": first_ms, "warm_ms": warm_ms, "ratio": first_ms / warm_ms,
                     "pocl_programs_added": added, "warm_calls_per_loop": calls})
    return {"variant": explained["variant"], "source": explained["source"], "rows": rows}


def run_child(args, api: str, state: str, cache_dir: Path) -> dict:
    """Run ``child`` for ``api`` in a fresh interpreter with PoCL's cache in ``state``."""
    env = dict(os.environ, POCL_CACHE_DIR=str(cache_dir), POCL_KERNEL_CACHE="0" if state == "off" else "1")
    command = [sys.executable, __file__, "--child", "--api", api, "--shape", args.shape,
               "--warm-batch", str(args.warm_batch), "--new", str(args.new), "--rounds", str(args.rounds),
               "--loop-ms", str(args.loop_ms)] + (["--threads", str(args.threads)] if args.threads else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"first_call: the {api}/{state} child failed (exit {done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_shape(text: str) -> tuple:
    """``"24x19x23:5x7"`` -> ``((24, 19, 23), (5, 7))``."""
    shape, _, out = text.partition(":")
    return tuple(int(s) for s in shape.split("x")), tuple(int(s) for s in out.split("x"))


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--api", default=",".join(APIS), help="comma-separated, of numpy, torch (default: %(default)s)")
    parser.add_argument("--pocl-cache", default="cold,disk",
                        help="comma-separated PoCL cache states, of cold, disk, off (default: %(default)s)")
    parser.add_argument("--shape", default="24x19x23:5x7", help="per-sample CxHxW:HxW (default: %(default)s)")
    parser.add_argument("--warm-batch", type=int, default=8, help="batch size warmed first (default: %(default)s)")
    parser.add_argument("--new", type=int, default=24, help="new batch sizes, 1, 2, ... skipping the warm one "
                        "(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="warm loops per batch size (default: %(default)s)")
    parser.add_argument("--loop-ms", type=float, default=20.0, help="wall time each warm loop aims at "
                        "(default: %(default)s)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's default)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    common.add_output_argument(parser)
    args = parser.parse_args()
    args.per_sample, args.output_size = parse_shape(args.shape)
    if args.child:
        print(json.dumps(child(args)))
        return
    apis = common.choices(parser, args.api, APIS, "--api")
    states = common.pocl_cache_states(parser, args.pocl_cache, POCL_CACHE_STATES)
    info = common.circumstances()
    print(common.describe_circumstances(info))
    print(f"per-sample shape {args.shape}, warmed at batch {args.warm_batch}, then {args.new} new batch sizes")
    results, summary_rows = [], []
    with tempfile.TemporaryDirectory(prefix="first_call_") as tmp:
        for api in apis:
            cache_dir = Path(tmp) / api
            for state in states:
                result = run_child(args, api, state, cache_dir if state != "off" else Path(tmp) / f"{api}_off")
                result.update(api=api, pocl_cache=state)
                results.append(result)
                ratios = [r["ratio"] for r in result["rows"]]
                worst = max(result["rows"], key=lambda r: r["ratio"])
                print(f"\n{api}, PoCL cache {state} (kernel {result['variant']}, from {result['source']})")
                print(common.format_table(
                    ["batch", "first ms", "warm ms", "first/warm", "PoCL +programs"],
                    [[r["batch"], f"{r['first_ms']:.2f}", f"{r['warm_ms']:.3f}", f"{r['ratio']:.1f}x",
                      r["pocl_programs_added"]] for r in result["rows"]]))
                summary_rows.append([f"{api}, PoCL cache {state}", f"{np.median(ratios):.1f}x",
                                     f"{worst['ratio']:.1f}x (batch {worst['batch']})",
                                     f"{np.median([r['first_ms'] for r in result['rows']]):.2f}",
                                     f"{np.median([r['warm_ms'] for r in result['rows']]):.3f}",
                                     sum(r["pocl_programs_added"] for r in result["rows"])])
    print("\nSummary over the new batch sizes")
    print(common.format_table(["api, state", "median first/warm", "max first/warm", "median first ms",
                               "median warm ms", "PoCL +programs"], summary_rows))
    print("\nfirst ms: the first call at that batch size, alone; warm ms: median of loops of calls back to back"
          "\nat that size right after; PoCL +programs: programs the first call added to PoCL's kernel cache"
          "\n(cold: compiled; disk: found on disk, none added; off: PoCL's cache disabled)")
    common.write_json(args.out, {"benchmark": "first_call", "circumstances": common.record_end(info),
                                 "shape": args.shape, "warm_batch": args.warm_batch, "results": results})


if __name__ == "__main__":
    main()
