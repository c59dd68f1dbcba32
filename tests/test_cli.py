"""The ``pool-tuner`` command line (DESIGN section 6), end to end: through ``cli.main`` in this
process and through real ``python -m pool_tuner.cli`` subprocesses.  Tuning budgets are tiny."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pool_tuner as pt
from pool_tuner import backends, cli, dispatch, kernel_source
from pool_tuner import cache as cache_mod
from pool_tuner.backends import opencl
from pool_tuner.problem import Problem
from pool_tuner.variants import variants_for

REPO = Path(__file__).resolve().parents[1]
OP = "adaptive_avg_pool2d"
CHEAP = ["--direction", "forward", "--variants", "thread_per_output", "--strategy", "random_sample", "--max-fevals", "3"]
SUBCOMMANDS = ["devices", "tune", "cache", "explain", "bench"]




def run(capsys, *argv):
    """``cli.main(argv)`` -> (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_subprocess(cache_dir, cwd, *argv, timeout=240):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["POOL_TUNER_CACHE_DIR"] = str(cache_dir)
    return subprocess.run([sys.executable, "-m", "pool_tuner.cli", *map(str, argv)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def key_of(op, shape, out):
    return cache_mod.cache_key(Problem.create(op, shape, out), backends.resolve_device())


def user_records(directory) -> dict:
    return json.loads((directory / cache_mod.USER_FILE).read_text())["records"]


def synthetic_record(shape, out=(3, 4), params=None, time_ms=0.01):
    problem = Problem.create(OP, shape, out)
    default = variants_for(OP)["thread_per_output"].default
    best = {"variant": "thread_per_output", "time_ms": time_ms,
            "params": dict(default, **(params or {"block_size_x": 32, "outputs_per_thread": 4}))}
    return cache_mod.make_record(problem, backends.resolve_device().fingerprint, cache_mod.kernel_hash(problem), best, [])


def shipped_count(tmp_path) -> int:
    empty = tmp_path / "no_user_cache"
    return len(cache_mod.TuningCache(kernel_source.shipped_cache_dir(), empty).records())


def assert_one_error_line(code, err):
    assert code == cli.EXIT_ERROR == 2
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pool-tuner: error: "), err
    assert "Traceback" not in err
    return lines[0]


# ---------------------------------------------------------------- devices


def test_devices_lists_every_device_and_marks_the_default(capsys, user_cache):
    code, out, err = run(capsys, "devices")
    assert code == 0 and err == ""
    lines = out.strip().splitlines()
    devices = pt.devices()
    if any(device.is_pocl and device.is_cpu for device in devices):
        # After the devices, a line says whether PoCL's worker threads were asked to be pinned.
        assert lines.pop() == f"PoCL: {opencl.pocl_affinity()}"
    assert "opencl:pocl:0" in [device.id for device in devices]  # ids name the platform, not its position
    assert len(lines) == len(devices)
    for device, line in zip(devices, lines):
        assert line.startswith(device.id) and device.name in line
    default = backends.default_device()
    marked = [line for line in lines if "(default" in line]
    assert len(marked) == 1 and marked[0].startswith(default.id)


# ---------------------------------------------------------------- tune


def test_tune_shape_prints_table_with_winner_and_speedup(capsys, user_cache):
    code, out, err = run(capsys, "tune", "--input", "2x3x5x7", "--output", "3x4", *CHEAP, "--quiet")
    assert code == 0, err
    assert "adaptive_avg_pool2d" in out and "2x3x5x7 -> 2x3x3x4" in out
    assert "thread_per_output" in out and "<- winner" in out
    assert "x faster" in out
    assert "NOT stored" not in out
    assert f"cache: {user_cache / cache_mod.USER_FILE}" in out
    assert "tuning" not in err  # --quiet: no progress bar
    key = key_of(OP, (2, 3, 5, 7), (3, 4))
    assert key in user_records(user_cache)
    assert pt.explain(OP, (2, 3, 5, 7), (3, 4))["source"] == "cache"


def test_tune_shapes_file_with_progress_bar(capsys, user_cache, tmp_path):
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps([
        {"input": [2, 3, 5, 7], "output": [3, 4]},
        {"op": "adaptive_avg_pool1d", "input": [2, 3, 9], "output": [4]},
    ]))
    code, out, err = run(capsys, "tune", "--shapes", shapes, *CHEAP)
    assert code == 0, err
    assert out.count("<- winner") == 2
    assert "adaptive_avg_pool1d" in out and "2x3x9 -> 2x3x4" in out
    assert "tuning" in err  # the progress bar
    records = user_records(user_cache)
    assert key_of(OP, (2, 3, 5, 7), (3, 4)) in records
    assert key_of("adaptive_avg_pool1d", (2, 3, 9), (4,)) in records


def test_tune_preset(capsys, user_cache):
    code, out, err = run(capsys, "tune", "--preset", "upsample_area", "--direction", "forward",
                         "--variants", "thread_per_output",
                         "--strategy", "random_sample", "--max-fevals", "2", "--quiet")
    assert code == 0, err
    assert "16x64x5x5 -> 16x64x7x7" in out and "<- winner" in out
    assert list(user_records(user_cache)) == [key_of(OP, (16, 64, 5, 5), (7, 7))]


# ---------------------------------------------------------------- cache


def test_cache_path(capsys, user_cache):
    code, out, err = run(capsys, "cache", "path")
    assert code == 0 and err == ""
    assert f"user cache:    {user_cache / cache_mod.USER_FILE}" in out
    assert str(kernel_source.shipped_cache_dir()) in out


def test_cache_show_and_clear_after_a_real_tune(capsys, user_cache, tmp_path):
    shipped = shipped_count(tmp_path)
    code, out, _ = run(capsys, "cache", "show")
    assert code == 0 and out.strip().splitlines()[-1].startswith(f"{shipped} records")

    code, _, err = run(capsys, "tune", "--input", "2x3x5x7", "--output", "3x4", *CHEAP, "--quiet")
    assert code == 0, err
    best = user_records(user_cache)[key_of(OP, (2, 3, 5, 7), (3, 4))]["best"]

    code, out, err = run(capsys, "cache", "show")
    assert code == 0 and err == ""
    lines = out.strip().splitlines()
    assert lines[-1].startswith(f"{shipped + 1} records")
    (row,) = [line for line in lines if "2x3x5x7" in line]
    assert "2x3x3x4" in row and best["variant"] in row and json.dumps(best["params"]) in row

    code, out, err = run(capsys, "cache", "clear")
    assert code == 0 and err == "" and "cleared" in out
    assert not (user_cache / cache_mod.USER_FILE).exists()
    code, out, _ = run(capsys, "cache", "show")
    assert code == 0
    assert "2x3x5x7" not in out
    assert out.strip().splitlines()[-1].startswith(f"{shipped} records")
    assert pt.explain(OP, (2, 3, 5, 7), (3, 4))["source"] != "cache"


def test_cache_clear_on_a_missing_cache_is_fine(capsys, user_cache):
    code, out, err = run(capsys, "cache", "clear")
    assert code == 0 and err == ""


def test_cache_merge_into_user_cache_and_into_a_file(capsys, user_cache, tmp_path):
    shipped = kernel_source.shipped_cache_dir()
    a = synthetic_record((2, 3, 5, 7))
    b = synthetic_record((2, 3, 9, 4), params={"block_size_x": 64, "outputs_per_thread": 2})
    cache_mod.TuningCache(shipped, tmp_path / "machine_a").store(a)
    cache_mod.TuningCache(shipped, tmp_path / "machine_b").store(b)
    files = [tmp_path / "machine_a" / cache_mod.USER_FILE, tmp_path / "machine_b" / cache_mod.USER_FILE]

    code, out, err = run(capsys, "cache", "merge", *files)
    assert code == 0 and err == ""
    assert "merged 2 records" in out
    assert set(user_records(user_cache)) == {a["key"], b["key"]}
    info = pt.explain(OP, (2, 3, 9, 4), (3, 4))
    assert (info["source"], info["params"]) == ("cache", b["best"]["params"])

    into = tmp_path / "fleet" / "merged.json"
    code, out, err = run(capsys, "cache", "merge", *files, "--into", into)
    assert code == 0 and err == ""
    assert "merged 2 records" in out and str(into) in out
    assert set(json.loads(into.read_text())["records"]) == {a["key"], b["key"]}
    # Merging again changes nothing; a faster record for a key replaces the slower one.
    code, out, _ = run(capsys, "cache", "merge", *files, "--into", into)
    assert code == 0 and "merged 0 records" in out
    faster = synthetic_record((2, 3, 5, 7), params={"block_size_x": 128, "outputs_per_thread": 1}, time_ms=0.001)
    cache_mod.TuningCache(shipped, tmp_path / "machine_c").store(faster)
    code, out, _ = run(capsys, "cache", "merge", tmp_path / "machine_c" / cache_mod.USER_FILE, "--into", into)
    assert code == 0 and "merged 1 records" in out
    assert json.loads(into.read_text())["records"][a["key"]]["best"]["params"] == faster["best"]["params"]


# ---------------------------------------------------------------- explain


def test_explain_prints_json(capsys, user_cache):
    code, out, err = run(capsys, "explain", "--input", "2x3x5x7", "--output", "1x1")
    assert code == 0 and err == ""
    info = json.loads(out)
    assert info["source"] == "default"
    assert info["output_shape"] == [2, 3, 1, 1]
    assert info["cache_key"] == key_of(OP, (2, 3, 5, 7), (1, 1))
    assert info["device"] == backends.default_device().describe()

    code, out, _ = run(capsys, "explain", "--op", "adaptive_avg_pool1d", "--input", "2x3x9", "--output", "4")
    assert code == 0 and json.loads(out)["output_shape"] == [2, 3, 4]
    code, out, _ = run(capsys, "explain", "--input", "2x3x5x7", "--output", "2")
    assert code == 0 and json.loads(out)["output_shape"] == [2, 3, 2, 2]
    code, out, _ = run(capsys, "explain", "--input", "2x3x5x7", "--output", "3xNone")
    assert code == 0 and json.loads(out)["output_shape"] == [2, 3, 3, 7]


def test_explain_reports_a_cache_hit(capsys, user_cache):
    record = synthetic_record((2, 3, 5, 7))
    cache_mod.TuningCache(kernel_source.shipped_cache_dir(), user_cache).store(record)
    dispatch.forget()
    code, out, _ = run(capsys, "explain", "--input", "2x3x5x7", "--output", "3x4")
    info = json.loads(out)
    assert code == 0 and (info["source"], info["record_key"]) == ("cache", record["key"])
    assert info["params"] == record["best"]["params"]


# ---------------------------------------------------------------- --help


@pytest.mark.parametrize("argv", [["--help"]] + [[name, "--help"] for name in SUBCOMMANDS],
                         ids=["top"] + SUBCOMMANDS)
def test_help_exits_zero(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: pool-tuner")
    if argv == ["--help"]:
        for name in SUBCOMMANDS:
            assert name in out


# ---------------------------------------------------------------- errors


SHAPE_ARGS = ["--input", "2x3x5x7", "--output", "3x4"]


@pytest.mark.parametrize("argv, mentions", [
    (["tune", "--input", "2x3xfivex7", "--output", "3x4"], "--input"),
    (["tune", "--input", "2x3x5x7", "--output", "3x-4"], "output_size"),
    (["explain", "--input", "2x3x5x7", "--output", "3xx4"], "--output"),
    (["explain", "--input", "2xNonex5x7", "--output", "3x4"], "--input"),
    (["tune", "--op", "adaptive_foo_pool2d", *SHAPE_ARGS], "op"),
    (["explain", "--op", "adaptive_foo_pool2d", *SHAPE_ARGS], "op"),
    (["tune", "--preset", "no_such_preset"], "preset"),
    (["tune", "--input", "2x3x5x7"], "--output"),
    (["tune"], "--preset"),
    (["tune", *SHAPE_ARGS, "--preset", "upsample_area"], "exactly one"),
    (["tune", "--shapes", "missing_shapes.json"], "--shapes"),
    (["tune", *SHAPE_ARGS, "--variants", "no_such_variant", "--quiet"], "variants"),
    (["tune", *SHAPE_ARGS, "--strategy", "brute_force", "--max-fevals", "2", "--quiet"], "max_fevals"),
    (["explain", *SHAPE_ARGS, "--device", "opencl:99:0"], "device"),
    (["explain", *SHAPE_ARGS, "--dtype", "int8"], "dtype"),
    (["cache", "merge", "missing_records.json"], "missing_records.json"),
    (["cache", "merge", "missing_records.json", "--into", "merged.json"], "missing_records.json"),
    (["cache", "merge"], "merge"),
], ids=["bad-shape", "negative-output", "bad-output-text", "none-in-input", "tune-unknown-op",
        "explain-unknown-op", "unknown-preset", "missing-output", "no-shapes", "two-shape-sources",
        "missing-shapes-file", "unknown-variant", "brute-force-budget", "unknown-device", "bad-dtype",
        "merge-missing-file", "merge-missing-file-into", "merge-nothing"])
def test_errors_are_one_line_and_exit_2(capsys, user_cache, argv, mentions):
    code, out, err = run(capsys, *argv)
    line = assert_one_error_line(code, err)
    assert mentions in line
    assert "winner" not in out
    assert not (user_cache / cache_mod.USER_FILE).exists()


def test_shapes_file_with_bad_content(capsys, user_cache, tmp_path):
    for content in ('{"input": [2, 3, 5, 7]}', '[{"input": [2, 3, 5, 7]}]', "[1, 2]", "not json"):
        (tmp_path / "shapes.json").write_text(content)
        code, _, err = run(capsys, "tune", "--shapes", tmp_path / "shapes.json")
        line = assert_one_error_line(code, err)
        assert "--shapes" in line, content


def test_argparse_errors_exit_2(capsys):
    for argv in (["explain", "--input", "2x3x5x7"], ["frobnicate"], ["cache", "vacuum"],
                 ["tune", "--max-fevals", "many"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2
        assert "error:" in capsys.readouterr().err


# ---------------------------------------------------------------- real subprocesses


def test_subprocess_tune_show_explain(user_cache, tmp_path):
    tuned = run_subprocess(user_cache, tmp_path, "tune", "--input", "2x3x5x7", "--output", "3x4", *CHEAP, "--quiet")
    assert tuned.returncode == 0, tuned.stderr
    assert "<- winner" in tuned.stdout and "faster" in tuned.stdout
    key = key_of(OP, (2, 3, 5, 7), (3, 4))
    assert key in user_records(user_cache)

    shown = run_subprocess(user_cache, tmp_path, "cache", "show")
    assert shown.returncode == 0 and "2x3x5x7" in shown.stdout

    explained = run_subprocess(user_cache, tmp_path, "explain", "--input", "2x3x5x7", "--output", "3x4")
    assert explained.returncode == 0, explained.stderr
    info = json.loads(explained.stdout)
    assert (info["source"], info["cache_key"]) == ("cache", key)


def test_subprocess_error_is_one_line_and_exit_2(user_cache, tmp_path):
    proc = run_subprocess(user_cache, tmp_path, "tune", "--preset", "no_such_preset")
    line = assert_one_error_line(proc.returncode, proc.stderr)
    assert "no_such_preset" in line
    assert proc.stdout == ""
