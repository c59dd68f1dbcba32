"""The database shipped in tuning_cache/: well-formed, current with the kernel sources, and used."""

import json
import warnings

import pytest

from conftest import SHIPPED_CACHE_DIR
from pool_tuner import backends, cache, dispatch
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
