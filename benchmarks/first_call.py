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

``--model NAME`` times a whole torchvision model instead (``weights=None``), stock against
``replace_pooling``, each in a fresh process of its own per PoCL cache state (in one process, the
model called second at a batch size would find the convolutions' one-time costs of that size paid
by the first): the first forward (eval mode, under ``torch.inference_mode()``) at the warm batch
size -- the process's first -- then at each new batch size a first forward followed by a second of
the same batch.  Reported: the first and second forward of each, and stock / pool_tuner of the
first forwards (below 1: pool_tuner's first call at a new size costs more than the stock model's).

    python benchmarks/first_call.py [--api numpy,torch] [--pocl-cache cold,disk] [--shape 24x19x23:5x7]
                                    [--warm-batch 8] [--new 24] [--out FILE]
    python benchmarks/first_call.py --model mobilenet_v3_large [--warm-batch 1] [--new 6] [--threads 2]
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


def model_child(args) -> dict:
    """``child`` for ``--model``: the first and second forwards at each batch size of the stock
    model (``--side stock``) or of its ``replace_pooling`` copy (see the module docstring)."""
    import torch
    import torchvision

    import pool_tuner.torch as ptt

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = torchvision.models.get_model(args.model, weights=None).eval()
    if args.side == "pool_tuner":
        model = ptt.replace_pooling(model)
    cache_dir = Path(os.environ["POCL_CACHE_DIR"])
    batches = [args.warm_batch] + [b for b in range(1, args.new + 2) if b != args.warm_batch][:args.new]
    rows = []
    with torch.inference_mode():
        for batch in batches:
            x = torch.from_numpy(np.random.default_rng(batch).standard_normal((batch, 3, 224, 224), dtype=np.float32))
            programs = pocl_programs(cache_dir)
            start = time.perf_counter()
            model(x)
            middle = time.perf_counter()
            model(x)
            rows.append({"batch": batch, "first_ms": (middle - start) * 1e3,
                         "second_ms": (time.perf_counter() - middle) * 1e3,
                         "pocl_programs_added": pocl_programs(cache_dir) - programs})
    return {"rows": rows}


def print_model_result(sides: dict, state: str, model: str) -> list:
    """Print a ``--model`` state's table from its two children's results; returns its summary row."""
    print(f"\n{model}, PoCL cache {state}")
    pairs = list(zip(sides["stock"]["rows"], sides["pool_tuner"]["rows"]))
    print(common.format_table(
        ["batch", "stock first ms", "pool_tuner first ms", "stock/pt first", "stock second ms",
         "pool_tuner second ms", "PoCL +programs (pt)"],
        [[f"{s['batch']}{' (first in process)' if i == 0 else ''}", f"{s['first_ms']:.1f}", f"{p['first_ms']:.1f}",
          f"{s['first_ms'] / p['first_ms']:.2f}x", f"{s['second_ms']:.1f}", f"{p['second_ms']:.1f}",
          p["pocl_programs_added"]] for i, (s, p) in enumerate(pairs)]))
    ratios = [s["first_ms"] / p["first_ms"] for s, p in pairs[1:]]
    return [f"{model}, PoCL cache {state}", f"{pairs[0][0]['first_ms'] / pairs[0][1]['first_ms']:.2f}x",
            f"{np.median([s['first_ms'] for s, _ in pairs[1:]]):.1f}",
            f"{np.median([p['first_ms'] for _, p in pairs[1:]]):.1f}", f"{np.median(ratios):.2f}x",
            f"{min(ratios):.2f}x"]


def run_child(args, who: str, state: str, cache_dir: Path) -> dict:
    """Run ``child`` (with ``--model``: ``model_child``) in a fresh interpreter with PoCL's cache in
    ``state``; ``who``: the API the layer is called through, or with ``--model`` the side (stock,
    pool_tuner)."""
    env = dict(os.environ, POCL_CACHE_DIR=str(cache_dir), POCL_KERNEL_CACHE="0" if state == "off" else "1")
    chosen = ["--model", args.model, "--side", who] if args.model else ["--api", who]
    command = [sys.executable, __file__, "--child", *chosen, "--shape", args.shape,
               "--warm-batch", str(args.warm_batch), "--new", str(args.new), "--rounds", str(args.rounds),
               "--loop-ms", str(args.loop_ms)] + (["--threads", str(args.threads)] if args.threads else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"first_call: the {who}/{state} child failed (exit {done.returncode}):\n{done.stderr}")
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
    parser.add_argument("--model", help="a torchvision model name: time its first forwards, stock against "
                        "replace_pooling, instead of one layer (--api and --shape are then unused)")
    parser.add_argument("--side", choices=("stock", "pool_tuner"), help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    common.add_output_argument(parser)
    args = parser.parse_args()
    args.per_sample, args.output_size = parse_shape(args.shape)
    if args.child:
        print(json.dumps(model_child(args) if args.model else child(args)))
        return
    apis = common.choices(parser, args.api, APIS, "--api")
    states = common.pocl_cache_states(parser, args.pocl_cache, POCL_CACHE_STATES)
    info = common.circumstances()
    print(common.describe_circumstances(info))
    if args.model:
        return model_main(args, states, info)
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


def model_main(args, states: list, info: dict) -> None:
    """``main`` for ``--model``: one fresh process per PoCL cache state."""
    try:
        import torchvision
    except ImportError:
        raise SystemExit('first_call.py --model needs torchvision: pip install "pool-tuner[bench]"') from None
    print(f"{args.model} (torchvision {torchvision.__version__}): first forwards at batch {args.warm_batch}, then "
          f"{args.new} new batch sizes")
    results, summary_rows = [], []
    with tempfile.TemporaryDirectory(prefix="first_call_") as tmp:
        for state in states:
            sides = {side: run_child(args, side, state, Path(tmp) / (side if state != "off" else f"{side}_off"))
                     for side in ("stock", "pool_tuner")}
            results.append({"pocl_cache": state, **sides})
            summary_rows.append(print_model_result(sides, state, args.model))
    print("\nSummary over the new batch sizes")
    print(common.format_table(["model, state", "stock/pt first in process", "median stock first ms",
                               "median pt first ms", "median stock/pt first", "min stock/pt first"], summary_rows))
    print("\nfirst ms: a batch size's first forward, alone; second ms: the next forward of the same batch;"
          "\nstock/pt first: stock's first forward / pool_tuner's (below 1: pool_tuner's costs more); each model"
          "\nin a process of its own, whose first forward is the first row's")
    common.write_json(args.out, {"benchmark": "first_call", "circumstances": common.record_end(info),
                                 "model": args.model, "warm_batch": args.warm_batch, "results": results})


if __name__ == "__main__":
    main()
