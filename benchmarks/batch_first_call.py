"""First call at a new batch size of a known per-sample shape, against a warm call of that size.

The plane count is a kernel argument (docs/design.md, Kernels and variants), so once one batch size
of a per-sample shape has run, the first call at another batch size should cost a dispatch
decision, a grid and a launch -- not a build.  For each batch size in turn (after a first call at
batch size 1, which builds), the script times its first call, then warm calls of the same size, on
host (numpy) arrays through ``pool_tuner``'s public functions, result included; it reports each
size's first call and the median of its warm calls, and the medians over all sizes.

    python benchmarks/batch_first_call.py [--sample 24x19x23] [--output 7x7] [--batches 24] [--warm 9]
"""

import argparse
import time

import numpy as np

import pool_tuner as pt
from pool_tuner import backends


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device")
    parser.add_argument("--op", default="adaptive_avg_pool2d")
    parser.add_argument("--sample", default="24x19x23", help="per-sample shape C x spatial sizes")
    parser.add_argument("--output", default="7x7")
    parser.add_argument("--batches", type=int, default=24, help="batch sizes 2..BATCHES after batch size 1")
    parser.add_argument("--warm", type=int, default=9, help="warm calls per batch size")
    args = parser.parse_args()
    device = backends.resolve_device(args.device)
    sample = tuple(int(s) for s in args.sample.split("x"))
    size = tuple(int(s) for s in args.output.split("x"))
    fn = getattr(pt, args.op)
    rng = np.random.default_rng(0)
    print(f"device: {device.describe()}   pool_tuner {pt.__version__}   {args.op} per sample "
          f"{args.sample} -> {args.output}")
    build_ms = _timed(lambda: fn(rng.standard_normal((1, *sample)).astype(np.float32), size, device=device))
    print(f"batch 1 (builds): {build_ms:.2f} ms")
    print(f"{'batch':>5s} {'first ms':>9s} {'warm ms':>8s} {'first/warm':>10s}")
    firsts, warms = [], []
    for batch in range(2, args.batches + 1):
        x = rng.standard_normal((batch, *sample)).astype(np.float32)
        first = _timed(lambda: fn(x, size, device=device))
        warm = float(np.median([_timed(lambda: fn(x, size, device=device)) for _ in range(args.warm)]))
        firsts.append(first)
        warms.append(warm)
        print(f"{batch:5d} {first:9.3f} {warm:8.3f} {first / warm:10.2f}")
    ratios = np.array(firsts) / np.array(warms)
    print(f"medians over {len(firsts)} batch sizes: first {np.median(firsts):.3f} ms, warm {np.median(warms):.3f} ms, "
          f"first/warm {np.median(ratios):.2f} (worst {ratios.max():.2f})")


if __name__ == "__main__":
    main()
