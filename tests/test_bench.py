"""`pool-tuner bench` end to end on the cheapest suite shape: JSON, plot and table."""

import dataclasses
import json
import sys
import time

import pytest

import pool_tuner as pt
from pool_tuner import backends, bench, cli
from pool_tuner.backends import opencl


def test_bench_writes_json_plot_and_table(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    status = cli.main(["bench", "--preset", "upsample_area", "--repeat", "2", "--out", str(tmp_path), "--quiet"])
    assert status == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.png").stat().st_size > 1000
    assert list(report["memory_gbs"]) == list(bench.STREAMS)
    before, after = report["memory_gbs_before_and_after"]
    assert report["memory_gbs"] == {name: max(before[name], after[name]) for name in bench.STREAMS}
    assert all(gbs > 0 for gbs in report["memory_gbs"].values())
    assert report["copy_gbs"] == max(report["memory_gbs"][name] for name in bench.COPY_METHODS)
    assert report["method"]["loop_s"] == bench.LOOP_S and "back to back" in report["method"]["timing"]
    device = backends.default_device()
    assert report["runtime_note"] == (f"PoCL: {opencl.pocl_affinity()}" if device.is_pocl and device.info.is_cpu else None)
    rows = report["rows"]
    assert [r["direction"] for r in rows] == ["forward", "backward"]
    for r in rows:
        assert r["input_shape"] == [16, 64, 5, 5] and r["output_shape"] == [16, 64, 7, 7]
        assert r["tuned_ms"] > 0 and r["default_ms"] > 0 and r["torch_ms"] > 0
        for calls in (r["tuned_calls"], r["default_calls"], r["torch_calls"]):
            assert bench.MIN_CALLS <= calls <= bench.MAX_CALLS
        assert r["speedup_vs_torch"] == pytest.approx(r["torch_ms"] / r["tuned_ms"])
        assert r["times_floor"] == pytest.approx(r["tuned_ms"] / r["floor_ms"])
        assert r["bytes_read"] + r["bytes_written"] == r["bytes_moved"]
        streams = report["memory_gbs"]
        assert r["stream_floor_ms"] == pytest.approx(max(r["floor_ms"], r["bytes_read"] / streams["read_kernel"] / 1e6,
                                                         r["bytes_written"] / streams["write_kernel"] / 1e6))
        assert r["times_stream_floor"] == pytest.approx(r["tuned_ms"] / r["stream_floor_ms"])
    assert set(report["summary"]) == {"forward", "backward"}
    table = capsys.readouterr().out
    assert "upsample_area 16x64x5x5->16x64x7x7" in table and "geomean" in table
    assert "pool_tuner ms" in table and "PyTorch ms" in table and "x stream floor" in table
    assert f"copy bandwidth {report['copy_gbs']:.1f} GB/s" in table
    assert f"suite: buffer_copy {report['memory_gbs']['buffer_copy']:.1f}, " in table
    if report["runtime_note"]:
        assert report["runtime_note"] in table.splitlines()


def test_a_bench_cut_off_part_way_keeps_the_problems_it_finished(tmp_path, monkeypatch, capsys):
    """The first H100 lease's suite steps were killed at their timeouts having written nothing:
    each row is in bench_rows.jsonl, and its line on stderr, as soon as it is measured."""
    measured = []
    real_measure = bench.measure

    def measure_then_die(*args, **kwargs):
        if measured:
            raise KeyboardInterrupt("the step's timeout")
        measured.append(real_measure(*args, **kwargs))
        return measured[-1]

    monkeypatch.setattr(bench, "measure", measure_then_die)
    status = cli.main(["bench", "--preset", "upsample_area", "--repeat", "1", "--stream-mib", "1", "--out",
                       str(tmp_path)])
    assert status != 0
    assert not (tmp_path / "bench.json").exists()
    [row] = [json.loads(line) for line in (tmp_path / bench.ROWS_FILE).read_text().splitlines()]
    assert row["name"] == "upsample_area" and row["direction"] == "forward" and row["input_shape"] == [16, 64, 5, 5]
    assert row["tuned_ms"] == measured[0].tuned_ms and row["speedup_vs_torch"] == pytest.approx(
        measured[0].torch_ms / measured[0].tuned_ms)
    assert row["floor_ms"] > 0
    line = f"upsample_area 16x64x5x5->16x64x7x7 forward: pool_tuner {measured[0].tuned_ms:.4f} ms"
    assert line in capsys.readouterr().err


def test_bytes_moved_counts_reads_writes_and_indices():
    from pool_tuner.problem import Problem

    avg = Problem.create("adaptive_avg_pool2d", (2, 3, 10, 9), (4, 7))
    assert avg.bytes_moved() == (2 * 3 * 10 * 9 + 2 * 3 * 4 * 7) * 4
    mx = Problem.create("adaptive_max_pool2d", (2, 3, 10, 9), (4, 7))
    assert mx.bytes_moved() == avg.bytes_moved() + 2 * 3 * 4 * 7 * 8
    inputs, outputs, indices = 2 * 3 * 10 * 9 * 4, 2 * 3 * 4 * 7 * 4, 2 * 3 * 4 * 7 * 8
    assert avg.bytes_read_written() == (inputs, outputs)
    assert mx.bytes_read_written() == (inputs, outputs + indices)
    backward = Problem.create("adaptive_max_pool2d", (2, 3, 10, 9), (4, 7), direction="backward")
    assert backward.bytes_read_written() == (outputs + indices, inputs)
    assert bench.geomean([1.0, 4.0]) == pytest.approx(2.0)


def test_scripts_in_benchmarks_run(tmp_path):
    """The scripts in benchmarks/ run to the end on the default device and print their reports
    (a smoke test: tiny repeat counts, nothing timed is asserted)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "call_overhead.py"
    if not script.exists():
        pytest.skip("benchmarks/ is not beside the tests (installed package)")
    env = dict(os.environ, POOL_TUNER_CACHE_DIR=str(tmp_path / "cache"))
    report = tmp_path / "call_overhead.json"
    done = subprocess.run([sys.executable, str(script), "--rounds", "2", "--loop-ms", "1", "--shapes", "1x8x4x4:1",
                           "--out", str(report)], capture_output=True, text=True, timeout=120, check=True,
                          cwd=tmp_path, env=env)
    assert re.search(r"^floor: bare launch\+wait +[\d.]+ \(", done.stdout, re.M), done.stdout
    (shape,) = json.loads(report.read_text())["shapes"]
    assert shape["calls"]["numpy API avg"]["us"]["median"] > 0
    assert shape["calls"]["floor: bare launch+wait"]["times_floor"]["of_medians"] == 1.0

    script = script.with_name("variant_timings.py")
    done = subprocess.run([sys.executable, str(script), "--repeat", "1"], capture_output=True, text=True,
                          timeout=300, check=True, cwd=tmp_path, env=env)
    timed = re.findall(r"^  (\w+) +([\d.]+) ms", done.stdout, re.M)
    names = {name for name, _ in timed}
    assert "thread_per_output" in names and names <= set(pt.variants("adaptive_avg_pool2d")), done.stdout
    assert all(float(ms) > 0 for _, ms in timed)


CALL_PATH_SCRIPTS = {
    # script: (tiny arguments, exit statuses allowed, a key of its JSON report)
    "first_call.py": (["--new", "2", "--rounds", "1", "--loop-ms", "1"], (0,), "results"),
    "memory_growth.py": (["--shapes", "4", "--every", "2"], (0,), "results"),
    # a checker: exit 1 reports failures found, which is its job, not the script's failure
    "threads_fork.py": (["--runs", "1", "--threads", "2", "--calls", "8", "--fork-timeout", "10"], (0, 1), "failed"),
    "models.py": (["--models", "resnet50", "--cases", "infer_b1", "--rounds", "1", "--loop-s", "0.01", "--control"], (0,),
                  "models"),
    "first_call.py --model": (["--model", "mobilenet_v3_small", "--new", "1", "--pocl-cache", "off"], (0,), "results"),
}
#: The scripts that time torchvision models.
NEED_TORCHVISION = ("models.py", "first_call.py --model")


@pytest.mark.parametrize("name", sorted(CALL_PATH_SCRIPTS))
def test_call_path_scripts_run(tmp_path, name):
    """The call-path benchmarks of benchmarks/ (docs/benchmarks.md) run to the end with tiny settings
    and write their JSON reports (a smoke test: nothing measured is asserted)."""
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / name.split()[0]
    if not script.exists():
        pytest.skip("benchmarks/ is not beside the tests (installed package)")
    if name in NEED_TORCHVISION:
        pytest.importorskip("torchvision")
    arguments, statuses, key = CALL_PATH_SCRIPTS[name]
    report = tmp_path / "report.json"
    env = dict(os.environ, POOL_TUNER_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, str(script), *arguments, "--out", str(report)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env=env)
    assert done.returncode in statuses, done.stdout + done.stderr
    assert key in json.loads(report.read_text()), done.stdout


def test_memory_bandwidth_times_every_stream_and_checks_its_work(monkeypatch):
    device = backends.default_device()
    streams = bench.memory_bandwidth(device, nbytes=1 << 20, repeat=1)
    assert list(streams) == list(bench.STREAMS) and all(gbs > 0 for gbs in streams.values())
    from pool_tuner import kernel_source

    source = kernel_source.read("bandwidth.cl")
    for broken, stream in (("dst[i] = src[i];", "copy_kernel"), ("run += vload8", "read_kernel")):
        assert broken in source
        wrong = source.replace(broken, {"copy_kernel": "dst[i] = src[i] + 1.0f;", "read_kernel": "run -= vload8"}[stream])
        monkeypatch.setattr(kernel_source, "read", lambda name, wrong=wrong: wrong)
        with pytest.raises(RuntimeError, match=f"the benchmark's {stream} did not do its work"):
            bench.memory_bandwidth(device, nbytes=1 << 20, repeat=1)


def test_stream_buffers_fit_the_device_and_stay_small_on_simulators():
    from types import SimpleNamespace

    def device(simulator, alloc, memory):
        return SimpleNamespace(info=SimpleNamespace(is_simulator=simulator, max_allocation_bytes=alloc, memory_bytes=memory))

    unit = bench.READ_RUN * 256
    big = 2**40
    assert bench._stream_elements(device(False, big, big), bench.STREAM_BYTES, unit) * 4 == bench.STREAM_BYTES
    assert bench._stream_elements(device(True, big, big), bench.STREAM_BYTES, unit) * 4 == bench.SIMULATOR_STREAM_BYTES
    assert bench._stream_elements(device(False, 2**27, big), bench.STREAM_BYTES, unit) * 4 == 2**27
    assert bench._stream_elements(device(False, big, 2**28), bench.STREAM_BYTES, unit) * 4 == 2**26
    assert bench._stream_elements(device(False, big, big), 1000, unit) == unit  # at least one unit


def synthetic_report():
    """A report of two rows as ``run`` makes it, without running anything."""
    streams = {"buffer_copy": 10.0, "copy_kernel": 20.0, "copy_kernel_streaming": 25.0, "read_kernel": 15.0,
               "write_kernel": 12.0}
    rows = [bench.Row("upsample_area", "adaptive_avg_pool2d", direction, [16, 64, 5, 5], [16, 64, 7, 7], 3_000_000,
                      1_000_000, 2_000_000, tuned, default, torch_ms, 10, 10, 10, "cache", "thread_per_row",
                      {"block_size_x": 16})
            for direction, tuned, default, torch_ms in (("forward", 0.12, 0.2, 0.3), ("backward", 0.4, 0.4, 0.2))]
    report_rows = [dict(dataclasses.asdict(r), **r.derived(streams)) for r in rows]
    summary = {r["direction"]: {"geomean_speedup_vs_torch": r["speedup_vs_torch"], "geomean_times_floor": r["times_floor"],
                                "geomean_times_stream_floor": r["times_stream_floor"],
                                "geomean_tuned_vs_default": r["tuned_vs_default"], "min_fraction_of_copy_at_64MB": None}
               for r in report_rows}
    return {"date": "2026-11-23T00:00:00+00:00", "device": "opencl:0:0 test", "torch": {"version": "2"},
            "copy_gbs": bench.copy_bandwidth(streams), "memory_gbs": streams, "runtime_note": None,
            "rows": report_rows, "summary": summary}


def test_table_keeps_the_batch_and_has_readable_headers_and_a_legend():
    table = bench.format_table(synthetic_report())
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("shape"))
    for column in ("pass", "pool_tuner ms", "PyTorch ms", "vs PyTorch", "GB/s", "% of copy", "x floor",
                   "x stream floor", "tuned vs default", "kernel"):
        assert column in header
    for cryptic in ("%copy", "xfloor", "xstream", "vs dflt", "ours ms"):
        assert cryptic not in header
    forward = next(line for line in lines if " forward " in line)
    assert forward.startswith("upsample_area 16x64x5x5->16x64x7x7 ")
    assert forward.split()[2:7] == ["forward", "0.120", "0.300", "2.50x", f"{3_000_000 / 0.12e-3 / 1e9:.2f}"]
    legend = table.split("\n\n", 1)[1]
    for column in ("pool_tuner ms, PyTorch ms:", "vs PyTorch:", "GB/s:", "% of copy:", "x floor:", "x stream floor:",
                   "tuned vs default:", "kernel:"):
        assert column in legend


def test_plot_shows_milliseconds_full_labels_and_both_floors(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    shown = {}
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kwargs: shown.update(figure=fig, kwargs=kwargs))
    report = synthetic_report()
    bench.plot(report, tmp_path / "bench.png")
    (ax,) = shown["figure"].axes
    assert "milliseconds" in ax.get_ylabel()
    heights = sorted(round(bar.get_height(), 6) for bar in ax.patches)
    assert heights == sorted([0.12, 0.3, 0.4, 0.2])
    labels = [label.get_text() for label in ax.get_xticklabels()]
    assert labels[0].split("\n") == ["upsample_area", "16x64x5x5", "-> 16x64x7x7", "forward"]
    assert labels[1].endswith("backward")
    floors = {c.get_label(): c for c in ax.collections}
    stream = floors["stream floor (reads, writes alone)"]
    assert stream.get_linewidth()[0] >= 3 and len(stream.get_segments()) == 2
    (y0, y1), = {tuple(seg[:, 1]) for seg in stream.get_segments()[:1]}
    assert y0 == y1 == pytest.approx(report["rows"][0]["stream_floor_ms"])
    assert len(floors["copy floor"].get_segments()) == 2
    assert shown["kwargs"].get("bbox_inches") == "tight"  # labels are never cut off


def test_bench_without_torch_says_how_to_install_it_before_any_work(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    monkeypatch.setattr(bench, "memory_bandwidth", lambda *a, **k: pytest.fail("bench ran without torch"))
    monkeypatch.setattr(backends, "resolve_device", lambda *a, **k: pytest.fail("bench ran without torch"))
    assert cli.main(["bench", "--preset", "upsample_area", "--repeat", "1"]) == cli.EXIT_ERROR
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "needs it installed" in line and 'pip install "pool-tuner[bench]"' in line


def test_bench_help_says_torch_is_needed(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    assert 'pip install "pool-tuner[bench]"' in " ".join(capsys.readouterr().out.split())


class _RecordingCandidate:
    """Records the order of its calls and waits."""

    def __init__(self, seconds_per_call=0.0):
        self.events, self.seconds_per_call = [], seconds_per_call

    def call(self):
        self.events.append("call")
        time.sleep(self.seconds_per_call)

    def wait(self):
        self.events.append("wait")


def test_a_timed_loop_makes_its_calls_back_to_back_and_waits_once():
    recorder = _RecordingCandidate(0.002)
    ms = bench.time_loop(bench.Candidate(recorder.call, recorder.wait), 5)
    assert recorder.events == ["call"] * 5 + ["wait"]
    assert 2.0 <= ms < 50.0  # per call, not per loop


def test_calls_per_loop_fill_the_loop_time_within_bounds():
    slow = _RecordingCandidate(bench.LOOP_S)
    assert bench.calls_per_loop(bench.Candidate(slow.call, slow.wait)) == bench.MIN_CALLS
    assert bench.calls_per_loop(bench.Candidate(lambda: None, lambda: None)) == bench.MAX_CALLS
    medium = _RecordingCandidate(bench.LOOP_S / 10)
    assert 5 <= bench.calls_per_loop(bench.Candidate(medium.call, medium.wait)) <= 10


def test_the_suite_has_untuned_shapes_that_no_preset_tunes():
    from pool_tuner import presets

    tuned = {(op, shape, out) for op, shape, out in presets.preset_shapes("all")}
    default = bench.suite()
    untuned = [(op, shape, out) for name, op, shape, out in default if name == presets.UNTUNED_NAME]
    assert untuned == presets.UNTUNED and not tuned & set(untuned)
    assert {(op, shape, out) for name, op, shape, out in default if name != presets.UNTUNED_NAME} == tuned
    assert [row[0] for row in bench.suite(["untuned"])] == [presets.UNTUNED_NAME] * len(presets.UNTUNED)
    with pytest.raises(ValueError, match="preset must be one of .*'untuned'.*got 'resnet'"):
        bench.suite(["resnet"])


def test_bench_runs_the_suite_in_float16_and_refuses_what_numpy_cannot_make(monkeypatch):
    from pool_tuner.problem import Problem

    streams = synthetic_report()["memory_gbs"]
    monkeypatch.setattr(bench, "memory_bandwidth", lambda device, **stream_options: streams)
    report = bench.run(["upsample_area"], ("forward", "backward"), repeat=1, dtype="float16")
    assert report["dtype"] == "float16" and [r["direction"] for r in report["rows"]] == ["forward", "backward"]
    for row in report["rows"]:
        sizes = row["output_shape"][2:]
        problems = [Problem.create(row["op"], row["input_shape"], sizes, dtype, direction=row["direction"])
                    for dtype in ("float16", "float32")]
        assert row["bytes_moved"] == problems[0].bytes_moved() < problems[1].bytes_moved()
        assert row["tuned_ms"] > 0 and row["torch_ms"] > 0
    monkeypatch.setattr(bench, "memory_bandwidth", lambda *a, **k: pytest.fail("bench ran with a bad dtype"))
    with pytest.raises(ValueError, match="dtype must be one of float32, float16, float64.*got 'bfloat16'"):
        bench.run(["upsample_area"], ("forward",), repeat=1, dtype="bfloat16")


def test_untuned_shapes_get_their_own_geomeans(monkeypatch):
    from pool_tuner import presets

    report = synthetic_report()
    streams = report["memory_gbs"]
    monkeypatch.setattr(bench, "memory_bandwidth", lambda device, **stream_options: streams)

    def measure(name, op, shape, output_size, direction, device, repeat, rng, tune_here=False, dtype="float32"):
        speed = 2.0 if name == presets.UNTUNED_NAME else 8.0
        return bench.Row(name, op, direction, list(shape), list(shape), 1000, 500, 500, 1.0, 1.0, speed, 3, 3, 3,
                         "default", "thread_per_output", {})

    monkeypatch.setattr(bench, "measure", measure)
    report = bench.run(["upsample_area", "untuned"], ("forward",), repeat=1)
    assert set(report["summary"]) == {"forward", "forward, untuned shapes"}
    assert report["summary"]["forward"]["geomean_speedup_vs_torch"] == pytest.approx(8.0)
    assert report["summary"]["forward, untuned shapes"]["geomean_speedup_vs_torch"] == pytest.approx(2.0)
    assert "forward, untuned shapes: geomean 2.00x vs PyTorch" in bench.format_table(report)


def test_global_pooling_gets_its_own_geomeans(monkeypatch):
    """Rows whose every output size is 1, suite and untuned shapes alike, are summarised apart too."""
    report = synthetic_report()
    streams = report["memory_gbs"]
    monkeypatch.setattr(bench, "memory_bandwidth", lambda device, **stream_options: streams)

    def measure(name, op, shape, output_size, direction, device, repeat, rng, tune_here=False, dtype="float32"):
        out = list(shape[:2]) + [1 if s == 1 else s for s in output_size]
        speed = 4.0 if set(output_size) == {1} else 1.0
        return bench.Row(name, op, direction, list(shape), out, 1000, 500, 500, 1.0, 1.0, speed, 3, 3, 3,
                         "default", "thread_per_output", {})

    monkeypatch.setattr(bench, "measure", measure)
    report = bench.run(["resnet50_head", "vgg16_256px", "untuned"], ("forward",), repeat=1)
    assert report["summary"]["forward, global pooling"]["geomean_speedup_vs_torch"] == pytest.approx(4.0)
    assert report["summary"]["forward"]["geomean_speedup_vs_torch"] == pytest.approx(2.0)
    assert "forward, global pooling: geomean 4.00x vs PyTorch" in bench.format_table(report)


def test_tune_here_times_the_winner_of_a_tuning_in_the_run_beside_dispatch(monkeypatch, user_cache):
    """``bench --tune-untuned``'s fourth candidate: the shape tuned in the run (a small budget here),
    not stored, its winner timed and compared with the dispatched kernel."""
    import functools

    import numpy as np

    from pool_tuner import cache, tuner
    from pool_tuner.problem import Problem

    pytest.importorskip("torch")
    monkeypatch.setattr(bench, "TUNE_HERE_BUDGET", {"strategy": "random_sample", "max_fevals": 2, "time_limit": 4})
    monkeypatch.setattr(tuner, "tune", functools.partial(tuner.tune, variants=["thread_per_output", "thread_per_row"]))
    device = backends.default_device()
    row = bench.measure("untuned", "adaptive_avg_pool2d", (2, 8, 10, 9), (4, 7), "forward", device, 2,
                        np.random.default_rng(), tune_here=True)
    assert row.tuned_here_variant in ("thread_per_output", "thread_per_row") and row.tuned_here_ms > 0
    derived = row.derived({name: 10.0 for name in bench.STREAMS})
    assert derived["dispatched_vs_tuned_here"] == pytest.approx(row.tuned_here_ms / row.tuned_ms)
    problem = Problem.create("adaptive_avg_pool2d", (2, 8, 10, 9), (4, 7))
    assert dispatch_tables_hold_no_record(problem, device, cache)


def dispatch_tables_hold_no_record(problem, device, cache) -> bool:
    from pool_tuner import dispatch

    return dispatch.tuning_cache().lookup(cache.cache_key(problem, device)) is None


def test_read_kernel_reads_at_least_the_bytes_asked_for():
    """held_back.py's ``read`` column: a call that reads every element of a buffer of at least the
    given size (``read_kernel`` checks the sums when it makes it: a read that did not read would
    raise), and runs again as a timed candidate."""
    device = backends.default_device()
    candidate = bench.read_kernel(device, 100_000)
    candidate.call()
    candidate.wait()


def test_held_back_times_the_problem_its_calls_make(tmp_path):
    """A channels-last global layer's backward call reads its grad_out (one value per plane,
    contiguous either way) as channels-first: held_back.py's ``rules`` must be what dispatch decides
    for that problem, not for the layer's nominal channels-last one (a variant no call runs)."""
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "held_back.py"
    if not script.exists():
        pytest.skip("benchmarks/ is not beside the tests (installed package)")
    report = tmp_path / "report.json"
    env = dict(os.environ, POOL_TUNER_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, str(script), "--backward", "--no-tune", "--rounds", "1", "--layer",
                           "convnext_head_cl_backward", "--tuned-dir", str(tmp_path / "tuned"), "--out", str(report)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    row = json.loads(report.read_text())["layers"][0]
    assert (row["layout"], row["call_layout"]) == ("NHWC", "NCHW")
    dispatched = pt.explain("adaptive_avg_pool2d", (32, 768, 7, 7), 1, layout="NCHW", direction="backward")
    assert row["choices"]["rules"] == {"variant": dispatched["variant"], "params": dispatched["params"]}


def test_grid_race_races_a_forward_variant_on_the_grids_global_problems(tmp_path):
    """grid_race.py times a forward variant (its input is the layer's input, not a gradient)
    against each grid problem's winner, only global problems with ``--only-global``."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "grid_race.py"
    if not script.exists():
        pytest.skip("benchmarks/ is not beside the tests (installed package)")

    def record(shape, output):
        problem = {"op": "adaptive_avg_pool2d", "direction": "forward", "dtype": "float32", "layout": "NHWC",
                   "input_shape": list(shape), "output_shape": list(shape[:2]) + list(output)}
        return {"problem": problem, "best": {"variant": "thread_per_output", "params": {}, "time_ms": 1.0}}

    grid = tmp_path / "records.json"
    grid.write_text(json.dumps({"schema": 1, "records": {"global": record((2, 16, 5, 6), (1, 1)),
                                                          "regional": record((2, 16, 5, 6), (2, 3))}}))
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(script), "--grid", str(grid), "--variant", "global_channels",
                           "--direction", "forward", "--layout", "channels_last", "--only-global", "--rounds", "1",
                           "--config", '{"channels_per_item": 4}', "--out", str(report)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(report.read_text())["problems"]
    assert [(r["input"], r["output"]) for r in rows] == [([2, 16, 5, 6], [1, 1])]
    assert rows[0]["ms"]["global_channels"] > 0


def test_record_race_races_two_tunings_choices_and_lists_the_same_choice(tmp_path, capsys):
    """benchmarks/record_race.py: a problem whose two records choose different kernels is raced
    (both kernels timed, the ratio printed); one whose records agree is listed, not raced."""
    import re

    from conftest import load_benchmark
    from pool_tuner import cache

    record_race = load_benchmark("record_race")
    files = {}
    for name, variant in (("old", "thread_per_output"), ("new", "thread_per_row")):
        table = cache.TuningCache(tmp_path / "no_shipped", tmp_path / name)
        pt.tune("adaptive_avg_pool2d", (2, 3, 10, 9), (4, 7), variants=[variant], strategy="random_sample",
                max_fevals=2, tuning_cache=table)
        files[name] = table.path()
    winners = tmp_path / "winners.json"
    assert record_race.main([str(files["old"]), str(files["new"]), "--rounds", "2", "--repetitions", "2",
                             "--winners", str(winners)]) == 0
    out = capsys.readouterr().out
    (kept,) = json.loads(winners.read_text())["records"].values()
    assert kept in [json.loads(files[name].read_text())["records"][kept["key"]] for name in files]
    assert re.search(r"^  old thread_per_output .* [\d.]+ ms$", out, re.M), out
    assert re.search(r"^  new thread_per_row .* [\d.]+ ms$", out, re.M), out
    assert "raced 1 problems" in out
    assert record_race.main([str(files["new"]), str(files["new"])]) == 0
    out = capsys.readouterr().out
    assert "the same choice, thread_per_row" in out and "raced" not in out
