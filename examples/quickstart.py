"""The main job: run a preset's model layers through pool_tuner, dispatching from the tuning cache.

Run `pool-tuner tune --preset NAME` first; this script then calls the library on the same shapes
and prints, per shape, where the kernel choice came from (`cache` after tuning), the kernel, the
largest error against the float64 reference and the time per call on device arrays, called back to
back in a loop as an application would (``pool_tuner.bench.time_loop``; medians of the loops).

    python examples/quickstart.py upsample_area
"""

import argparse
import functools

import numpy as np

import pool_tuner as pt
from pool_tuner import backends, bench, reference
from pool_tuner.presets import PRESETS, preset_shapes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset", nargs="?", default="upsample_area", choices=sorted(PRESETS) + ["all"])
    parser.add_argument("--repeat", type=int, default=5, help="timed loops of calls per shape (median reported)")
    args = parser.parse_args()

    device = backends.default_device()
    rng = np.random.default_rng()
    print(f"device: {device.describe()}")
    for op, shape, output_size in preset_shapes(args.preset):
        pool = getattr(pt, op)
        x = rng.uniform(-1.0, 1.0, shape).astype(np.float32)
        y = pool(x, output_size)  # numpy in, numpy out (max pooling: the values)
        expected = reference.forward(op, x, output_size)
        expected = expected[0] if isinstance(expected, tuple) else expected
        error = float(np.abs(y - expected).max())

        x_dev = device.to_device(x, device.queue)  # device arrays: no host round trip
        calls = bench.Candidate(functools.partial(pool, x_dev, output_size),
                                functools.partial(device.synchronize, device.queue))
        bench.time_loop(calls, 2)  # builds the kernel
        per_loop = bench.calls_per_loop(calls)
        ms = np.median([bench.time_loop(calls, per_loop) for _ in range(args.repeat)])

        info = pt.explain(op, shape, output_size)
        print(f"{op} {'x'.join(map(str, shape))} -> {'x'.join(map(str, y.shape))}: "
              f"source={info['source']} variant={info['variant']} params={info['params']} "
              f"max|err|={error:.1e} {ms:.3f} ms/call (loops of {per_loop} calls)")


if __name__ == "__main__":
    main()
