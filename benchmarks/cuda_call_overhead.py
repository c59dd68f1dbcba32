"""Call time of pool_tuner.torch on CUDA tensors against PyTorch's own call and a bare launch.

For each shape (a tiny one, then the benchmark suite's presets), three ways of computing the same
forward pooling are each called back to back, ``--calls`` times in a row, repeated ``--repeat``
times:

* ``pytorch``: ``torch.nn.functional.adaptive_{avg,max}_pool{1,2,3}d``;
* ``pool_tuner``: ``pool_tuner.torch.adaptive_...`` (cache hits: a signature's first call is made
  during the warm-up);
* ``bare``: the same kernel through the same prepared launch (``backends.cuda_driver``) on
  preallocated tensors, pointers and stream handle -- the floor of pool_tuner's launch path.

Reported per call, medians over the repeats: ``device`` from CUDA events around each run of calls
(when kernels are shorter than the host's work per call this is the host's pace, else the
kernels'), and ``host``, the wall time of the Python loop.  Needs a CUDA GPU, PyTorch with CUDA
and pool_tuner's CUDA backend (PyCUDA); without them it says what is missing and exits non-zero.

    python benchmarks/cuda_call_overhead.py [--preset all] [--dtype float32] [--calls 200] [--repeat 15]
"""

import argparse
import json
import statistics
import sys
import time


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


def _time(torch, fn, calls: int, repeat: int) -> tuple:
    """(device, host) microseconds per call: medians over ``repeat`` runs of ``calls`` calls."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    device, host = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeat):
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t0) * 1e6 / calls)
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(device), statistics.median(host)


def _cases(preset: str, tiny: bool) -> list:
    from pool_tuner.presets import PRESETS, preset_shapes

    cases = [("tiny", ("adaptive_avg_pool2d", (1, 16, 8, 8), (4, 4)))] if tiny else []
    names = list(PRESETS) if preset == "all" else preset.split(",")
    for name in names:
        cases += [(name, shape) for shape in preset_shapes(name)]
    return cases


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="all", help="comma-separated preset names, or all")
    parser.add_argument("--no-tiny", action="store_true", help="leave out the tiny shape")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64", "float16", "bfloat16"))
    parser.add_argument("--calls", type=int, default=200, help="calls per timed run")
    parser.add_argument("--repeat", type=int, default=15, help="timed runs per side")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    torch, ptt = _require_gpu()
    from pool_tuner import ops, torch_cuda

    dtype = getattr(torch, args.dtype)
    stream = torch.cuda.current_stream().cuda_stream
    rows = []
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {args.dtype}; {args.calls} calls x "
          f"{args.repeat} runs; microseconds per call (device: CUDA events, host: Python loop)")
    print(f"{'case':16s} {'input -> output':32s} {'pytorch':>15s} {'pool_tuner':>15s} {'bare':>15s} {'pt/torch':>8s}")
    for name, (op, shape, size) in _cases(args.preset, not args.no_tiny):
        x = torch.rand(shape, device="cuda", dtype=dtype) + 0.5
        torch_fn, ours = getattr(torch.nn.functional, op), getattr(ptt, op)
        plan = torch_cuda.plan(getattr(ops, op), [x], size, {})
        outputs = [torch.empty_strided(s, st, dtype=d, device="cuda") for s, st, d in plan.outputs]
        pointers = [x.data_ptr()] + [o.data_ptr() for o in outputs]
        sides = {
            "pytorch": lambda: torch_fn(x, size),
            "pool_tuner": lambda: ours(x, size),
            "bare": lambda: plan.launch(stream, *pointers),
        }
        timings = {side: _time(torch, fn, args.calls, args.repeat) for side, fn in sides.items()}
        rows.append({"case": name, "op": op, "input": list(shape), "output_size": list(size), "dtype": args.dtype,
                     "variant": plan.choice.variant.name, "source": plan.choice.source,
                     **{f"{side}_{what}_us": t for side, (dev, host) in timings.items()
                        for what, t in (("device", dev), ("host", host))}})
        cells = " ".join(f"{dev:7.1f}/{host:7.1f}" for dev, host in timings.values())
        ratio = timings["pool_tuner"][0] / timings["pytorch"][0]
        print(f"{name:16s} {'x'.join(map(str, shape)) + ' -> ' + str(tuple(size)):32s} {cells} {ratio:8.2f}")
    ratios = [r["pool_tuner_device_us"] / r["pytorch_device_us"] for r in rows]
    print(f"geomean pool_tuner/pytorch device time per call: {statistics.geometric_mean(ratios):.2f} "
          "(below 1: pool_tuner faster)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
