"""Per-call overhead of the library's cache-hit path over a raw kernel launch, on device arrays.

Both sides enqueue the same built kernel on the same device arrays; the library side additionally
validates arguments, looks up the memoised decision and allocates the output.  What is timed is
the host time of the enqueueing call itself, so the kernel's own run time -- identical on both
sides and noisy on a shared CPU -- does not enter.  Two ways of calling, timed with perf_counter
and reported as medians and their difference:

* drained: raw and library calls alternate, and the queue is drained before every call, so each
  call starts right after a blocking wait -- where the host's caches are cold and each Python step costs several times its warm
  price (on the 2-core VM this was measured on, 3-10x);
* pipelined: batches of raw and of library calls alternate; the calls of a batch are enqueued back
  to back, as a model's forward pass makes them, while the device runs the earlier ones; the first
  call of each batch (which follows a drain) is not counted.

    python benchmarks/dispatch_overhead.py [--repeat 2000] [--batch 8]
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
    parser.add_argument("--batch", type=int, default=8, help="calls per batch of the pipelined measurement")
    args = parser.parse_args()
    if args.batch < 2:
        parser.error("--batch must be at least 2 (the first call of each batch is not counted)")
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
        device.launch(queue, launch.kernel, launch.groups, launch.block, (x.data, out.data, *launch.scalars))

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
    raw_piped, lib_piped = [], []
    for _ in range(max(1, args.repeat // args.batch)):
        for call, times in ((raw, raw_piped), (library, lib_piped)):
            queue.finish()
            for k in range(args.batch):
                t0 = time.perf_counter()
                call()
                if k:
                    times.append(time.perf_counter() - t0)
    queue.finish()
    info = pt.explain("adaptive_avg_pool2d", shape, out_size)
    print(f"device {device.describe()}; {args.input} -> {args.output}; dispatch source={info['source']} "
          f"variant={info['variant']}")
    for mode, raw_times, lib_times in (("drained", raw_t, lib_t), ("pipelined", raw_piped, lib_piped)):
        raw_med, lib_med = np.median(raw_times) * 1e6, np.median(lib_times) * 1e6
        print(f"{mode:9s}  raw enqueue median {raw_med:6.1f} us  library call median {lib_med:6.1f} us  "
              f"overhead {lib_med - raw_med:6.1f} us  ({len(lib_times)} calls each)")


if __name__ == "__main__":
    main()
