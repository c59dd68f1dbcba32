"""Kernel time of every variant's default configuration, on a small and a large shape.

Launches are interleaved across variants on one queue and timed with OpenCL profiling events;
medians of --repeat launches.  GB/s counts bytes read plus bytes written by an ideal kernel.

    python benchmarks/variant_timings.py [--device ID] [--repeat 25]
"""

import argparse

import pool_tuner as pt
from pool_tuner import backends, dispatch, tuner
from pool_tuner.problem import Problem
from pool_tuner.variants import variants_for

SHAPES = [
    ("small", "adaptive_avg_pool2d", (16, 64, 5, 5), (7, 7)),
    ("large", "adaptive_avg_pool2d", (32, 256, 56, 56), (7, 7)),
    ("global", "adaptive_avg_pool2d", (32, 2048, 7, 7), (1, 1)),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device")
    parser.add_argument("--repeat", type=int, default=25)
    args = parser.parse_args()
    device = backends.resolve_device(args.device)
    print(f"device: {device.info.describe()}   pool_tuner {pt.__version__}")
    for label, op, shape, out in SHAPES:
        problem = Problem.create(op, shape, out)
        table = variants_for(op)
        choices = [dispatch.choose(problem, device, variant=name) for name, v in table.items()
                   if v.is_legal({}, problem, device.info.limits)]  # channels_vector: channels-last only
        times = tuner.race(problem, device, choices, repetitions=args.repeat)
        print(f"\n{label}: {op} {'x'.join(map(str, shape))} -> {'x'.join(map(str, problem.output_shape))}"
              f"  ({problem.bytes_moved() / 1e6:.1f} MB moved)")
        for choice, ms in zip(choices, times):
            gbs = problem.bytes_moved() / (ms * 1e-3) / 1e9
            print(f"  {choice.variant.name:18s} {ms:9.4f} ms  {gbs:7.2f} GB/s  default {choice.config}")


if __name__ == "__main__":
    main()
