"""Whole torchvision and timm models on the CPU (or a CUDA GPU), stock against ``pool_tuner.torch.replace_pooling``.

What a user sees who swaps pool_tuner into a model: the model's time per call, not the pooling
layer's.  Each model (``weights=None`` / ``pretrained=False``: random initialisation, nothing
downloaded) is built once; a deep copy with ``replace_pooling`` applied has the same weights.
A model is a torchvision name (``resnet50``) or ``timm:<name>:<global_pool>``
(``timm:resnet18:catavgmax``: ``timm.create_model(name, global_pool=...)``, swapped with
``replace_pooling(fuse=True)``, which swaps timm's pooling layers).  Before any timing the two are
run once on the same batch and their outputs must agree (``allclose``).  Then, in one process, each
case times the stock and the swapped model in interleaved rounds (``pool_tuner.bench``'s loops of
calls back to back, a fresh random order every round), medians:

* ``infer_b1`` and ``infer_b16``: a forward pass of 1 or 16 images of 224x224 in eval mode under
  ``torch.inference_mode()``;
* ``train_b8``: a training step on 8 images in train mode -- forward, cross-entropy loss, backward,
  an SGD step (each model of the pair trains its own copy, so the inference models stay as built).

``--device cuda`` runs the models on the GPU (``CUDA_MODELS``) with the cases ``infer_b1``,
``infer_b64``, ``infer_b64_fp16_cl`` (batch 64 under ``torch.autocast`` to float16, model and images
channels-last) and ``train_b32``; each loop of calls ends with ``torch.cuda.synchronize()``.

``--head`` times a timm model's pooling layer alone (``model.global_pool``, stock and swapped) on
the features the model pools (``forward_features`` of the case's images): the cases' forward, and
for ``train_b8`` a forward and backward of the layer.  On a shared machine the whole model's time
moves by more than the layer takes; the layer alone says what the swap changes.

``--profile N`` then runs one call of each side of every case under ``torch.profiler`` and prints
its N heaviest operations and kernels by self time on the device (CUDA: the kernels, pool_tuner's
driver-API launches among them) or on the host (CPU), with the totals.  A side slower than the
other shows whether the difference is in kernels or in host work around them.

Reported: milliseconds per call of each (median and quartiles over the rounds), the ratio stock /
pool_tuner (below 1: pool_tuner's model is slower) of the medians and the quartiles of the paired
per-round ratios, and the pooling layers swapped.  PyTorch's intra-op threads are set explicitly
(``--threads``; default: what torch chose) and printed: PoCL runs its own worker threads beside
them.

    python benchmarks/models.py [--models efficientnet_b0,timm:resnet18:catavgmax] [--cases infer_b1,infer_b16,train_b8]
                                [--rounds 5] [--threads N] [--out FILE]
    python benchmarks/models.py --device cuda [--cases infer_b1,infer_b64,infer_b64_fp16_cl,train_b32]
    python benchmarks/models.py --device cuda --models mobilenet_v3_large --cases train_b32 --profile 15
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys

import numpy as np
import torch

try:
    import torchvision
except ImportError:
    raise SystemExit('models.py needs torchvision: pip install "pool-tuner[bench]" (a torchvision matching '
                     'the installed torch)') from None

import pool_tuner.torch as ptt
from pool_tuner import backends

import common

MODELS = ("efficientnet_b0", "mobilenet_v3_large", "regnet_y_400mf", "resnet50")
CUDA_MODELS = ("efficientnet_b0", "mobilenet_v3_large", "resnet50", "convnext_tiny")


@dataclasses.dataclass(frozen=True)
class Case:
    """One way of calling a model: a batch of ``batch`` images, a training step or a forward pass,
    and whether under float16 autocast with model and images channels-last."""

    batch: int
    train: bool = False
    fp16_channels_last: bool = False


#: device -> case name -> Case
CASES = {
    "cpu": {"infer_b1": Case(1), "infer_b16": Case(16), "train_b8": Case(8, train=True)},
    "cuda": {"infer_b1": Case(1), "infer_b64": Case(64), "infer_b64_fp16_cl": Case(64, fp16_channels_last=True),
             "train_b32": Case(32, train=True)},
}
IMAGE = 224
CLASSES = 1000
#: How a timm model is named on the command line: ``timm:<model name>:<global_pool>``.
TIMM_PREFIX = "timm:"


def _timm():
    try:
        import timm
    except Exception as error:  # a torchvision built for another torch raises RuntimeError
        raise SystemExit(f"timm models need timm (pip install \"pool-tuner[bench]\", a torchvision matching the "
                         f"installed torch): {type(error).__name__}: {error}") from None
    return timm


def _timm_model(name: str):
    arch, _, global_pool = name[len(TIMM_PREFIX):].partition(":")
    return _timm().create_model(arch, pretrained=False, num_classes=CLASSES, global_pool=global_pool or "avg")


def build(name: str) -> tuple:
    """``(stock, swapped, swapped layer names)``: the model with random weights and a deep copy with
    pool_tuner's pooling layers (for a timm model, ``fuse=True``: its avg+max layers pool twice)."""
    timm_model = name.startswith(TIMM_PREFIX)
    stock = _timm_model(name) if timm_model else torchvision.models.get_model(name, weights=None, num_classes=CLASSES)
    report = []
    swapped = ptt.replace_pooling(copy.deepcopy(stock), fuse=timm_model, report=report)
    names = [entry["module"] for entry in report if entry["action"] != "kept"]
    return stock, swapped, names


def agreement(stock, swapped, rng, device: str = "cpu") -> dict:
    """Both models in eval mode on one batch of two images: whether their outputs agree, and how
    far apart they are (summation order differs, and the difference grows through the layers
    after a pooling layer, so the tolerance is relative to the outputs' scale)."""
    images = torch.from_numpy(rng.standard_normal((2, 3, IMAGE, IMAGE), dtype=np.float32)).to(device)
    with torch.inference_mode():
        expected, got = stock.eval()(images), swapped.eval()(images)
    scale = float(expected.abs().max())
    difference = float((got - expected).abs().max())
    return {"allclose": bool(torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * scale)),
            "max_abs_difference": difference, "output_scale": scale}


def _wait(device: str):
    """What ends a loop of calls: nothing on the CPU (each call returns its result), the device's
    queue drained on a GPU."""
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def inference(model, images, case: Case, device: str = "cpu") -> common.Candidate:
    model.eval()
    if case.fp16_channels_last:
        model = copy.deepcopy(model).to(memory_format=torch.channels_last)
        images = images.to(memory_format=torch.channels_last)

    def call():
        with torch.inference_mode(), torch.autocast(device, dtype=torch.float16, enabled=case.fp16_channels_last):
            model(images)

    return common.Candidate(call, _wait(device))


def training_step(model, images, labels, device: str = "cpu") -> common.Candidate:
    """One step on a copy of ``model`` of its own (momentum buffers and all)."""
    model = copy.deepcopy(model).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def call():
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(images), labels).backward()
        optimizer.step()

    return common.Candidate(call, _wait(device))


def head_step(layer, features, device: str = "cpu") -> common.Candidate:
    """A forward and backward of a pooling layer alone, on ``features`` that require a gradient."""
    features = features.detach().requires_grad_()
    grad = torch.ones_like(layer(features))

    def call():
        features.grad = None
        layer(features).backward(grad)

    return common.Candidate(call, _wait(device))


def profile(candidate: common.Candidate, device: str, top: int) -> dict:
    """One call of ``candidate`` (after one untimed call) under ``torch.profiler``: the totals and
    the ``top`` events by self time on the device (``cuda``) or the host, each as its name, calls
    and self microseconds on the device and on the host."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    candidate.call()
    candidate.wait()
    with torch.profiler.profile(activities=activities) as profiler:
        candidate.call()
        candidate.wait()
    events = [{"name": e.key, "calls": e.count, "device_us": getattr(e, "self_device_time_total", 0.0),
               "host_us": e.self_cpu_time_total} for e in profiler.key_averages()]
    order = "device_us" if device == "cuda" else "host_us"
    return {"device_us": sum(e["device_us"] for e in events), "host_us": sum(e["host_us"] for e in events),
            "top": sorted(events, key=lambda e: -e[order])[:top]}


def _print_profile(title: str, found: dict) -> None:
    print(f"{title}: self time {found['device_us'] / 1e3:.2f} ms on the device, {found['host_us'] / 1e3:.2f} ms "
          "on the host (profiled: slower than unprofiled)")
    print(common.format_table(["event", "calls", "device us", "host us"],
                              [[e["name"][:60], e["calls"], f"{e['device_us']:.0f}", f"{e['host_us']:.0f}"]
                               for e in found["top"]]))


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--device", default="cpu", choices=tuple(CASES), help="where the models run (default: cpu)")
    parser.add_argument("--models", help=f"comma-separated torchvision model names or timm:<name>:<global_pool> "
                        f"(default: {', '.join(MODELS)}; with --device cuda {', '.join(CUDA_MODELS)})")
    parser.add_argument("--cases", help="comma-separated, of " + "; ".join(
        f"{', '.join(cases)} (--device {device})" for device, cases in CASES.items()) + " (default: all of the device's)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per case (default: %(default)s)")
    parser.add_argument("--loop-s", type=float, default=0.3,
                        help="wall time each timed loop of calls aims at, at least one call (default: %(default)s)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's default)")
    parser.add_argument("--head", action="store_true",
                        help="time timm models' pooling layer (global_pool) alone, on the features it pools")
    parser.add_argument("--control", action="store_true",
                        help="also time a copy of the stock model (copy.deepcopy) in the same rounds: stock/copy is "
                             "how far the same model moves at other addresses, the floor under stock/pt's noise")
    parser.add_argument("--profile", type=int, metavar="N", default=0,
                        help="after timing, profile one call of each side and print its N heaviest events")
    common.add_output_argument(parser)
    args = parser.parse_args()
    device_cases = CASES[args.device]
    cases = args.cases.split(",") if args.cases else list(device_cases)
    unknown = [c for c in cases if c not in device_cases]
    if unknown:
        parser.error(f"unknown case(s) {unknown} for --device {args.device}; choose from {list(device_cases)}")
    models = args.models.split(",") if args.models else list(CUDA_MODELS if args.device == "cuda" else MODELS)
    if args.head and not all(name.startswith(TIMM_PREFIX) for name in models):
        parser.error(f"--head times timm models' global_pool: name models as {TIMM_PREFIX}<name>:<global_pool>")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("models.py --device cuda needs a CUDA GPU and PyTorch built with CUDA")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    info = common.circumstances(torch, backends.default_device())
    info["torchvision"] = torchvision.__version__
    if any(name.startswith(TIMM_PREFIX) for name in models):
        info["timm"] = _timm().__version__
    print(common.describe_circumstances(info) + f"; torchvision {torchvision.__version__}"
          + (f"; timm {info['timm']}" if "timm" in info else ""))
    results, rows, disagreed = [], [], []
    for name in models:
        stock, swapped, swapped_names = build(name)
        stock, swapped = stock.to(args.device), swapped.to(args.device)
        agree = agreement(stock, swapped, rng, args.device)
        if not agree["allclose"]:
            disagreed.append(name)
        entry = {"model": name, "timed": "global_pool" if args.head else "model",
                 "pooling_layers_swapped": swapped_names, "outputs_agree": agree, "cases": {}}
        for case in cases:
            spec = device_cases[case]
            images = torch.from_numpy(rng.standard_normal((spec.batch, 3, IMAGE, IMAGE), dtype=np.float32))
            images = images.to(args.device)
            if args.head:
                with torch.no_grad():
                    images = stock.eval().forward_features(images)
                stock_part, swapped_part = stock.global_pool, swapped.global_pool
            else:
                stock_part, swapped_part = stock, swapped
            if spec.train and args.head:
                make = functools.partial(head_step, features=images, device=args.device)
            elif spec.train:
                labels = torch.from_numpy(rng.integers(0, CLASSES, spec.batch)).to(args.device)
                make = functools.partial(training_step, images=images, labels=labels, device=args.device)
            else:
                make = functools.partial(inference, images=images, case=spec, device=args.device)
            sides = {"stock": make(stock_part), "pool_tuner": make(swapped_part)}
            if args.control:
                sides["stock_copy"] = make(copy.deepcopy(stock_part))
            timings = common.interleave(sides, args.rounds, args.loop_s, rng)
            ratio = timings.ratio("stock", "pool_tuner")
            entry["cases"][case] = {"stock_ms": timings.summary("stock"), "pool_tuner_ms": timings.summary("pool_tuner"),
                                    "ratio_stock_over_pool_tuner": ratio}
            rows.append([f"{name} {case}", len(swapped_names), common.fmt_spread(timings.summary("stock")),
                         common.fmt_spread(timings.summary("pool_tuner")), f"{ratio['of_medians']:.2f}x",
                         f"{ratio['q1']:.2f}-{ratio['q3']:.2f}", "yes" if agree["allclose"] else "NO"])
            if args.control:
                control = entry["cases"][case]["ratio_stock_over_stock_copy"] = timings.ratio("stock", "stock_copy")
                rows[-1].insert(6, f"{control['of_medians']:.2f}x ({control['q1']:.2f}-{control['q3']:.2f})")
            print(f"{name} {case}: stock {timings.median('stock'):.1f} ms, pool_tuner {timings.median('pool_tuner'):.1f} ms",
                  file=sys.stderr, flush=True)
            if args.profile:
                found = {side: profile(candidate, args.device, args.profile) for side, candidate in sides.items()}
                entry["cases"][case]["profile"] = found
                for side, side_profile in found.items():
                    _print_profile(f"{name} {case}, {side}", side_profile)
        results.append(entry)
    print(common.format_table(["model case", "swapped", "stock ms (q1-q3)", "pool_tuner ms (q1-q3)", "stock/pt",
                               "paired q1-q3", *(["stock/copy (q1-q3)"] if args.control else []), "agree"], rows))
    print("\nms: time per call, median over the rounds of loops of calls back to back (q1-q3: quartiles);"
          "\nstock/pt: stock median / pool_tuner median (below 1: pool_tuner's model is slower); paired q1-q3: the"
          "\nquartiles of the per-round ratios; swapped: pooling layers replace_pooling swapped; stock/copy"
          "\n(--control): stock median / a deepcopy's, the same model at other addresses; agree: outputs"
          "\nallclose (rtol 1e-4, atol 1e-4 x the outputs' largest magnitude) before timing")
    for name in disagreed:
        print(f"WARNING: {name}'s outputs with pool_tuner differ from the stock model's (see the JSON)")
    common.write_json(args.out, {"benchmark": "models", "circumstances": common.record_end(info),
                                 "rounds": args.rounds, "loop_s": args.loop_s, "image": IMAGE, "models": results})
    raise SystemExit(1 if disagreed else 0)


if __name__ == "__main__":
    main()
