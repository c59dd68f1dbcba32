"""The CUDA tuning path, run in CI without a GPU: Kernel Tuner replays a recorded cache file in its
simulation mode.

SYNTHETIC DATA: ``data/synthetic_cuda_kernel_tuner_cache.json`` was not measured on any GPU.  It
was made by this module (``PYTHONPATH=$PWD python tests/test_cuda_tuning_replay.py`` rewrites it)
from the search
spaces, with made-up timings from a fixed formula; no number from it, or from these tests, may be
quoted as a measurement.

What runs for real: ``tuner.tune`` and ``pool-tuner tune --device cuda:0`` on a ``CudaDevice``
(identity, fingerprint, limits and Kernel Tuner arguments from made-up H100-like properties, no
PyCUDA needed), the search space and its restrictions as Kernel Tuner receives them, Kernel
Tuner's ``tune_kernel`` with the arguments pool_tuner passes (``lang="PYCUDA"``, the ordinal),
its strategies (brute force, random sampling) over the space, pool_tuner's reading of the
results, the race through the device contract, the record written to the tuning cache and the
dispatch from it.

What the replay replaces, and only a GPU checks: compiling and running each configuration (Kernel
Tuner's simulation mode reads the results from the file instead), so the verification of every
configuration against the reference does not run here; and the race's kernel times (the device
below answers ``timed_launch`` with the recorded median of the configuration).  Kernel Tuner's
PyCUDA backend itself (its context, nvcc options) is not exercised.
"""

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from pool_tuner import cache, cli, dispatch, kernel_source, tuner
from pool_tuner.backends import cuda
from pool_tuner.problem import Problem
from pool_tuner.variants import variants_for

from test_device_contract import SYNTHETIC_H100

RECORDED = Path(__file__).resolve().parent / "data" / "synthetic_cuda_kernel_tuner_cache.json"
OP, SHAPE, OUTPUT = "adaptive_avg_pool2d", (2, 8, 10, 9), (4, 7)
#: The variants recorded (the op's others have no legal configuration for this problem); the
#: first two are searched whole (brute force), block_per_row by random sampling (41 points).
VARIANTS = ("thread_per_output", "thread_per_row", "block_per_row")
#: Made-up kernel times (ms) per variant: each configuration gets base * uniform(1, 1.5) from a
#: generator seeded by its name, so thread_per_row (searched whole) holds the overall minimum.
SYNTHETIC_BASE_MS = {"thread_per_row": 0.004, "thread_per_output": 0.006, "block_per_row": 0.010}
LABEL = ("SYNTHETIC DATA, NOT MEASUREMENTS: Kernel Tuner cache entries made up from pool_tuner's search spaces by "
         "tests/test_cuda_tuning_replay.py for replay in Kernel Tuner's simulation mode; device properties are "
         "invented (H100-like); every time is base * uniform(1, 1.5) from a seeded generator")


def problem() -> Problem:
    return Problem.create(OP, SHAPE, OUTPUT)


def _config_key(params: dict, names) -> str:
    """Kernel Tuner's cache key of a configuration: its values in search-space order."""
    return ",".join(str(params[name]) for name in names)


def synthetic_cache() -> dict:
    """The recorded file's content, made from the current search spaces (see the module docstring)."""
    limits = cuda.CudaDevice(0, SYNTHETIC_H100).limits
    table, recorded = variants_for(OP), {}
    for name in VARIANTS:
        variant = table[name]
        entries = {}
        for params in variant.legal_configurations(problem(), limits):
            made_up = random.Random(f"{name}:{sorted(params.items())}")
            times = [round(SYNTHETIC_BASE_MS[name] * made_up.uniform(1.0, 1.5), 6) for _ in range(tuner.ITERATIONS)]
            entries[_config_key(params, variant.search_space)] = {
                **params, "time": float(np.mean(times)), "times": times, "compile_time": 300.0,
                "verification_time": 1.0, "benchmark_time": float(np.sum(times)), "strategy_time": 0,
                "framework_time": 0.1, "timestamp": "synthetic"}
        recorded[name] = {"device_name": SYNTHETIC_H100.name, "kernel_name": variant.kernel_name,
                          "problem_size": "callable", "tune_params_keys": list(variant.search_space),
                          "tune_params": {k: list(v) for k, v in variant.search_space.items()},
                          "objective": "time", "cache": entries}
    return {"synthetic": LABEL, "problem": {"op": OP, "input_shape": SHAPE, "output_size": OUTPUT},
            "variants": recorded}


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(RECORDED.read_text())


def recorded_median(recorded, variant: str, params: dict) -> float:
    names = recorded["variants"][variant]["tune_params_keys"]
    return float(np.median(recorded["variants"][variant]["cache"][_config_key(params, names)]["times"]))


class ReplayCudaDevice(cuda.CudaDevice):
    """A ``CudaDevice`` whose kernels never run: ``build`` returns the rendered source, arrays stay
    numpy, and ``timed_launch`` answers with the recorded median of the configuration the source
    was rendered for (its variant read back from the variant's file that ends it, its parameters
    from its ``#define``s).  Identity, fingerprint, limits and Kernel Tuner's arguments are the
    real class's."""

    def __init__(self, recorded):
        super().__init__(0, SYNTHETIC_H100)
        self.recorded = recorded
        self.timed = []

    queue = cuda.CudaQueue(context="replay")

    def build(self, context, source, kernel_name):
        return source

    def kernel_work_group_limit(self, kernel):
        return self.limits.max_work_group_size

    def to_device(self, host, queue=None):
        return np.array(host)

    def launch(self, queue, kernel, groups, block, args, wait_for=None):
        return None

    def synchronize(self, queue=None):
        return None

    def timed_launch(self, queue, kernel, groups, block, args):
        (variant,) = [name for name in VARIANTS
                      if kernel.endswith(kernel_source.read(variants_for(OP)[name].template))]
        names = self.recorded["variants"][variant]["tune_params_keys"]
        params = {name: int(re.search(rf"^#define {name} (-?\d+)$", kernel, re.M)[1]) for name in names}
        self.timed.append((variant, params))
        return recorded_median(self.recorded, variant, params)


@pytest.fixture
def replayed_kernel_tuner(monkeypatch, recorded):
    """Kernel Tuner's own ``tune_kernel``, in simulation mode on the recorded file of the variant
    whose search space it is given; returns the arguments of every call."""
    import kernel_tuner

    real = kernel_tuner.tune_kernel
    calls = []

    def tune_kernel(kernel_name, kernel_source, problem_size, arguments, tune_params, **options):
        calls.append(dict(options, tune_params=tune_params))
        matching = [name for name, c in recorded["variants"].items() if c["tune_params"] == tune_params]
        assert len(matching) == 1, f"no recorded cache for the search space {tune_params}"
        Path(options["cache"]).write_text(json.dumps(recorded["variants"][matching[0]]))
        return real(kernel_name, kernel_source, problem_size, arguments, tune_params, simulation_mode=True, **options)

    monkeypatch.setattr(kernel_tuner, "tune_kernel", tune_kernel)
    return calls


def test_the_recorded_file_is_labelled_synthetic_and_matches_the_search_spaces(recorded):
    """If a search space or legality rule changes, rewrite the file (see the module docstring)."""
    assert recorded["synthetic"].startswith("SYNTHETIC DATA, NOT MEASUREMENTS")
    assert recorded == json.loads(json.dumps(synthetic_cache())), "stale: PYTHONPATH=$PWD python tests/test_cuda_tuning_replay.py"


def test_tuning_on_a_cuda_device_passes_pycuda_arguments_and_stores_a_cuda_record(user_cache, recorded,
                                                                                  replayed_kernel_tuner):
    device = ReplayCudaDevice(recorded)
    result = tuner.tune(OP, SHAPE, OUTPUT, device=device, direction="forward", variants=VARIANTS)

    # Kernel Tuner was asked for its PyCUDA backend on ordinal 0, nothing of OpenCL.
    assert len(replayed_kernel_tuner) == len(VARIANTS)
    for options in replayed_kernel_tuner:
        assert options["lang"] == "PYCUDA" and options["device"] == 0 and "platform" not in options
    # Whole spaces searched where small, sampled where large.
    evaluated = {v.variant: v.evaluated for v in result.variants}
    sizes = {name: len(recorded["variants"][name]["cache"]) for name in VARIANTS}
    assert evaluated["thread_per_output"] == sizes["thread_per_output"] <= tuner.BRUTE_FORCE_LIMIT
    assert evaluated["thread_per_row"] == sizes["thread_per_row"]
    assert sizes["block_per_row"] > tuner.BRUTE_FORCE_LIMIT and evaluated["block_per_row"] == tuner.DEFAULT_MAX_FEVALS
    assert all(not v.failures for v in result.variants)

    # The winner is the overall fastest recorded configuration (in a variant searched whole), timed
    # again by the race through the device contract.
    fastest = min(((name, entry) for name in ("thread_per_output", "thread_per_row")
                   for entry in recorded["variants"][name]["cache"].values()),
                  key=lambda pair: float(np.median(pair[1]["times"])))
    names = recorded["variants"][fastest[0]]["tune_params_keys"]
    assert (result.best_variant, result.best_params) == (fastest[0], {n: fastest[1][n] for n in names})
    assert result.best_time_ms == recorded_median(recorded, result.best_variant, result.best_params)
    assert ("thread_per_output", result.default_params) in device.timed  # the default raced too
    assert result.default_variant == "thread_per_output"

    # The record: a CUDA key and fingerprint, the same format as every record, found by dispatch.
    assert result.stored
    stored = json.loads((user_cache / cache.USER_FILE).read_text())["records"]
    record = stored[result.cache_key]
    assert result.cache_key == cache.cache_key(problem(), device) and "|cuda|" in result.cache_key
    assert record["device"] == device.fingerprint and record["kernel_hash"] == cache.kernel_hash(problem())
    assert record["best"] == {"variant": result.best_variant, "params": result.best_params,
                              "time_ms": result.best_time_ms}
    assert cache._record_problem(result.cache_key, record) is None  # well-formed as the cache reads it
    choice = dispatch.choose(problem(), device)
    assert (choice.source, choice.variant.name, choice.config) == ("cache", result.best_variant, result.best_params)


def test_pool_tuner_tune_device_cuda_0_runs_the_same_path(user_cache, recorded, replayed_kernel_tuner, monkeypatch,
                                                          capsys):
    device = ReplayCudaDevice(recorded)
    monkeypatch.setattr(cuda, "list_devices", lambda: (device,))
    code = cli.main(["tune", "--input", "x".join(map(str, SHAPE)), "--output", "x".join(map(str, OUTPUT)),
                     "--direction", "forward", "--device", "cuda:0", "--variants", ",".join(VARIANTS), "--quiet"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"on cuda:0 {SYNTHETIC_H100.name}" in out and "<- winner" in out
    assert {options["lang"] for options in replayed_kernel_tuner} == {"PYCUDA"}
    assert cli.main(["explain", "--input", "x".join(map(str, SHAPE)), "--output", "x".join(map(str, OUTPUT)),
                     "--device", "cuda:0"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["source"] == "cache" and info["device"].startswith("cuda:0 ") and "|cuda|" in info["cache_key"]


if __name__ == "__main__":  # rewrite the recorded file from the current search spaces
    RECORDED.parent.mkdir(exist_ok=True)
    RECORDED.write_text(json.dumps(synthetic_cache(), indent=1) + "\n")
    print(f"wrote {RECORDED}")
