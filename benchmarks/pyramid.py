"""Multi-level pooling: one fused call against the separate calls, pool_tuner's and PyTorch's.

For each fused preset (pool_tuner.presets.FUSED_PRESETS: pspnet_ppm_fused, spp_net_fused,
avgmax_head), forward and backward, the time per call in loops of calls back to back
(``bench.time_loop``), the candidates interleaved in a fresh random order every round (medians and
quartiles, and the round-by-round ratios):

* forward: the fused call (numpy arrays, and device arrays; avgmax's includes timm's ``avg+max``
  join), pool_tuner's separate single-level calls (not joined), PyTorch's separate calls
  (``torch.nn.functional``, its own threads);
* backward: the fused backward (every input gradient written once; avgmax's from the joined
  gradient), pool_tuner's separate backward calls plus numpy's sum of their gradients, PyTorch's
  separate ATen backward calls plus their sum; on device arrays the fused backward and the separate
  calls without the sum -- a bound below any sum (PyOpenCL's ``+=`` on PoCL streams at a small
  fraction of the copy bandwidth, and would dwarf the calls).

The machine's load average is recorded before and after: on a shared machine every number moves.

    python benchmarks/pyramid.py [--rounds 5] [--loop-s 0.5] [--presets pspnet_ppm_fused,...] [--out report.json]
    python benchmarks/pyramid.py --channels-last --directions forward   # inputs stored channels-last
"""

from __future__ import annotations

import functools
import json

import numpy as np
import torch

import common
import pool_tuner as pt
from pool_tuner import backends, dispatch, presets, reference
from pool_tuner.bench import Candidate
from pool_tuner.problem import LAYOUT_NAMES, Problem

F = torch.nn.functional
ATEN_BACKWARD = {"avg": torch.ops.aten._adaptive_avg_pool2d_backward, "max": torch.ops.aten.adaptive_max_pool2d_backward}


def _levels(op: str, shape, output_size) -> tuple[list, list]:
    """The (kind, size) of every level of a multi-level problem."""
    problem = Problem.create(op, shape, output_size)
    sizes = problem.operation.levels_of(problem.input_shape, problem.output_shape)
    return list(problem.operation.level_kinds(len(sizes))), list(sizes)


def candidates(op: str, shape, output_size, direction: str, device, rng, channels_last: bool = False) -> dict:
    """name -> Candidate for one preset and pass (``fused`` first, then the separate calls)."""
    kinds, sizes = _levels(op, shape, output_size)
    x = rng.uniform(-1.0, 1.0, shape).astype(np.float32)
    if channels_last:  # the same logical array, its memory channels-last (a torch tensor of it too)
        x = np.moveaxis(np.ascontiguousarray(np.moveaxis(x, 1, -1)), -1, 1)
    xt = torch.from_numpy(x)
    wait = functools.partial(device.synchronize, device.queue)
    done = lambda: None  # noqa: E731 -- numpy and torch CPU calls return finished
    single = [getattr(pt, f"adaptive_{kind}_pool2d") for kind in kinds]
    if direction == "forward":
        if op == "adaptive_avgmax_pool2d":
            fused = functools.partial(pt.adaptive_avgmax_pool2d, x, output_size)
        else:
            fused = functools.partial(getattr(pt, f"adaptive_{kinds[0]}_pool_pyramid"), x, sizes)
        found = {
            "fused (numpy)": Candidate(fused, done),
            "pool_tuner separate (numpy)": Candidate(lambda: [f(x, s) for f, s in zip(single, sizes)], done),
            "PyTorch separate": Candidate(
                lambda: [getattr(F, f"adaptive_{k}_pool2d")(xt, s) for k, s in zip(kinds, sizes)], done),
        }
        x_dev = device.to_device(np.ascontiguousarray(np.moveaxis(x, 1, -1)) if channels_last else x, device.queue)
        if channels_last:
            x_dev = device.arrays.strided_view(x_dev, x.shape, x.strides)
        if op == "adaptive_avgmax_pool2d":
            found["fused (device arrays)"] = Candidate(lambda: pt.adaptive_avgmax_pool2d(x_dev, output_size), wait)
        else:
            fn = getattr(pt, f"adaptive_{kinds[0]}_pool_pyramid")
            found["fused (device arrays)"] = Candidate(lambda: fn(x_dev, sizes), wait)
        found["pool_tuner separate (device arrays)"] = Candidate(
            lambda: [f(x_dev, s) for f, s in zip(single, sizes)], wait)
        return found
    values, indices = reference.forward(op, x, sizes if op != "adaptive_avgmax_pool2d" else output_size)
    grads = [rng.uniform(-1.0, 1.0, v.shape).astype(np.float32) for v in values]
    indices_of = {}
    max_levels = iter(indices)
    for level, kind in enumerate(kinds):
        if kind == "max":
            indices_of[level] = next(max_levels)
    on_device = functools.partial(device.to_device, queue=device.queue)
    if op == "adaptive_avgmax_pool2d":
        # timm's avgmax, (avg + max) / 2: the gradient of its result reaches each pooling halved
        joined = grads[0]
        grads = [joined * 0.5, joined * 0.5]
        fused = functools.partial(pt.adaptive_avgmax_pool2d_backward, joined, indices_of[1], shape)
        fused_dev = functools.partial(pt.adaptive_avgmax_pool2d_backward, on_device(joined),
                                      on_device(indices_of[1]), shape)
    elif kinds[0] == "avg":
        fused = functools.partial(pt.adaptive_avg_pool_pyramid_backward, grads, shape)
        fused_dev = functools.partial(pt.adaptive_avg_pool_pyramid_backward, [on_device(g) for g in grads], shape)
    else:
        fused = functools.partial(pt.adaptive_max_pool_pyramid_backward, grads, list(indices), shape)
        fused_dev = functools.partial(pt.adaptive_max_pool_pyramid_backward, [on_device(g) for g in grads],
                                      [on_device(i) for i in indices], shape)

    def separate(grads, indices_of, combine):
        total = None
        for level, (kind, grad) in enumerate(zip(kinds, grads)):
            if kind == "avg":
                g = pt.adaptive_avg_pool2d_backward(grad, shape)
            else:
                g = pt.adaptive_max_pool2d_backward(grad, indices_of[level], shape)
            total = g if total is None else combine(total, g)
        return total

    ours_separate = functools.partial(separate, grads, indices_of, lambda total, g: np.add(total, g, out=total))
    grads_dev = [on_device(g) for g in grads]
    indices_dev = {level: on_device(i) for level, i in indices_of.items()}
    ours_separate_dev = functools.partial(separate, grads_dev, indices_dev, lambda total, g: total)

    grads_t = [torch.from_numpy(g) for g in grads]
    indices_t = {level: torch.from_numpy(i) for level, i in indices_of.items()}

    def torch_separate():
        total = None
        for level, (kind, grad) in enumerate(zip(kinds, grads_t)):
            g = ATEN_BACKWARD[kind](grad, xt) if kind == "avg" else ATEN_BACKWARD[kind](grad, xt, indices_t[level])
            total = g if total is None else total.add_(g)
        return total

    return {"fused (numpy)": Candidate(fused, done), "pool_tuner separate + sum (numpy)": Candidate(ours_separate, done),
            "PyTorch separate + sum": Candidate(torch_separate, done),
            "fused (device arrays)": Candidate(fused_dev, wait),
            "pool_tuner separate, not summed (device arrays)": Candidate(ours_separate_dev, wait)}


def main(argv=None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--loop-s", type=float, default=0.5, help="seconds per timed loop (default 0.5)")
    parser.add_argument("--presets", default=",".join(presets.FUSED_PRESETS), help="comma-separated fused presets")
    parser.add_argument("--directions", default="forward,backward")
    parser.add_argument("--channels-last", action="store_true",
                        help="inputs stored channels-last (with --directions forward)")
    common.add_output_argument(parser)
    args = parser.parse_args(argv)
    chosen = common.choices(parser, args.presets, tuple(presets.FUSED_PRESETS), "--presets")
    directions = common.choices(parser, args.directions, ("forward", "backward"), "--directions")
    if args.channels_last and "backward" in directions:
        parser.error("--channels-last times the forward pass only: pass --directions forward")
    device = backends.default_device()
    rng = np.random.default_rng(0)
    info = common.circumstances(torch, device)
    print(common.describe_circumstances(info))
    report = {"circumstances": info, "results": []}
    for name in chosen:
        for op, shape, output_size in presets.preset_shapes(name):
            for direction in directions:
                layout = LAYOUT_NAMES[len(shape) - 2][1] if args.channels_last else None
                problem = Problem.create(op, shape, output_size, layout=layout, direction=direction)
                explained = dispatch.describe(problem, device, dispatch.choose(problem, device))
                found = candidates(op, shape, output_size, direction, device, rng, args.channels_last)
                timings = common.interleave(found, args.rounds, args.loop_s, rng)
                names = list(found)
                rows = [[n, common.fmt_spread(timings.summary(n)),
                         f"{timings.ratio(n, names[0])['of_medians']:.2f}"] for n in names]
                print(f"\n{name} {direction}: {op} {'x'.join(map(str, shape))} -> {output_size}; fused runs "
                      f"{explained['variant']} {explained['params']} ({explained['source']})")
                print(common.format_table(["candidate", "ms per call (q1-q3)", "x fused"], rows))
                report["results"].append({
                    "preset": name, "op": op, "layout": problem.layout, "input_shape": list(shape), "output_size": json.loads(json.dumps(output_size)),
                    "direction": direction, "fused_variant": explained["variant"], "fused_params": explained["params"],
                    "fused_source": explained["source"],
                    "ms": {n: timings.summary(n) for n in names},
                    "vs_fused": {n: timings.ratio(n, names[0]) for n in names},
                })
    return common.finish(info, report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
