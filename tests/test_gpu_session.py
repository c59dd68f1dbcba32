"""The one command for a GPU lease (benchmarks/gpu_session.py, docs/gpu.md) and what it stands on,
proven without a GPU: the test runner that a fault cannot cascade through
(benchmarks/isolated_tests.py), the dry run of every step, the CUDA variant matrix collecting the
same in every process (what pytest-xdist's workers need), and the grid data named after the GPU."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

from cuda_fakes import fake_cuda_device

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
if not (BENCHMARKS / "gpu_session.py").exists():
    pytest.skip("benchmarks/ is not beside the tests (installed package)", allow_module_level=True)


def _script(name):
    """A script of benchmarks/ as a module (registered, as its dataclasses need)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


#: Cases standing in for the GPU tests' failures: a CUDA error that poisons the process's context
#: (simulated: every later case of the process fails), a crash, cases marked own_process that fail
#: and die, and skips by mark and at run time.
SYNTHETIC = textwrap.dedent('''
    import os
    import pytest

    POISONED = []


    def test_first():
        assert not POISONED


    def test_poisons():
        POISONED.append(1)
        raise RuntimeError("cuLaunchKernel: CUDA_ERROR_ILLEGAL_ADDRESS (an illegal memory access was encountered)")


    def test_after_the_poison():
        assert not POISONED


    def test_fails_plainly():
        assert 1 == 2


    def test_after_the_plain_failure():
        assert not POISONED


    def test_crashes():
        os.abort()


    def test_after_the_crash():
        assert not POISONED


    @pytest.mark.skipif(True, reason="no such device here")
    def test_skipped_by_its_mark():
        os.abort()  # never run: no process is started for it


    def test_skips_when_run():
        pytest.skip("decided at run time")


    @pytest.mark.own_process
    def test_alone_fails():
        assert not POISONED and False


    @pytest.mark.own_process
    def test_alone_dies():
        os._exit(3)
''')


def _outcomes(result):
    return {case["nodeid"].rsplit("::", 1)[1]: case["outcome"] for case in result["cases"]}


def test_a_fault_or_a_crash_takes_no_other_case_down(tmp_path):
    isolated_tests = _script("isolated_tests")
    test_file = tmp_path / "test_synthetic.py"
    test_file.write_text(SYNTHETIC)
    results = isolated_tests.run_files([str(test_file)], tmp_path / "out", jobs=1, timeout_s=240)
    result = results[str(test_file)]
    assert _outcomes(result) == {
        "test_first": "passed", "test_poisons": "failed", "test_after_the_poison": "passed",
        "test_fails_plainly": "failed", "test_after_the_plain_failure": "passed",
        "test_crashes": "crashed", "test_after_the_crash": "passed",
        "test_skipped_by_its_mark": "skipped", "test_skips_when_run": "skipped",
        "test_alone_fails": "failed", "test_alone_dies": "crashed",
    }
    # the shard: a first process stopped after the poisoning failure, a second died in the crash, a
    # third finished; and one process for each case of its own
    assert "11 cases: 4 passed, 3 failed, 2 skipped, 2 crashed (5 pytest processes" in result["summary"]
    assert f"POOL_TUNER_TEST_SEED={os.environ['POOL_TUNER_TEST_SEED']}" in result["summary"]  # one seed: replayable
    written = json.loads((tmp_path / "out" / "results.json").read_text())
    assert written == results
    messages = {case["nodeid"].rsplit("::", 1)[1]: case["message"] for case in result["cases"]}
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in messages["test_poisons"]
    assert messages["test_skipped_by_its_mark"] == "no such device here"


def test_the_deadline_kills_what_still_runs(tmp_path):
    isolated_tests = _script("isolated_tests")
    test_file = tmp_path / "test_hangs.py"
    test_file.write_text(textwrap.dedent('''
        import time


        def test_quick():
            pass


        def test_hangs():
            time.sleep(600)


        def test_after_the_hang():
            pass
    '''))
    results = isolated_tests.run_files([str(test_file)], tmp_path / "out", jobs=1, timeout_s=14)
    assert _outcomes(results[str(test_file)]) == {"test_quick": "passed", "test_hangs": "timed out",
                                                  "test_after_the_hang": "not run"}


def test_every_files_quick_cases_run_before_the_cases_of_their_own(tmp_path):
    """The first lease's tests step: the long cases of their own of the first file took every
    slot, and the second file never started.  Its quick cases run first; no more than
    ``alone_jobs`` cases of their own at a time (each may hold gigabytes of GPU memory)."""
    isolated_tests = _script("isolated_tests")
    long_file = tmp_path / "test_long.py"
    long_file.write_text(textwrap.dedent('''
        import time

        import pytest


        @pytest.mark.own_process
        @pytest.mark.parametrize("i", range(3))
        def test_long(i):
            time.sleep(600)


        def test_quick_beside_them():
            pass
    '''))
    quick_file = tmp_path / "test_quick.py"
    quick_file.write_text("def test_quick_1():\n    pass\n\n\ndef test_quick_2():\n    pass\n")
    results = isolated_tests.run_files([str(long_file), str(quick_file)], tmp_path / "out", jobs=2, timeout_s=16,
                                       alone_jobs=1)
    assert _outcomes(results[str(quick_file)]) == {"test_quick_1": "passed", "test_quick_2": "passed"}
    assert _outcomes(results[str(long_file)]) == {"test_long[0]": "timed out", "test_long[1]": "not run",
                                                  "test_long[2]": "not run", "test_quick_beside_them": "passed"}


def test_a_cut_off_run_has_tried_every_test_function():
    isolated_tests = _script("isolated_tests")
    ids = ["t.py::test_a[1]", "t.py::test_a[2]", "t.py::test_a[3]", "t.py::test_b", "t.py::test_c[1]",
           "t.py::test_c[2]"]
    assert isolated_tests.interleaved(ids) == ["t.py::test_a[1]", "t.py::test_b", "t.py::test_c[1]",
                                               "t.py::test_a[2]", "t.py::test_c[2]", "t.py::test_a[3]"]
    assert isolated_tests.shard_counts({"big": ids * 30, "small": ids[:2], "none": []}, 10) == {"big": 9, "small": 1}
    assert isolated_tests.shard_counts({"one": ids}, 1) == {"one": 1}


def test_a_stopped_runner_leaves_no_test_process_behind(tmp_path):
    """SIGTERM (gpu_session.py's step timeout) to the runner ends the pytest processes it started in
    process groups of their own, and it still writes its results."""
    test_file = tmp_path / "test_hangs.py"
    pid_file = tmp_path / "pid"
    test_file.write_text(textwrap.dedent(f'''
        import os
        import time


        def test_hangs():
            open({str(pid_file)!r}, "w").write(str(os.getpid()))
            time.sleep(600)
    '''))
    runner = subprocess.Popen([sys.executable, str(BENCHMARKS / "isolated_tests.py"), str(test_file), "--out",
                               str(tmp_path / "out"), "--jobs", "1", "--timeout", "300"], cwd=tmp_path,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        pid = int(pid_file.read_text())
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=60) == 1
    finally:
        if runner.poll() is None:
            runner.kill()
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert _outcomes(results[str(test_file)]) == {"test_hangs": "timed out"}


@pytest.mark.exhaustive  # about a minute of the core's time: the CI runs it in the exhaustive tier
def test_the_dry_run_runs_every_step_and_reports_each(tmp_path):
    """``gpu_session.py --dry-run``: every step runs here (the GPU test files skip, the steps that
    need a GPU fail and are reported so without stopping the others), records and rules are
    written, and the exit status says the plumbing works.  What comes back from a lease is two
    files: the report and the packed working folder."""
    gpu_session = _script("gpu_session")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_session.py"), "--dry-run", "--jobs", "2", "--out",
                           str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "session.tar.gz"]
    report = (out / "report.md").read_text()
    with tarfile.open(out / "session.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    work = tmp_path / "session"
    names = [step.name for step in gpu_session.steps(work, dry_run=True, jobs=2)]
    assert names == ["tests", "suite_float32", "global_pooling", "call_overhead", "gem", "models", "suite_float16",
                     "memory", "dispatch_grid", "derive_rules", "tune_float32", "tune_float16"]
    rows = {line.split(" | ")[0].strip("| "): line for line in report.splitlines() if line.startswith("| ")}
    for name in names:
        assert f"## {name}: " in report and (work / name / "log.txt").exists(), name
        if name in ("call_overhead", "models"):
            assert "expected in a dry run" in rows[name] or "| ok |" in rows[name], rows[name]
        else:
            assert f"| {name} | ok |" in rows[name], rows[name]
    assert "not run yet" not in report
    assert "tests/test_cuda_gpu.py: " in report and "tests/test_cuda.py: " in report
    assert "geomean" in report  # the suite's figures
    assert "upsample_area 16x64x5x5->16x64x7x7 forward: pool_tuner " in (work / "suite_float32" / "log.txt").read_text()
    assert (work / "suite_float32" / "bench_rows.jsonl").exists()
    global_pooling = report.split("## global_pooling: ", 1)[1].split("\n## ", 1)[0]
    assert "global_blocks" in global_pooling and "global_blocks split=" in global_pooling  # a few huge planes
    records = list((work / "tuning_cache").glob("*.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["records"]
    rules = json.loads((work / "default_rules.json").read_text())["devices"]["cpu"]
    assert rules["derived_from"] == f"benchmarks/dispatch_grid/{gpu_session.grid_data_dir(work).name}/records.json"
    assert rules["problems"] >= 1


#: A plugin that lists one fake CUDA GPU before the test files are imported, so that
#: tests/test_cuda.py generates its whole variant matrix without a GPU.
FAKE_GPU_PLUGIN = textwrap.dedent('''
    import cuda_fakes
    from pool_tuner.backends import cuda

    _device = cuda_fakes.fake_cuda_device()
    cuda.list_devices = lambda: (_device,)
''')


def test_the_cuda_variant_matrix_collects_the_same_in_every_process(tmp_path):
    """pytest-xdist runs a file's cases in several workers only if every worker collects the same
    cases in the same order (``-n 8 --dist load`` on a GPU, docs/gpu.md): the matrix of
    tests/test_cuda.py, generated as on a GPU, is the same under other hash seeds and test seeds."""
    (tmp_path / "fake_gpu.py").write_text(FAKE_GPU_PLUGIN)
    collected = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, POOL_TUNER_TEST_SEED=seed,
                   PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT / "tests"), str(ROOT)]))
        proc = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-p",
                               "fake_gpu", "--collect-only", "-q", "tests/test_cuda.py"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        collected.append([line for line in proc.stdout.splitlines() if "::" in line])
    assert collected[0] == collected[1]
    assert sum("test_every_variant_on_the_shape_matrix[" in nodeid for nodeid in collected[0]) > 100
    assert not any("no-cuda-gpu" in nodeid for nodeid in collected[0])


def test_a_suite_cut_off_reports_the_problems_it_finished(tmp_path):
    """No bench.json (the step was killed): the report's figures come from bench_rows.jsonl."""
    gpu_session = _script("gpu_session")
    rows = [{"direction": "forward", "speedup_vs_torch": 2.0, "tuned_vs_default": 1.0, "times_floor": 1.5},
            {"direction": "forward", "speedup_vs_torch": 0.5, "tuned_vs_default": 4.0, "times_floor": 1.5},
            {"direction": "backward", "speedup_vs_torch": 3.0, "tuned_vs_default": 1.0, "times_floor": 2.0}]
    (tmp_path / "bench_rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    figures = gpu_session.suite_figures(tmp_path, "$ pool-tuner bench ...\n")
    assert figures[0].startswith("cut off after 3 problems")
    assert figures[1:] == ["forward, 2 problems: geomean 1.00x PyTorch, tuned/default 2.00x, 1.50x the copy floor",
                           "backward, 1 problems: geomean 3.00x PyTorch, tuned/default 1.00x, 2.00x the copy floor"]
    (tmp_path / "bench_rows.jsonl").write_text("")
    assert gpu_session.suite_figures(tmp_path, "a\nb\n") == ["a", "b"]

def test_a_gpus_grid_data_is_named_after_the_gpu():
    dispatch_grid = _script("dispatch_grid")
    assert dispatch_grid.device_slug(fake_cuda_device()) == "cuda_fake_gpu"


def test_records_tuned_on_a_gpu_are_exported_under_its_architecture(tmp_path):
    """A record tuned on a CUDA GPU (compute capability 9.0) goes to ``tuning_cache/cuda_sm_90.json``."""
    from pool_tuner import cache

    gpu_session = _script("gpu_session")
    shipped = json.loads((ROOT / "tuning_cache" / "pocl_cpu.json").read_text())
    record = next(iter(shipped["records"].values()))
    device = fake_cuda_device()
    record = dict(record, device=device.info.fingerprint, key=cache.cache_key(cache.problem_of(record), device))
    (tmp_path / "tune" / "cache").mkdir(parents=True)
    (tmp_path / "tune" / "cache" / cache.USER_FILE).write_text(
        json.dumps({"schema": shipped["schema"], "records": {record["key"]: record}}))
    figures = gpu_session.export_records(tmp_path / "tune", "tuned\n", tmp_path)
    assert figures[-1] == "1 records of Fake GPU merged into tuning_cache/cuda_sm_90.json"
    exported = json.loads((tmp_path / "tuning_cache" / "cuda_sm_90.json").read_text())["records"]
    assert list(exported) == [record["key"]] and exported[record["key"]]["device"] == device.info.fingerprint


def test_the_plan_fits_a_leases_budget_with_the_tuning_steps_last():
    """The fixed steps' timeouts, the start-up and the report's reserve leave the tuning steps at
    least ``MIN_TUNING_S`` of the budget, which leaves a lease's 600 s command 40 s for the install
    and the last step's stop; the tuning steps come last."""
    gpu_session = _script("gpu_session")
    for dry_run in (False, True):
        chosen = gpu_session.steps(Path("work"), dry_run=dry_run, jobs=2)
        assert gpu_session.plan_problem(chosen, gpu_session.BUDGET_S) is None, dry_run
        fixed = sum(step.timeout_s for step in chosen if step.share is None)
        assert fixed + gpu_session.START_UP_S + gpu_session.RESERVE_S + gpu_session.MIN_TUNING_S <= gpu_session.BUDGET_S
        assert gpu_session.BUDGET_S + gpu_session.STOP_GRACE_S <= 600 - 30
        tuning = [step.name for step in chosen if step.share is not None]
        assert tuning == ["dispatch_grid", "tune_float32", "tune_float16"]
        assert [step.name for step in chosen][-4:] == ["dispatch_grid", "derive_rules", "tune_float32", "tune_float16"]
    assert "more than the budget of 300 s" in gpu_session.plan_problem(chosen, 300)


def test_the_tuning_steps_are_cut_short_by_the_time_left():
    """A tuning step's timeout is its share of what is left after the fixed steps still to come;
    the last takes all of it; a fixed step keeps its own timeout unless less is left; a tuning step
    named by ``--timeout`` becomes fixed.  The grid's own budget follows its timeout."""
    gpu_session = _script("gpu_session")
    named = {step.name: step for step in gpu_session.steps(Path("work"), dry_run=False, jobs=2)}
    grid, last, tests = named["dispatch_grid"], named["tune_float16"], named["tests"]
    share = gpu_session.TUNING_SHARES["dispatch_grid"]
    assert gpu_session.step_timeout(grid, 115.0, 15.0) == pytest.approx(100.0 * share)
    assert gpu_session.step_timeout(grid, 215.0, 15.0) == pytest.approx(200.0 * share)  # more left: more time
    assert gpu_session.step_timeout(last, 40.0, 0.0) == 40.0
    assert gpu_session.step_timeout(tests, 500.0, 0.0) == gpu_session.TIMEOUTS["tests"]
    assert gpu_session.step_timeout(tests, 30.0, 0.0) == 30.0
    command = [str(part) for part in grid.command(70.0)]
    assert command[command.index("--budget") + 1] == str(70.0 - gpu_session.WIND_DOWN_S)
    fixed = {s.name: s for s in gpu_session.steps(Path("work"), dry_run=False, jobs=2, timeouts={"dispatch_grid": 200})}
    assert fixed["dispatch_grid"].share is None and fixed["dispatch_grid"].timeout_s == 200


def test_a_budget_the_plan_cannot_fit_is_refused_before_anything_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_session.py"), "--budget", "200", "--out",
                           str(tmp_path / "out"), "--work", str(tmp_path / "work")], check=False, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2 and "more than the budget of 200 s" in proc.stderr
    assert not list((tmp_path / "work").iterdir())
