"""Memory a process keeps for every distinct shape it has called: its resident set, and PoCL's
kernel cache directory on disk.

A process that meets many shapes (a server fed images of every size, a sweep) keeps, per shape,
whatever the call path memoises -- validated problems, dispatch decisions, built programs -- and
PoCL writes every program it compiles to its on-disk cache.  For ``--shapes`` distinct input shapes
(default 400, 2x4xHxW pooled to 4x3), each called once, this reports the process's resident set
(``VmRSS`` of ``/proc/self/status``) and the size of PoCL's cache directory every ``--every``
shapes, then after a second pass over the same shapes (which should add nothing), then after
``pool_tuner.release_memory()`` and a garbage collection.

Each API (``--api``: the numpy API, the ``pool_tuner.torch`` module) runs in fresh processes with
``POCL_CACHE_DIR`` in a temporary directory of its own, in up to two states (``--pocl-cache``):
``cold``, an empty directory, where PoCL compiles every program and writes it there (the
directory's growth is the cost of the builds on disk), and ``disk``, the directory the cold run
filled, where PoCL loads every program from disk instead (what a later run of the same program
does; a loaded program takes memory of its own, and the directory does not grow).

    python benchmarks/memory_growth.py [--api numpy,torch] [--shapes 400] [--every 50] [--pocl-cache cold,disk] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import common

APIS = common.APIS
POCL_CACHE_STATES = ("cold", "disk")
OUTPUT_SIZE = (4, 3)


def rss_kib() -> int:
    """The process's resident set in KiB: ``VmRSS`` where ``/proc`` has it, else the peak from
    ``getrusage`` (an upper bound)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def pocl_cache(directory: Path) -> tuple:
    """``(bytes, programs)`` of PoCL's kernel cache directory."""
    files = [p for p in directory.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), sum(1 for p in files if p.name == "program.bc")


def shapes(count: int) -> list:
    """``count`` distinct input shapes 2x4xHxW, H and W from 5 upwards (every W for one H, then
    the next H)."""
    side = int(np.ceil(np.sqrt(count)))
    return [(2, 4, 5 + i // side, 5 + i % side) for i in range(count)]


def child(args) -> dict:
    """One API's run in a fresh process (the parent set ``POCL_CACHE_DIR``)."""
    import pool_tuner as pt

    if args.api == "torch":
        import torch

        import pool_tuner.torch as ptt

        layer = ptt.AdaptiveAvgPool2d(OUTPUT_SIZE)

        def call(x):
            layer(torch.from_numpy(x))
    else:
        def call(x):
            pt.adaptive_avg_pool2d(x, OUTPUT_SIZE)

    cache_dir = Path(os.environ["POCL_CACHE_DIR"])
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(shape, dtype=np.float32) for shape in shapes(args.shapes)]
    call(rng.standard_normal((2, 4, 4, 4), dtype=np.float32))  # device, queue and imports: not per shape
    gc.collect()

    def point(label, done):
        cache_bytes, programs = pocl_cache(cache_dir)
        return {"label": label, "shapes": done, "rss_kib": rss_kib(), "pocl_cache_bytes": cache_bytes,
                "pocl_programs": programs, "elapsed_s": time.perf_counter() - start}

    start = time.perf_counter()
    points = [point("start", 0)]
    for i, x in enumerate(inputs, 1):
        call(x)
        if i % args.every == 0 or i == len(inputs):
            points.append(point("first pass", i))
            print(f"{args.api}: {i} shapes, {points[-1]['elapsed_s']:.0f} s", file=sys.stderr, flush=True)
    for x in inputs:
        call(x)
    points.append(point("second pass", len(inputs)))
    pt.release_memory()
    gc.collect()
    points.append(point("release_memory + gc", len(inputs)))
    return {"points": points}


def run_child(args, api: str, cache_dir: Path) -> dict:
    env = dict(os.environ, POCL_CACHE_DIR=str(cache_dir), POCL_KERNEL_CACHE="1")
    command = [sys.executable, __file__, "--child", "--api", api, "--shapes", str(args.shapes),
               "--every", str(args.every)]
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"memory_growth: the {api} child failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--api", default=",".join(APIS), help="comma-separated, of numpy, torch (default: %(default)s)")
    parser.add_argument("--shapes", type=int, default=400, help="distinct shapes (default: %(default)s)")
    parser.add_argument("--every", type=int, default=50, help="shapes between readings (default: %(default)s)")
    parser.add_argument("--pocl-cache", default="cold,disk",
                        help="comma-separated PoCL cache states, of cold, disk (default: %(default)s)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    common.add_output_argument(parser)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    apis = common.choices(parser, args.api, APIS, "--api")
    states = common.pocl_cache_states(parser, args.pocl_cache, POCL_CACHE_STATES)
    info = common.circumstances()
    print(common.describe_circumstances(info))
    print(f"{args.shapes} distinct shapes 2x4xHxW -> {OUTPUT_SIZE[0]}x{OUTPUT_SIZE[1]}, each called once, then a second pass")
    results, summary = [], []
    with tempfile.TemporaryDirectory(prefix="memory_growth_") as tmp:
        for api, state in [(api, state) for api in apis for state in POCL_CACHE_STATES if state in states]:
            result = dict(run_child(args, api, Path(tmp) / api), api=api, pocl_cache=state)
            results.append(result)
            points = result["points"]
            base = points[0]
            rows = [[p["label"], p["shapes"], f"{p['rss_kib'] / 1024:.1f}", f"{(p['rss_kib'] - base['rss_kib']) / 1024:+.1f}",
                     f"{(p['rss_kib'] - base['rss_kib']) / p['shapes']:.1f}" if p["shapes"] else "",
                     f"{p['pocl_cache_bytes'] / 2**20:.2f}", p["pocl_programs"], f"{p['elapsed_s']:.0f}"]
                    for p in points]
            print(f"\n{api}, PoCL cache {state}")
            print(common.format_table(["reading", "shapes", "RSS MiB", "growth MiB", "KiB/shape", "PoCL cache MiB",
                                       "programs", "s"], rows))
            passes = [p for p in points if p["label"] == "first pass"]
            first = passes[-1]
            slope = ((first["rss_kib"] - passes[0]["rss_kib"]) / (first["shapes"] - passes[0]["shapes"])
                     if len(passes) > 1 else float("nan"))
            second, released = points[-2], points[-1]
            cache_growth = first["pocl_cache_bytes"] - base["pocl_cache_bytes"]
            summary.append([f"{api}, PoCL cache {state}",
                            f"{(first['rss_kib'] - base['rss_kib']) / first['shapes']:.1f}", f"{slope:.1f}",
                            f"{(second['rss_kib'] - first['rss_kib']) / 1024:+.1f}",
                            f"{(released['rss_kib'] - base['rss_kib']) / 1024:+.1f}",
                            f"{cache_growth / first['shapes'] / 1024:.1f}"])
    print("\nSummary")
    print(common.format_table(["api, state", "RSS KiB/new shape", "after first reading", "second pass MiB",
                               "kept after release MiB", "PoCL cache KiB/new shape"], summary))
    print("\nRSS: VmRSS of the process; growth and KiB/shape against the reading after one warm-up call of another"
          "\nshape; after first reading: KiB per shape from the first reading to the end of the first pass (without"
          "\nwhat the first shapes cost once); second pass: the same shapes again; kept after release: growth"
          "\nstill held after pool_tuner.release_memory() and gc.collect(); PoCL cache: bytes of files in"
          "\nPOCL_CACHE_DIR (cold: compiled programs written; disk: programs loaded from it)")
    common.write_json(args.out, {"benchmark": "memory_growth", "circumstances": common.record_end(info),
                                 "shapes": args.shapes, "output_size": list(OUTPUT_SIZE), "results": results})


if __name__ == "__main__":
    main()
