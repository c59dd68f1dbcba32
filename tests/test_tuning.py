"""Autotuning, the tuning cache as dispatch sees it, and the hot path (docs/design.md: Tuning, Tuning cache, Dispatch).

Every test gets its own user cache (``POOL_TUNER_CACHE_DIR`` under ``tmp_path``) and forgets the
process-wide dispatch state before and after.  Tuning budgets are tiny: one variant, a few
configurations, a problem of 2x3x5x7 -> 3x4, so a tune takes seconds.
"""

import ast
import builtins
import json
import logging
import os
import pathlib
import subprocess
import sys
import textwrap
import time
import types
import warnings
from pathlib import Path

import filelock
import numpy as np
import pyopencl
import pytest

import pool_tuner as pt
from pool_tuner import backends, dispatch, kernel_source, reference, tuner
from pool_tuner import cache as cache_mod
from pool_tuner.backends import opencl
from pool_tuner.cache import CacheWarning
from pool_tuner.problem import Problem
from pool_tuner.variants import SMALL_BOX_LIMIT, variants_for

from conftest import random_input

REPO = Path(__file__).resolve().parents[1]
OP = "adaptive_avg_pool2d"
SHAPE, OUT = (2, 3, 5, 7), (3, 4)
NEAR = (2, 3, 6, 7)  # a nearby shape, never tuned
CHEAP = dict(variants=["thread_per_output"], strategy="random_sample", max_fevals=3)
#: A complete, legal thread_per_output configuration that is not its default.
NONDEFAULT = dict(variants_for(OP)["thread_per_output"].default, block_size_x=32, outputs_per_thread=4)




def device():
    return backends.resolve_device()


def problem(shape=SHAPE, out=OUT):
    return Problem.create(OP, shape, out)


def key_of(shape=SHAPE, out=OUT):
    return cache_mod.cache_key(problem(shape, out), device())


def stored_records(directory) -> dict:
    return json.loads((directory / cache_mod.USER_FILE).read_text())["records"]


def make_record(shape=SHAPE, out=OUT, best=None, fingerprint=None):
    """A well-formed record for this device and kernel code (as ``tune`` would write it)."""
    p = problem(shape, out)
    best = best or {"variant": "thread_per_output", "params": dict(NONDEFAULT), "time_ms": 0.01}
    fingerprint = fingerprint or device().info.fingerprint
    return cache_mod.make_record(p, fingerprint, cache_mod.record_kernel_hash(p, fingerprint), best, [])


def write_records(directory, records, schema=cache_mod.SCHEMA_VERSION):
    directory.mkdir(parents=True, exist_ok=True)
    payload = {"schema": schema, "records": {r["key"]: r for r in records}}
    (directory / cache_mod.USER_FILE).write_text(json.dumps(payload))


def subprocess_env(cache_dir) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["POOL_TUNER_CACHE_DIR"] = str(cache_dir)
    env.pop("POOL_TUNER_AUTOTUNE", None)
    return env


def run_python(code, cache_dir, cwd, timeout=240):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=subprocess_env(cache_dir), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return proc


def explain(shape=SHAPE, out=OUT):
    return pt.explain(OP, shape, out)


# ---------------------------------------------------------------- 1. tune -> record -> fresh process


def test_tune_writes_record_used_by_a_fresh_process(user_cache, tmp_path, rng):
    assert explain()["source"] == "default"
    result = pt.tune(OP, SHAPE, OUT, **CHEAP)
    assert result.stored is True
    assert result.cache_key == key_of()
    assert result.best_variant == "thread_per_output"
    assert result.best_time_ms > 0 and result.default_time_ms > 0

    records = stored_records(user_cache)
    assert result.cache_key in records
    best = records[result.cache_key]["best"]
    assert (best["variant"], best["params"]) == (result.best_variant, result.best_params)
    # The same process dispatches from it at once.
    info = explain()
    assert (info["source"], info["variant"], info["params"]) == ("cache", result.best_variant, result.best_params)

    x = random_input(rng, SHAPE)
    np.save(tmp_path / "x.npy", x)
    proc = run_python(f"""
        import json
        import numpy as np
        import pool_tuner as pt
        from pool_tuner import reference
        exact = pt.explain({OP!r}, {SHAPE!r}, {OUT!r})
        near = pt.explain({OP!r}, {NEAR!r}, {OUT!r})
        x = np.load("x.npy")
        y = pt.adaptive_avg_pool2d(x, {OUT!r})
        error = float(np.abs(y - reference.adaptive_avg_pool(x, {OUT!r}, 2)).max())
        print(json.dumps({{"exact": exact, "near": near, "error": error}}))
        """, user_cache, tmp_path)
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    exact, near = seen["exact"], seen["near"]
    assert exact["source"] == "cache"
    assert exact["cache_key"] == result.cache_key == exact["record_key"]
    assert (exact["variant"], exact["params"]) == (result.best_variant, result.best_params)
    assert near["source"] == "nearest"
    assert near["record_key"] == result.cache_key
    assert near["cache_key"] != result.cache_key
    assert (near["variant"], near["params"]) == (result.best_variant, result.best_params)
    assert seen["error"] < 1e-5


def test_tune_reports_speedup_over_the_heuristic_default_even_when_a_record_exists(user_cache):
    """The race's "default" is the documented heuristic default, not the previous winner
    (otherwise re-tuning compares a config with itself and the record's "default" lies)."""
    heuristic = explain()
    assert heuristic["source"] == "default"
    assert heuristic["params"] != NONDEFAULT
    write_records(user_cache, [make_record()])
    dispatch.forget()
    assert explain()["source"] == "cache"
    result = pt.tune(OP, SHAPE, OUT, **CHEAP)
    assert (result.default_variant, result.default_params) == (heuristic["variant"], heuristic["params"])
    assert stored_records(user_cache)[result.cache_key]["default"]["params"] == heuristic["params"]


# ---------------------------------------------------------------- 2. stale records


def test_changed_kernel_source_makes_the_record_stale(user_cache, monkeypatch):
    write_records(user_cache, [make_record()])
    before = explain()
    assert before["source"] == "cache" and before["params"] == NONDEFAULT

    monkeypatch.setattr(kernel_source, "template_hash", lambda template, *header: "e" * 64)
    dispatch.forget()
    after = explain()
    assert after["cache_key"] != before["cache_key"]
    assert after["source"] not in ("cache", "nearest")
    assert after["record_key"] is None
    # And a fresh record for the new code is used again.
    write_records(user_cache, [make_record()])
    dispatch.forget()
    assert explain()["source"] == "cache"


# ---------------------------------------------------------------- 3. cache faults through dispatch


def test_good_synthetic_record_is_used(user_cache):
    """Control for the fault tests below: the records they damage are otherwise used."""
    write_records(user_cache, [make_record()])
    info = explain()
    assert (info["source"], info["params"], info["record_key"]) == ("cache", NONDEFAULT, key_of())
    near = explain(NEAR)
    assert (near["source"], near["record_key"]) == ("nearest", key_of())


def test_truncated_cache_file_is_a_warning_and_a_miss(user_cache, rng):
    write_records(user_cache, [make_record()])
    path = user_cache / cache_mod.USER_FILE
    path.write_text(path.read_text()[: len(path.read_text()) // 2])
    with pytest.warns(CacheWarning):
        info = explain()
    assert info["source"] == "default"
    x = random_input(rng, SHAPE)
    np.testing.assert_allclose(pt.adaptive_avg_pool2d(x, OUT), reference.adaptive_avg_pool(x, OUT, 2),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("payload", [
    {"schema": cache_mod.SCHEMA_VERSION + 1},
    {"schema": "1"},
    {"records": None},
    ["a", "list"],
], ids=["newer-schema", "schema-string", "no-schema", "not-an-object"])
def test_foreign_schema_is_a_warning_and_a_miss(user_cache, payload):
    record = make_record()
    if isinstance(payload, dict):
        payload = {**{"records": {record["key"]: record}}, **payload}
        if payload["records"] is None:
            payload["records"] = {record["key"]: record}
    user_cache.mkdir(parents=True)
    (user_cache / cache_mod.USER_FILE).write_text(json.dumps(payload))
    with pytest.warns(CacheWarning):
        info = explain()
    assert info["source"] == "default"
    assert explain(NEAR)["source"] == "default"


def _foreign_fingerprint():
    """A device with nothing in common with this one: another vendor's GPU (not even its family)."""
    return dict(device().info.fingerprint, name="Imaginary GPU 9000", vendor="Imaginary Inc.", type="gpu", driver="0.0.1")


def test_record_of_a_foreign_device_is_not_used(user_cache):
    foreign = make_record(fingerprint=_foreign_fingerprint())
    assert foreign["key"] != key_of()
    write_records(user_cache, [foreign])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a foreign record is normal (merged fleet caches): no warning
        assert explain()["source"] == "default"
        assert explain(NEAR)["source"] == "default"


@pytest.mark.parametrize("edit", ["device-field", "key-device-hash"])
def test_record_whose_key_and_device_disagree_is_not_used(user_cache, edit):
    """A hand-edited record claiming one device in its key and another in its fingerprint."""
    record = make_record()
    if edit == "device-field":
        record["device"] = _foreign_fingerprint()
    else:
        ours = f"dev={cache_mod._fingerprint_hash(device().info.fingerprint)}"
        foreign = f"dev={cache_mod._fingerprint_hash(_foreign_fingerprint())}"
        assert ours in record["key"]
        record["key"] = record["key"].replace(ours, foreign)
    write_records(user_cache, [record])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        for shape in (SHAPE, NEAR):
            info = explain(shape)
            assert info["source"] == "default", (shape, info)


@pytest.mark.parametrize("best", [
    {"variant": "thread_per_output", "params": {"block_size_x": 3, "outputs_per_thread": 1}},
    {"variant": "thread_per_output", "params": {"block_size_x": 64, "bogus": 2}},
    {"variant": "thread_per_output", "params": {"block_size_x": True}},
    {"variant": "no_such_variant", "params": {}},
], ids=["block_size_x-3", "unknown-param", "bool-param", "unknown-variant"])
def test_record_with_illegal_config_is_ignored_with_a_warning_and_never_launched(user_cache, monkeypatch, rng, best):
    bad = dict(best, time_ms=0.01)
    write_records(user_cache, [make_record(best=bad)])
    with pytest.warns(CacheWarning):
        info = explain()
    assert info["source"] != "cache"
    assert info["params"] != bad["params"]
    assert explain(NEAR)["source"] != "nearest"  # not legal there either: passed over

    prepared = []
    original = dispatch.prepare

    def spy(device_, context, problem_, choice):
        prepared.append((choice.variant.name, choice.config))
        return original(device_, context, problem_, choice)

    monkeypatch.setattr(dispatch, "prepare", spy)
    x = random_input(rng, SHAPE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        y = pt.adaptive_avg_pool2d(x, OUT)
    np.testing.assert_allclose(y, reference.adaptive_avg_pool(x, OUT, 2), rtol=1e-5, atol=1e-6)
    assert prepared, "the call did not go through dispatch.prepare"
    assert all((name, params) != (bad["variant"], bad["params"]) for name, params in prepared)
    problem, limits = Problem.create("adaptive_avg_pool2d", SHAPE, OUT), backends.default_device().info.limits
    assert all(variants_for("adaptive_avg_pool2d")[name].is_legal(params, problem, limits) for name, params in prepared)


def test_unwritable_cache_dir_keeps_the_result_in_memory(user_cache, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("POOL_TUNER_CACHE_DIR", str(blocker / "cache"))
    dispatch.forget()
    with pytest.warns(CacheWarning):
        result = pt.tune(OP, SHAPE, OUT, **CHEAP)
    assert result.stored is False
    assert result.best_params is not None and result.cache_key == key_of()
    assert blocker.read_text() == "not a directory"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        info = explain()
    assert (info["source"], info["params"]) == ("cache", result.best_params)


def test_tune_over_a_corrupt_file_reports_stored_when_it_wrote(user_cache):
    """A damaged cache file is set aside (with a warning) and the new record is written: the
    result must say it was stored, or the CLI claims "NOT stored" for a record that is there."""
    user_cache.mkdir()
    (user_cache / cache_mod.USER_FILE).write_text('{"schema": 1, "records": {"trunc')
    with pytest.warns(CacheWarning):
        result = pt.tune(OP, SHAPE, OUT, **CHEAP)
    assert result.cache_key in stored_records(user_cache)
    assert result.stored is True


def test_a_tuning_that_verified_less_does_not_replace_one_that_verified_more(user_cache):
    """A record counts what it verified; a later tuning that verified fewer variants is not stored
    over it, and says why."""
    full = pt.tune(OP, SHAPE, OUT, variants=["thread_per_output", "block_per_row"], strategy="random_sample",
                   max_fevals=2)
    assert full.stored and stored_records(user_cache)[full.cache_key]["verified"] >= 2
    less = pt.tune(OP, SHAPE, OUT, **CHEAP)
    assert less.stored is False and "verified more" in less.not_stored
    assert stored_records(user_cache)[full.cache_key]["runners_up"]


def test_a_search_cut_short_by_the_time_limit_says_so(user_cache, capsys, monkeypatch):
    """Random sampling stopped by the time limit before its budget is marked, in the result and in
    the command line's table and summary; a search that used its budget is not."""
    evaluated = [2]

    def searching(variant, problem, device, **options):  # a search of `evaluated` configurations that took its time
        time.sleep(options["time_limit"])
        return dict(variant.default_for(problem)), 0.1, evaluated[0], []

    monkeypatch.setattr(tuner, "tune_variant", searching)
    result = pt.tune(OP, SHAPE, OUT, variants=["thread_per_output"], strategy="random_sample", max_fevals=20,
                     time_limit=0.2)
    assert result.variants[0].cut_short
    evaluated[0] = 20
    full = pt.tune(OP, SHAPE, OUT, variants=["thread_per_output"], strategy="random_sample", max_fevals=20,
                   time_limit=0.2)
    assert not full.variants[0].cut_short
    from pool_tuner import cli

    evaluated[0] = 2
    code = cli.main(["tune", "--input", "x".join(map(str, SHAPE)), "--output", "x".join(map(str, OUT)), "--quiet",
                     "--direction", "forward", "--variants", "thread_per_output", "--strategy", "random_sample",
                     "--max-fevals", "20", "--time-limit", "0.2"])
    out = capsys.readouterr().out
    assert code == 0 and "(search cut short by the time limit)" in out and "cut short by the time limit before" in out


# ---------------------------------------------------------------- 4. concurrent tuners


def test_two_processes_tuning_different_shapes_lose_nothing(user_cache, tmp_path):
    shapes = [(2, 3, 5, 7), (2, 3, 9, 4)]
    code = """
        import sys
        import pool_tuner as pt
        shape = tuple(int(n) for n in sys.argv[1].split("x"))
        result = pt.tune({op!r}, shape, (3, 4), variants=["thread_per_output"], strategy="random_sample", max_fevals=2)
        assert result.stored, "not stored"
        print(result.cache_key)
        """
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code.format(op=OP)), "x".join(map(str, s))],
                              env=subprocess_env(user_cache), cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for s in shapes]
    keys = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        keys.append(out.strip().splitlines()[-1])
    assert keys == [key_of(s) for s in shapes]
    records = stored_records(user_cache)
    assert set(keys) <= set(records)
    assert not list(user_cache.glob("*.corrupt-*")) and not list(user_cache.glob("*.tmp"))


# ---------------------------------------------------------------- 5. failing configurations


@pytest.fixture
def small_space(monkeypatch):
    """thread_per_output with a 4-point space (still holding its default configuration)."""
    variant = variants_for(OP)["thread_per_output"]
    space = {name: [variant.default[name]] for name in variant.search_space}
    space.update(block_size_x=[64, 256], outputs_per_thread=[1, 2])
    assert variant.default["block_size_x"] in space["block_size_x"]
    assert variant.default["outputs_per_thread"] in space["outputs_per_thread"]
    monkeypatch.setattr(variant, "search_space", space)
    return variant


@pytest.fixture
def building(monkeypatch):
    """The kernel source rendered last: its ``template`` (the variant's file, which selects the
    variant) and its ``defines`` (the configuration Kernel Tuner is on)."""
    last = types.SimpleNamespace(template=None, defines={})
    original = kernel_source.render

    def render(template, defines, *header):
        last.template, last.defines = template, dict(defines)
        return original(template, defines, *header)

    monkeypatch.setattr(kernel_source, "render", render)
    return last, render


def _matches(params, config) -> bool:
    return all(params.get(k) == v for k, v in config.items())


def _failed(result, config):
    (variant_result,) = result.variants
    return [f for f in variant_result.failures if _matches(f["params"], config)]


def test_config_failing_verification_is_recorded_and_never_selected(user_cache, small_space, building, monkeypatch):
    last, _ = building
    bad = {"block_size_x": 64, "outputs_per_thread": 1}
    checked = []

    original = tuner.Case.verify  # Kernel Tuner's verify= is make_case(...).verify

    def verify(self, *args, **kwargs):
        config = {k: last.defines.get(k) for k in bad}  # the configuration Kernel Tuner just ran
        checked.append(config)
        return False if config == bad else original(self, *args, **kwargs)

    monkeypatch.setattr(tuner.Case, "verify", verify)
    result = pt.tune(OP, SHAPE, OUT, variants=["thread_per_output"], strategy="brute_force")
    assert bad in checked
    assert len(_failed(result, bad)) == 1
    assert "verif" in _failed(result, bad)[0]["error"].lower()
    assert not _matches(result.best_params, bad)
    assert {k: result.best_params[k] for k in bad} in [c for c in checked if c != bad]
    assert result.variants[0].evaluated == 3
    record = stored_records(user_cache)[result.cache_key]
    assert not _matches(record["best"]["params"], bad)
    assert any(_matches(f["params"], bad) and f["variant"] == "thread_per_output" for f in record["failures"])


def test_config_failing_to_compile_is_recorded_and_skipped(user_cache, small_space, building, monkeypatch, capfd):
    _, render = building
    bad = {"block_size_x": 256, "outputs_per_thread": 2}

    def broken_render(template, defines, *header):
        source = render(template, defines, *header)
        if all(defines.get(k) == v for k, v in bad.items()):
            source = "#error injected compile failure for this test\n" + source
        return source

    monkeypatch.setattr(kernel_source, "render", broken_render)
    result = pt.tune(OP, SHAPE, OUT, variants=["thread_per_output"], strategy="brute_force")
    capfd.readouterr()  # the compiler's complaints
    failed = _failed(result, bad)
    assert len(failed) == 1 and failed[0]["error"]
    assert not _matches(result.best_params, bad)
    assert result.variants[0].evaluated == 3
    assert result.stored
    assert explain()["params"] == result.best_params


@pytest.mark.parametrize("budget", [dict(strategy="brute_force"), dict(strategy="random_sample", max_fevals=3)],
                         ids=["brute_force", "random_sample"])
def test_every_config_failing_is_a_clear_error(user_cache, small_space, building, monkeypatch, capfd, budget):
    _, render = building
    monkeypatch.setattr(kernel_source, "render", lambda t, d, *h: "#error every configuration is broken\n" + render(t, d, *h))
    with pytest.raises(RuntimeError, match="no configuration"):
        pt.tune(OP, SHAPE, OUT, variants=["thread_per_output"], **budget)
    capfd.readouterr()
    assert not (user_cache / cache_mod.USER_FILE).exists()


# ---------------------------------------------------------------- 6. POOL_TUNER_AUTOTUNE


@pytest.fixture
def counted_tune(monkeypatch):
    """Count tuner.tune calls; fail at once if tuning re-enters itself (autotune recursion)."""
    calls = []
    depth = [0]
    original = tuner.tune

    def wrapper(*args, **kwargs):
        calls.append(args[:3])
        if depth[0]:
            raise AssertionError("tune() re-entered itself: autotuning recursed from inside a tuning run")
        depth[0] += 1
        try:
            return original(*args, **kwargs)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(tuner, "tune", wrapper)
    return calls


def test_autotune_tunes_a_miss_once_and_says_so(user_cache, monkeypatch, rng, counted_tune, caplog):
    monkeypatch.setattr(tuner, "BRUTE_FORCE_LIMIT", 0)
    monkeypatch.setattr(tuner, "DEFAULT_MAX_FEVALS", 1)
    monkeypatch.setattr(tuner, "DEFAULT_TIME_LIMIT", 5.0)
    monkeypatch.setenv("POOL_TUNER_AUTOTUNE", "1")
    assert explain()["source"] == "default"  # explain reports, never tunes
    assert counted_tune == []
    x = random_input(rng, SHAPE)
    caplog.set_level("WARNING", logger="pool_tuner")
    y = pt.adaptive_avg_pool2d(x, OUT)
    np.testing.assert_allclose(y, reference.adaptive_avg_pool(x, OUT, 2), rtol=1e-5, atol=1e-6)
    assert len(counted_tune) == 1
    assert key_of() in stored_records(user_cache)
    info = explain()
    assert info["source"] == "cache" and info["autotune_on_miss"] is True
    # Before and after the tuning, one message each on the pool_tuner logger, naming the shape.
    legal = [v for v in variants_for(OP).values() if v.is_legal({}, problem(), device().info.limits)]
    starting, done = [r.getMessage() for r in caplog.records if r.name == "pool_tuner"]
    assert starting.startswith("POOL_TUNER_AUTOTUNE=1 and no tuning record for adaptive_avg_pool2d "
                               "forward float32 NCHW 2x3x5x7 -> 2x3x3x4 on ")
    assert f"tuning it now, before this call returns -- up to {len(legal)} configurations of {len(legal)} variants" in starting
    record = stored_records(user_cache)[key_of()]
    assert done.startswith("tuned adaptive_avg_pool2d forward float32 NCHW 2x3x5x7 -> 2x3x3x4 in ")
    # The message names the stored best; its parameters are a dict, compared as one (its key order is the tuner's).
    named = done.split(": ", 1)[1].rsplit(" (kernel ", 1)[0]
    variant_named, params_named = named.split(" ", 1)
    assert variant_named == record["best"]["variant"] and ast.literal_eval(params_named) == record["best"]["params"]
    assert done.endswith("stored in the tuning cache")
    caplog.clear()
    pt.adaptive_avg_pool2d(x, OUT)
    assert len(counted_tune) == 1  # once
    assert caplog.records == []


def test_autotune_retunes_a_shape_whose_record_is_partial(user_cache, monkeypatch, rng, counted_tune):
    write_records(user_cache, [dict(make_record(), partial={"variants_searched": []})])
    assert explain()["partial"] == {"variants_searched": []}
    monkeypatch.setattr(tuner, "BRUTE_FORCE_LIMIT", 0)
    monkeypatch.setattr(tuner, "DEFAULT_MAX_FEVALS", 1)
    monkeypatch.setenv("POOL_TUNER_AUTOTUNE", "1")
    pt.adaptive_avg_pool2d(random_input(rng, SHAPE), OUT)
    assert len(counted_tune) == 1
    assert explain()["partial"] is None and not cache_mod.is_partial(stored_records(user_cache)[key_of()])


def test_autotune_tunes_the_direction_of_the_call(user_cache, monkeypatch, rng):
    """A backward call's miss tunes the backward problem (it once tuned the forward one)."""
    asked = []
    original = tuner.tune

    def recording(*args, **kwargs):  # the real tuning (autotune reports its result), on a small budget
        asked.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(tuner, "tune", recording)
    monkeypatch.setattr(tuner, "BRUTE_FORCE_LIMIT", 0)
    monkeypatch.setattr(tuner, "DEFAULT_MAX_FEVALS", 1)
    monkeypatch.setenv("POOL_TUNER_AUTOTUNE", "1")
    grad = random_input(rng, SHAPE[:2] + OUT)
    np.testing.assert_allclose(pt.adaptive_avg_pool2d_backward(grad, SHAPE),
                               reference.backward("adaptive_avg_pool2d", grad.astype(np.float64), SHAPE),
                               rtol=1e-5, atol=1e-6)
    assert [(args[:3], kwargs.get("direction")) for args, kwargs in asked] == [
        (("adaptive_avg_pool2d", SHAPE, OUT), "backward")]
    backward_key = cache_mod.cache_key(Problem.create(OP, SHAPE, OUT, direction="backward"), device())
    assert list(stored_records(user_cache)) == [backward_key]


def test_without_autotune_a_miss_never_tunes(user_cache, monkeypatch, rng):
    def forbidden(*args, **kwargs):
        raise AssertionError("tuned without being asked")

    monkeypatch.setattr(tuner, "tune", forbidden)
    monkeypatch.setattr(tuner, "tune_variant", forbidden)
    for value in (None, "0", "", "off", "False", "no"):
        if value is None:
            monkeypatch.delenv("POOL_TUNER_AUTOTUNE", raising=False)
        else:
            monkeypatch.setenv("POOL_TUNER_AUTOTUNE", value)
        dispatch.forget()
        x = random_input(rng, SHAPE)
        np.testing.assert_allclose(pt.adaptive_avg_pool2d(x, OUT), reference.adaptive_avg_pool(x, OUT, 2),
                                   rtol=1e-5, atol=1e-6)
        assert explain()["source"] == "default"
    assert not (user_cache / cache_mod.USER_FILE).exists()


# ---------------------------------------------------------------- 7. the hot path


def test_repeated_calls_touch_no_files_and_build_nothing(user_cache, rng):
    write_records(user_cache, [make_record()])
    x = random_input(rng, SHAPE)
    expected = reference.adaptive_avg_pool(x, OUT, 2)
    np.testing.assert_allclose(pt.adaptive_avg_pool2d(x, OUT), expected, rtol=1e-5, atol=1e-6)  # first call

    touched = []

    def forbidden(name):
        def fail(*args, **kwargs):
            touched.append(name)
            raise AssertionError(f"hot path called {name}")
        return fail

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builtins, "open", forbidden("open"))
        mp.setattr(os, "open", forbidden("os.open"))
        mp.setattr(os, "replace", forbidden("os.replace"))
        mp.setattr(os, "listdir", forbidden("os.listdir"))
        mp.setattr(os, "scandir", forbidden("os.scandir"))
        for method in ("open", "read_text", "read_bytes", "write_text", "iterdir", "exists", "is_dir", "stat"):
            mp.setattr(pathlib.Path, method, forbidden(f"Path.{method}"))
        mp.setattr(filelock, "FileLock", forbidden("FileLock"))
        mp.setattr(opencl, "_build", forbidden("backends.opencl._build"))
        mp.setattr(pyopencl, "Program", forbidden("pyopencl.Program"))
        results = [pt.adaptive_avg_pool2d(x, OUT) for _ in range(3)]
        assert touched == []
        # The guards bite: a new shape must build a kernel, which is refused here.
        with pytest.raises(AssertionError, match="hot path called"):
            pt.adaptive_avg_pool2d(random_input(rng, (2, 3, 4, 4)), (3, 3))
        assert touched
    for y in results:
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    assert explain()["source"] == "cache"


# ---------------------------------------------------------------- 8. budgets


@pytest.mark.parametrize("budget", [dict(max_fevals=3), dict(time_limit=1.0)])
def test_brute_force_with_a_budget_is_an_error(user_cache, budget):
    name = next(iter(budget))
    with pytest.raises(ValueError, match=name):
        pt.tune(OP, SHAPE, OUT, variants=["thread_per_output"], strategy="brute_force", **budget)
    assert not (user_cache / cache_mod.USER_FILE).exists()


def test_a_budget_with_the_automatic_strategy_applies_only_where_it_samples(user_cache):
    """A time limit for a whole run (CLI --time-limit) must not fail on variants whose spaces are
    small enough to be searched whole (here the backward thread_per_input: 24 points)."""
    result = pt.tune(OP, SHAPE, OUT, direction="backward", variants=["thread_per_input"], time_limit=5.0)
    assert result.best_variant == "thread_per_input"
    assert result.variants[0].evaluated == 24


def test_a_one_parameter_space_is_tuned_whole(user_cache):
    """plane_scatter's space has one parameter, for which Kernel Tuner calls restrictions with the
    bare value instead of a dict."""
    result = pt.tune(OP, SHAPE, OUT, direction="backward", variants=["plane_scatter"])
    assert result.best_variant == "plane_scatter"
    assert result.variants[0].evaluated == len(variants_for(OP, "backward")["plane_scatter"].search_space["block_size_x"])


def test_a_variant_whose_search_breaks_is_left_out_with_a_warning(user_cache, monkeypatch):
    """A search that raises (here: as Kernel Tuner did on one-parameter spaces) costs only its own
    variant; the others are still tuned, raced and stored."""
    real = tuner.tune_variant

    def breaking(variant, *args, **kwargs):
        if variant.name == "block_per_row":
            raise AttributeError("'int' object has no attribute 'items'")
        return real(variant, *args, **kwargs)

    monkeypatch.setattr(tuner, "tune_variant", breaking)
    with pytest.warns(RuntimeWarning, match="block_per_row.*AttributeError"):
        result = pt.tune(OP, SHAPE, OUT, variants=["thread_per_output", "block_per_row"], strategy="random_sample",
                         max_fevals=3)
    broken = next(v for v in result.variants if v.variant == "block_per_row")
    assert broken.best_params is None and "AttributeError" in broken.failures[0]["error"]
    assert result.best_variant == "thread_per_output" and result.stored
    record = stored_records(user_cache)[result.cache_key]
    assert any(f["variant"] == "block_per_row" for f in record["failures"])


def test_tune_rejects_unknown_variant_and_empty_output(user_cache):
    with pytest.raises(ValueError, match="variants"):
        pt.tune(OP, SHAPE, OUT, variants=["no_such_variant"])
    with pytest.raises(ValueError, match="output_size"):
        pt.tune(OP, SHAPE, (0, 4))


def test_the_stored_winner_never_lost_to_the_default_in_the_race(user_cache):
    result = pt.tune(OP, SHAPE, OUT, strategy="random_sample", max_fevals=3)
    assert result.best_time_ms <= result.default_time_ms
    assert result.speedup_over_default >= 1.0


@pytest.mark.parametrize("input_shape,output_size,lanes", [
    ((32, 2048, 7, 7), (1, 1), 1),        # 49-element windows: the unrolled small-window path
    ((32, 256, 13, 13), (1, 1), 1),       # 169 elements: still unrolled
    ((8, 2048, 8, 7, 7), (1, 1, 1), 8),   # 392-element slabs of 49-element runs: lanes
    ((8, 64, 64, 64), (1, 1), 8),         # whole 4096-element planes: lanes
    ((2, 3, 64, 64), (6, 6), 1),          # 12-element runs: too short for lanes
])
def test_thread_per_output_default_lanes_follow_the_window(input_shape, output_size, lanes):
    """One lane (the unrolled path) while a window fits SMALL_BOX_LIMIT, lanes for long runs beyond."""
    op = f"adaptive_avg_pool{len(output_size)}d"
    problem = Problem.create(op, input_shape, output_size)
    assert variants_for(op)["thread_per_output"].default_for(problem)["row_lanes"] == lanes


def test_small_box_limit_is_the_kernels():
    """The host's SMALL_BOX_LIMIT decides defaults; the kernels' decides which code runs."""
    header = kernel_source.read("windows.h")
    assert f"#define SMALL_BOX_LIMIT {SMALL_BOX_LIMIT}\n" in header


# ---------------------------------------------------------------- Ctrl-C while tuning

TWO_VARIANTS = dict(variants=["thread_per_output", "block_per_row"], strategy="random_sample", max_fevals=3)


def interrupt_variant(patch, building, owner, name, variant, calls):
    """Make ``owner.name`` raise KeyboardInterrupt, as Ctrl-C would there, on its ``calls``-th call
    while ``variant``'s kernels are on (by the variant file rendered last).  Returns the configurations of
    ``variant`` that the calls before saw."""
    last, _ = building
    original, seen = getattr(owner, name), []
    template, space = variants_for(OP)[variant].template, variants_for(OP)[variant].search_space

    def interrupting(*args, **kwargs):
        if last.template == template:
            if len(seen) + 1 == calls:
                raise KeyboardInterrupt
            seen.append({k: last.defines[k] for k in space})
        return original(*args, **kwargs)

    patch.setattr(owner, name, interrupting)
    return seen


def test_ctrl_c_inside_kernel_tuners_loop_stores_the_best_so_far_as_partial(user_cache, building):
    # Verification runs inside Kernel Tuner's loop after each configuration (and its warm-up run).
    with pytest.MonkeyPatch.context() as patch, pytest.raises(
            tuner.TuningInterrupted, match="interrupted: stored the best configuration measured so far") as caught:
        verified = interrupt_variant(patch, building, tuner.Case, "verify", "block_per_row", 3)
        pt.tune(OP, SHAPE, OUT, **TWO_VARIANTS)
    assert isinstance(caught.value, KeyboardInterrupt)
    result = caught.value.result
    searched, cut = result.variants
    assert (searched.variant, searched.evaluated, cut.variant) == ("thread_per_output", 3, "block_per_row")
    measured = [dict(t) for t in {tuple(sorted(c.items())) for c in verified}]
    assert cut.evaluated == len(measured) >= 1 and cut.best_params in measured
    assert result.partial == {"variants_searched": ["thread_per_output"], "variant_interrupted": "block_per_row",
                              "variants_not_searched": [], "timing": "Kernel Tuner's medians; not raced against the default"}
    assert result.default_time_ms is None and result.speedup_over_default is None and result.stored
    record = stored_records(user_cache)[key_of()]
    assert cache_mod.is_partial(record) and record["partial"] == result.partial
    assert record["best"] == {"variant": result.best_variant, "params": result.best_params, "time_ms": result.best_time_ms}
    assert result.best_time_ms == min(searched.best_time_ms, cut.best_time_ms)
    info = explain()
    assert (info["source"], info["params"], info["partial"]) == ("cache", result.best_params, result.partial)

    # A later full tuning replaces it; an interrupted one after that leaves the full one alone.
    full = pt.tune(OP, SHAPE, OUT, **CHEAP)
    assert full.partial is None and not cache_mod.is_partial(stored_records(user_cache)[key_of()])
    assert explain()["partial"] is None
    with pytest.MonkeyPatch.context() as patch, pytest.raises(
            tuner.TuningInterrupted, match="the cache's full tuning of it is kept") as caught:
        interrupt_variant(patch, building, tuner.Case, "verify", "thread_per_output", 3)
        pt.tune(OP, SHAPE, OUT, **CHEAP)
    assert caught.value.result.partial and not caught.value.result.stored
    assert stored_records(user_cache)[key_of()]["best"]["params"] == full.best_params
    assert explain()["partial"] is None


def test_ctrl_c_inside_a_pyopencl_build_keeps_the_finished_variant(user_cache, monkeypatch, building):
    """Ctrl-C inside PyOpenCL while building block_per_row's first kernel: none of its
    configurations has been measured, thread_per_output's search counts."""
    interrupt_variant(monkeypatch, building, pyopencl.Program, "build", "block_per_row", 1)
    with pytest.raises(tuner.TuningInterrupted) as caught:
        pt.tune(OP, SHAPE, OUT, **TWO_VARIANTS)
    result = caught.value.result
    assert result.best_variant == "thread_per_output"
    assert [(v.variant, v.evaluated) for v in result.variants] == [("thread_per_output", 3), ("block_per_row", 0)]
    assert result.partial["variant_interrupted"] == "block_per_row"
    assert cache_mod.is_partial(stored_records(user_cache)[key_of()])


def test_ctrl_c_before_anything_was_measured_stores_nothing(user_cache, monkeypatch, building):
    interrupt_variant(monkeypatch, building, tuner.Case, "verify", "thread_per_output", 1)
    with pytest.raises(tuner.TuningInterrupted, match="before a configuration had been measured; nothing") as caught:
        pt.tune(OP, SHAPE, OUT, **CHEAP)
    assert caught.value.result is None
    assert not (user_cache / cache_mod.USER_FILE).exists()


@pytest.mark.parametrize("value", ["true", "YES", "on", " 1 "])
def test_autotune_takes_the_usual_spellings_of_on(monkeypatch, value):
    monkeypatch.setenv("POOL_TUNER_AUTOTUNE", value)
    assert tuner.autotune_enabled()


def test_autotune_warns_of_a_value_it_does_not_know(monkeypatch):
    monkeypatch.setenv("POOL_TUNER_AUTOTUNE", "always")
    with pytest.warns(RuntimeWarning, match="POOL_TUNER_AUTOTUNE='always' is neither on .* autotuning stays off"):
        assert not tuner.autotune_enabled()


def test_autotune_speaks_in_one_format_through_a_call(user_cache, monkeypatch, rng, capsys):
    """Without logging configured, both lines go to stderr as "pool_tuner: ..." even when the
    tuning configures logging in between (as libraries imported during it may)."""
    quiet = logging.Logger("pool_tuner")  # no parent: no handlers anywhere, as in a plain script
    monkeypatch.setattr(tuner, "log", quiet)
    heard = []
    original = tuner.tune

    def configuring(*args, **kwargs):
        handler = logging.Handler()
        handler.emit = heard.append
        quiet.addHandler(handler)
        return original(*args, **kwargs)

    monkeypatch.setattr(tuner, "tune", configuring)
    monkeypatch.setattr(tuner, "BRUTE_FORCE_LIMIT", 0)
    monkeypatch.setattr(tuner, "DEFAULT_MAX_FEVALS", 1)
    monkeypatch.setenv("POOL_TUNER_AUTOTUNE", "yes")
    pt.adaptive_avg_pool2d(random_input(rng, SHAPE), OUT)
    lines = [line for line in capsys.readouterr().err.splitlines() if "adaptive_avg_pool2d forward" in line]
    assert [line.split()[:2] for line in lines] == [["pool_tuner:", "POOL_TUNER_AUTOTUNE=yes"], ["pool_tuner:", "tuned"]]
    assert heard == []


def test_gem_is_tuned_over_the_shared_variants_and_dispatched_from_its_record(user_cache, rng):
    """GeM takes the shared forward variants through its operator: Kernel Tuner tunes them (with
    the default p and eps as the kernels' run-time arguments, verified against the reference), the
    record stores the winner and dispatch then runs it, at any p."""
    op, shape, out = "adaptive_gem_pool2d", (2, 8, 9, 9), (2, 3)
    assert pt.explain(op, shape, out)["source"] == "default"
    result = pt.tune(op, shape, out, variants=["thread_per_output", "smem_tiled"], strategy="random_sample",
                     max_fevals=3)
    assert result.stored and result.best_variant in ("thread_per_output", "smem_tiled")
    assert {v.variant for v in result.variants} == {"thread_per_output", "smem_tiled"}
    assert all(not v.failures and v.evaluated for v in result.variants)
    info = pt.explain(op, shape, out)
    assert (info["source"], info["variant"], info["params"]) == ("cache", result.best_variant, result.best_params)
    x = rng.random(shape).astype(np.float32)
    for p in (3.0, 1.5):
        np.testing.assert_allclose(pt.adaptive_gem_pool2d(x, out, p=p),
                                   reference.adaptive_gem_pool(x.astype(np.float64), out, 2, p), rtol=2e-5)
