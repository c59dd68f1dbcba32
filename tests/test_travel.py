"""Tuning records travel: device tiers (exact, same model, same family), the problem classes of the
nearest-shape search, the one ranking rule, and what explain and ``cache show`` say about them
(design.md, Tuning cache and Dispatch).

Devices here are PoCL's CPU device reporting made-up fingerprints (``Elsewhere``): the decisions
read only a device's fingerprint, limits and kind, so no other hardware is needed.  Nothing is
built or launched.
"""

import dataclasses
import json
import types
import warnings

import pytest

import pool_tuner as pt
from conftest import SHIPPED_CACHE_DIR
from pool_tuner import backends, cache, cli, dispatch, kernel_source
from pool_tuner.backends import cuda
from pool_tuner.backends.base import DeviceLimits
from pool_tuner.problem import Problem

OP = "adaptive_avg_pool2d"
#: A PoCL CPU device as the shipped database's machine reports it (made up, not read from one).
HERE = {"backend": "opencl", "platform": "Portable Computing Language", "name": "pthread-AMD EPYC",
        "vendor": "AuthenticAMD", "type": "cpu", "version": "OpenCL 3.0 PoCL HSTR: pthread-x86_64-unknown-linux-gnu-znver3",
        "driver": "6.0", "compute_units": 2}
#: A device reporting ``HERE``.
HERE_DEVICE = types.SimpleNamespace(info=types.SimpleNamespace(fingerprint=HERE))
SHAPE, OUT = (4, 32, 13, 13), (4, 4)  # uniform downsampling: windows of 4, stride 3


class Elsewhere:
    """PoCL's device reporting another fingerprint (and, optionally, other limits): a machine
    whose devices differ from this one only in what the fingerprint and limits say."""

    def __init__(self, fingerprint, limits=None):
        self._real = backends.resolve_device("opencl:pocl:0")
        limits = limits or self._real.info.limits
        self.info = dataclasses.replace(
            self._real.info, fingerprint=fingerprint, limits=limits, name=fingerprint["name"],
            id=f"{self._real.info.id}@{cache._fingerprint_hash(fingerprint)}-{limits}")

    def __getattr__(self, name):
        return getattr(self._real, name)


def config(block_size_x):
    """A complete thread_per_output configuration told apart by its block size."""
    return {"block_size_x": block_size_x, "outputs_per_thread": 1, "row_lanes": 1}


def record_of(fingerprint, shape=SHAPE, out=OUT, block_size_x=64, kernel_hash=None, variant="thread_per_output",
              params=None):
    problem = Problem.create(OP, shape, out)
    best = {"variant": variant, "params": params or config(block_size_x), "time_ms": 0.5}
    code = kernel_hash or cache.record_kernel_hash(problem, fingerprint)
    return cache.make_record(problem, fingerprint, code, best, [])


@pytest.fixture
def shipped(tmp_path, monkeypatch, user_cache):
    """Write records as the shipped database (a fresh directory) and forget every decision."""
    directory = tmp_path / "shipped"
    directory.mkdir()
    monkeypatch.setattr(kernel_source, "shipped_cache_dir", lambda: directory)

    def ship(*records):
        payload = {"schema": cache.SCHEMA_VERSION, "records": {r["key"]: r for r in records}}
        (directory / "fleet.json").write_text(json.dumps(payload))
        dispatch.forget()

    ship()
    return ship


def store_user(*records):
    """Store records in the user cache (the ``user_cache`` fixture's directory)."""
    table = cache.TuningCache(kernel_source.shipped_cache_dir())
    for record in records:
        table.store(record)
    dispatch.forget()


def explain(device, shape=SHAPE, out=OUT):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # records of other devices are normal: no warning
        return pt.explain(OP, shape, out, device=device)


# ---------------------------------------------------------------- tiers


OPENCL_TIERS = [
    ("same fingerprint", {}, "exact"),
    ("compiler target", {"version": "OpenCL 3.0 PoCL HSTR: pthread-x86_64-unknown-linux-gnu-znver1"}, "model"),
    ("driver", {"driver": "5.0"}, "model"),
    ("driver and target", {"driver": "5.0", "version": "OpenCL 3.0 PoCL HSTR: pthread-x86_64-unknown-linux-gnu-znver2"},
     "model"),
    ("compute units", {"compute_units": 64}, "family"),
    ("device name", {"name": "pthread-AMD Ryzen 9", "compute_units": 16}, "family"),
    ("vendor", {"vendor": "GenuineIntel"}, None),
    ("device type", {"type": "gpu", "name": "AMD Radeon (synthetic)", "compute_units": 60}, None),
    ("platform", {"platform": "AMD Accelerated Parallel Processing"}, None),
    ("backend", {"backend": "cuda"}, None),
]


@pytest.mark.parametrize("changes, tier", [case[1:] for case in OPENCL_TIERS], ids=[case[0] for case in OPENCL_TIERS])
def test_opencl_tier_of_a_fingerprint_that_differs(changes, tier):
    assert cache.device_tier(dict(HERE, **changes), HERE_DEVICE) == tier


def test_a_fingerprint_without_a_field_matches_no_level_that_needs_it():
    """Records made before the OpenCL fingerprint had its ``type``: the same model still (the type
    is not part of it), but not the same family, which it cannot tell."""
    untyped = {name: value for name, value in HERE.items() if name != "type"}
    assert cache.device_tier(dict(untyped, driver="5.0"), HERE_DEVICE) == "model"
    assert cache.device_tier(dict(untyped, compute_units=64), HERE_DEVICE) is None


def test_cuda_tiers_model_across_drivers_family_by_major_architecture():
    properties = dict(name="NVIDIA H100 80GB HBM3 (synthetic)", compute_capability=(9, 0), multiprocessors=132,
                      max_threads_per_block=1024, max_shared_memory_per_block=48 * 1024, total_memory=80 * 2**30,
                      driver_version=13000)
    device = cuda.CudaDevice(0, cuda.CudaProperties(**properties))
    mine = device.info.fingerprint
    assert "driver" in mine  # still part of the exact identity (and the key) ...
    assert cache.device_tier(dict(mine), device) == "exact"
    assert cache.device_tier(dict(mine, driver=12040), device) == "model"  # ... but a driver update keeps the model
    assert cache.device_tier(dict(mine, name="NVIDIA H100 PCIe (synthetic)", multiprocessors=114), device) == "family"
    assert cache.device_tier(dict(mine, name="NVIDIA H200 (synthetic)", compute_capability="9.0"), device) == "family"
    assert cache.device_tier(dict(mine, name="NVIDIA A100 (synthetic)", compute_capability="8.0"), device) is None
    assert cache.device_tier(dict(HERE), device) is None  # another backend


@pytest.mark.parametrize("changes, tier", [case[1:] for case in OPENCL_TIERS], ids=[case[0] for case in OPENCL_TIERS])
def test_every_tier_decides_a_call_and_explain_names_it(shipped, changes, tier):
    record = record_of(dict(HERE, **changes), block_size_x=64)
    shipped(record)
    info = explain(Elsewhere(HERE))
    if tier is None:
        assert (info["source"], info["tier"], info["record_key"]) == ("default", None, None)
        return
    assert (info["source"], info["tier"], info["record_key"], info["record_origin"]) == (
        "cache", tier, record["key"], "shipped")
    assert info["params"] == config(64) and info["distance"] == 0.0 and info["problem_class"] == "uniform"


# ---------------------------------------------------------------- the ranking rule


def test_the_users_exact_record_beats_shipped_records_of_every_tier(shipped):
    here = Elsewhere(HERE)
    model, family = record_of(dict(HERE, driver="5.0"), block_size_x=64), record_of(dict(HERE, compute_units=8), block_size_x=32)
    shipped(model, family)
    assert (explain(here)["tier"], explain(here)["params"]) == ("model", config(64))  # model before family
    store_user(record_of(HERE, block_size_x=128))
    info = explain(here)
    assert (info["source"], info["tier"], info["record_origin"], info["params"]) == ("cache", "exact", "user", config(128))


def test_within_a_tier_the_users_record_beats_the_shipped_one(shipped):
    shipped(record_of(dict(HERE, driver="5.0"), block_size_x=64))
    store_user(record_of(dict(HERE, driver="5.1"), block_size_x=32))
    info = explain(Elsewhere(HERE))
    assert (info["tier"], info["record_origin"], info["params"]) == ("model", "user", config(32))


def test_this_shape_at_any_tier_beats_another_shape_tuned_here(shipped):
    shipped(record_of(dict(HERE, compute_units=8), block_size_x=32),       # this shape, same family
            record_of(HERE, shape=(4, 32, 17, 17), block_size_x=128))     # another uniform shape, this device
    info = explain(Elsewhere(HERE))
    assert (info["source"], info["tier"], info["params"]) == ("cache", "family", config(32))


def test_an_illegal_configuration_at_a_tier_is_passed_over_without_a_warning(shipped):
    """Legal on the machine that tuned it, not on this one (smaller work-groups): the next record
    decides.  Only a record of this very device and shape that is illegal here warns (stale)."""
    real = backends.resolve_device("opencl:pocl:0").info.limits
    small = Elsewhere(HERE, limits=DeviceLimits(max_work_group_size=64, local_mem_size=real.local_mem_size,
                                                      device_type=real.device_type))
    too_big = record_of(dict(HERE, driver="5.0"), block_size_x=256)
    fits = record_of(dict(HERE, compute_units=8), block_size_x=32)
    shipped(too_big, fits)
    assert explain(Elsewhere(HERE))["params"] == config(256)  # legal with PoCL's own limits
    info = explain(small)
    assert (info["tier"], info["record_key"], info["params"]) == ("family", fits["key"], config(32))
    shipped(record_of(HERE, block_size_x=256), fits)
    with pytest.warns(cache.CacheWarning, match="not legal here"):
        info = pt.explain(OP, SHAPE, OUT, device=small)
    assert (info["tier"], info["params"]) == ("family", config(32))


# ---------------------------------------------------------------- problem classes and nearest


@pytest.mark.parametrize("op, shape, out, expected", [
    ("adaptive_avg_pool2d", (2, 8, 7, 7), (1, 1), "global"),
    ("adaptive_max_pool3d", (2, 8, 4, 7, 7), (1, 1, 1), "global"),
    ("adaptive_avg_pool2d", (16, 64, 5, 5), (7, 7), "upsampling"),
    ("adaptive_avg_pool2d", (16, 64, 5, 5), (1, 7), "upsampling"),  # one axis up is enough
    ("adaptive_avg_pool2d", (2, 8, 8, 8), (4, 4), "uniform"),
    ("adaptive_avg_pool1d", (2, 8, 7), (3,), "uniform"),  # windows 3, stride 2
    ("adaptive_avg_pool2d", (2, 8, 56, 56), (56, 1), "uniform"),
    ("adaptive_avg_pool2d", (2, 8, 10, 9), (4, 7), "non-uniform"),
    ("adaptive_avg_pool1d", (2, 8, 1000), (128,), "non-uniform"),
    ("adaptive_avg_pool2d", (2, 8, 10, 9), (0, 7), "non-uniform"),  # empty axis: no windows; 9 -> 7 decides
])
def test_problem_class(op, shape, out, expected):
    assert Problem.create(op, shape, out).problem_class == expected


def test_speed_features_are_windows_planes_and_bytes():
    problem = Problem.create(OP, (2, 3, 10, 9), (4, 7))
    # largest windows 3 (10 -> 4: 0:3 ... 7:10) and 3 (9 -> 7: 3:6), planes of 90 and 28 elements, 6 planes,
    # float32 bytes read and written
    assert problem.speed_features == (3, 3, 90, 28, 6, 6 * (90 + 28) * 4)
    other = Problem.create(OP, (2, 3, 20, 9), (4, 7))
    assert dispatch.shape_distance(problem, problem) == 0
    assert dispatch.shape_distance(problem, other) == dispatch.shape_distance(other, problem) > 0


#: A GPU reporting itself: the device type whose nearest-shape search takes global pooling.
GPU_HERE = dict(HERE, type="gpu", name="Radeon (synthetic)")


def gpu_elsewhere():
    gpu = Elsewhere(GPU_HERE, limits=DeviceLimits(max_work_group_size=1024, local_mem_size=64 * 1024,
                                                  device_type="gpu"))
    gpu.info = dataclasses.replace(gpu.info, is_cpu=False)
    return gpu


def test_a_global_problem_never_takes_an_upsampling_record(shipped):
    """The shipped database's upsampling record (16x64x5x5 -> 7x7) once decided global pooling;
    a global record of another shape does, on a GPU."""
    upsampling = record_of(GPU_HERE, shape=(16, 64, 5, 5), out=(7, 7), block_size_x=32)
    uniform = record_of(GPU_HERE, shape=(8, 64, 14, 14), out=(2, 2), block_size_x=32)  # same input, other class
    shipped(upsampling, uniform)
    shape = (8, 64, 14, 14)
    assert explain(gpu_elsewhere(), shape, 1)["source"] == "default"

    near = record_of(GPU_HERE, shape=(16, 64, 14, 14), out=(1, 1), block_size_x=128)
    shipped(upsampling, uniform, near)
    info = explain(gpu_elsewhere(), shape, 1)
    assert (info["source"], info["record_key"], info["problem_class"]) == ("nearest", near["key"], "global")
    expected = dispatch.shape_distance(Problem.create(OP, shape, 1), Problem.create(OP, (16, 64, 14, 14), 1))
    assert info["distance"] == round(expected, 3) > 0
    assert info["nearest_beyond_bound"] is None


def test_on_a_cpu_a_global_record_decides_only_its_own_shape_and_explain_says_why(shipped):
    """CPU global pooling is ``EXACT_SHAPE_ONLY``: a record of 16x64x14x14 decides that shape
    (any tier) and no other, however near; the rules decide 8x64x14x14, and explain names the record
    passed over and the rule that passed it."""
    near = record_of(HERE, shape=(16, 64, 14, 14), out=(1, 1), block_size_x=128)
    shipped(near)
    exact = explain(Elsewhere(HERE), (16, 64, 14, 14), 1)
    assert (exact["source"], exact["record_key"]) == ("cache", near["key"])
    assert explain(Elsewhere(dict(HERE, driver="5.0")), (16, 64, 14, 14), 1)["source"] == "cache"  # model tier
    shape = (8, 64, 14, 14)
    info = explain(Elsewhere(HERE), shape, 1)
    rules = dispatch.default_choice(Problem.create(OP, shape, 1), Elsewhere(HERE))
    assert (info["source"], info["variant"], info["params"]) == ("default", rules.variant.name, rules.config)
    beyond = info["nearest_beyond_bound"]
    distance = dispatch.shape_distance(Problem.create(OP, shape, 1), Problem.create(OP, (16, 64, 14, 14), 1))
    assert (beyond["record_key"], beyond["distance"]) == (near["key"], round(distance, 3))
    assert distance < dispatch.NEAREST_MAX_DISTANCE["cpu"]
    assert "EXACT_SHAPE_ONLY['cpu']" in beyond["why"]


#: Non-uniform downsampling to 6x6: the class the nearest-shape tests below search in.
NEAR_OUT = (6, 6)


def test_nearest_is_searched_on_the_best_tier_then_by_distance(shipped):
    shape = (8, 64, 14, 14)
    far_here = record_of(HERE, shape=(8, 256, 14, 14), out=NEAR_OUT, block_size_x=128)
    near_here = record_of(HERE, shape=(8, 64, 16, 16), out=NEAR_OUT, block_size_x=64)
    nearer_elsewhere = record_of(dict(HERE, driver="5.0"), shape=(8, 64, 15, 15), out=NEAR_OUT, block_size_x=32)
    shipped(far_here, nearer_elsewhere)
    assert explain(Elsewhere(HERE), shape, NEAR_OUT)["record_key"] == far_here["key"]  # exact tier before model
    shipped(far_here, near_here, nearer_elsewhere)
    info = explain(Elsewhere(HERE), shape, NEAR_OUT)
    assert (info["record_key"], info["tier"], info["params"]) == (near_here["key"], "exact", config(64))


def test_a_record_beyond_the_bound_leaves_the_problem_to_the_rules_and_explain_names_it(shipped):
    """Once the one record of a class decided every problem of it, however far: 2x64x14x14 (256
    times fewer planes) lies beyond the CPU's ``NEAREST_MAX_DISTANCE`` from 32x2048x14x14."""
    shape, far_shape = (2, 64, 14, 14), (32, 2048, 14, 14)
    distance = dispatch.shape_distance(Problem.create(OP, shape, NEAR_OUT), Problem.create(OP, far_shape, NEAR_OUT))
    assert distance > dispatch.NEAREST_MAX_DISTANCE["cpu"]
    far = record_of(HERE, shape=far_shape, out=NEAR_OUT, block_size_x=128)
    farther = record_of(HERE, shape=(64, 2048, 14, 14), out=NEAR_OUT, block_size_x=32)
    shipped(far, farther)
    info = explain(Elsewhere(HERE), shape, NEAR_OUT)
    rules = dispatch.default_choice(Problem.create(OP, shape, NEAR_OUT), Elsewhere(HERE))
    assert (info["source"], info["variant"], info["params"]) == ("default", rules.variant.name, rules.config)
    assert (info["record_key"], info["distance"]) == (None, None)
    beyond = info["nearest_beyond_bound"]
    assert (beyond["record_key"], beyond["distance"]) == (far["key"], round(distance, 3))
    assert "NEAREST_MAX_DISTANCE['cpu']" in beyond["why"]


def test_the_bound_is_the_device_types(shipped):
    """The same record and problem: beyond the GPU's bound, within the CPU's."""
    shape, record_shape = (8, 64, 14, 14), (32, 512, 14, 14)
    distance = dispatch.shape_distance(Problem.create(OP, shape, NEAR_OUT), Problem.create(OP, record_shape, NEAR_OUT))
    assert dispatch.NEAREST_MAX_DISTANCE["gpu"] < distance <= dispatch.NEAREST_MAX_DISTANCE["cpu"]
    record = record_of(HERE, shape=record_shape, out=NEAR_OUT, block_size_x=128)
    gpu_record = record_of(GPU_HERE, shape=record_shape, out=NEAR_OUT, block_size_x=128)
    shipped(record, gpu_record)
    assert explain(Elsewhere(HERE), shape, NEAR_OUT)["record_key"] == record["key"]
    info = explain(gpu_elsewhere(), shape, NEAR_OUT)
    assert (info["source"], info["nearest_beyond_bound"]["record_key"]) == ("default", gpu_record["key"])


def test_a_record_within_the_bound_on_a_lower_tier_beats_one_beyond_it_on_this_device(shipped):
    shape = (2, 64, 14, 14)
    far_here = record_of(HERE, shape=(32, 2048, 14, 14), out=NEAR_OUT, block_size_x=128)
    near_elsewhere = record_of(dict(HERE, driver="5.0"), shape=(2, 64, 15, 15), out=NEAR_OUT, block_size_x=32)
    shipped(far_here, near_elsewhere)
    info = explain(Elsewhere(HERE), shape, NEAR_OUT)
    assert (info["source"], info["record_key"], info["tier"]) == ("nearest", near_elsewhere["key"], "model")
    assert info["nearest_beyond_bound"] is None


# ---------------------------------------------------------------- cache show


def test_cache_show_says_per_record_whether_and_how_it_applies(shipped, capsys):
    device = backends.resolve_device("opencl:pocl:0")
    mine = device.info.fingerprint
    records = {
        "exact device": record_of(mine, shape=(4, 32, 13, 13)),
        "model": record_of(dict(mine, driver=mine["driver"] + "-updated"), shape=(4, 32, 14, 14)),
        "family": record_of(dict(mine, compute_units=mine["compute_units"] + 62), shape=(4, 32, 15, 15)),
        "other device": record_of(dict(mine, vendor="Imaginary Inc."), shape=(4, 32, 16, 16)),
        "stale": record_of(mine, shape=(4, 32, 17, 17), kernel_hash="0" * 64),
        "illegal": record_of(mine, shape=(4, 32, 18, 18), params={"block_size_x": 3}),
    }
    shipped(*records.values())
    assert cli.main(["cache", "show", "--device", device.info.id]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "applies" in lines[0].split() and "class" in lines[0].split()
    for word, record in records.items():
        (row,) = [line for line in lines if "x".join(map(str, record["problem"]["input_shape"])) in line]
        assert f" {word.split()[0]} " in row and f" {cache.problem_of(record).problem_class} " in row, (word, row)
    assert lines[-2] == (f"6 records, 3 apply to {device.info.describe()}: 1 exact device, 1 same model (other "
                         f"driver/target), 1 same family; not applying: 1 other devices, 1 stale (kernel code "
                         f"changed), 1 not legal on this device")


# ---------------------------------------------------------------- the shipped database elsewhere


def _retargeted(version: str) -> str:
    """PoCL's version string with another LLVM target (its last ``-`` field)."""
    head, _, target = version.rpartition("-")
    return f"{head}-{'znver3' if target != 'znver3' else 'znver4'}"


@pytest.mark.parametrize("what", ["compiler target", "driver"])
def test_the_shipped_records_apply_at_the_model_tier_on_another_pocl(user_cache, monkeypatch, capsys, what):
    """The shipped database on a machine whose PoCL differs only in its compiler target or driver.

    Independent of the kernel hash being current (the lead re-tunes the file after kernel changes):
    the kernel hash of each op, direction and device type is taken to be the one its shipped records carry."""
    shipped_records = cache.TuningCache(SHIPPED_CACHE_DIR, user_cache / "unused").records()
    records = {key: r for key, r in shipped_records.items() if r["device"]["backend"] == "opencl"}
    if not records:
        pytest.skip("no PoCL tuning results are shipped yet")
    hashes = {(r["problem"]["op"], r["problem"]["direction"], cache.device_type(r["device"])): r["kernel_hash"]
              for r in shipped_records.values()}
    monkeypatch.setattr(cache, "kernel_hash", lambda problem, device_type: hashes.get(
        (problem.op, problem.direction, device_type), "none"))
    monkeypatch.setattr(kernel_source, "shipped_cache_dir", lambda: SHIPPED_CACHE_DIR)
    dispatch.forget()
    for fingerprint in {json.dumps(r["device"], sort_keys=True) for r in records.values()}:
        tuned_on = json.loads(fingerprint)
        # A current device reports its type; records made before the field existed do not.
        changes = ({"version": _retargeted(tuned_on["version"])} if what == "compiler target"
                   else {"driver": tuned_on["driver"] + "-updated"})
        device = Elsewhere({"type": "cpu", **tuned_on, **changes})
        mine = [r for r in records.values() if r["device"] == tuned_on]
        for record in mine:
            p = cache.problem_of(record)
            info = pt.explain(p.op, p.input_shape, p.operation.output_size_of(p.input_shape, p.output_shape), p.dtype,
                              p.layout, device=device, direction=p.direction)
            assert (info["source"], info["tier"], info["record_key"]) == ("cache", "model", record["key"]), info
            assert info["variant"] == record["best"]["variant"]
            assert record["best"]["params"].items() <= info["params"].items()
        # An untuned global shape takes a global record of that device, never another class's.
        info = pt.explain(OP, (16, 1024, 14, 14), 1, device=device)
        if info["source"] == "nearest":
            used = cache.problem_of(records[info["record_key"]])
            assert (info["tier"], used.problem_class, info["problem_class"]) == ("model", "global", "global")

        monkeypatch.setattr(cli.backends, "resolve_device", lambda *args: device)
        assert cli.main(["cache", "show"]) == 0
        summary = capsys.readouterr().out.splitlines()[-2]
        n, others = len(mine), len(shipped_records) - len(mine)
        assert summary.startswith(f"{len(shipped_records)} records, {n} apply to {device.info.describe()}: 0 exact device, "
                                  f"{n} same model (other driver/target), 0 same family; not applying: "
                                  f"{others} other devices, 0 stale"), summary
