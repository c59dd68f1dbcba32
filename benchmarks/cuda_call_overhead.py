"""Call time of pool_tuner.torch on CUDA tensors against PyTorch's own call and a bare launch.

For each shape (a tiny one, then the benchmark suite's presets), three ways of computing the same
pooling are each called back to back, ``--calls`` times in a row, in ``--repeat`` rounds, the three
in a fresh random order every round:

* ``pytorch``: ``torch.nn.functional.adaptive_{avg,max}_pool{1,2,3}d``;
* ``pool_tuner``: ``pool_tuner.torch.adaptive_...`` (cache hits: a signature's first call is made
  during the warm-up);
* ``bare``: the same kernel through the same prepared launch (``backends.cuda_driver``) on
  preallocated tensors, pointers and stream handle -- the floor of pool_tuner's launch path.

``--direction backward`` times a forward and its backward instead (``train``: the input requires
grad, the result's ``backward`` is called; ``bare``: the forward and the backward kernel launched
on preallocated tensors).  Reported per call, medians over the rounds: ``device`` from CUDA events
around each run of calls (when kernels are shorter than the host's work per call this is the
host's pace, else the kernels'), and ``host``, the wall time of the Python loop.  Needs a CUDA GPU,
PyTorch with CUDA and pool_tuner's CUDA backend; without them it says what is missing and exits
non-zero.  ``--list`` prints the cases it would time and needs none of that.

``--shapes`` times average poolings of other shapes instead of the presets: a list such as
``32x72x28x28:1,32x120x28x28:1`` (an output size of one number is that size in every pooled
dimension), or the name of a set in ``SHAPE_SETS`` -- ``mobilenet_v3_large_b32``: the pooling
layers of torchvision's mobilenet_v3_large at batch 32 and 224 pixels, whose training step
``models.py --device cuda`` times (with ``--direction backward``, each layer's forward and backward
as in that step, the device column telling the kernels' time from the host's).

    python benchmarks/cuda_call_overhead.py [--preset all] [--dtype float32] [--direction forward,backward]
                                            [--calls 200] [--repeat 15] [--list] [--json FILE]
    python benchmarks/cuda_call_overhead.py --shapes mobilenet_v3_large_b32 --direction forward,backward
"""

import argparse
import json
import random
import statistics
import sys
import time

#: Where the tensors live (the tests run the cases on a fake GPU with CPU tensors standing in).
DEVICE = "cuda"
DIRECTIONS = ("forward", "backward")
#: Named ``--shapes``: the pooling layers (input shape, output size) of a model at a batch size.
SHAPE_SETS = {
    "mobilenet_v3_large_b32": "32x72x28x28:1,32x120x28x28:1,32x120x28x28:1,32x480x14x14:1,32x672x14x14:1,"
                              "32x672x7x7:1,32x960x7x7:1,32x960x7x7:1,32x960x7x7:1",
}


def _require_gpu():
    """torch, pool_tuner.torch and the CUDA device, or exit with what is missing."""
    try:
        import torch
    except ImportError:
        sys.exit("cuda_call_overhead: needs PyTorch with CUDA (pip install torch)")
    if not torch.cuda.is_available():
        sys.exit("cuda_call_overhead: needs a CUDA GPU and PyTorch built with CUDA "
                 "(torch.cuda.is_available() is False)")
    from pool_tuner.backends import cuda

    if not cuda.list_devices():
        sys.exit(f"cuda_call_overhead: pool_tuner's CUDA backend is unavailable ({cuda.import_error()}); "
                 "install it with `pip install pool-tuner[cuda]`")
    import pool_tuner.torch as ptt

    return torch, ptt


def _time_rounds(torch, sides: dict, calls: int, repeat: int) -> dict:
    """side -> (device, host) microseconds per call: medians over ``repeat`` rounds, each round
    one run of ``calls`` calls of every side, the sides in a fresh random order."""
    for fn in sides.values():
        for _ in range(10):
            fn()
    torch.cuda.synchronize()
    times = {side: ([], []) for side in sides}
    order = list(sides)
    for _ in range(repeat):
        random.shuffle(order)
        for side in order:
            device, host = _time_run(torch, sides[side], calls)
            times[side][0].append(device)
            times[side][1].append(host)
    return {side: (statistics.median(device), statistics.median(host)) for side, (device, host) in times.items()}


def _time_run(torch, fn, calls: int) -> tuple:
    """(device, host) microseconds per call of one run of ``calls`` calls of ``fn``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) * 1e6 / calls
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls, host


def parse_shapes(text: str) -> list:
    """``--shapes``: ``"32x72x28x28:1,8x64x50:4"`` (or a name in ``SHAPE_SETS``) -> ``(name, (op,
    input shape, output size))`` of average poolings, the op's dimensions those after batch and
    channels."""
    found = []
    for entry in SHAPE_SETS.get(text, text).split(","):
        shape_text, _, size_text = entry.partition(":")
        shape, size = tuple(int(n) for n in shape_text.split("x")), tuple(int(n) for n in size_text.split("x"))
        ndim = len(shape) - 2
        if ndim not in (1, 2, 3) or len(size) not in (1, ndim):
            raise ValueError(f"--shapes takes NxCxL, NxCxHxW or NxCxDxHxW:OUT entries, got {entry!r}")
        found.append(("shapes", (f"adaptive_avg_pool{ndim}d", shape, size * ndim if len(size) == 1 else size)))
    return found


def cases(preset: str, tiny: bool, shapes: str | None = None) -> list:
    """``(name, (op, input shape, output size))`` of every shape to time: ``shapes``
    (``parse_shapes``) where given, else the tiny one and the presets'."""
    from pool_tuner.presets import PRESETS, preset_shapes

    if shapes:
        return parse_shapes(shapes)
    found = [("tiny", ("adaptive_avg_pool2d", (2, 16, 14, 14), (1, 1)))] if tiny else []
    names = list(PRESETS) if preset == "all" else preset.split(",")
    for name in names:
        found += [(name, shape) for shape in preset_shapes(name)]
    return found


def sides_of(torch, ptt, op: str, shape, size, dtype, direction: str) -> tuple:
    """``(sides, plan)``: the three ways of computing one case (see the module docstring) as
    functions of no arguments, and pool_tuner's plan of its forward (``torch_cuda``)."""
    from pool_tuner import torch_cuda

    x = torch.rand(shape, device=DEVICE, dtype=dtype) + 0.5
    torch_fn, ours = getattr(torch.nn.functional, op), getattr(ptt, op)
    plan = torch_cuda.plan_op(op, "forward", [x], size, "")
    outputs = [torch_cuda.empty_result(x, result, None) for result in plan.results]
    stream = torch_cuda.current_raw_stream(x.device.index)
    pointers = [x.data_ptr()] + [o.data_ptr() for o in outputs]
    launch = plan.prepared_launch()
    if direction == "forward":
        return {"pytorch": lambda: torch_fn(x, size), "pool_tuner": lambda: ours(x, size),
                "bare": lambda: launch(stream, *pointers)}, plan
    grad = torch.rand(outputs[0].shape, device=DEVICE, dtype=dtype)
    backward_inputs = [grad] + outputs[1:]  # a max pooling's backward reads the forward's indices
    backward = torch_cuda.plan_op(op, "backward", backward_inputs, tuple(shape), "")
    grad_in = torch_cuda.empty_result(grad, backward.results[0], None)
    backward_pointers = [t.data_ptr() for t in backward_inputs] + [grad_in.data_ptr()]
    backward_launch = backward.prepared_launch()
    x_grad = x.detach().requires_grad_()

    def train(fn):
        fn(x_grad, size).backward(grad)

    def bare():
        launch(stream, *pointers)
        backward_launch(stream, *backward_pointers)

    return {"pytorch": lambda: train(torch_fn), "pool_tuner": lambda: train(ours), "bare": bare}, plan


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--preset", default="all", help="comma-separated preset names, or all")
    parser.add_argument("--no-tiny", action="store_true", help="leave out the tiny shape")
    parser.add_argument("--shapes", help=f"average poolings to time instead of the presets: NxCxHxW:OUT,... or one "
                                         f"of {', '.join(SHAPE_SETS)}")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64", "float16", "bfloat16"))
    parser.add_argument("--direction", default="forward",
                        help="comma-separated, of forward and backward (a forward and its backward)")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed run")
    parser.add_argument("--repeat", type=int, default=15, help="timed rounds")
    parser.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    directions = args.direction.split(",")
    if set(directions) - set(DIRECTIONS):
        parser.error(f"--direction takes {', '.join(DIRECTIONS)}")
    todo = [(direction, name, case) for direction in directions
            for name, case in cases(args.preset, not args.no_tiny, args.shapes)]
    if args.list:
        for direction, name, (op, shape, size) in todo:
            print(f"{direction:8s} {name:16s} {op} {'x'.join(map(str, shape))} -> {tuple(size)}")
        return
    torch, ptt = _require_gpu()
    dtype = getattr(torch, args.dtype)
    rows = []
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {args.dtype}; {args.calls} calls x "
          f"{args.repeat} rounds; microseconds per call, device (CUDA events) / host (Python loop)")
    print(f"{'direction':9s} {'case':16s} {'input -> output':32s} {'pytorch':>15s} {'pool_tuner':>15s} {'bare':>15s} "
          f"{'host pt/torch':>13s}")
    for direction, name, (op, shape, size) in todo:
        sides, plan = sides_of(torch, ptt, op, shape, size, dtype, direction)
        timings = _time_rounds(torch, sides, args.calls, args.repeat)
        rows.append({"direction": direction, "case": name, "op": op, "input": list(shape), "output_size": list(size),
                     "dtype": args.dtype, "variant": plan.choice.variant.name, "source": plan.choice.source,
                     **{f"{side}_{what}_us": t for side, (dev, host) in timings.items()
                        for what, t in (("device", dev), ("host", host))}})
        cells = " ".join(f"{dev:7.1f}/{host:7.1f}" for dev, host in timings.values())
        ratio = timings["pool_tuner"][1] / timings["pytorch"][1]
        print(f"{direction:9s} {name:16s} {'x'.join(map(str, shape)) + ' -> ' + str(tuple(size)):32s} {cells} "
              f"{ratio:13.2f}")
    for direction in directions:
        ratios = [r["pool_tuner_host_us"] / r["pytorch_host_us"] for r in rows if r["direction"] == direction]
        print(f"{direction}: geomean pool_tuner/pytorch host time per call: {statistics.geometric_mean(ratios):.2f} "
              "(the target: at most 1.5)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
