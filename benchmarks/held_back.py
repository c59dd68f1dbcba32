"""Real layers held back from everything the shipped dispatch was fitted or tuned on -- in no
dispatch grid (``dispatch_grid.py``) and no preset -- on device arrays against PyTorch on the CPU:
how pool_tuner does on shapes and CPUs nobody tuned.

For each layer (float32; forward passes, or with ``--backward`` the backward passes of 2d avg
pools, against ``torch.ops.aten._adaptive_avg_pool2d_backward``), in one process, interleaved
rounds (``common.interleave``: loops of calls back to back, the candidates in a fresh random order
every round), medians:

* ``torch`` -- ``torch.nn.functional``'s pooling on a CPU tensor in the layer's memory format,
  ``--threads`` intra-op threads;
* ``rules`` -- the variant and configuration the shipped default rules decide
  (``default_rules.decide``), forced with ``variant=``/``config=``: what dispatch runs when no
  record applies, whatever records the machine holds;
* ``old rules`` (``--old-rules FILE``) -- the same with the CPU rules of another rules file, e.g.
  an older commit's ``pool_tuner/default_rules.json``;
* ``measured`` -- the plain call after a first call with ``pool_tuner.benchmark_mode(True)``
  (``POOL_TUNER_BENCHMARK=1``), in a user cache of the run's own (``POOL_TUNER_CACHE_DIR``, a fresh
  temporary directory unless set): what a user of the mode gets;
* ``tuned`` -- the winner of ``pool_tuner.tune`` with the shipped records' budget (``--max-fevals``
  8, ``--time-limit`` 4, random sampling) in a scratch cache (``--tuned-dir``, kept: a second run
  reuses its tunings), forced;
* ``read`` (forward) -- ``bench.read_kernel``: a kernel that only reads as many bytes as the
  layer's input (``kernels/bandwidth.cl``'s read), called the same way: how fast a plain kernel on
  the device reads that input.  It is no floor -- on PoCL, PyTorch's loops and the pooling kernels
  can read faster -- but where a pooling kernel matches it, the kernel runs at the device's plain
  read speed.

``rules``, ``measured`` and ``tuned`` are those of the problem the calls make: the layout the call
reads its input (backward: grad_out) in, ``call_layout``, which for a channels-last global layer's
backward is channels-first (its grad_out, one value per plane, is contiguous either way).

Every candidate's output is checked against PyTorch's once before timing.  Reported per layer:
milliseconds of each and each one's speed-up over PyTorch (torch ms / candidate ms); overall the
geomean and worst speed-up of each, and measured / tuned.  The load average is printed before and
after: the machine's other work moves every number.

    python benchmarks/held_back.py [--backward] [--old-rules FILE] [--layer NAME ...] [--rounds 7] [--threads 2]
                                   [--tuned-dir DIR] [--no-tune | --tune-only] [--out FILE]
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

os.environ.setdefault("POOL_TUNER_CACHE_DIR", tempfile.mkdtemp(prefix="pool_tuner_held_back_"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import common  # noqa: E402
import pool_tuner as pt  # noqa: E402
from pool_tuner import backends, bench, cache, default_rules, ops, tuner  # noqa: E402
from pool_tuner.problem import LAYOUT_NAMES, Problem  # noqa: E402

#: name -> (op, input shape, output size, layout): forward passes of torchvision/timm-style layers
#: whose shapes are in no grid and no preset.
LAYERS = {
    "efficientnet_b0_head": ("adaptive_avg_pool2d", (32, 1280, 7, 7), (1, 1), "NCHW"),
    "densenet121_head": ("adaptive_avg_pool2d", (32, 1024, 7, 7), (1, 1), "NCHW"),
    "inception_v3_head": ("adaptive_avg_pool2d", (32, 2048, 8, 8), (1, 1), "NCHW"),
    "mobilenet_v3_se_28": ("adaptive_avg_pool2d", (16, 120, 28, 28), (1, 1), "NCHW"),
    "regnet_y_se_14": ("adaptive_avg_pool2d", (16, 208, 14, 14), (1, 1), "NCHW"),
    "deeplabv3_image_pool": ("adaptive_avg_pool2d", (8, 2048, 33, 33), (1, 1), "NCHW"),
    "pspnet_473_level_3": ("adaptive_avg_pool2d", (4, 2048, 60, 60), (3, 3), "NCHW"),
    "pspnet_473_level_6": ("adaptive_avg_pool2d", (4, 2048, 60, 60), (6, 6), "NCHW"),
    "spp_vgg_level_3": ("adaptive_max_pool2d", (8, 512, 14, 14), (3, 3), "NCHW"),
    "global_max_head": ("adaptive_max_pool2d", (32, 1024, 7, 7), (1, 1), "NCHW"),
    "convnext_head_cl": ("adaptive_avg_pool2d", (32, 768, 7, 7), (1, 1), "NHWC"),
    "inception_grid_17_to_5": ("adaptive_avg_pool2d", (8, 768, 17, 17), (5, 5), "NCHW"),
    "text_mean_pool_1d": ("adaptive_avg_pool1d", (32, 768, 128), (1,), "NCL"),
    "video_r2plus1d_head": ("adaptive_avg_pool3d", (8, 512, 4, 7, 7), (1, 1, 1), "NCDHW"),
}
#: name -> (op, input shape, output size, layout): backward passes (the gradient of an avg pool with
#: respect to its input, as in training) of such layers; ``--backward`` times these instead.
BACKWARD_LAYERS = {
    "convnext_head_cl_backward": ("adaptive_avg_pool2d", (32, 768, 7, 7), (1, 1), "NHWC"),
    "mobilenet_v3_se_cl_backward": ("adaptive_avg_pool2d", (16, 72, 56, 56), (1, 1), "NHWC"),
    "pspnet_473_level_6_cl_backward": ("adaptive_avg_pool2d", (4, 512, 60, 60), (6, 6), "NHWC"),
    "inception_grid_17_to_5_cl_backward": ("adaptive_avg_pool2d", (8, 768, 17, 17), (5, 5), "NHWC"),
    "efficientnet_b0_head_backward": ("adaptive_avg_pool2d", (32, 1280, 7, 7), (1, 1), "NCHW"),
    "deeplabv3_image_pool_backward": ("adaptive_avg_pool2d", (8, 2048, 33, 33), (1, 1), "NCHW"),
    "pspnet_473_level_3_backward": ("adaptive_avg_pool2d", (4, 2048, 60, 60), (3, 3), "NCHW"),
}
TUNE_BUDGET = {"strategy": "random_sample", "max_fevals": 8, "time_limit": 4}


def host_copy(array) -> np.ndarray:
    """A device array's values on the host, logical channels-first (channels-last memory too)."""
    import pyopencl.array as cl_array

    if array.flags.forc:
        return array.get()
    memory_shape = (array.shape[0], *array.shape[2:], array.shape[1])
    memory = cl_array.Array(array.queue, memory_shape, array.dtype, data=array.base_data, offset=array.offset)
    return np.moveaxis(memory.get(), -1, 1)


def torch_input(x: np.ndarray, layout: str) -> torch.Tensor:
    t = torch.from_numpy(x)
    if layout == LAYOUT_NAMES[x.ndim - 2][0]:
        return t
    return t.contiguous(memory_format=torch.channels_last if x.ndim == 4 else torch.channels_last_3d)


def layer(name: str) -> tuple:
    """``(op, input shape, output size, layout, direction)`` of layer ``name``."""
    return (*LAYERS[name], "forward") if name in LAYERS else (*BACKWARD_LAYERS[name], "backward")


def tuned_choice(name: str, device, table: cache.TuningCache, allow_tuning: bool, layout: str | None = None
                 ) -> tuple | None:
    """The scratch cache's winner for layer ``name`` (tuned now if missing and ``allow_tuning``), in
    ``layout`` where given (the layout its calls read, ``call_layout``), else the layer's."""
    op, shape, size, layer_layout, direction = layer(name)
    layout = layout or layer_layout
    problem = Problem.create(op, shape, size, "float32", layout, direction=direction)
    record = table.lookup(cache.cache_key(problem, device))
    if record is None and allow_tuning:
        tuner.tune(op, shape, size, "float32", layout, device, direction=direction, tuning_cache=table,
                   **TUNE_BUDGET)
        record = table.lookup(cache.cache_key(problem, device))
    return None if record is None else (record["best"]["variant"], record["best"]["params"])


def call_layout(array, ndim: int) -> str:
    """The layout a call reads ``array`` (its input, or a backward call's grad_out) in: where the
    memory is both contiguous and channels-last (a global grad_out, one value per plane) contiguous
    wins, so a channels-last global layer's backward is a channels-first problem; its rules, its
    measured choice and its tuning must be that problem's, not the layer's nominal layout's."""
    return ops.memory_layout(array, ndim)


def compare(name: str, device, old_rules, table, allow_tuning: bool, rounds: int, rng) -> dict:
    op, shape, size, layout, direction = layer(name)
    output_shape = Problem.create(op, shape, size, "float32", layout, direction=direction).output_shape
    x_host = rng.uniform(-2, 2, shape).astype(np.float32)
    x, t = common.device_input(device, x_host, layout), torch_input(x_host, layout)
    if direction == "forward":
        function, torch_function = getattr(pt, op), getattr(F, op)

        def ours_call(variant=None, config=None):
            return function(x, size, variant=variant, config=config)

        def torch_call():
            return torch_function(t, size)
    else:  # the gradient of a random upstream gradient, in the layer's memory format
        g_host = rng.uniform(-2, 2, output_shape).astype(np.float32)
        g, g_t = common.device_input(device, g_host, layout), torch_input(g_host, layout)
        function = getattr(pt, f"{op}_backward")
        torch_function = getattr(torch.ops.aten, f"_{op}_backward")

        def ours_call(variant=None, config=None):
            return function(g, shape, variant=variant, config=config)

        def torch_call():
            return torch_function(g_t, t)
    read = call_layout(x if direction == "forward" else g, len(size))
    problem = Problem.create(op, shape, size, "float32", read, direction=direction)
    plain_source = pt.explain(op, shape, size, layout=read, direction=direction)["source"]
    with pt.benchmark_mode(True):
        ours_call()
    measured = pt.explain(op, shape, size, layout=read, direction=direction)
    choices = {"rules": default_rules.decide(problem, device)}
    if old_rules is not None:
        choices["old rules"] = default_rules.decide(problem, device, old_rules)
    forced = {k: (d.variant.name, d.params) for k, d in choices.items()}
    tuned = tuned_choice(name, device, table, allow_tuning, read)
    if tuned is not None:
        forced["tuned"] = tuned

    def ours(variant=None, config=None):
        return bench.Candidate(lambda: ours_call(variant, config), device.queue.finish)

    candidates = {"torch": bench.Candidate(torch_call, lambda: None),
                  "measured": ours(), **{k: ours(*v) for k, v in forced.items()}}
    want = torch_call().numpy()
    for key, candidate in candidates.items():
        got = np.asarray(host_copy(candidate.call()) if key != "torch" else candidate.call())
        if not np.allclose(got, want, rtol=1e-5, atol=1e-5):
            raise AssertionError(f"{name}: {key} disagrees with PyTorch")
    if direction == "forward":
        candidates["read"] = bench.read_kernel(device, problem.bytes_read_written()[0])
    timings = common.interleave(candidates, rounds, 0.2, rng)
    return {
        "layer": name, "op": op, "direction": direction, "input": list(shape), "output_size": list(size),
        "layout": layout, "call_layout": read,
        "plain_source": plain_source,
        "choices": {**{k: {"variant": v, "params": p} for k, (v, p) in forced.items()},
                    "measured": {"variant": measured["variant"], "params": measured["params"],
                                 "source": measured["source"]}},
        "ms": {k: timings.summary(k) for k in candidates},
        "speedup": {k: timings.ratio("torch", k)["of_medians"] for k in candidates if k != "torch"},
        "measured_over_tuned": timings.ratio("measured", "tuned") if "tuned" in candidates else None,
    }


def summary(rows: list) -> dict:
    """Geomean and worst speed-up over PyTorch of each candidate, and measured / tuned."""
    out = {}
    for key in rows[0]["speedup"]:
        values = [r["speedup"][key] for r in rows if key in r["speedup"]]
        out[key] = {"geomean": math.exp(sum(map(math.log, values)) / len(values)), "worst": min(values),
                    "layers": len(values)}
    ratios = [r["measured_over_tuned"]["of_medians"] for r in rows if r["measured_over_tuned"]]
    if ratios:
        out["measured/tuned"] = {"geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)), "worst": max(ratios)}
    return out


def table(rows: list) -> str:
    keys = [k for k in ("rules", "old rules", "measured", "tuned", "read") if any(k in r["speedup"] for r in rows)]
    headers = ["layer", "torch ms"] + [f"{k} ms (x)" for k in keys] + ["rules variant", "measured variant"]
    lines = []
    for r in rows:
        cells = [r["layer"], f"{r['ms']['torch']['median']:.3f}"]
        cells += [f"{r['ms'][k]['median']:.3f} ({r['speedup'][k]:.2f})" if k in r["speedup"] else "-" for k in keys]
        cells += [r["choices"]["rules"]["variant"], r["choices"]["measured"]["variant"]]
        lines.append(cells)
    return common.format_table(headers, lines)


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--layer", nargs="+", choices=sorted(LAYERS) + sorted(BACKWARD_LAYERS),
                        help="the layers to time (default: every forward layer, or with --backward every backward one)")
    parser.add_argument("--backward", action="store_true", help="the backward layers (BACKWARD_LAYERS)")
    parser.add_argument("--old-rules", type=Path, help="a rules file whose cpu rules to time beside the shipped ones")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2, help="PyTorch's intra-op threads")
    parser.add_argument("--tuned-dir", type=Path, default=Path(tempfile.gettempdir()) / "pool_tuner_held_back_tuned",
                        help="the scratch cache of the tunings (kept between runs)")
    parser.add_argument("--no-tune", action="store_true", help="time only layers the scratch cache already holds")
    parser.add_argument("--tune-only", action="store_true",
                        help="tune the layers the scratch cache lacks and exit (the timings can then run later, "
                             "on a quieter machine, with --no-tune)")
    common.add_output_argument(parser)
    args = parser.parse_args()
    args.layer = args.layer or list(BACKWARD_LAYERS if args.backward else LAYERS)
    torch.set_num_threads(args.threads)
    device = backends.default_device()
    old_rules = None
    if args.old_rules:
        old_cpu = json.loads(args.old_rules.read_text())["devices"]["cpu"]
        old_rules = default_rules.parse({"devices": {"old": old_cpu}})["old"]
    args.tuned_dir.mkdir(parents=True, exist_ok=True)
    (args.tuned_dir / "no_shipped_records").mkdir(exist_ok=True)
    table_ = cache.TuningCache(shipped_dir=args.tuned_dir / "no_shipped_records", user_dir=args.tuned_dir)
    if args.tune_only:
        for name in args.layer:
            print(f"  {name}: tuned {tuned_choice(name, device, table_, True)}", flush=True)
        return
    info = common.circumstances(torch=torch, device=device)
    print(common.describe_circumstances(info), flush=True)
    rng = np.random.default_rng()
    rows = []
    for name in args.layer:
        rows.append(compare(name, device, old_rules, table_, not args.no_tune, args.rounds, rng))
        print(f"  {name}: " + ", ".join(f"{k} {v:.2f}x" for k, v in rows[-1]["speedup"].items()), flush=True)
    print()
    print("Speed-up over PyTorch on device arrays (ms per call, medians of interleaved rounds; (x) = torch / it):")
    print(table(rows))
    overall = summary(rows)
    print()
    for key, values in overall.items():
        print(f"{key}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items()))
    common.finish(info, {"circumstances": info, "layers": rows, "summary": overall}, args.out)


if __name__ == "__main__":
    main()
