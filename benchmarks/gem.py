"""GeM pooling on CPU or CUDA tensors: pool_tuner's fused op against PyTorch's four-op composition
``F.adaptive_avg_pool2d(x.clamp(min=eps).pow(p), out).pow(1/p)``, forward and forward+backward
(gradients for x and p), global and regional outputs, with peak memory.

Both take ``p`` as a one-element ``nn.Parameter`` (the learnt exponent of a retrieval head); the
candidates of a case run interleaved in a fresh random order every round (``common.interleave``),
medians and round-by-round ratios reported, outputs and gradients checked against each other first.
Peak memory is what a call allocates beyond its arguments, measured once per candidate: on the CPU
PyTorch's allocations (``torch.profiler`` with ``profile_memory``) plus numpy's (``tracemalloc``:
pool_tuner's CPU results come from numpy), on a GPU the CUDA caching allocator's peak
(``torch.cuda.max_memory_allocated``); minus the results a call must return (the output;
forward+backward: also the input's gradient), as a percentage of the input.

    python benchmarks/gem.py [--device cpu|cuda:0] [--shapes 32x2048x7x7,8x2048x64x64] [--outputs 1,2,3]
                             [--dtypes float32,float16] [--p 3.0] [--rounds 5] [--loop-s 0.5] [--out report.json]
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import torch
import torch.nn.functional as F

import common
import pool_tuner.torch as ptt
from pool_tuner import backends
from pool_tuner.bench import Candidate

EPS = 1e-6


def composition(x, out, p):
    return F.adaptive_avg_pool2d(x.clamp(min=EPS).pow(p), out).pow(1 / p)


def fused(x, out, p):
    return ptt.adaptive_gem_pool2d(x, out, p, EPS)


def peak_extra_bytes(call, device: torch.device) -> int:
    """Bytes allocated at the peak of one ``call`` beyond what existed before it: on a GPU the
    caching allocator's peak; on the CPU PyTorch's allocator (profiler memory events, in time
    order) plus numpy/Python's (tracemalloc)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        call()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    tracemalloc.start()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        call()
    numpy_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # allocations are PyTorch's ops' own (self) memory, at the op's start; frees are "[memory]"
    # events.  Custom ops and autograd nodes are left out: their self memory counts the frees of
    # the tensors made inside them, at their start, which would hide those tensors.
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in profile.events()
                    if e.self_cpu_memory_usage and (e.name == "[memory]" or e.name.startswith("aten::")))
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    return peak + numpy_peak


def main(argv=None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--device", default="cpu", help="where the tensors live: cpu (default) or cuda:N")
    parser.add_argument("--shapes", default="32x2048x7x7,8x2048x64x64")
    parser.add_argument("--outputs", default="1,2,3")
    parser.add_argument("--dtypes", default="float32,float16")
    parser.add_argument("--p", type=float, default=3.0, help="the exponent (default 3.0, GeM's usual start)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loop-s", type=float, default=0.5, help="seconds per timed loop (default 0.5)")
    common.add_output_argument(parser)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    wait = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    info = common.circumstances(torch, backends.resolve_device(args.device) if device.type == "cuda" else None)
    print(common.describe_circumstances(info))
    rng = np.random.default_rng(0)
    report = {"circumstances": info, "p": args.p, "cases": []}
    rows = []
    for shape_text in args.shapes.split(","):
        shape = tuple(int(n) for n in shape_text.split("x"))
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            x = torch.from_numpy(rng.random(shape, dtype=np.float32)).to(device=device, dtype=dtype)
            x_grad = x.clone().requires_grad_()
            for out in (int(n) for n in args.outputs.split(",")):
                p = torch.nn.Parameter(torch.tensor([args.p], device=device))
                y_fused, y_composed = fused(x, out, p), composition(x, out, p)
                difference = (y_fused.float() - y_composed.float()).abs().max().item()
                g = torch.randn_like(y_fused)

                def forward(function):
                    def run():
                        with torch.no_grad():
                            function(x, out, p)
                    return run

                def training(function):
                    def run():
                        x_grad.grad = p.grad = None
                        function(x_grad, out, p).backward(g)
                    return run

                for case, make in (("forward", forward), ("forward+backward", training)):
                    calls = {"composition": make(composition), "pool_tuner": make(fused)}
                    timings = common.interleave({n: Candidate(c, wait) for n, c in calls.items()},
                                                args.rounds, args.loop_s, rng, warmup=1)
                    ratio = timings.ratio("composition", "pool_tuner")
                    returned = y_fused.numel() * y_fused.element_size() + (
                        x.numel() * x.element_size() if case == "forward+backward" else 0)
                    memory = {}
                    for name, call in calls.items():
                        x_grad.grad = p.grad = None  # freed before the baseline, not inside the call
                        memory[name] = max(0, peak_extra_bytes(call, device) - returned)
                    input_bytes = x.numel() * x.element_size()
                    entry = {"shape": shape, "dtype": dtype_name, "output": out, "case": case,
                             "ms": {n: timings.summary(n) for n in calls}, "composition_over_pool_tuner": ratio,
                             "extra_peak_bytes": memory, "max_output_difference": difference}
                    report["cases"].append(entry)
                    rows.append([f"{shape_text} {dtype_name} ->{out} {case}",
                                 common.fmt_spread(timings.summary("composition")),
                                 common.fmt_spread(timings.summary("pool_tuner")),
                                 f"{ratio['of_medians']:.2f} ({ratio['q1']:.2f}-{ratio['q3']:.2f})",
                                 f"{100 * memory['composition'] / input_bytes:.0f}%",
                                 f"{100 * memory['pool_tuner'] / input_bytes:.1f}%"])
                    print(common.format_table(["case", "composition ms", "pool_tuner ms", "speed-up",
                                               "comp. extra mem", "pt extra mem"], rows[-1:]), flush=True)
    print()
    print(common.format_table(["case", "composition ms (q1-q3)", "pool_tuner ms (q1-q3)", "speed-up (round by round)",
                               "composition extra peak", "pool_tuner extra peak"], rows))
    return common.finish(info, report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
