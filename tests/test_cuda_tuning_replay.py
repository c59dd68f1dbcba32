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
below answers a timed ``launch`` with the recorded median of the configuration).  Kernel Tuner's
PyCUDA backend itself (its context, nvcc options) is not exercised; where the tuning runs (the CUDA
tuning thread, ``backends/cuda_tuning.py``) and the toolkit Kernel Tuner is given are.
"""

import json
import logging
import os
import random
import re
import shutil
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from pool_tuner import cache, cli, device_tuning, dispatch, kernel_source, tuner
from pool_tuner.backends import cuda, cuda_tuning
from pool_tuner.backends.base import TuningUnavailable
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
    limits = cuda.CudaDevice(0, SYNTHETIC_H100).info.limits
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


def _nvcc_missing() -> str | None:
    try:
        cuda.find_nvcc()
    except cuda.NvccNotFoundError as why:
        return str(why)
    return None


#: A CUDA tuning sets Kernel Tuner up with pool_tuner's nvcc (``device_tuning.run``), so even a replayed
#: one needs an nvcc installed.
needs_nvcc = pytest.mark.skipif(_nvcc_missing() is not None, reason=f"a CUDA tuning needs nvcc: {_nvcc_missing()}")


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(RECORDED.read_text())


def recorded_median(recorded, variant: str, params: dict) -> float:
    names = recorded["variants"][variant]["tune_params_keys"]
    return float(np.median(recorded["variants"][variant]["cache"][_config_key(params, names)]["times"]))


class ReplayKernel(str):
    """A kernel's rendered source standing in for the kernel, launchable with blocks up to the
    device's limit."""

    max_work_group_size = SYNTHETIC_H100.max_threads_per_block


class ReplayCudaDevice(cuda.CudaDevice):
    """A ``CudaDevice`` whose kernels never run: ``build`` returns the rendered source, arrays stay
    numpy, and a timed ``launch`` answers with the recorded median of the configuration the source
    was rendered for (its variant read back from the variant's file that ends it, its parameters
    from its ``#define``s).  Identity, fingerprint, limits and Kernel Tuner's arguments are the
    real class's."""

    def __init__(self, recorded):
        super().__init__(0, SYNTHETIC_H100)
        self.recorded = recorded
        self.timed = []
        self.threads = set()  # the threads the race timed on

    queue = cuda.CudaQueue(context="replay")

    def build(self, context, source, kernel_name):
        return ReplayKernel(source)

    def to_device(self, host, queue=None):
        return np.array(host)

    def synchronize(self, queue=None):
        return None

    def launch(self, queue, kernel, groups, block, args, timed=False):
        if not timed:
            return None
        self.threads.add(threading.get_ident())
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
        calls.append(dict(options, tune_params=tune_params, thread=threading.get_ident(),
                          nvcc_on_path=shutil.which("nvcc"), cuda_root=os.environ.get("CUDA_ROOT")))
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


@needs_nvcc
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
    assert record["device"] == device.info.fingerprint
    assert record["kernel_hash"] == cache.record_kernel_hash(problem(), device.info.fingerprint)
    assert record["best"] == {"variant": result.best_variant, "params": result.best_params,
                              "time_ms": result.best_time_ms}
    assert cache._record_problem(result.cache_key, record) is None  # well-formed as the cache reads it
    choice = dispatch.choose(problem(), device)
    assert (choice.source, choice.variant.name, choice.config) == ("cache", result.best_variant, result.best_params)


@needs_nvcc
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


# ---------------------------------------------------------------------- where and how CUDA tuning runs

@needs_nvcc
def test_tuning_from_two_threads_runs_on_the_one_tuning_thread(user_cache, recorded, replayed_kernel_tuner):
    """Kernel Tuner's PyCUDA backend works on one thread only: whoever asks, every search and
    every race runs on the process's CUDA tuning thread, which outlives each tuning."""
    device = ReplayCudaDevice(recorded)
    callers, errors = [], []

    def tune_here(variants):
        callers.append(threading.get_ident())
        try:
            tuner.tune(OP, SHAPE, OUTPUT, device=device, direction="forward", variants=variants, store=False)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=tune_here, args=(variants,)) for variants in (VARIANTS[:1], VARIANTS[1:2])]
    for worker in workers:
        worker.start()
    tune_here(VARIANTS[:2])
    for worker in workers:
        worker.join()
    assert not errors, errors
    tuning_thread = cuda_tuning.tuning_thread().ident
    assert {call["thread"] for call in replayed_kernel_tuner} == {tuning_thread}
    assert device.threads == {tuning_thread}
    assert tuning_thread not in callers and len(set(callers)) == 3


@needs_nvcc
def test_autotune_on_a_miss_from_another_thread(user_cache, recorded, replayed_kernel_tuner, monkeypatch):
    """POOL_TUNER_AUTOTUNE=1 and a backward pass on PyTorch's autograd thread: the miss tunes on the
    tuning thread, the calling thread gets the tuned decision, and the next miss asks nothing."""
    monkeypatch.setenv(tuner.AUTOTUNE_ENV, "1")
    monkeypatch.setattr(tuner, "variants_for", lambda op, direction="forward": {
        name: variant for name, variant in variants_for(op, direction).items() if name in VARIANTS})
    device = ReplayCudaDevice(recorded)
    dispatch.forget(problem(), device)
    chosen = []
    worker = threading.Thread(target=lambda: chosen.append(dispatch.choose(problem(), device,
                                                                           on_miss=tuner.tune_on_miss)))
    worker.start()
    worker.join()
    (choice,) = chosen
    assert choice.source == "cache"
    assert {call["thread"] for call in replayed_kernel_tuner} == {cuda_tuning.tuning_thread().ident}
    calls = len(replayed_kernel_tuner)
    assert dispatch.choose(problem(), device, on_miss=tuner.tune_on_miss).config == choice.config
    assert len(replayed_kernel_tuner) == calls


@needs_nvcc
def test_two_threads_missing_one_problem_tune_it_once(user_cache, recorded, replayed_kernel_tuner, monkeypatch):
    monkeypatch.setenv(tuner.AUTOTUNE_ENV, "1")
    monkeypatch.setattr(tuner, "variants_for", lambda op, direction="forward": {
        name: variant for name, variant in variants_for(op, direction).items() if name in VARIANTS[:1]})
    device = ReplayCudaDevice(recorded)
    both_missed = threading.Barrier(2)
    real_run = device_tuning.run

    def after_both_missed(on, work):
        if not cuda_tuning.on_tuning_thread():  # the callers, not the tuning's own nested calls
            both_missed.wait(10)
        return real_run(on, work)

    monkeypatch.setattr(device_tuning, "run", after_both_missed)
    answers = []
    workers = [threading.Thread(target=lambda: answers.append(tuner.tune_on_miss(problem(), device)))
               for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert answers == [True, True]
    assert len(replayed_kernel_tuner) == 1, "the second miss tuned the problem again"


@needs_nvcc
def test_kernel_tuner_compiles_with_the_nvcc_pool_tuner_found(user_cache, recorded, replayed_kernel_tuner,
                                                              monkeypatch, tmp_path):
    """nvcc found only through CUDA_HOME: Kernel Tuner (nvcc from PATH, libcudadevrt from
    CUDA_ROOT) is given that toolkit while it tunes, and the environment is restored after."""
    nvcc = os.path.realpath(cuda.find_nvcc())
    home = os.path.dirname(os.path.dirname(nvcc))
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setenv("CUDA_HOME", home)
    monkeypatch.delenv("CUDA_ROOT", raising=False)
    assert shutil.which("nvcc") is None and cuda.find_nvcc() == os.path.join(home, "bin", "nvcc")
    tuner.tune(OP, SHAPE, OUTPUT, device=ReplayCudaDevice(recorded), direction="forward", variants=VARIANTS[:1],
               store=False)
    (call,) = replayed_kernel_tuner
    assert os.path.realpath(call["nvcc_on_path"]) == nvcc
    assert os.path.isfile(os.path.join(call["cuda_root"], "lib64", "libcudadevrt.a"))
    assert os.environ["PATH"] == str(empty) and "CUDA_ROOT" not in os.environ


@needs_nvcc
def test_a_driver_older_than_nvcc_is_refused_with_what_to_do(user_cache, recorded, replayed_kernel_tuner,
                                                              monkeypatch, caplog):
    major, minor = cuda_tuning.nvcc_release(cuda.find_nvcc())
    device = ReplayCudaDevice(recorded)
    device.properties = SYNTHETIC_H100.__class__(**{**SYNTHETIC_H100.__dict__,
                                                    "driver_version": major * 1000 + minor * 10 - 10})
    with pytest.raises(TuningUnavailable, match="only a driver at least as new as the nvcc can load"):
        tuner.tune(OP, SHAPE, OUTPUT, device=device, direction="forward", variants=VARIANTS)
    monkeypatch.setenv(tuner.AUTOTUNE_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="pool_tuner"):
        assert tuner.tune_on_miss(problem(), device) is False
    assert "using the untuned decision" in caplog.text and "update the driver" in caplog.text
    assert not replayed_kernel_tuner


def test_the_tuning_thread_returns_results_raises_errors_and_runs_nested_work_in_place():
    assert cuda_tuning.run(lambda: threading.get_ident()) == cuda_tuning.tuning_thread().ident
    with pytest.raises(ZeroDivisionError):
        cuda_tuning.run(lambda: 1 / 0)
    assert cuda_tuning.run(lambda: cuda_tuning.run(lambda: "nested")) == "nested"


def test_what_a_tuning_left_in_reference_cycles_is_freed_on_the_tuning_thread():
    """Kernel Tuner's PyCudaFunctions and its PyCudaRuntimeObserver refer to each other, so the
    module, stream and events they hold are freed by the cycle collector: on the tuning thread,
    where their context is current, before the caller's wait ends -- not on another thread later
    ("module in out-of-thread context could not be cleaned up")."""
    import gc

    freed_on = []

    class PyCudaFunctionsLike:
        def __init__(self):
            self.observer = types.SimpleNamespace(dev=self)  # the cycle

        def __del__(self):
            freed_on.append(threading.get_ident())

    def tune():
        PyCudaFunctionsLike()
        return "tuned"

    enabled = gc.isenabled()
    gc.disable()  # no collection by chance, on any thread
    try:
        assert cuda_tuning.run(tune) == "tuned"
        assert freed_on == [cuda_tuning.tuning_thread().ident]
    finally:
        if enabled:
            gc.enable()

def test_ctrl_c_while_waiting_interrupts_the_work_on_the_tuning_thread():
    """Ctrl-C reaches the waiting main thread; the work on the tuning thread gets it, ends as the
    tuner does (it raises TuningInterrupted), and that reaches the caller."""
    import signal
    import time

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("Ctrl-C (SIGINT) is handled on the main thread, and this test runs on another")
    started = threading.Event()

    def work():
        started.set()
        try:
            while True:
                time.sleep(0.01)
        except KeyboardInterrupt:
            raise tuner.TuningInterrupted("stored what was measured") from None

    def press_ctrl_c():
        started.wait(5)
        os.kill(os.getpid(), signal.SIGINT)  # what a terminal's Ctrl-C does

    threading.Thread(target=press_ctrl_c).start()
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # pytest-xdist's workers ignore SIGINT
    try:
        with pytest.raises(tuner.TuningInterrupted, match="stored what was measured"):
            cuda_tuning.run(work)
    finally:
        signal.signal(signal.SIGINT, handler)
    assert cuda_tuning.run(lambda: "still serving") == "still serving"


if __name__ == "__main__":  # rewrite the recorded file from the current search spaces
    RECORDED.parent.mkdir(exist_ok=True)
    RECORDED.write_text(json.dumps(synthetic_cache(), indent=1) + "\n")
    print(f"wrote {RECORDED}")
