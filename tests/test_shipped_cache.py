"""The database shipped in tuning_cache/: well-formed, current with the kernel sources, and used."""

import importlib.util
import json
import sys
import warnings
from pathlib import Path

import pytest

import pool_tuner as pt
from conftest import SHIPPED_CACHE_DIR
from pool_tuner import backends, cache, dispatch
from pool_tuner.backends import cuda
from pool_tuner.backends.base import DeviceLimits
from pool_tuner.problem import Problem
from pool_tuner.variants import get_variant


def shipped_records():
    with warnings.catch_warnings():
        warnings.simplefilter("error", cache.CacheWarning)  # a damaged shipped file is a defect
        return cache.TuningCache(SHIPPED_CACHE_DIR, SHIPPED_CACHE_DIR / "no_user_cache").records()


def problem_of(record):
    p = record["problem"]
    return Problem(p["op"], p["direction"], p["dtype"], p["layout"], tuple(p["input_shape"]), tuple(p["output_shape"]))


def test_shipped_files_are_valid_json_databases():
    files = sorted(SHIPPED_CACHE_DIR.glob("*.json"))
    if not files:
        pytest.skip("no tuning results are shipped yet")
    for path in files:
        data = json.loads(path.read_text())
        assert data["schema"] == cache.SCHEMA_VERSION
    assert shipped_records()


def test_shipped_records_match_the_current_kernel_sources_and_are_legal():
    """Editing a kernel makes its shipped records stale: re-tune (`pool-tuner tune --preset all`) and
    ship the new results along with the kernel change."""
    for key, record in shipped_records().items():
        problem = problem_of(record)
        current = cache.record_kernel_hash(problem, record["device"])
        assert record["kernel_hash"] == current, f"stale shipped record {key}"
        variant = get_variant(problem.op, record["best"]["variant"], problem.direction)
        assert variant.check_config(record["best"]["params"], problem, limits_of(record["device"])) is not None


def limits_of(device: dict) -> DeviceLimits:
    """The launch limits of the device a record names: a CUDA GPU's are the same on every
    architecture since compute capability 2.0 (1024 threads per block, 48 KiB of static shared
    memory); a CPU's are this machine's default device's."""
    if device["backend"] == "cuda":
        return DeviceLimits(max_work_group_size=1024, local_mem_size=48 * 1024, device_type="gpu")
    return backends.default_device().info.limits


def test_dispatch_uses_shipped_records_on_their_device(monkeypatch):
    device = backends.default_device()
    mine = [r for r in shipped_records().values() if r["device"] == device.info.fingerprint]
    if not mine:
        pytest.skip(f"no shipped results for {device.info.describe()} ({device.info.fingerprint})")
    monkeypatch.setattr(dispatch.kernel_source, "shipped_cache_dir", lambda: SHIPPED_CACHE_DIR)
    dispatch.forget()
    try:
        for record in mine:
            problem = problem_of(record)
            choice = dispatch.choose(problem, device, memoise=False)
            assert (choice.source, choice.variant.name, choice.config) == ("cache", record["best"]["variant"], record["best"]["params"])
    finally:
        dispatch.forget()


def h100():
    """A CUDA device reporting the fingerprint of the H100 the shipped GPU records were tuned on
    (made from properties, as ``cuda_fakes.fake_cuda_device``; nothing runs on it)."""
    properties = cuda.CudaProperties(name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), multiprocessors=132,
                                     max_threads_per_block=1024, max_shared_memory_per_block=48 * 1024,
                                     total_memory=80 * 2**30, driver_version=13000)
    return cuda.CudaDevice(0, properties)


def test_the_h100_global_pooling_record_decides_only_its_neighbourhood(monkeypatch):
    """The one shipped global-pooling record of the H100 (32x2048x7x7, 4 threads per plane) decides
    its own shape and near ones; mobilenet's 32x72x28x28, planes 16 times larger and 28 times fewer,
    lies beyond ``dispatch.NEAREST_MAX_DISTANCE``: the default rules decide it, and explain names
    the record passed over."""
    device = h100()
    records = [r for r in shipped_records().values() if r["device"] == device.info.fingerprint]
    (head,) = [r for r in records if r["problem"]["input_shape"] == [32, 2048, 7, 7]
               and (r["problem"]["direction"], r["problem"]["dtype"]) == ("forward", "float32")]
    monkeypatch.setattr(dispatch.kernel_source, "shipped_cache_dir", lambda: SHIPPED_CACHE_DIR)
    dispatch.forget()
    try:
        own = pt.explain("adaptive_avg_pool2d", (32, 2048, 7, 7), 1, device=device)
        assert (own["source"], own["record_key"], own["variant"]) == ("cache", head["key"], "global_blocks")
        assert own["params"] == head["best"]["params"]
        near = pt.explain("adaptive_avg_pool2d", (32, 1280, 7, 7), 1, device=device)
        assert (near["source"], near["record_key"]) == ("nearest", head["key"])

        far = pt.explain("adaptive_avg_pool2d", (32, 72, 28, 28), 1, device=device)
        rules = dispatch.default_choice(Problem.create("adaptive_avg_pool2d", (32, 72, 28, 28), 1), device)
        assert (far["source"], far["variant"], far["params"]) == ("default", rules.variant.name, rules.config)
        assert far["params"]["threads_per_plane"] > head["best"]["params"]["threads_per_plane"]
        assert far["nearest_beyond_bound"]["record_key"] == head["key"]
        assert far["nearest_beyond_bound"]["distance"] > dispatch.NEAREST_MAX_DISTANCE["gpu"]
    finally:
        dispatch.forget()


# ---------------------------------------------------------------------------- the programs the records measured
PROGRAM_IDENTITY = Path(__file__).resolve().parent.parent / "benchmarks" / "program_identity.py"
needs_identity = pytest.mark.skipif(not PROGRAM_IDENTITY.exists(), reason="benchmarks/ is not beside the tests")


def program_identity():
    """benchmarks/program_identity.py as a module."""
    if "program_identity" not in sys.modules:
        spec = importlib.util.spec_from_file_location("program_identity", PROGRAM_IDENTITY)
        sys.modules["program_identity"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["program_identity"])
    module = sys.modules["program_identity"]
    if module.preprocessor() is None:
        pytest.skip("no C preprocessor (cpp, gcc or clang) on PATH")
    return module


@needs_identity
def test_the_shipped_records_programs_are_the_ones_they_measured():
    """A shipped record stands for the programs it measured: its kernel hash may be re-stamped after
    an edit of the kernel files only where every program it covers is the same token for token
    (benchmarks/program_identity.py, tuning_cache/README.md).  Fails where such a program changed
    while its record still claims the current kernel code."""
    identity = program_identity()
    shipped = shipped_records()
    expected = json.loads(identity.SHIPPED_PROGRAMS.read_text())
    assert sorted(expected) == sorted(shipped), "shipped records without fingerprints (or fingerprints without records)"
    changed = identity.differences(expected, identity.fingerprint(shipped))
    assert not changed, f"programs changed under current-looking shipped records: {changed}"


@needs_identity
def test_the_fingerprint_sees_a_changed_program_and_not_a_changed_comment(monkeypatch):
    """The check above can fail: one more statement in thread_per_output's kernel changes the
    fingerprint of an avg record that covers it; a comment or blank line does not."""
    identity = program_identity()
    (key, record), = [(k, r) for k, r in shipped_records().items()
                      if r["problem"]["op"] == "adaptive_avg_pool2d" and r["problem"]["direction"] == "forward"
                      and r["problem"]["input_shape"] == [32, 512, 8, 8] and cache.device_type(r["device"]) == "gpu"]
    expected = json.loads(identity.SHIPPED_PROGRAMS.read_text())[key]
    read = cache.kernel_source.read

    def edited(body):
        def read_edited(name):
            text = read(name)
            return text.replace("{", "{" + body, 1) if name == "forward/thread_per_output.c" else text
        return read_edited

    monkeypatch.setattr(cache.kernel_source, "read", edited("\n/* a comment */\n\n"))
    assert identity.fingerprint({key: record})[key] == expected
    monkeypatch.setattr(cache.kernel_source, "read", edited(" (void)0;"))
    changed = identity.differences({key: expected}, identity.fingerprint({key: record}))[key]
    assert changed and all(label.startswith("thread_per_output ") for label in changed)
