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
from pool_tuner import avgmax, backends, bench, reference
from pool_tuner.operations import OPERATIONS
from pool_tuner.presets import FUSED_PRESETS, PRESETS, preset_shapes


def levels(result) -> list:
    """A result as a list of arrays: a pyramid's levels, else the one array."""
    return list(result) if isinstance(result, list) else [result]


def expected_levels(op, x, output_size) -> list:
    """The float64 reference of what ``pool_tuner.<function_name>(x, output_size)`` returns, as
    ``levels``: the values (max pooling's without indices), avg+max joined as its default mode."""
    operation = OPERATIONS[op]
    expected = reference.forward(op, x, output_size)
    if not operation.multi_level:
        return [expected[0] if operation.selects else expected]
    values = expected[0]
    return values if operation.pyramid else [avgmax.join_numpy(*values, avgmax.MODES[0])]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset", nargs="?", default="upsample_area",
                        choices=sorted(PRESETS) + sorted(FUSED_PRESETS) + ["all"])
    parser.add_argument("--repeat", type=int, default=5, help="timed loops of calls per shape (median reported)")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")

    device = backends.default_device()
    rng = np.random.default_rng()
    print(f"device: {device.info.describe()}")
    for op, shape, output_size in preset_shapes(args.preset):
        pool = getattr(pt, OPERATIONS[op].function_name)
        x = rng.uniform(-1.0, 1.0, shape).astype(np.float32)
        y = levels(pool(x, output_size))  # numpy in, numpy out (max pooling: the values)
        error = max(float(np.abs(got - want).max()) for got, want in zip(y, expected_levels(op, x, output_size)))

        x_dev = device.to_device(x, device.queue)  # device arrays: no host round trip
        calls = bench.Candidate(functools.partial(pool, x_dev, output_size),
                                functools.partial(device.synchronize, device.queue))
        bench.time_loop(calls, 2)  # builds the kernel
        per_loop = bench.calls_per_loop(calls)
        ms = np.median([bench.time_loop(calls, per_loop) for _ in range(args.repeat)])

        info = pt.explain(op, shape, output_size)
        print(f"{op} {'x'.join(map(str, shape))} -> {', '.join('x'.join(map(str, level.shape)) for level in y)}: "
              f"source={info['source']} variant={info['variant']} params={info['params']} "
              f"max|err|={error:.1e} {ms:.3f} ms/call (loops of {per_loop} calls)")


if __name__ == "__main__":
    main()
