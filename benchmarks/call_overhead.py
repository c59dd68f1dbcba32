"""Per-call time of tiny pooling calls on the CPU, against the floor of one OpenCL launch and wait.

A pooling layer of a small model on a CPU is a tiny call, and there pool_tuner's cost is what its
host path adds around the kernel, not the kernel.  For each shape, side by side in one run (loops
of calls back to back, interleaved, medians: ``pool_tuner.bench``'s timing):

* ``floor``: a bare PyOpenCL launch of a trivial kernel on pre-made buffers, then a wait -- no
  pool_tuner code.  Every synchronous call on host data pays at least this, as it must launch and
  wait for its result;
* ``kernel, bare launch+wait``: pool_tuner's dispatched kernel for the shape, launched the same
  bare way on pre-made device arrays: what the kernel itself adds to the floor;
* ``numpy API avg/max``: ``pool_tuner.adaptive_{avg,max}_pool2d`` on a numpy array;
* ``pool_tuner.torch Avg/Max``: the ``AdaptiveAvgPool2d``/``AdaptiveMaxPool2d`` modules on a CPU
  tensor (no autograd: the input does not require grad);
* ``torch.nn Avg/Max``: PyTorch's own modules on the same tensor;
* ``device arrays: library`` and ``device arrays: bare launch``: the avg kernel on data already on
  the device (``pyopencl.array.Array``), calls back to back and one wait per loop, through the
  library and as bare launches of the same kernel: their difference is what dispatch adds to a
  launch when nothing is waited for or copied.

Each is printed in microseconds per call (median and quartiles over the rounds) and as a multiple
of the floor measured in the same rounds.  pool_tuner lists the OpenCL devices first, so the floor
runs with the PoCL settings pool_tuner chose (its worker pinning, docs/design.md "PoCL worker pinning").

    python benchmarks/call_overhead.py [--shapes 1x8x4x4:1,1x64x7x7:1,1x8x9x9:4x4] [--rounds 30] [--out FILE]
"""

from __future__ import annotations

import functools

import numpy as np
import pyopencl as cl
import pyopencl.array as cl_array
import torch

import pool_tuner as pt
import pool_tuner.torch as ptt
from pool_tuner import backends, dispatch
from pool_tuner.problem import Problem

import common

DEFAULT_SHAPES = "1x8x4x4:1,1x64x7x7:1,1x8x9x9:4x4"
TRIVIAL_KERNEL = "__kernel void touch(__global float *x) { x[get_global_id(0)] += 1.0f; }"
FLOOR = "floor: bare launch+wait"
#: Fewest calls in a timed loop: a loop of a few calls would count its one wait several times over,
#: which a stall during calibration on a busy machine could otherwise choose.
MIN_CALLS = 20


def parse_shapes(text: str) -> list:
    """``"1x8x4x4:1,1x8x9x9:4x4"`` -> ``[((1, 8, 4, 4), (1, 1)), ((1, 8, 9, 9), (4, 4))]``."""
    shapes = []
    for entry in text.split(","):
        shape, _, out = entry.partition(":")
        out_size = tuple(int(s) for s in out.split("x"))
        shapes.append((tuple(int(s) for s in shape.split("x")), out_size * 2 if len(out_size) == 1 else out_size))
    return shapes


def floor_candidate(cl_device) -> common.Candidate:
    """A trivial kernel on a one-element buffer, in a context and queue of its own, built once,
    its argument set once: each call is one enqueue and one wait."""
    context = cl.Context([cl_device])
    queue = cl.CommandQueue(context)
    kernel = cl.Program(context, TRIVIAL_KERNEL).build().touch
    buffer = cl.Buffer(context, cl.mem_flags.READ_WRITE, 4)
    kernel.set_args(buffer)

    def call():
        cl.enqueue_nd_range_kernel(queue, kernel, (1,), None)
        queue.finish()

    call.buffer = buffer  # a kernel's argument does not keep its buffer alive

    return common.Candidate(call, lambda: None)


def candidates_for(shape, out_size, device, rng) -> dict:
    """Every way of computing one shape's pooling (see the module docstring), named."""
    queue = device.queue
    x = rng.uniform(-1.0, 1.0, shape).astype(np.float32)
    t = torch.from_numpy(x.copy())
    problem = Problem.create("adaptive_avg_pool2d", shape, out_size)
    launch = dispatch.prepare(device, queue.context, problem, dispatch.choose(problem, device))
    x_dev = cl_array.to_device(queue, x)
    out_dev = cl_array.empty(queue, problem.output_shape, np.float32)

    def bare(wait: bool):
        device.launch(queue, launch.kernel, launch.groups, launch.block, (x_dev.data, out_dev.data, *launch.scalars))
        if wait:
            queue.finish()

    finish = functools.partial(device.synchronize, queue)
    no_wait = lambda: None  # noqa: E731 -- the synchronous calls wait inside each call
    modules = {
        "pool_tuner.torch Avg": ptt.AdaptiveAvgPool2d(out_size),
        "pool_tuner.torch Max": ptt.AdaptiveMaxPool2d(out_size),
        "torch.nn Avg": torch.nn.AdaptiveAvgPool2d(out_size),
        "torch.nn Max": torch.nn.AdaptiveMaxPool2d(out_size),
    }
    candidates = {
        FLOOR: floor_candidate(device.cl_device),
        "kernel, bare launch+wait": common.Candidate(functools.partial(bare, True), no_wait),
        "numpy API avg": common.Candidate(functools.partial(pt.adaptive_avg_pool2d, x, out_size), no_wait),
        "numpy API max": common.Candidate(functools.partial(pt.adaptive_max_pool2d, x, out_size), no_wait),
    }
    candidates.update({name: common.Candidate(functools.partial(m, t), no_wait) for name, m in modules.items()})
    candidates["device arrays: library"] = common.Candidate(
        functools.partial(pt.adaptive_avg_pool2d, x_dev, out_size), finish)
    candidates["device arrays: bare launch"] = common.Candidate(functools.partial(bare, False), finish)
    check(x, t, x_dev, out_size, candidates, modules)
    return candidates


def check(x, t, x_dev, out_size, candidates, modules) -> None:
    """Every candidate computes the same pooling (the floor aside): a benchmark of a wrong result
    would time nothing worth having."""
    expected_avg = torch.nn.functional.adaptive_avg_pool2d(t, out_size).numpy()
    expected_max = torch.nn.functional.adaptive_max_pool2d(t, out_size).numpy()
    results = {
        "numpy API avg": (pt.adaptive_avg_pool2d(x, out_size), expected_avg),
        "numpy API max": (pt.adaptive_max_pool2d(x, out_size), expected_max),
        "device arrays: library": (pt.adaptive_avg_pool2d(x_dev, out_size).get(), expected_avg),
    }
    for name, module in modules.items():
        results[name] = (module(t).numpy(), expected_max if name.endswith("Max") else expected_avg)
    for name, (got, expected) in results.items():
        if not np.allclose(got, expected, rtol=1e-5, atol=1e-6):
            raise SystemExit(f"call_overhead: {name} gave a wrong result; not timing it")


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help="comma-separated NxCxHxW:OUT (OUT an int or HxW) (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds per shape (default: %(default)s)")
    parser.add_argument("--loop-ms", type=float, default=20.0,
                        help="wall time each timed loop of calls aims at (default: %(default)s)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's default)")
    common.add_output_argument(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = backends.default_device()
    rng = np.random.default_rng()
    info = common.circumstances(torch, device)
    print(common.describe_circumstances(info))
    results = []
    for shape, out_size in parse_shapes(args.shapes):
        candidates = candidates_for(shape, out_size, device, rng)
        timings = common.interleave(candidates, args.rounds, args.loop_ms * 1e-3, rng, min_calls=MIN_CALLS)
        explained = pt.explain("adaptive_avg_pool2d", shape, out_size)
        label = f"{'x'.join(map(str, shape))} -> {'x'.join(map(str, out_size))}"
        rows = []
        entry = {"input": list(shape), "output_size": list(out_size),
                 "avg_kernel": {"variant": explained["variant"], "source": explained["source"]}, "calls": {}}
        for name in candidates:
            s = timings.summary(name, 1e3)
            times_floor = timings.ratio(name, FLOOR)
            entry["calls"][name] = dict(us=s, times_floor=times_floor)
            rows.append([name, common.fmt_spread(s), f"{times_floor['of_medians']:.1f}x",
                         f"{times_floor['q1']:.1f}-{times_floor['q3']:.1f}", s["calls_per_loop"]])
        print(f"\n{label}  (avg kernel: {explained['variant']}, from {explained['source']})")
        print(common.format_table(["call", "us per call (q1-q3)", "x floor", "x floor q1-q3", "calls/loop"], rows))
        results.append(entry)
    print("\nus per call: median over the rounds of loops of calls back to back (q1-q3: quartiles over the rounds);"
          "\nx floor: median time / the floor's median time in the same rounds, and the quartiles of the per-round"
          "\nratios.  All calls but the two 'device arrays' rows wait for their result inside each call.")
    common.write_json(args.out, {"benchmark": "call_overhead", "circumstances": common.record_end(info), "rounds": args.rounds,
                                 "loop_ms": args.loop_ms, "shapes": results})


if __name__ == "__main__":
    main()
