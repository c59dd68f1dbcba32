"""Global pooling (every output size 1) against PyTorch: kernel and call times.

On an OpenCL device, for each layer and pass: the kernel time (OpenCL profiling events,
``tuner.race``) of the dispatched choice, of the variant the heuristic took before the
global-pooling variants (``BEFORE``: thread_per_output, channels_vector, plane_scatter) and, forward,
of ``global_blocks`` (the variant shaped for GPUs, forced where the device is not one); and the time
per call in loops of calls back to back (``bench.time_loop``), interleaved in a fresh random order
each round, medians: pool_tuner on device arrays (dispatched and the earlier variant), the
``pool_tuner.torch`` module on CPU tensors (forward), and PyTorch.

On a CUDA device (``--device cuda:0``; forward), what a GPU lease measures against the issue's
targets: PyTorch (``torch.nn.functional`` on CUDA tensors), ``pool_tuner.torch`` on the same
tensors (dispatched), and the kernels alone (``bench``'s prepared launch) of the dispatched choice,
``global_blocks`` (and, where the layer allows, ``global_blocks`` reading 4 positions per load:
``VECTOR_CONFIG``; where its default splits planes, ``global_blocks`` unsplit), the channels-first or channels-last global variant of before it and the earlier
heuristic's variant; each loop between CUDA events, interleaved, medians; every time also as a
multiple of the copy floor (the layer's bytes over the device's copy bandwidth).

    python benchmarks/global_pooling.py [--device ID] [--repeat 7] [--backward] [--max]
                                        [--layer 32x2048x7x7 ...] [--issue-layers] [--split-layers]
                                        [--shape 2x8x7x7 ...]
"""

import argparse
import functools

import numpy as np
import torch

import pool_tuner as pt
import pool_tuner.torch as ptt
from pool_tuner import backends, bench, dispatch, tuner
from pool_tuner.problem import LAYOUT_NAMES, Problem
from pool_tuner.variants import variants_for

import common

#: (input shape, layout): every layer pools to 1 along each axis.
LAYERS = [
    ((32, 2048, 7, 7), "NCHW"), ((32, 256, 56, 56), "NCHW"), ((32, 1280, 7, 7), "NCHW"),
    ((32, 72, 56, 56), "NCHW"), ((8, 2048, 33, 33), "NCHW"), ((8, 2048, 8, 7, 7), "NCDHW"),
    ((8, 2048, 64, 64), "NCHW"), ((32, 2048, 7, 7), "NHWC"), ((32, 72, 56, 56), "NHWC"),
]
#: The layers of issue 35's global-pooling targets (>= 0.9x PyTorch, >= 80% of copy bandwidth on
#: the large ones), measured there on an H200 before global_blocks.
ISSUE_LAYERS = [
    ((8, 2048, 64, 64), "NCHW"), ((16, 2048, 65, 65), "NCHW"), ((64, 2560, 19, 19), "NCHW"),
    ((32, 256, 56, 56), "NCHW"), ((32, 2048, 7, 7), "NCHW"),
]
#: A few huge planes (``--split-layers``): global_blocks's default cuts each plane into parts over
#: work-groups merged by a second pass (``split``); timed beside it unsplit (``UNSPLIT_CONFIG``).
SPLIT_LAYERS = [((1, 4, 4096, 4096), "NCHW"), ((2, 1, 16384, 16384), "NCHW")]
UNSPLIT_CONFIG = {"split": 1}
#: The global-pooling forward variant of before global_blocks, per channels-last.
GLOBAL_BEFORE = {False: "global_planes", True: "global_channels"}
#: global_blocks's default with vector loads, timed beside it on CUDA where legal: its default reads
#: one element per load until a GPU has measured the widths.
VECTOR_CONFIG = {"vector_width": 4}
#: The variant the heuristic default took for each (direction, channels-last) before.
BEFORE = {("forward", False): "thread_per_output", ("forward", True): "channels_vector",
          ("backward", False): "plane_scatter", ("backward", True): "plane_scatter"}


def measure(device, op, shape, layout, direction, repeat, rng):
    ndim = len(shape) - 2
    problem = Problem.create(op, shape, 1, layout=layout, direction=direction)
    chosen = dispatch.choose(problem, device)
    before = dispatch.choose(problem, device, variant=BEFORE[(direction, problem.channels_last)])
    blocks = dispatch.choose(problem, device, variant="global_blocks") if direction == "forward" else None
    raced = [chosen, before] + ([blocks] if blocks else []) + (
        [dispatch.choose(problem, device, variant="global_blocks", config=UNSPLIT_CONFIG)]
        if blocks and blocks.config["split"] > 1 else [])
    kernel_ms = tuner.race(problem, device, raced, repetitions=repeat * 3)
    x = rng.uniform(-1.0, 1.0, shape).astype(np.float32)
    xt = torch.from_numpy(x)
    if layout != LAYOUT_NAMES[ndim][0]:
        xt = xt.contiguous(memory_format=torch.channels_last if ndim == 2 else torch.channels_last_3d)
    wait = functools.partial(device.synchronize, device.queue)
    size = (1,) * ndim
    if direction == "forward":
        fn, args = getattr(pt, op), (common.device_input(device, x, layout), size)
        module = getattr(ptt, f"Adaptive{'Avg' if 'avg' in op else 'Max'}Pool{ndim}d")(1)
        reference = getattr(torch.nn.functional, op)
        candidates = {"torch": bench.Candidate(functools.partial(reference, xt, size), lambda: None),
                      "pool_tuner.torch": bench.Candidate(functools.partial(module, xt), lambda: None)}
    else:
        grad = rng.uniform(-1.0, 1.0, shape[:2] + size).astype(np.float32)
        fn = getattr(pt, f"{op}_backward")
        gt = torch.from_numpy(grad)
        if "avg" in op:
            args = (device.to_device(grad, device.queue), shape)
            aten = getattr(torch.ops.aten, f"_adaptive_avg_pool{ndim}d_backward")
            call = functools.partial(aten, gt, xt)
        else:
            _, indices = getattr(pt, op)(x, size, return_indices=True)
            args = (device.to_device(grad, device.queue), device.to_device(indices, device.queue), shape)
            aten = getattr(torch.ops.aten, f"adaptive_max_pool{ndim}d_backward")
            call = functools.partial(aten, gt, xt, torch.from_numpy(indices))
        candidates = {"torch": bench.Candidate(call, lambda: None)}
    candidates["pool_tuner"] = bench.Candidate(functools.partial(fn, *args), wait)
    candidates["before"] = bench.Candidate(functools.partial(fn, *args, variant=before.variant.name), wait)
    for candidate in candidates.values():
        bench.time_loop(candidate, 2)
    calls = {name: bench.calls_per_loop(c) for name, c in candidates.items()}
    times = {name: [] for name in candidates}
    for _ in range(repeat):
        for name in rng.permutation(list(candidates)):
            times[name].append(bench.time_loop(candidates[name], calls[name]))
    call_ms = {name: float(np.median(t)) for name, t in times.items()}
    gbs = problem.bytes_moved() / (kernel_ms[0] * 1e-3) / 1e9
    label = f"{op} {'x'.join(map(str, shape))} {layout} {direction}"
    print(f"{label}: kernel {choice_label(chosen)} {kernel_ms[0]:.3f} ms ({gbs:.2f} GB/s), "
          + ", ".join(f"{choice_label(c)} {ms:.3f} ms" for c, ms in zip(raced[1:], kernel_ms[1:]))
          + " | call ms: "
          + ", ".join(f"{name} {ms:.3f}" for name, ms in call_ms.items())
          + f" | pool_tuner vs torch {call_ms['torch'] / call_ms['pool_tuner']:.2f}x"
          + (f", module vs torch {call_ms['torch'] / call_ms['pool_tuner.torch']:.2f}x" if "pool_tuner.torch" in call_ms else ""),
          flush=True)


def choice_label(choice) -> str:
    """A variant's name, with its ``split`` where it cuts planes into parts."""
    split = choice.config.get("split", 1)
    return choice.variant.name + (f" split={split}" if split > 1 else "")


def measure_cuda(device, op, shape, layout, repeat, rng, copy_gbs):
    """The forward of one layer on a CUDA device (the module docstring): one line of milliseconds,
    each with its multiple of the copy floor, and the ratios to PyTorch."""
    ndim = len(shape) - 2
    problem = Problem.create(op, shape, 1, layout=layout)
    x = rng.uniform(-1.0, 1.0, shape).astype(np.float32)
    tensors = bench._cuda_tensors(problem, x, None, None, device.info.torch_device)
    if problem.channels_last:
        tensors = [t.contiguous(memory_format=torch.channels_last if ndim == 2 else torch.channels_last_3d)
                   for t in tensors]
    chosen = dispatch.choose(problem, device).variant.name
    kernels = list(dict.fromkeys([chosen, "global_blocks", GLOBAL_BEFORE[problem.channels_last],
                                  BEFORE[("forward", problem.channels_last)]]))
    functional = getattr(torch.nn.functional, op)
    candidates = {"torch": bench.Candidate(functools.partial(functional, tensors[0], (1,) * ndim),
                                           functools.partial(torch.cuda.synchronize, tensors[0].device)),
                  "pool_tuner.torch": bench._pool_tuner_torch_candidate(problem, tensors)}
    candidates.update({f"kernel {name}": bench._cuda_kernel_candidate(problem, tensors, variant=name)
                       for name in kernels})
    blocks = variants_for(op)["global_blocks"]
    if blocks.is_legal(VECTOR_CONFIG, problem, device.info.limits):
        candidates["kernel global_blocks vector_width=4"] = bench._cuda_kernel_candidate(
            problem, tensors, variant="global_blocks", config=VECTOR_CONFIG)
    split = blocks.default_for(problem)["split"]
    default_blocks = f"kernel global_blocks split={split}" if split > 1 else "kernel global_blocks"
    if split > 1:
        candidates[f"kernel global_blocks split={split}"] = candidates.pop("kernel global_blocks")
        candidates["kernel global_blocks"] = bench._cuda_kernel_candidate(problem, tensors, variant="global_blocks",
                                                                          config=UNSPLIT_CONFIG)
    medians, _ = bench._interleaved(list(candidates.values()), repeat, rng, bench.time_loop_cuda_events)
    ms = dict(zip(candidates, medians))
    floor_ms = problem.bytes_moved() / (copy_gbs * 1e9) * 1e3
    label = f"{op} {'x'.join(map(str, shape))} {layout} forward"
    print(f"{label} (dispatched {chosen}; copy floor {floor_ms:.4f} ms): "
          + ", ".join(f"{name} {t:.4f} ms ({t / floor_ms:.2f}x floor)" for name, t in ms.items())
          + f" | pool_tuner.torch vs torch {ms['torch'] / ms['pool_tuner.torch']:.2f}x, "
          f"{default_blocks} vs torch {ms['torch'] / ms[default_blocks]:.2f}x", flush=True)


def parse_shape(text: str) -> tuple:
    """``NxCxHxW`` or ``NxCxHxW:NHWC`` (the layout defaults to channels-first)."""
    dims, _, layout = text.partition(":")
    shape = tuple(int(d) for d in dims.split("x"))
    if not 3 <= len(shape) <= 5:
        raise argparse.ArgumentTypeError(f"--shape takes N x C and 1 to 3 pooled sizes, e.g. 2x8x7x7, got {text!r}")
    return shape, layout or LAYOUT_NAMES[len(shape) - 2][0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="device id (default: the default device)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--backward", action="store_true", help="backward passes too (OpenCL devices)")
    parser.add_argument("--max", action="store_true", help="max pooling instead of average pooling")
    parser.add_argument("--layer", action="append", help="only layers of this input shape (e.g. 32x2048x7x7)")
    parser.add_argument("--issue-layers", action="store_true", help="the five layers of issue 35's targets")
    parser.add_argument("--split-layers", action="store_true",
                        help="a few huge planes (global_blocks split over work-groups, and unsplit)")
    parser.add_argument("--shape", action="append", type=parse_shape, help="a layer of its own (2x8x7x7[:NHWC])")
    args = parser.parse_args()
    device = backends.resolve_device(args.device)
    rng = np.random.default_rng()
    bandwidth = bench.memory_bandwidth(device)
    print(f"device {device.info.describe()}, torch {torch.__version__} with {torch.get_num_threads()} threads, "
          f"GB/s: " + ", ".join(f"{name} {gbs:.1f}" for name, gbs in bandwidth.items()), flush=True)
    layers = args.shape or ((ISSUE_LAYERS if args.issue_layers else []) + (SPLIT_LAYERS if args.split_layers else [])
                            or LAYERS)
    for shape, layout in layers:
        if args.layer and "x".join(map(str, shape)) not in args.layer:
            continue
        op = f"adaptive_{'max' if args.max else 'avg'}_pool{len(shape) - 2}d"
        if device.info.backend == "cuda":
            measure_cuda(device, op, shape, layout, args.repeat, rng, bench.copy_bandwidth(bandwidth))
            continue
        for direction in ("forward", "backward") if args.backward else ("forward",):
            measure(device, op, shape, layout, direction, args.repeat, rng)


if __name__ == "__main__":
    main()
