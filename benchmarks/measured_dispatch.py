"""Measured dispatch (``POOL_TUNER_BENCHMARK=1``) against the default rules and a tuning, on real
layers that no record covers, and what the first call pays for it.

For each layer: the default rules' choice; the measured choice (``pool_tuner.measured.measure``:
every legal variant's rule configuration timed on the problem, as a first call in the mode does);
and the winner of a tuning with a small budget (``--max-fevals`` sampled configurations per
variant, nothing stored).  Each of the three is then timed per call on device arrays (forced with
``variant=``/``config=``, loops of calls back to back, ``--rounds`` rounds in a fresh random order
each, medians): ``measured/tuned`` is the target (within 1.10).

The first call (``--first-call``): a fresh process per layer and mode, with an empty user cache and
an empty PoCL kernel cache, times its first call on a device array (building, and with the mode on
measuring, included) and its second; ``measure s`` is what the measurement itself took (its
record's ``seconds``), ``builds s`` the part of it spent building the candidates.

Every run starts with an empty user cache of its own (the user's is left alone).  The machine's
load average is printed before and after: other work on the machine moves every number.

    python benchmarks/measured_dispatch.py [--layer NAME ...] [--rounds 7] [--max-fevals 6]
                                          [--no-first-call] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("POOL_TUNER_CACHE_DIR", tempfile.mkdtemp(prefix="pool_tuner_measured_bench_"))

import numpy as np  # noqa: E402

import common  # noqa: E402
import pool_tuner as pt  # noqa: E402
from pool_tuner import backends, bench, dispatch, measured, tuner  # noqa: E402
from pool_tuner.problem import Problem  # noqa: E402

#: name -> (op, input shape, output size, layout): forward passes of real model layers.
LAYERS = {
    "pspnet_ppm_6": ("adaptive_avg_pool2d", (8, 2048, 64, 64), (6, 6), "NCHW"),
    "spp_net_4": ("adaptive_max_pool2d", (32, 256, 13, 13), (4, 4), "NCHW"),
    "efficientnet_head": ("adaptive_avg_pool2d", (32, 1280, 7, 7), (1, 1), "NCHW"),
    "se_block_cl": ("adaptive_avg_pool2d", (4, 256, 56, 56), (1, 1), "NHWC"),
    "vgg16_256px": ("adaptive_avg_pool2d", (32, 512, 8, 8), (7, 7), "NCHW"),
    "audio_1d": ("adaptive_avg_pool1d", (32, 512, 1000), (128,), "NCL"),
}


def _layer_input(device, name: str, rng):
    op, shape, size, layout = LAYERS[name]
    return op, size, common.device_input(device, rng.uniform(-2, 2, shape).astype(np.float32), layout), layout


def child(name: str) -> dict:
    """A fresh process's first and second call of layer ``name`` (the mode from the environment)."""
    device = backends.default_device()
    op, size, x, layout = _layer_input(device, name, np.random.default_rng(0))
    function = getattr(pt, op)
    started = time.perf_counter()
    function(x, size)
    device.queue.finish()
    first = time.perf_counter() - started
    started = time.perf_counter()
    function(x, size)
    device.queue.finish()
    second = time.perf_counter() - started
    info = pt.explain(op, x.shape, size, layout=layout)
    record = dispatch.tuning_cache().lookup(info["cache_key"]) if info["source"] == "measured" else None
    return {"first_s": first, "second_s": second, "source": info["source"], "variant": info["variant"],
            "measure": None if record is None else record["measured"]}


def first_call(name: str, mode: str) -> dict:
    """``child`` in a fresh process with empty user and PoCL caches and the mode ``mode``."""
    with tempfile.TemporaryDirectory() as user, tempfile.TemporaryDirectory() as pocl:
        env = dict(os.environ, POOL_TUNER_CACHE_DIR=user, POCL_CACHE_DIR=pocl,
                   POOL_TUNER_BENCHMARK="1" if mode == "on" else "0")
        out = subprocess.run([sys.executable, __file__, "--child", name], env=env, capture_output=True, text=True,
                             check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(name: str, rounds: int, max_fevals: int, rng) -> dict:
    """Rules, measured and tuned choices of layer ``name`` and their times per call on device arrays."""
    device = backends.default_device()
    op, size, x, layout = _layer_input(device, name, rng)
    problem = Problem.create(op, x.shape, size, "float32", layout)
    rules = dispatch.default_choice(problem, device)
    record = measured.measure(problem, device, rng)
    tuned = tuner.tune(op, x.shape, size, "float32", layout, device, strategy="random_sample",
                       max_fevals=max_fevals, time_limit=30, store=False)
    choices = {"rules": (rules.variant.name, rules.config),
               "measured": (record["best"]["variant"], record["best"]["params"]),
               "tuned": (tuned.best_variant, tuned.best_params)}
    function = getattr(pt, op)

    def candidate(variant, config):
        return bench.Candidate(lambda: function(x, size, variant=variant, config=config), device.queue.finish)

    timings = common.interleave({k: candidate(*v) for k, v in choices.items()}, rounds, 0.2, rng)
    return {
        "layer": name, "op": op, "input": list(x.shape), "output_size": list(size), "layout": layout,
        "choices": {k: {"variant": v, "params": p} for k, (v, p) in choices.items()},
        "ms": {k: timings.summary(k) for k in choices},
        "measured_over_tuned": timings.ratio("measured", "tuned"),
        "rules_over_tuned": timings.ratio("rules", "tuned"),
        "measurement": {"seconds": record["measured"]["seconds"], "build_seconds": record["measured"]["build_seconds"],
                        "kernel_ms": {e["variant"]: e["time_ms"] for e in [record["best"], *record["runners_up"]]}},
        "tuning_seconds": round(tuned.seconds, 1),
    }


def table(rows: list) -> str:
    headers = ["layer", "rules ms", "measured ms", "tuned ms", "measured/tuned", "rules/tuned", "rules variant",
               "measured variant", "tuned variant"]
    lines = []
    for r in rows:
        ms = r["ms"]
        lines.append([r["layer"], f"{ms['rules']['median']:.3f}", f"{ms['measured']['median']:.3f}",
                      f"{ms['tuned']['median']:.3f}", f"{r['measured_over_tuned']['of_medians']:.2f}",
                      f"{r['rules_over_tuned']['of_medians']:.2f}", r["choices"]["rules"]["variant"],
                      r["choices"]["measured"]["variant"], r["choices"]["tuned"]["variant"]])
    return common.format_table(headers, lines)


def first_call_table(rows: list) -> str:
    headers = ["layer", "off: first s", "on: first s", "on: measure s", "on: builds s", "second s (on)",
               "chosen (on)"]
    lines = []
    for r in rows:
        off, on = r["off"], r["on"]
        lines.append([r["layer"], f"{off['first_s']:.2f}", f"{on['first_s']:.2f}",
                      f"{on['measure']['seconds']:.2f}" if on["measure"] else "-",
                      f"{on['measure']['build_seconds']:.2f}" if on["measure"] else "-",
                      f"{on['second_s'] * 1e3:.1f} ms", on["variant"]])
    return common.format_table(headers, lines)


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--layer", nargs="+", choices=sorted(LAYERS), default=list(LAYERS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--max-fevals", type=int, default=6)
    parser.add_argument("--no-first-call", action="store_true")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    rng = np.random.default_rng()
    device = backends.default_device()
    info = common.circumstances(device=device)
    print(common.describe_circumstances(info), flush=True)
    rows = []
    for name in args.layer:
        rows.append(compare(name, args.rounds, args.max_fevals, rng))
        print(f"  {name}: measured/tuned {rows[-1]['measured_over_tuned']['of_medians']:.2f}", flush=True)
    firsts = [] if args.no_first_call else [
        {"layer": name, "off": first_call(name, "off"), "on": first_call(name, "on")} for name in args.layer]
    common.record_end(info)
    print()
    print("Per call on device arrays (ms, medians of interleaved rounds):")
    print(table(rows))
    if firsts:
        print()
        print("First call in a fresh process (empty user and PoCL caches):")
        print(first_call_table(firsts))
    print(f"\nload average before {info['load_average']}, after {info['load_average_after']}")
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"circumstances": info, "layers": rows, "first_call": firsts}, out, indent=1)


if __name__ == "__main__":
    main()
