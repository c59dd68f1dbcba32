"""Per-call overhead of the library's cache-hit path over a raw kernel launch, on device arrays.

Both sides enqueue the same built kernel on the same device arrays; the library side additionally
validates arguments, looks up the memoised decision and allocates the output.  What is timed is
the host time of the enqueueing call itself (the queue is drained outside the timed region), so
the kernel's own run time -- identical on both sides and noisy on a shared CPU -- does not enter.
Calls are interleaved (raw, library, raw, ...) and timed with perf_counter; the report gives
medians and their difference.

    python benchmarks/dispatch_overhead.py [--repeat 2000]
"""

import argparse
import time

import numpy as np
import pyopencl.array as cl_array

import pool_tuner as pt
from pool_tuner import backends, dispatch
from pool_tuner.problem import Problem


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--input", default="16x64x5x5")
    parser.add_argument("--output", default="7x7")
    args = parser.parse_args()
    shape = tuple(int(s) for s in args.input.split("x"))
    out_size = tuple(int(s) for s in args.output.split("x"))

    device = backends.default_device()
    queue = device.queue
    x = cl_array.to_device(queue, np.random.default_rng().uniform(-1, 1, shape).astype(np.float32))
    problem = Problem.create("adaptive_avg_pool2d", shape, out_size)
    choice = dispatch.choose(problem, device)
    launch = dispatch.prepare(device, queue.context, problem, choice)
    out = cl_array.empty(queue, problem.output_shape, np.float32)

    def raw():
        device.launch(queue, launch.kernel, launch.groups, launch.block, (x.data, out.data))

    def library():
        pt.adaptive_avg_pool2d(x, out_size)

    for _ in range(50):
        raw()
        library()
    queue.finish()
    raw_t, lib_t = [], []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        raw()
        t1 = time.perf_counter()
        queue.finish()
        t2 = time.perf_counter()
        library()
        t3 = time.perf_counter()
        queue.finish()
        raw_t.append(t1 - t0)
        lib_t.append(t3 - t2)
    raw_med, lib_med = np.median(raw_t) * 1e6, np.median(lib_t) * 1e6
    info = pt.explain("adaptive_avg_pool2d", shape, out_size)
    print(f"device {device.describe()}; {args.input} -> {args.output}; dispatch source={info['source']} "
          f"variant={info['variant']}")
    print(f"raw enqueue     median {raw_med:8.1f} us")
    print(f"library call    median {lib_med:8.1f} us")
    print(f"overhead    median {lib_med - raw_med:8.1f} us per call ({args.repeat} interleaved pairs)")


if __name__ == "__main__":
    main()
