"""The dispatch grid measured as the benchmark mode measures (``benchmarks/dispatch_grid.py
--measure``), the GPU's grid as data (``benchmarks/dispatch_grid/gpu_grid.json``), and the ``gpu``
rules derived from what one lease measures (``benchmarks/derive_rules.py``)."""

import json
import shutil
import threading
from pathlib import Path

import pytest
from conftest import load_benchmark
from test_default_rules import load_derive_rules, write_grid

from pool_tuner import cache, default_rules, kernel_source, measured, memo
from pool_tuner.backends import cuda
from pool_tuner.problem import Problem

ROOT = Path(__file__).resolve().parent.parent
COMPILE = cuda._compile  # the real one, before a fake replaces it
GPU_GRID = ROOT / "benchmarks" / "dispatch_grid" / "gpu_grid.json"
H100 = {"backend": "cuda", "name": "NVIDIA H100 80GB HBM3", "compute_capability": [9, 0], "multiprocessors": 132}


def load_dispatch_grid():
    return load_benchmark("dispatch_grid")


def tiny_grid(path: Path, directions=("forward",), regimes=("global",), shapes=((2, 4, 6, 6),)) -> Path:
    path.write_text(json.dumps({"crosses": [
        {"kinds": ["avg"], "directions": list(directions), "layouts": ["channels_first"], "regimes": list(regimes),
         "shapes": [list(s) for s in shapes], "dtypes": ["float32"]}]}))
    return path


def gpu_record(op: str, shape: tuple, size: tuple, direction: str, entries: list, device=H100) -> dict:
    """A measured grid record of ``op`` on ``device``: ``entries`` (variant, params, ms), several
    per variant as ``--measure`` keeps them, fastest first."""
    problem = Problem.create(op, shape, size, direction=direction)
    entries = sorted(({"variant": v, "params": p, "time_ms": ms} for v, p, ms in entries), key=lambda e: e["time_ms"])
    key = cache.make_key(problem, device, "0" * 64)
    fields = {"op": problem.op, "direction": problem.direction, "dtype": problem.dtype, "layout": problem.layout,
              "input_shape": list(problem.input_shape), "output_shape": list(problem.output_shape)}
    return {"key": key, "problem": fields, "device": device, "kernel_hash": "0" * 64, "best": entries[0],
            "runners_up": entries[1:], "measured": {"rounds": [3]}}


@pytest.fixture(autouse=True)
def memo_limit():
    """dispatch_grid --measure raises the process's memo limit: the tests' process gets it back."""
    limit = memo.limit()
    yield
    memo.set_limit(limit)


# ---------------------------------------------------------------------- the GPU grid as data

def test_the_gpu_grid_covers_what_the_gpu_rules_decide_within_a_lease():
    """Both directions and kinds, both layouts, global and windowed (uniform, non-uniform), few and
    many planes, float16 beside float32, and few enough problems for one lease's grid step."""
    dispatch_grid = load_dispatch_grid()
    entries = dispatch_grid.grid_from_file(GPU_GRID)
    problems = [dispatch_grid.problem_of(entry) for entry in entries]
    assert len(set(problems)) == len(problems) <= 64
    features = [default_rules.features(p) for p in problems]
    for feature, values in {"direction": {"forward", "backward"}, "kind": {"avg", "max"},
                            "layout": {"channels_first", "channels_last"},
                            "problem_class": {"global", "uniform", "non-uniform"}}.items():
        assert values <= {f[feature] for f in features}, feature
    assert {p.dtype for p in problems} == {"float32", "float16"}
    assert min(f["planes"] for f in features) <= 16 and max(f["planes"] for f in features) >= 8192
    for direction in ("forward", "backward"):  # enough for the derivation to split each direction
        assert sum(f["direction"] == direction for f in features) >= 4 * load_derive_rules().MIN_LEAF


def test_a_grid_file_with_an_unknown_regime_is_refused(tmp_path):
    dispatch_grid = load_dispatch_grid()
    with pytest.raises(ValueError, match="regime 'tiled' is none of"):
        dispatch_grid.grid_from_file(tiny_grid(tmp_path / "grid.json", regimes=("tiled",)))


# ---------------------------------------------------------------------- --measure on the default device

def test_measure_keeps_every_variants_neighbourhood_and_a_rerun_skips_what_is_done(tmp_path, capsys):
    dispatch_grid = load_dispatch_grid()
    grid_file = tiny_grid(tmp_path / "grid.json")
    root = tmp_path / "data"
    arguments = ["--measure", "--grid-file", str(grid_file), "--data-root", str(root),
                 "--variants", "thread_per_output,global_planes"]
    assert dispatch_grid.main(arguments) == 0
    [records_file] = root.glob("*/records.json")
    [record] = json.loads(records_file.read_text())["records"].values()
    assert cache.is_measured(record) and not cache.is_partial(record) and record["measured"]["rounds"][0] >= 3
    entries = [record["best"]] + record["runners_up"]
    assert {e["variant"] for e in entries} == {"thread_per_output", "global_planes"}
    for variant in ("thread_per_output", "global_planes"):  # its rule configuration and its changes
        assert sum(e["variant"] == variant for e in entries) > 1, variant
    assert all(e["time_ms"] > 0 and e["stage"] == "neighbourhoods" for e in entries)
    capsys.readouterr()
    assert dispatch_grid.main(arguments) == 0
    assert "1 grid problems, 0 to measure" in capsys.readouterr().out


def test_a_problem_whose_measurement_fails_is_said_and_the_grid_goes_on(tmp_path, capsys, monkeypatch):
    dispatch_grid = load_dispatch_grid()
    grid_file = tiny_grid(tmp_path / "grid.json", shapes=((2, 4, 6, 6), (2, 4, 5, 5)))
    real = measured.measure_neighbourhoods

    def first_fails(problem, device, variants=None):
        if problem.input_shape == (2, 4, 6, 6):
            raise RuntimeError("a device error")
        return real(problem, device, variants=variants)

    monkeypatch.setattr(measured, "measure_neighbourhoods", first_fails)
    assert dispatch_grid.main(["--measure", "--grid-file", str(grid_file), "--data-root", str(tmp_path / "data"),
                               "--variants", "thread_per_output"]) == 0
    [records_file] = (tmp_path / "data").glob("*/records.json")
    [record] = json.loads(records_file.read_text())["records"].values()
    assert record["problem"]["input_shape"] == [2, 4, 5, 5]
    assert "failed (RuntimeError: a device error); going on" in capsys.readouterr().err


# ---------------------------------------------------------------------- --measure on a fake GPU

@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A fake CUDA device (tests/cuda_fakes.py) whose "compiler" records each program it is given."""
    from cuda_fakes import forget_fake_gpu, install_fake_gpu

    from pool_tuner.backends import cuda

    monkeypatch.setenv("POOL_TUNER_CACHE_DIR", str(tmp_path / "user_cache"))
    device, _, driver = install_fake_gpu(monkeypatch)
    compiled = []
    monkeypatch.setattr(cuda, "_compile", lambda source, arch: compiled.append(source) or b"cubin:" + source.encode())
    yield device, driver, compiled
    forget_fake_gpu()


def test_on_a_gpu_each_problem_is_one_program_of_every_configuration_timed_by_events(fake_gpu, tmp_path):
    _, driver, compiled = fake_gpu
    dispatch_grid = load_dispatch_grid()
    grid_file = tiny_grid(tmp_path / "grid.json", directions=("forward", "backward"), shapes=((2, 4, 8, 8),))
    root = tmp_path / "data"
    assert dispatch_grid.main(["--device", "cuda:0", "--measure", "--grid-file", str(grid_file),
                               "--data-root", str(root), "--compile-ahead", "0"]) == 0
    records = json.loads((root / "cuda_fake_gpu" / "records.json").read_text())["records"].values()
    assert len(records) == 2 and len(compiled) == 2, "one compile per problem, every configuration in it"
    for record in records:
        entries = [record["best"]] + record["runners_up"]
        assert len(entries) > len({e["variant"] for e in entries}) > 1, "every variant and its changes"
        assert record["device"]["name"] == "Fake GPU" and not record["failures"]
        direction = cache.problem_of(record).direction
        [program] = [s for s in compiled if f"#define pool_{direction} pool_{direction}_0" in s]
        assert program.count(f"#define pool_{direction} pool_{direction}_") >= len(entries)
    assert driver.events > 0, "timed by the driver's events"
    modules = {driver.function_modules[launch["function"]] for launch in driver.launches}
    assert len(modules) == 2


def test_the_next_problems_programs_are_compiled_ahead_into_the_compilers_cache(fake_gpu, tmp_path, monkeypatch):
    """The programs compiled ahead, in other threads, are the ones the problems' builds ask for: a
    measuring run after them finds every program in the compiler's cache and runs nvcc no more.
    Compiling ahead while measuring runs nvcc once per problem, in whichever thread reaches a
    program first (a build that gets there before the ahead thread compiles it itself, and the
    ahead thread then waits on the program's lock and finds it built)."""
    from pool_tuner.backends import cuda, cuda_compile

    monkeypatch.setattr(cuda, "_compile", COMPILE)  # the real cache in front of a counting "nvcc"
    runs = []
    monkeypatch.setattr(cuda_compile, "compile_source", lambda source, arch, nvcc, options=None: runs.append(
        (threading.current_thread().name, source)) or source.encode())
    monkeypatch.setattr(cuda, "find_nvcc", lambda nvcc=None: shutil.which("true") or "/bin/true")
    dispatch_grid = load_dispatch_grid()
    grid_file = tiny_grid(tmp_path / "grid.json", directions=("forward", "backward"), regimes=("global", "uniform"),
                          shapes=((2, 4, 8, 8),))

    def measure(name: str, threads: int) -> None:
        monkeypatch.setenv("POOL_TUNER_CACHE_DIR", str(tmp_path / name))  # the cubins under it: a cold cache
        assert dispatch_grid.main(["--device", "cuda:0", "--measure", "--grid-file", str(grid_file),
                                   "--data-root", str(tmp_path / name / "data"), "--compile-ahead", str(threads)]) == 0
        assert len(json.loads((tmp_path / name / "data" / "cuda_fake_gpu" / "records.json").read_text())["records"]) == 4

    measure("while_measuring", threads=2)
    assert len(runs) == 4 and len({source for _, source in runs}) == 4, "nvcc once per problem"

    runs.clear()
    monkeypatch.setenv("POOL_TUNER_CACHE_DIR", str(tmp_path / "ahead_first"))
    dispatch_grid.compile_ahead(fake_gpu[0], dispatch_grid.grid_from_file(grid_file), None, 2).shutdown(wait=True)
    assert len(runs) == 4 and all(name.startswith("compile_ahead") for name, _ in runs), runs
    measure("ahead_first", threads=0)
    assert len(runs) == 4, "every problem's build found its program compiled ahead"


def test_a_neighbourhood_larger_than_the_memo_is_refused_before_anything_is_built(fake_gpu):
    """Its kernels would be evicted between the one build and the race, and built again one
    program (one nvcc run) each."""
    device, driver, compiled = fake_gpu
    problem = Problem.create("adaptive_avg_pool2d", (2, 4, 8, 8), (1, 1))
    memo.set_limit(8)
    with pytest.raises(ValueError, match="more than the memo's limit of 8 holds: raise it"):
        measured.measure_neighbourhoods(problem, device)
    assert compiled == [] and driver.launches == []


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_nvcc_compiles_a_gpu_grid_problems_one_program(fake_gpu):
    """The fake compiles anything; nvcc checks that the program of a GPU grid problem's whole
    neighbourhood is CUDA it accepts, with every configuration's kernel under its own name."""
    from pool_tuner.backends import cuda, cuda_compile

    device = fake_gpu[0]
    dispatch_grid = load_dispatch_grid()
    problem = dispatch_grid.problem_of(next(e for e in dispatch_grid.grid_from_file(GPU_GRID)
                                            if e[3] == "NHWC" and e[4] == "forward" and e[5] == "float16"))
    choices = measured.neighbourhoods(problem, device)
    kernel_name = choices[0].variant.kernel_name
    source = kernel_source.render_together([c.variant.program(c.config, problem) for c in choices], kernel_name)
    cubin = cuda_compile.compile_source(source, "sm_90", cuda.find_nvcc())
    assert len(choices) > 10
    for position in range(len(choices)):
        assert kernel_source.together_name(kernel_name, position).encode() in cubin


# ---------------------------------------------------------------------- the gpu rules from one lease

def lease_grid() -> list:
    """What one lease's grid might hold: forward problems where global_planes is fastest on
    global pooling and thread_per_output elsewhere (global_planes cannot run those), each variant at
    several configurations, fastest first as ``--measure`` writes them; backward problems where
    plane_scatter wins."""
    records = []
    for side in (8, 12, 16, 20, 24):
        records.append(gpu_record("adaptive_avg_pool2d", (32, 64, side, side), (1, 1), "forward", [
            ("thread_per_output", {"block_size_x": 128}, 4.0), ("global_planes", {"block_size_x": 64}, 3.0),
            ("global_planes", {"block_size_x": 256}, 1.0), ("thread_per_output", {"block_size_x": 256}, 5.0)]))
        records.append(gpu_record("adaptive_avg_pool2d", (32, 64, side, side), (side // 4, side // 4), "forward", [
            ("thread_per_output", {"block_size_x": 128}, 1.0), ("thread_per_output", {"block_size_x": 256}, 1.5)]))
        records.append(gpu_record("adaptive_avg_pool2d", (32, 64, side, side), (side // 4, side // 4), "backward", [
            ("thread_per_input", {}, 2.0), ("plane_scatter", {}, 1.0)]))
    return records


def test_a_variants_time_is_that_of_its_fastest_configuration():
    derive_rules = load_derive_rules()
    sample = derive_rules.Sample(lease_grid()[0])
    assert sample.times == {"thread_per_output": 4.0, "global_planes": 1.0}
    assert sample.params["global_planes"] == {"block_size_x": 256}


def test_the_gpu_rules_from_one_lease_replace_the_unmeasured_ones_and_name_the_device(tmp_path, capsys):
    """The shipped gpu rules are guesses written by hand before any GPU grid ("by hand, not
    measured"): they would decide every grid problem and leave the derivation nothing; the grid's
    rules replace them, the multi-level ones are kept, and --check holds the result to the data."""
    derive_rules = load_derive_rules()
    grid = write_grid(tmp_path / "cuda_nvidia_h100_80gb_hbm3", lease_grid())
    out = tmp_path / "rules.json"
    assert derive_rules.main(["--data-dir", str(grid), "--device-type", "gpu", "--rules-out", str(out)]) == 0
    gpu = json.loads(out.read_text())["devices"]["gpu"]
    assert gpu["derived_from"] == "benchmarks/dispatch_grid/cuda_nvidia_h100_80gb_hbm3/records.json"
    assert gpu["device"] == ["NVIDIA H100 80GB HBM3"] and gpu["problems"] == 15
    single = [r for r in gpu["rules"] if "levels" not in r["when"]]
    assert not any(r["evidence"].startswith(derive_rules.UNMEASURED) for r in single)
    assert [r["variant"] for r in single] == ["global_planes", "thread_per_output", "plane_scatter",
                                              "thread_per_input"]
    assert single[0]["when"] == {"direction": "forward", "problem_class": "global"}
    assert single[0]["config"] == {"block_size_x": 256}
    shipped = json.loads(default_rules.RULES_FILE.read_text())["devices"]["gpu"]["rules"]
    assert gpu["rules"][len(single):] == [r for r in shipped if "levels" in r["when"]]
    assert default_rules.parse({"devices": {"gpu": gpu}})["gpu"]
    # --check against that rules file as the shipped one
    rules_file = default_rules.RULES_FILE
    try:
        default_rules.RULES_FILE = out
        assert derive_rules.main(["--check", "--device-type", "gpu", "--data-dir", str(grid)]) == 0
    finally:
        default_rules.RULES_FILE = rules_file


def test_too_little_data_gives_unsplit_rules_and_says_so(tmp_path, capsys):
    derive_rules = load_derive_rules()
    few = write_grid(tmp_path / "cuda_few", lease_grid()[:2])
    out = tmp_path / "rules.json"
    assert derive_rules.main(["--data-dir", str(few), "--device-type", "gpu", "--rules-out", str(out)]) == 0
    report = capsys.readouterr().out
    assert "forward: 2 grid problems, fewer than 8: one rule for them all, no split" in report
    assert "backward: no grid problems: only the fallback rule (thread_per_input)" in report
    single = [r for r in json.loads(out.read_text())["devices"]["gpu"]["rules"] if "levels" not in r["when"]]
    assert [(r["when"], r["variant"]) for r in single] == [
        ({"direction": "forward"}, "global_planes"), ({"direction": "forward"}, "thread_per_output"),
        ({"direction": "backward"}, "thread_per_input")]
    empty = write_grid(tmp_path / "cuda_none", [])
    assert derive_rules.main(["--data-dir", str(empty), "--device-type", "gpu", "--rules-out", str(out)]) == 1
    assert "no finished grid problems" in capsys.readouterr().err


@pytest.mark.parametrize("device_type", sorted(
    name for name, entry in json.loads(default_rules.RULES_FILE.read_text())["devices"].items()
    if entry.get("derived_from")))
def test_every_shipped_derived_rule_list_is_what_its_grids_derive(device_type):
    """The gpu rules too, once a lease has derived them from a grid shipped in the checkout."""
    assert load_derive_rules().main(["--check", "--device-type", device_type]) == 0


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_grid_nvcc_cost_times_nvcc_on_a_grid_problems_program(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    script = load_benchmark("grid_nvcc_cost")
    assert script.main(["--sizes", "2", "--repeat", "1", "--problem", "1"]) == 0
    out = capsys.readouterr().out
    assert "62 problems, " in out and "2 configurations in one program: " in out
