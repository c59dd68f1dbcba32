"""Measured dispatch (``POOL_TUNER_BENCHMARK``, ``pt.benchmark_mode``, ``pool_tuner.measured``): off
by default; on, the first call of a problem no tuning covers times every legal variant's rule
configuration (then refines the fastest), keeps the winner in the user cache as a ``measured``
record that ``explain`` names, that a later process reads, that any tuning outranks and replaces, and that never decides
another shape or another device; a corrupt one is a warning and a miss; results are the
reference's.  On PoCL with small shapes, and on the CUDA fakes (one program per stage holding
every candidate, which nvcc compiles for real where it is installed)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyopencl.array as cla
import pytest

import pool_tuner as pt
from pool_tuner import backends, cache, dispatch, kernel_source, measured, memo, reference
from pool_tuner.problem import Problem

from conftest import legal_variants, random_input

REPO = Path(__file__).resolve().parent.parent
OP, SHAPE, SIZE = "adaptive_avg_pool2d", (2, 6, 23, 37), (5, 7)


@pytest.fixture
def mode(user_cache, monkeypatch):
    """The mode as a fresh process has it (POOL_TUNER_BENCHMARK unset, not read yet), in a private
    user cache; the process's mode restored afterwards.  Measurements kept short (three rounds,
    three refinements of one variant): what they time is not what these tests check."""
    monkeypatch.delenv(measured.BENCHMARK_ENV, raising=False)
    monkeypatch.setattr(measured, "_mode", None)
    monkeypatch.setattr(measured, "MAX_ROUNDS", measured.MIN_ROUNDS)
    monkeypatch.setattr(measured, "REFINE_VARIANTS", 1)
    monkeypatch.setattr(measured, "REFINE_LIMIT", 3)
    yield user_cache
    measured._mode = None


def _records(user_cache) -> dict:
    path = user_cache / cache.USER_FILE
    return json.loads(path.read_text())["records"] if path.exists() else {}


def _write_records(user_cache, *records) -> None:
    document = {"schema": cache.SCHEMA_VERSION, "records": {record["key"]: record for record in records}}
    (user_cache / cache.USER_FILE).write_text(json.dumps(document))


def _only_record(user_cache) -> dict:
    records = _records(user_cache)
    assert len(records) == 1, list(records)
    return next(iter(records.values()))


# ---------------------------------------------------------------------- the switch

def test_off_by_default_and_nothing_is_measured(mode, rng):
    assert not pt.benchmark_mode() and repr(pt.benchmark_mode()) == "benchmark_mode(False)"
    assert pt.benchmark_mode() == False and pt.benchmark_mode() != True  # noqa: E712 - the comparison users write
    x = random_input(rng, SHAPE)
    pt.adaptive_avg_pool2d(x, SIZE)
    info = pt.explain(OP, SHAPE, SIZE)
    assert info["source"] == "default" and info["measured"] is None and info["benchmark_on_miss"] is False
    assert _records(mode) == {}


@pytest.mark.parametrize("value,on", [("1", True), ("on", True), ("TRUE", True), ("0", False), ("", False)])
def test_the_environment_variable_is_read_once(mode, monkeypatch, value, on):
    monkeypatch.setenv(measured.BENCHMARK_ENV, value)
    assert bool(pt.benchmark_mode()) is on
    monkeypatch.setenv(measured.BENCHMARK_ENV, "0" if on else "1")
    assert bool(pt.benchmark_mode()) is on, "read once, on first use"


def test_a_misspelt_environment_value_warns_and_stays_off(mode, monkeypatch):
    monkeypatch.setenv(measured.BENCHMARK_ENV, "yes please")
    with pytest.warns(RuntimeWarning, match="POOL_TUNER_BENCHMARK"):
        assert not pt.benchmark_mode()


def test_the_switch_sets_the_mode_and_restores_it_as_a_context_manager(mode):
    with pt.benchmark_mode(True) as on:
        assert on and pt.benchmark_mode() and pt.explain(OP, SHAPE, SIZE)["benchmark_on_miss"] is True
        with pt.benchmark_mode(False):
            assert not pt.benchmark_mode()
        assert pt.benchmark_mode()
    assert not pt.benchmark_mode()
    pt.benchmark_mode(True)
    assert pt.benchmark_mode(), "without with, the mode stays set"
    pt.benchmark_mode(False)
    assert not pt.benchmark_mode()
    with pytest.raises(TypeError, match="benchmark_mode takes True, False or nothing"):
        pt.benchmark_mode("yes")


# ---------------------------------------------------------------------- measuring

def test_first_call_measures_every_legal_variant_and_explain_names_the_record(mode, rng):
    x = random_input(rng, SHAPE)
    with pt.benchmark_mode(True):
        y = pt.adaptive_avg_pool2d(x, SIZE)
        info = pt.explain(OP, SHAPE, SIZE)
    record = _only_record(mode)
    assert cache.is_measured(record) and record["key"] == info["cache_key"]
    entries = [record["best"], *record["runners_up"]]
    first_stage = [e["variant"] for e in entries if e["stage"] == "variants"]
    assert sorted(first_stage) == sorted(legal_variants(OP, "forward", SHAPE, SIZE)), "one entry per legal variant"
    times = [e["time_ms"] for e in entries]
    assert times[1:] == sorted(times[1:]) and all(t > 0 for t in times)
    refined = [e for e in entries if e["stage"] == "refine"]
    assert len({e["variant"] for e in refined}) == 1 and 1 < len(refined) <= 1 + measured.REFINE_LIMIT
    assert info["source"] == "measured" and info["record_origin"] == "user" and info["tier"] == "exact"
    assert (info["variant"], info["params"]) == (record["best"]["variant"], record["best"]["params"])
    assert info["measured"] == entries
    expected = reference.forward(OP, x.astype(np.float64), SIZE)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-6)
    assert np.array_equal(pt.adaptive_avg_pool2d(x, SIZE), y), "the same bits on every later call"
    assert memo.MEMOS.sizes()["dispatch.kernels"] == 1, "the candidates that lost are not kept built"


def test_each_candidate_has_its_rule_configuration(mode):
    device = backends.default_device()
    problem = Problem.create(OP, SHAPE, SIZE, "float32", "NCHW")
    by_variant = {c.variant.name: c for c in measured.candidates(problem, device)}
    rules_choice = dispatch.default_choice(problem, device)
    assert by_variant[rules_choice.variant.name].params == rules_choice.params, \
        "the variant the rules pick is timed with the rules' configuration"
    for choice in by_variant.values():
        assert choice.variant.check_config(choice.config, problem, device.info.limits) == choice.config


@pytest.mark.parametrize("op,layout,dtype,direction", [
    ("adaptive_max_pool2d", "NCHW", "float32", "forward"),
    ("adaptive_max_pool2d", "NHWC", "float16", "backward"),
    ("adaptive_avg_pool2d", "NHWC", "float32", "backward"),
    ("adaptive_avg_pool1d", "NCL", "float64", "forward"),
])
def test_measured_results_equal_the_reference(mode, rng, op, layout, dtype, direction):
    shape, size = ((3, 5, 41), (6,)) if op.endswith("1d") else ((2, 9, 13, 11), (4, 3))
    np_dtype = np.dtype(dtype)
    def in_layout(a):
        return np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2) if layout == "NHWC" else a

    x = in_layout(random_input(rng, shape, np_dtype))
    forward = getattr(pt, op)
    values64, indices = (reference.forward(op, x.astype(np.float64), size) if op.startswith("adaptive_max")
                         else (reference.forward(op, x.astype(np.float64), size), None))
    tolerance = dict(rtol=2e-3, atol=2e-3) if dtype == "float16" else dict(rtol=1e-5, atol=1e-6)
    with pt.benchmark_mode(True):
        if direction == "forward":
            got = forward(x, size, return_indices=True) if indices is not None else (forward(x, size), None)
            np.testing.assert_allclose(got[0].astype(np.float64), values64, **tolerance)
            if indices is not None:
                assert np.array_equal(got[1], indices)
        else:
            grad = in_layout(random_input(rng, values64.shape, np_dtype))
            backward = getattr(pt, f"{op}_backward")
            got = backward(grad, in_layout(indices), shape) if indices is not None else backward(grad, shape)
            expected = reference.backward(op, grad.astype(np.float64), shape, indices)
            np.testing.assert_allclose(got.astype(np.float64), expected, **tolerance)
    record = _only_record(mode)
    assert cache.is_measured(record) and record["problem"]["direction"] == direction
    assert record["problem"]["layout"] == layout


def test_device_arrays_measure_on_scratch_buffers_not_the_callers(mode, rng):
    queue = backends.default_device().queue
    x_host = random_input(rng, SHAPE)
    x = cla.to_device(queue, x_host)
    with pt.benchmark_mode(True):
        y = pt.adaptive_max_pool2d(x, SIZE)
    assert np.array_equal(x.get(), x_host), "the caller's input is left as it was"
    np.testing.assert_array_equal(y.get(), reference.forward("adaptive_max_pool2d", x_host.astype(np.float64),
                                                             SIZE)[0].astype(np.float32))
    assert cache.is_measured(_only_record(mode))


def test_pytorch_tensors_are_measured_too(mode, rng):
    """pool_tuner.torch's CPU path (forward and autograd's backward) dispatches as the numpy API does."""
    torch = pytest.importorskip("torch")
    import pool_tuner.torch as ptt

    x = torch.from_numpy(random_input(rng, SHAPE)).requires_grad_()
    with pt.benchmark_mode(True):
        y = ptt.adaptive_avg_pool2d(x, SIZE)
        y.backward(torch.ones_like(y))
    torch.testing.assert_close(y, torch.nn.functional.adaptive_avg_pool2d(x, SIZE), rtol=1e-5, atol=1e-6)
    records = _records(mode).values()
    assert {r["problem"]["direction"] for r in records} == {"forward", "backward"}
    assert all(cache.is_measured(r) for r in records)


def test_a_measured_record_is_read_by_a_later_process(mode, rng):
    with pt.benchmark_mode(True):
        pt.adaptive_avg_pool2d(random_input(rng, SHAPE), SIZE)
    record = _only_record(mode)
    path = mode / cache.USER_FILE
    before = path.read_bytes()
    script = (
        "import numpy as np, pool_tuner as pt\n"
        f"print(pt.explain({OP!r}, {SHAPE!r}, {SIZE!r})['source'])\n"
        f"pt.adaptive_avg_pool2d(np.ones({SHAPE!r}, np.float32), {SIZE!r})\n"
        f"info = pt.explain({OP!r}, {SHAPE!r}, {SIZE!r})\n"
        "print(info['source'], info['variant'], len(info['measured']))\n"
    )
    env = dict(os.environ, POOL_TUNER_CACHE_DIR=str(mode), POOL_TUNER_BENCHMARK="1", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    entries = 1 + len(record["runners_up"])
    assert out.stdout.split() == ["measured", "measured", record["best"]["variant"], str(entries)]
    assert path.read_bytes() == before, "read, not measured again"


def test_a_tuning_outranks_and_replaces_a_measured_record(mode, rng):
    with pt.benchmark_mode(True):
        pt.adaptive_avg_pool2d(random_input(rng, SHAPE), SIZE)
        assert pt.explain(OP, SHAPE, SIZE)["source"] == "measured"
        result = pt.tune(OP, SHAPE, SIZE, variants=["thread_per_output"], strategy="random_sample", max_fevals=2)
        assert result.stored
        info = pt.explain(OP, SHAPE, SIZE)
    record = _only_record(mode)
    assert not cache.is_measured(record) and info["source"] == "cache" and info["measured"] is None
    measured_record = dict(record, measured={"rounds": 3})
    assert not cache.replaces(measured_record, record, faster_only=False), "a measurement never replaces a tuning"
    assert cache.replaces(record, measured_record, faster_only=True), "a tuning replaces a measurement"


def test_a_tuned_record_of_another_driver_outranks_a_measured_one(mode, rng):
    with pt.benchmark_mode(True):
        pt.adaptive_avg_pool2d(random_input(rng, SHAPE), SIZE)
    mine = _only_record(mode)
    device = backends.default_device()
    other_driver = dict(mine["device"], driver="another driver")
    assert cache.device_tier(other_driver, device) == "model"
    problem = Problem.create(OP, SHAPE, SIZE, "float32", "NCHW")
    runner_up = mine["runners_up"][0]
    tuned = cache.make_record(problem, other_driver, mine["kernel_hash"],
                              best={k: runner_up[k] for k in ("variant", "params", "time_ms")}, runners_up=[])
    dispatch.tuning_cache().store(tuned)
    dispatch.forget()
    info = pt.explain(OP, SHAPE, SIZE)
    assert (info["source"], info["tier"], info["variant"]) == ("cache", "model", runner_up["variant"])


def test_a_measured_record_decides_only_its_own_shape_and_device(mode, rng):
    with pt.benchmark_mode(True):
        pt.adaptive_avg_pool2d(random_input(rng, SHAPE), SIZE)
    record = _only_record(mode)
    assert pt.explain(OP, (2, 6, 25, 37), SIZE)["source"] == "default", "never a nearest shape"
    moved = dict(record, device=dict(record["device"], driver="another driver"))
    moved["key"] = cache.make_key(Problem.create(OP, SHAPE, SIZE, "float32", "NCHW"), moved["device"],
                                  record["kernel_hash"])
    _write_records(mode, moved)
    dispatch.forget()
    assert pt.explain(OP, SHAPE, SIZE)["source"] == "default", "never carried to another driver"


def test_a_nearest_shapes_tuned_choice_is_a_candidate_too(mode, rng):
    """So that measuring never runs something slower than what would have run without it."""
    device = backends.default_device()
    other = Problem.create(OP, (2, 6, 25, 37), SIZE, "float32", "NCHW")
    variant = dispatch.variants_mod.get_variant(OP, "thread_per_output")
    params = variant.check_config({"block_size_x": 64, "outputs_per_thread": 2}, other, device.info.limits)
    tuned = cache.make_record(other, device.info.fingerprint, cache.record_kernel_hash(other, device.info.fingerprint),
                              best={"variant": variant.name, "params": params, "time_ms": 0.1}, runners_up=[])
    dispatch.tuning_cache().store(tuned)
    assert pt.explain(OP, SHAPE, SIZE)["source"] == "nearest"
    with pt.benchmark_mode(True):
        pt.adaptive_avg_pool2d(random_input(rng, SHAPE), SIZE)
    record = _records(mode)[pt.explain(OP, SHAPE, SIZE)["cache_key"]]
    entries = [e for e in [record["best"], *record["runners_up"]] if e["stage"] == "variants"]
    assert len(entries) == len(legal_variants(OP, "forward", SHAPE, SIZE)) + 1
    assert [(e["variant"], e["params"]) for e in entries if e.get("record") == tuned["key"]] == [(variant.name, params)]


@pytest.mark.parametrize("damage", ["measured_not_an_object", "measured_and_partial", "untimed_candidate"])
def test_a_corrupt_measured_record_is_a_warning_and_a_miss(mode, rng, damage):
    with pt.benchmark_mode(True):
        pt.adaptive_avg_pool2d(random_input(rng, SHAPE), SIZE)
    record = _only_record(mode)
    if damage == "measured_not_an_object":
        record["measured"] = "fast"
    elif damage == "measured_and_partial":
        record["partial"] = {"variants_searched": []}
    else:
        record["best"]["time_ms"] = None
    _write_records(mode, record)
    dispatch.forget()
    with pytest.warns(cache.CacheWarning, match="ignored"):
        info = pt.explain(OP, SHAPE, SIZE)
    assert info["source"] == "default"
    x = random_input(rng, SHAPE)
    with pt.benchmark_mode(True), pytest.warns(cache.CacheWarning, match="moved it to"):
        y = pt.adaptive_avg_pool2d(x, SIZE)  # measured again; the damaged file set aside
    np.testing.assert_allclose(y, reference.forward(OP, x.astype(np.float64), SIZE), rtol=1e-5, atol=1e-6)
    assert cache.is_measured(_only_record(mode))


def test_autotune_still_tunes_a_problem_that_was_only_measured(mode, rng, monkeypatch):
    with pt.benchmark_mode(True):
        pt.adaptive_avg_pool2d(random_input(rng, SHAPE), SIZE)
    dispatch.forget()
    tuned = []
    monkeypatch.setenv("POOL_TUNER_AUTOTUNE", "1")
    monkeypatch.setattr(pt.tuner, "autotune", lambda problem, device: tuned.append(problem))
    pt.adaptive_avg_pool2d(random_input(rng, SHAPE), SIZE)
    assert [p.input_shape for p in tuned] == [SHAPE]


# ---------------------------------------------------------------------- CUDA: one program per stage

@pytest.fixture
def fake_cuda(monkeypatch, user_cache):
    """A fake CUDA device (tests/cuda_fakes.py) whose "compiler" records each source it is given."""
    from pool_tuner.backends import cuda

    from cuda_fakes import forget_fake_gpu, install_fake_gpu

    device, fake, driver = install_fake_gpu(monkeypatch)
    compiled = []
    monkeypatch.setattr(cuda, "_compile", lambda source, arch: compiled.append(source) or b"cubin:" + source.encode())
    monkeypatch.setattr(measured, "_mode", None)
    monkeypatch.delenv(measured.BENCHMARK_ENV, raising=False)
    yield device, fake, driver, compiled
    measured._mode = None
    pt.release_memory()
    forget_fake_gpu()


def test_on_cuda_each_stages_candidates_are_built_in_one_program(fake_cuda):
    device, fake, driver, compiled = fake_cuda
    fake.autoprimaryctx()
    x = fake.gpuarray.to_gpu(np.random.default_rng(0).random(SHAPE).astype(np.float32))
    with pt.benchmark_mode(True):
        pt.adaptive_avg_pool2d(x, SIZE)
        info = pt.explain(OP, SHAPE, SIZE, device=device.info.id)
    problem = Problem.create(OP, SHAPE, SIZE, "float32", "NCHW")
    names = [c.variant.name for c in measured.candidates(problem, device)]
    record = dispatch.tuning_cache().lookup(info["cache_key"])
    stages = len(record["measured"]["rounds"])
    assert len(names) > 1 and stages >= 2 and len(compiled) == stages, "one compile per stage, not per candidate"
    for position in range(len(names)):
        assert f"#define pool_forward {kernel_source.together_name('pool_forward', position)}" in compiled[0]
    first_stage = [e["variant"] for e in info["measured"] if e["stage"] == "variants"]
    assert info["source"] == "measured" and sorted(first_stage) == sorted(names)
    modules = {driver.function_modules[launch["function"]] for launch in driver.launches}
    assert len(modules) == stages, "each stage's kernels from its module"
    assert len(driver.launches) >= len(names) * (1 + measured.MIN_ROUNDS) + 1


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("op,shape,size,dtype,layout,direction", [
    ("adaptive_avg_pool2d", (8, 64, 64, 64), (6, 6), "float32", "NCHW", "forward"),
    ("adaptive_max_pool2d", (32, 256, 13, 13), (4, 4), "float16", "NHWC", "forward"),
    ("adaptive_max_pool2d", (4, 8, 13, 13), (4, 4), "bfloat16", "NCHW", "backward"),
    ("adaptive_avg_pool_pyramid2d", (2, 8, 12, 12), (1, 2, 3, 6), "float32", "NCHW", "forward"),
    ("adaptive_max_pool2d", (32, 2048, 7, 7), 1, "float16", "NHWC", "forward"),
])
def test_nvcc_compiles_the_one_program_of_every_candidate(fake_cuda, op, shape, size, dtype, layout, direction):
    """The fakes above "compile" anything; nvcc checks that the one program is CUDA that it accepts
    and that holds every candidate's kernel under its own name."""
    from pool_tuner.backends import cuda, cuda_compile

    device = fake_cuda[0]
    problem = Problem.create(op, shape, size, dtype, layout, direction=direction)
    choices = measured.candidates(problem, device)
    kernel_name = choices[0].variant.kernel_name
    source = kernel_source.render_together(
        [c.variant.program(c.config, problem) for c in choices], kernel_name)
    cubin = cuda_compile.compile_source(source, "sm_75", cuda.find_nvcc())
    for position in range(len(choices)):
        assert kernel_source.together_name(kernel_name, position).encode() in cubin


def test_multi_level_ops_are_measured_and_equal_the_reference(mode, rng):
    """Their scratch buffers are the flat buffers of every level, with valid indices for the backward."""
    shape, sizes = (2, 5, 13, 11), [1, 2, 3]
    x = random_input(rng, shape)
    grads = [random_input(rng, (2, 5, s, s)) for s in sizes]
    with pt.benchmark_mode(True):
        values, indices = pt.adaptive_max_pool_pyramid(x, sizes, return_indices=True)
        grad_in = pt.adaptive_max_pool_pyramid_backward(grads, indices, shape)
    expected = np.zeros(shape)
    for size, got, got_indices, grad in zip(sizes, values, indices, grads):
        want, want_indices = reference.forward("adaptive_max_pool2d", x.astype(np.float64), size)
        assert np.array_equal(got, want.astype(np.float32)) and np.array_equal(got_indices, want_indices)
        expected += reference.backward("adaptive_max_pool2d", grad.astype(np.float64), shape, want_indices)
    np.testing.assert_allclose(grad_in, expected, rtol=1e-5, atol=1e-6)
    records = _records(mode).values()
    assert len(records) == 2 and all(cache.is_measured(r) for r in records)
    assert {(r["problem"]["op"], r["problem"]["direction"]) for r in records} == {
        ("adaptive_max_pool_pyramid2d", "forward"), ("adaptive_max_pool_pyramid2d", "backward")}


def test_a_measurement_that_fails_warns_and_the_rules_decide(mode, rng, monkeypatch):
    def no_memory(problem, rng):
        raise MemoryError("no room for scratch buffers")

    monkeypatch.setattr(measured, "scratch_arguments", no_memory)
    x = random_input(rng, SHAPE)
    with pt.benchmark_mode(True), pytest.warns(RuntimeWarning, match="no room for scratch buffers"):
        y = pt.adaptive_avg_pool2d(x, SIZE)
    np.testing.assert_allclose(y, reference.forward(OP, x.astype(np.float64), SIZE), rtol=1e-5, atol=1e-6)
    assert pt.explain(OP, SHAPE, SIZE)["source"] == "default" and _records(mode) == {}


def test_a_stage_whose_candidates_all_fail_leaves_the_last_race_standing(mode, rng, monkeypatch):
    real, stages = dispatch.DISPATCHER.build_together, []

    def only_the_first_stage_builds(device, context, problem, choices):
        stages.append(len(choices))
        if len(stages) == 1:
            return real(device, context, problem, choices)
        return {i: RuntimeError("the compiler crashed") for i in range(len(choices))}

    monkeypatch.setattr(dispatch.DISPATCHER, "build_together", only_the_first_stage_builds)
    x = random_input(rng, SHAPE)
    with pt.benchmark_mode(True):
        y = pt.adaptive_avg_pool2d(x, SIZE)
    np.testing.assert_allclose(y, reference.forward(OP, x.astype(np.float64), SIZE), rtol=1e-5, atol=1e-6)
    record = _only_record(mode)
    assert len(stages) == 2 and record["best"]["stage"] == "variants"
    assert len(record["failures"]) == stages[1] and {f["stage"] for f in record["failures"]} == {"refine"}
    assert all("the compiler crashed" in f["error"] for f in record["failures"])


def test_threads_that_miss_one_problem_at_once_measure_it_once(mode, rng, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    real, measurements = measured.measure, []
    monkeypatch.setattr(measured, "measure", lambda problem, device, rng=None: measurements.append(problem) or
                        real(problem, device, rng))
    x = random_input(rng, SHAPE)
    with pt.benchmark_mode(True), ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: pt.adaptive_avg_pool2d(x, SIZE), range(4)))
    assert len(measurements) == 1, "the threads that waited use the first one's measurement"
    assert all(np.array_equal(r, results[0]) for r in results)
    assert cache.is_measured(_only_record(mode))


def test_on_a_gpu_the_variant_shaped_for_gpus_is_a_candidate(fake_cuda):
    """Measured dispatch on a GPU times global_blocks with the others (on PoCL, a CPU device, it is
    shaped for another kind of device and left out)."""
    device = fake_cuda[0]
    for layout in ("NCHW", "NHWC"):
        problem = Problem.create("adaptive_avg_pool2d", (32, 2048, 7, 7), 1, "float32", layout)
        assert "global_blocks" in [c.variant.name for c in measured.candidates(problem, device)]
        on_cpu = measured.candidates(problem, backends.resolve_device("opencl:pocl:0"))
        assert on_cpu and "global_blocks" not in [c.variant.name for c in on_cpu]


def test_on_cuda_a_two_pass_candidate_is_built_in_its_stages_one_program(fake_cuda):
    """A few huge planes: global_blocks's default splits them (a second pass), and both its kernels
    are built in the stage's one program -- the first call still costs one compile per stage."""
    device, fake, _, compiled = fake_cuda
    fake.autoprimaryctx()
    shape = (1, 1, 256, 256)
    problem = Problem.create(OP, shape, (1, 1), "float32", "NCHW")
    blocks = [c for c in measured.candidates(problem, device) if c.variant.name == "global_blocks"]
    assert blocks and blocks[0].config["split"] == 4
    x = fake.gpuarray.to_gpu(np.random.default_rng(0).random(shape).astype(np.float32))
    with pt.benchmark_mode(True):
        pt.adaptive_avg_pool2d(x, 1)
        info = pt.explain(OP, shape, 1, device=device.info.id)
    stages = len(dispatch.tuning_cache().lookup(info["cache_key"])["measured"]["rounds"])
    assert len(compiled) == stages, "one compile per stage, a second pass included"
    assert "#define COMBINE_PASS 1" in compiled[0]
    assert "global_blocks" in [e["variant"] for e in info["measured"] if e["stage"] == "variants"]
