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
  tensor (no autograd: the input does not require grad), as a user gets them: on a tiny shape
  their first call's race usually gives the layer to PyTorch's kernel;
* ``pool_tuner.torch Avg/Max, own kernel``: the same modules made with the variant and
  configuration dispatch chooses for the shape (``explain``), which forces pool_tuner's kernel --
  the same kernel a layer the race left to pool_tuner runs -- so that both are timed in one run;
* ``torch.nn Avg/Max``: PyTorch's own modules on the same tensor;
* ``device arrays: library`` and ``device arrays: bare launch``: the avg kernel on data already on
  the device (``pyopencl.array.Array``), calls back to back and one wait per loop, through the
  library and as bare launches of the same kernel: their difference is what dispatch adds to a
  launch when nothing is waited for or copied;
* ``device arrays, channels-last: library``: the same call on a channels-last device array (its own
  kernel, and a channels-last view of its result).

Each is printed in microseconds per call (median and quartiles over the rounds) and as a multiple
of the floor measured in the same rounds.

``--in-model`` measures instead what a pooling layer costs inside a model, where the convolutions
between two poolings leave the caches cold: a stack of MobileNetV3-Large's squeeze-excitation
blocks at batch 1 (each a depthwise convolution, then the average pooling to 1x1, two 1x1
convolutions and the rescaling; the channels and sizes of its nine poolings), forward under
``torch.inference_mode()``, with each pooling layer as

* ``stock``: ``torch.nn.AdaptiveAvgPool2d``;
* ``plain``: a Python module whose forward calls ``torch.nn.functional.adaptive_avg_pool2d`` (the
  least a Python layer can cost);
* ``pool_tuner``: ``pool_tuner.torch.AdaptiveAvgPool2d`` (at batch 1 its race gives every layer to
  PyTorch's kernel: its cost over ``plain`` is pool_tuner's Python per call).

Each pooling layer's call is timed where it runs, inside the model (``TimedLayer``: the calling
thread's CPU time around the layer's call, ``time.thread_time_ns``), so the rest of the model is
not in the measurement: on a shared machine the model's own time varies by far more than the
microseconds asked about.  PyTorch runs on one thread, the calling one.  Printed: microseconds per
pooling call of each (the mean over the nine layers and a loop of model calls; median and
quartiles over ``--rounds`` rounds, the three in a fresh random order every round) and the
difference to ``plain`` (of the medians, and the quartiles of the paired per-round differences).

    python benchmarks/call_overhead.py [--shapes 1x8x4x4:1,1x64x7x7:1,1x8x9x9:4x4] [--rounds 30] [--out FILE]
    python benchmarks/call_overhead.py --in-model [--rounds 30] [--loop-ms 200] [--out FILE]
"""

from __future__ import annotations

import functools
import time

import numpy as np
import pyopencl as cl
import pyopencl.array as cl_array
import torch

import pool_tuner as pt
import pool_tuner.torch as ptt
from pool_tuner import backends, dispatch
from pool_tuner.problem import Problem

import common
import held_back

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
        "pool_tuner.torch Avg, own kernel": ptt.AdaptiveAvgPool2d(out_size, **_dispatched("adaptive_avg_pool2d", problem)),
        "pool_tuner.torch Max, own kernel": ptt.AdaptiveMaxPool2d(out_size, **_dispatched("adaptive_max_pool2d", problem)),
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
    candidates["device arrays, channels-last: library"] = common.Candidate(
        functools.partial(pt.adaptive_avg_pool2d, common.device_input(device, x, "NHWC"), out_size), finish)
    check(x, t, x_dev, out_size, candidates, modules)
    return candidates


def _dispatched(op: str, problem: Problem) -> dict:
    """The variant and configuration dispatch chooses for ``op`` on ``problem``'s shapes, as a
    module's keyword options."""
    explained = pt.explain(op, problem.input_shape, problem.output_shape[-2:])
    return {"variant": explained["variant"], "config": explained["params"]}


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
    channels_last = candidates["device arrays, channels-last: library"].call.args[0]
    results["device arrays, channels-last: library"] = (
        held_back.host_copy(pt.adaptive_avg_pool2d(channels_last, out_size)), expected_avg)
    for name, module in modules.items():
        results[name] = (module(t).numpy(), expected_max if " Max" in name else expected_avg)
    for name, (got, expected) in results.items():
        if not np.allclose(got, expected, rtol=1e-5, atol=1e-6):
            raise SystemExit(f"call_overhead: {name} gave a wrong result; not timing it")


#: (channels, height and width) of MobileNetV3-Large's nine average poolings at 224x224: eight
#: squeeze-excitation blocks and the head.
MOBILENET_POOLS = ((72, 28), (120, 28), (120, 28), (480, 14), (672, 14), (672, 7), (960, 7), (960, 7), (960, 7))


class PlainPool(torch.nn.Module):
    """The least a Python pooling layer costs: a forward that calls PyTorch's functional form."""

    def __init__(self, output_size):
        super().__init__()
        self.output_size = output_size

    def forward(self, x):
        return torch.nn.functional.adaptive_avg_pool2d(x, self.output_size)


class SqueezeExcitation(torch.nn.Module):
    """A depthwise convolution, then squeeze-excitation around ``pool`` (MobileNetV3's pointwise
    convolutions left out: their time would bury the poolings' in the noise of a shared machine)."""

    def __init__(self, channels: int, pool: torch.nn.Module):
        super().__init__()
        self.depthwise = torch.nn.Conv2d(channels, channels, 3, padding=1, groups=channels)
        self.pool = pool
        self.squeeze = torch.nn.Conv2d(channels, channels // 4, 1)
        self.excite = torch.nn.Conv2d(channels // 4, channels, 1)

    def forward(self, x):
        x = self.depthwise(x)
        scale = torch.nn.functional.hardsigmoid(self.excite(torch.relu(self.squeeze(self.pool(x)))))
        return x * scale


class PoolingStack(torch.nn.Module):
    """``MOBILENET_POOLS``' blocks side by side, each on its own input (their shapes differ)."""

    def __init__(self, make_pool):
        super().__init__()
        self.blocks = torch.nn.ModuleList(SqueezeExcitation(c, make_pool(1)) for c, _ in MOBILENET_POOLS)

    def forward(self, inputs):
        return [block(x) for block, x in zip(self.blocks, inputs)]


IN_MODEL_POOLS = {"stock": torch.nn.AdaptiveAvgPool2d, "plain": PlainPool, "pool_tuner": ptt.AdaptiveAvgPool2d}


class TimedLayer(torch.nn.Module):
    """``layer``, its calls' CPU time summed (nanoseconds of the calling thread)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self.ns = 0
        self.calls = 0

    def forward(self, x):
        start = time.thread_time_ns()
        y = self.layer(x)
        self.ns += time.thread_time_ns() - start
        self.calls += 1
        return y


def _pooling_us(model, inputs, calls: int) -> float:
    """Microseconds of CPU time per pooling call over ``calls`` calls of ``model``."""
    timed = [m for m in model.modules() if isinstance(m, TimedLayer)]
    for m in timed:
        m.ns = m.calls = 0
    with torch.inference_mode():
        for _ in range(calls):
            model(inputs)
    return sum(m.ns for m in timed) / sum(m.calls for m in timed) / 1e3


def in_model(args, rng) -> dict:
    """The ``--in-model`` measurement (see the module docstring): its table printed, its numbers
    returned."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    models = {name: PoolingStack(lambda size, make=make: TimedLayer(make(size))).eval()
              for name, make in IN_MODEL_POOLS.items()}
    for model in models.values():
        model.load_state_dict(models["stock"].state_dict())
    inputs = [torch.from_numpy(rng.standard_normal((1, c, n, n), dtype=np.float32)) for c, n in MOBILENET_POOLS]
    with torch.inference_mode():
        expected = models["stock"](inputs)
        for name, model in models.items():
            if not all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(model(inputs), expected)):
                raise SystemExit(f"call_overhead: the {name} stack gave a wrong result; not timing it")
    calls = max(1, round(args.loop_ms / 5))  # a model call takes a few milliseconds
    names = list(models)
    us = {name: [] for name in names}
    for _ in range(args.rounds):
        for i in rng.permutation(len(names)):
            us[names[i]].append(_pooling_us(models[names[i]], inputs, calls))
    rows, entry = [], {"pools": [list(p) for p in MOBILENET_POOLS], "model_calls_per_round": calls, "calls": {}}
    for name in names:
        over = common.spread([a - b for a, b in zip(us[name], us["plain"])])
        mine = common.spread(us[name])
        of_medians = mine["median"] - common.spread(us["plain"])["median"]
        entry["calls"][name] = dict(us_per_call=dict(mine, rounds=us[name]), us_over_plain=dict(over, of_medians=of_medians))
        rows.append([name, common.fmt_spread(mine), f"{of_medians:+.1f}", f"{over['q1']:+.1f} to {over['q3']:+.1f}"])
    print(f"\n{len(MOBILENET_POOLS)} squeeze-excitation blocks of MobileNetV3-Large, batch 1, inference_mode, one "
          f"thread; {calls} model calls per round; CPU time of each pooling call, inside the model")
    print(common.format_table(["pooling layers", "us per call (q1-q3)", "over plain", "paired q1-q3"], rows))
    return entry


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--in-model", action="store_true",
                        help="time pooling layers inside a model instead of tiny calls alone (see above)")
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
    if args.in_model:
        entry = in_model(args, rng)
        common.write_json(args.out, {"benchmark": "call_overhead_in_model", "circumstances": common.record_end(info),
                                     "rounds": args.rounds, "loop_ms": args.loop_ms, "in_model": entry})
        print(f"\nload average after: {' '.join(f'{v:.2f}' for v in info['load_average_after'])}")
        return
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
