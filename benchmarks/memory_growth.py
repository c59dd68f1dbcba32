"""Resident memory and PoCL kernel-cache growth over many distinct shapes (docs/design.md, "Memory").

Calls ``adaptive_avg_pool2d`` forward on numpy inputs of ``--shapes`` distinct shapes
``(1, 3, 8 + i // 20, 8 + i % 20) -> (3, 5)``, after five warm-up shapes, and prints the growth of
``VmRSS`` (``/proc/self/status``) and of PoCL's kernel cache directory.  Run it once with an empty
``POCL_CACHE_DIR`` (every program compiled) and once more with the same one (every program loaded
from the cache)::

    POCL_CACHE_DIR=/tmp/kcache POOL_TUNER_MEMO_LIMIT=64 python benchmarks/memory_growth.py --shapes 400
"""

import argparse
import os
import time
from pathlib import Path

import numpy as np

import pool_tuner as pt
from pool_tuner import memo


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def cache_size(directory: Path) -> tuple:
    """(MiB, files) under ``directory``."""
    files = [p for p in directory.rglob("*") if p.is_file()] if directory.is_dir() else []
    return sum(p.stat().st_size for p in files) / 2**20, len(files)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=int, default=400)
    args = parser.parse_args()
    default_cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pocl" / "kcache"
    cache_dir = Path(os.environ.get("POCL_CACHE_DIR", default_cache))
    rng = np.random.default_rng(0)

    def call(i):
        x = rng.uniform(0.5, 2.0, (1, 3, 8 + i // 20, 8 + i % 20)).astype(np.float32)
        pt.adaptive_avg_pool2d(x, (3, 5))

    for i in range(5):
        call(args.shapes + i)
    rss, (cache_mib, cache_files) = resident_mib(), cache_size(cache_dir)
    started = time.perf_counter()
    for i in range(args.shapes):
        call(i)
    grown_mib, grown_files = (now - before for now, before in zip(cache_size(cache_dir), (cache_mib, cache_files)))
    print(f"{args.shapes} shapes, memo limit {memo.limit()}: RSS {rss:.0f} -> {resident_mib():.0f} MiB "
          f"(+{resident_mib() - rss:.1f}); PoCL cache {cache_dir} +{grown_mib:.1f} MiB, +{grown_files} files; "
          f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
