"""The ``pool-tuner`` command line (README, Command line), end to end: through ``cli.main`` in this
process and through real ``python -m pool_tuner.cli`` subprocesses.  Tuning budgets are tiny."""

import argparse
import json
import os
import re
import subprocess
import sys
import textwrap
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
    fingerprint = backends.resolve_device().info.fingerprint
    return cache_mod.make_record(problem, fingerprint, cache_mod.record_kernel_hash(problem, fingerprint), best, [])


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
    if any(device.is_pocl and device.info.is_cpu for device in devices):
        # After the devices, a line says whether PoCL's worker threads were asked to be pinned.
        assert lines.pop() == f"PoCL: {opencl.pocl_affinity()}"
    assert "opencl:pocl:0" in [device.info.id for device in devices]  # ids name the platform, not its position
    assert len(lines) == len(devices)
    for device, line in zip(devices, lines):
        assert line.startswith(device.info.id) and device.info.name in line
    default = backends.default_device()
    marked = [line for line in lines if "(default" in line]
    assert len(marked) == 1 and marked[0].startswith(default.info.id)


# ---------------------------------------------------------------- tune


def test_tune_shape_prints_table_with_winner_and_speedup(capsys, user_cache):
    code, out, err = run(capsys, "tune", "--input", "2x3x5x7", "--output", "3x4", *CHEAP, "--quiet")
    assert code == 0, err
    assert "adaptive_avg_pool2d" in out and "2x3x5x7 -> 2x3x3x4" in out
    assert "thread_per_output" in out and "<- winner" in out
    # the verdict on the winner against the default rules' choice (thread_per_output here, which a
    # search of thread_per_output alone may keep)
    assert "than the default" in out or "is the best configuration found: kept" in out
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


def test_tune_table_gives_reasons_kernel_time_and_a_kept_default(capsys, user_cache):
    """Inapplicable variants say why (no 'None' params), and the times are labelled kernel times."""
    code, out, err = run(capsys, "tune", "--input", "2x3x5x7", "--output", "3x4", "--direction", "forward",
                         "--variants", "thread_per_output,plane_reduce,channels_vector",
                         "--strategy", "random_sample", "--max-fevals", "2", "--quiet")
    assert code == 0, err
    lines = out.splitlines()
    assert any(line.split()[:2] == ["variant", "kernel"] and "ms" in line for line in lines)
    assert "kernel ms: the kernel alone" in out and "best ms" not in out
    (plane_reduce,) = [line for line in lines if line.strip().startswith("plane_reduce")]
    assert plane_reduce.split()[1:] == ["-", "not", "applicable:", "only", "for", "global", "pooling", "(every",
                                        "output", "size", "1)"]
    (channels_vector,) = [line for line in lines if line.strip().startswith("channels_vector")]
    assert "not applicable: needs a channels-last input" in channels_vector and "None" not in channels_vector


def test_tune_table_says_when_the_default_was_kept(capsys, user_cache, monkeypatch):
    """A search that finds only the default configuration keeps it, and says so."""
    default = dispatch.default_choice(Problem.create(OP, (2, 3, 5, 7), (3, 4)), backends.resolve_device())
    monkeypatch.setattr(default.variant, "search_space", {k: [v] for k, v in default.config.items()})
    code, out, err = run(capsys, "tune", "--input", "2x3x5x7", "--output", "3x4", "--direction", "forward",
                         "--variants", default.variant.name, "--quiet")
    assert code == 0, err
    assert f"the default {default.variant.name} {default.config}" in out
    assert "is the best configuration found: kept" in out and "faster" not in out


INTERRUPT_SHAPES = [{"input": [2, 3, 5, 7], "output": [3, 4]}, {"input": [2, 3, 6, 7], "output": [3, 4]}]


def test_ctrl_c_keeps_finished_shapes_and_the_partial_one_and_exits_130(capsys, user_cache, tmp_path, monkeypatch):
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps(INTERRUPT_SHAPES))
    from pool_tuner import tuner

    original, second_shape_calls = tuner.Case.verify, []

    def verify(self, *args, **kwargs):  # Ctrl-C in Kernel Tuner's loop, on the second shape's 3rd check
        if self.args[0].shape == (2, 3, 6, 7):
            second_shape_calls.append(1)
            if len(second_shape_calls) == 3:
                raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(tuner.Case, "verify", verify)
    code, out, err = run(capsys, "tune", "--shapes", shapes, *CHEAP, "--quiet")
    assert code == cli.EXIT_INTERRUPTED == 130
    (line,) = err.strip("\n").splitlines()
    assert line.startswith(f"pool-tuner: interrupted: 1 of 2 tuning jobs finished and kept in {user_cache / cache_mod.USER_FILE}; "
                           f"tuning adaptive_avg_pool2d forward float32 NCHW 2x3x6x7 -> 2x3x3x4 was interrupted: stored "
                           f"the best configuration measured so far"), line
    assert out.count("<- winner") == 1 and "2x3x5x7 -> 2x3x3x4" in out
    records = user_records(user_cache)
    finished, cut = records[key_of(OP, (2, 3, 5, 7), (3, 4))], records[key_of(OP, (2, 3, 6, 7), (3, 4))]
    assert not cache_mod.is_partial(finished) and cache_mod.is_partial(cut)
    assert cut["partial"]["variant_interrupted"] == "thread_per_output"

    code, out, _ = run(capsys, "cache", "show")
    (finished_row,) = [row for row in out.splitlines() if "2x3x5x7" in row]
    (cut_row,) = [row for row in out.splitlines() if "2x3x6x7" in row]
    assert "PARTIAL" not in finished_row
    assert "PARTIAL (tuning interrupted): 0 variants searched, thread_per_output cut short, 0 not searched" in cut_row
    assert json.loads(run(capsys, "explain", "--input", "2x3x6x7", "--output", "3x4")[1])["partial"] == cut["partial"]


def test_a_real_sigint_during_tune_exits_130_with_one_line(user_cache, tmp_path):
    """SIGINT sent to the process itself while Kernel Tuner checks a configuration."""
    script = textwrap.dedent("""
        import os, signal, sys
        from pool_tuner import cli, tuner
        original, calls = tuner.Case.verify, []
        def verify(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                os.kill(os.getpid(), signal.SIGINT)
            return original(self, *args, **kwargs)
        tuner.Case.verify = verify
        sys.exit(cli.main(sys.argv[1:]))
    """)
    env = dict(os.environ, POOL_TUNER_CACHE_DIR=str(user_cache))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", script, "tune", *SHAPE_ARGS, *CHEAP], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 130, proc.stderr
    lines = proc.stderr.strip("\n").splitlines()
    assert lines[-1].startswith("pool-tuner: interrupted: 0 of 1 tuning jobs finished"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert all("pool-tuner" not in line for line in lines[:-1])  # before it at most the progress bar


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


def test_cache_show_tells_the_directions_of_a_shape_apart(capsys, user_cache):
    forward = synthetic_record((2, 3, 5, 7))
    problem = Problem.create(OP, (2, 3, 5, 7), (3, 4), direction="backward")
    best = {"variant": "thread_per_input", "params": variants_for(OP, "backward")["thread_per_input"].default,
            "time_ms": 0.02}
    fingerprint = backends.resolve_device().info.fingerprint
    backward = cache_mod.make_record(problem, fingerprint, cache_mod.record_kernel_hash(problem, fingerprint), best, [])
    table = cache_mod.TuningCache(kernel_source.shipped_cache_dir(), user_cache)
    table.store(forward)
    table.store(backward)
    code, out, err = run(capsys, "cache", "show")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split()[:7] == ["op", "pass", "dtype", "layout", "input", "output", "variant"]
    rows = [line for line in lines if "2x3x5x7" in line]
    assert [row.split()[:4] for row in rows] == [[OP, "backward", "float32", "NCHW"], [OP, "forward", "float32", "NCHW"]]
    assert "thread_per_input" in rows[0] and "thread_per_output" in rows[1]


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
    assert info["device"] == backends.default_device().info.describe()

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
    (["tune", "--input", "2x3x5x7", "--output", "3x-4"], "--output sizes must be integers >= 0 or None"),
    (["tune", "--input", "8x64x-10x9", "--output", "1x1"], "--input sizes must be integers >= 0"),
    (["tune", "--input", "8x64x0x9", "--output", "1x1"], "--input has a pooled dimension of size 0"),
    (["explain", "--input", "0x3x0x7", "--output", "1x1"], "--input has a pooled dimension of size 0"),
    (["explain", "--input", "2x3x5x7", "--output", "3xx4"], "--output"),
    (["explain", "--input", "2xNonex5x7", "--output", "3x4"], "--input"),
    (["tune", "--preset", "no_such_preset"], "preset"),
    (["tune", "--input", "2x3x5x7"], "--output"),
    (["tune"], "--preset"),
    (["tune", *SHAPE_ARGS, "--preset", "upsample_area"], "exactly one"),
    (["tune", "--shapes", "missing_shapes.json"], "--shapes"),
    (["tune", *SHAPE_ARGS, "--variants", "no_such_variant", "--quiet"], "variants"),
    (["tune", *SHAPE_ARGS, "--strategy", "brute_force", "--max-fevals", "2", "--quiet"], "--max-fevals"),
    (["tune", *SHAPE_ARGS, "--strategy", "nonsense"], "--strategy must be a Kernel Tuner strategy"),
    (["tune", *SHAPE_ARGS, "--max-fevals", "-1"], "--max-fevals must be a positive integer, got -1"),
    (["tune", *SHAPE_ARGS, "--time-limit", "nan"], "--time-limit must be a positive number of seconds"),
    (["tune", *SHAPE_ARGS, "--time-limit", "-5"], "--time-limit must be a positive number of seconds"),
    (["tune", "--input", "2x3x5x7", "--output", "-3x3"], "--output sizes must be integers >= 0"),
    (["tune", "--input", "2x3x5x7", "--output", ""], "--output must be an output size such as 1x1"),
    (["tune", "--input", "2x3", "--output", "1"], "--input must be 3-d or 4-d"),
    (["tune", "--input", "2x3x5x7", "--output", "0"], "--output 0 gives an empty output"),
    (["explain", "--input", "2x3x5x7", "--output", "2x99999999999"], "--output[1] must be <= 2147483647"),
    (["bench", "--repeat", "0"], "--repeat must be a positive integer"),
    (["bench", "--repeat", "-2"], "--repeat must be a positive integer"),
    (["bench", "--out", "/proc/nope"], "--out /proc/nope"),
    (["cache", "show", "extra", "words"], "cache show takes no files"),
    (["explain", *SHAPE_ARGS, "--device", "opencl:99:0"], "device"),
    (["explain", *SHAPE_ARGS, "--dtype", "int8"], "dtype"),
    (["cache", "merge", "missing_records.json"], "missing_records.json"),
    (["cache", "merge", "missing_records.json", "--into", "merged.json"], "missing_records.json"),
    (["cache", "merge"], "merge"),
], ids=["bad-shape", "negative-output", "negative-input", "zero-input", "explain-zero-input", "bad-output-text",
        "none-in-input", "unknown-preset", "missing-output", "no-shapes", "two-shape-sources",
        "missing-shapes-file", "unknown-variant", "brute-force-budget", "unknown-strategy", "negative-max-fevals",
        "nan-time-limit", "negative-time-limit", "dash-output", "empty-output", "input-rank", "empty-result",
        "absurd-output", "repeat-0", "repeat-negative", "unwritable-out", "cache-show-extra",
        "unknown-device", "bad-dtype",
        "merge-missing-file", "merge-missing-file-into", "merge-nothing"])
def test_errors_are_one_line_and_exit_2(capsys, user_cache, argv, mentions):
    code, out, err = run(capsys, *argv)
    line = assert_one_error_line(code, err)
    assert mentions in line
    assert "winner" not in out
    assert not (user_cache / cache_mod.USER_FILE).exists()


def test_shapes_file_with_bad_content(capsys, user_cache, tmp_path):
    for content in ('{"input": [2, 3, 5, 7]}', '[{"input": [2, 3, 5, 7]}]', "[1, 2]", "not json",
                    '[{"input": [2, 3, -5, 7], "output": [1, 1]}]', '[{"input": [2, 3, 5, 7], "output": [1, -1]}]'):
        (tmp_path / "shapes.json").write_text(content)
        code, _, err = run(capsys, "tune", "--shapes", tmp_path / "shapes.json")
        line = assert_one_error_line(code, err)
        assert "--shapes" in line, content


def test_argparse_errors_exit_2(capsys):
    for argv in (["explain", "--input", "2x3x5x7"], ["frobnicate"], ["cache", "vacuum"],
                 ["tune", "--max-fevals", "many"], ["tune", "--op", "adaptive_foo_pool2d", *SHAPE_ARGS],
                 ["explain", "--op", "adaptive_foo_pool2d", *SHAPE_ARGS]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith("pool-tuner: error:"), err
        if "--op" in argv:  # the allowed ops are named
            assert "argument --op: invalid choice: 'adaptive_foo_pool2d'" in err and "adaptive_max_pool3d" in err


def _subcommand_parsers():
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


@pytest.mark.parametrize("name", ["devices", "tune", "cache", "explain", "bench", "compile-check"])
def test_every_option_has_help_text(name):
    parser = _subcommand_parsers()[name]
    undocumented = [a.option_strings or a.dest for a in parser._actions if not a.help]
    assert undocumented == []


@pytest.mark.parametrize("name", ["tune", "explain", "compile-check"])
def test_op_options_list_the_ops(name, capsys):
    (op,) = [a for a in _subcommand_parsers()[name]._actions if "--op" in a.option_strings]
    assert op.choices == sorted(pt.problem.OPS)
    with pytest.raises(SystemExit):
        cli.main([name, "--help"])
    shown = capsys.readouterr().out
    assert all(op_name in shown for op_name in pt.problem.OPS)


# ---------------------------------------------------------------- warnings


def test_warnings_are_one_clean_line(capsys, user_cache):
    user_cache.mkdir()
    (user_cache / cache_mod.USER_FILE).write_text("{not json")
    code, out, err = run(capsys, "cache", "show")
    assert code == 0
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"pool-tuner: warning: pool_tuner tuning cache {user_cache / cache_mod.USER_FILE}: "
                               f"not valid JSON")
    assert "cache.py" not in err and "warnings.warn" not in err and "CacheWarning" not in err


# ---------------------------------------------------------------- real subprocesses


def test_subprocess_tune_show_explain(user_cache, tmp_path):
    tuned = run_subprocess(user_cache, tmp_path, "tune", "--input", "2x3x5x7", "--output", "3x4", *CHEAP, "--quiet")
    assert tuned.returncode == 0, tuned.stderr
    assert "<- winner" in tuned.stdout and "the default" in tuned.stdout
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


def test_subprocess_warning_is_one_clean_line(user_cache, tmp_path):
    user_cache.mkdir()
    (user_cache / cache_mod.USER_FILE).write_text("{not json")
    proc = run_subprocess(user_cache, tmp_path, "cache", "show")
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stderr.strip("\n").splitlines()
    assert line.startswith("pool-tuner: warning: pool_tuner tuning cache ") and "not valid JSON" in line


def test_shapes_file_outputs_follow_the_output_rule(tmp_path):
    """A --shapes entry's output keeps a size with null and may be 0, as --output allows; its input
    sizes stay >= 0 (output entries were once checked by the input rule)."""
    (tmp_path / "shapes.json").write_text('[{"input": [2, 3, 5, 7], "output": [3, null]}, '
                                         '{"input": [2, 3, 5, 7], "output": [0, 1]}]')
    args = argparse.Namespace(input=None, output=None, preset=None, shapes=str(tmp_path / "shapes.json"),
                              op="adaptive_avg_pool2d")
    assert cli._shapes_from_args(args) == [("adaptive_avg_pool2d", (2, 3, 5, 7), (3, None)),
                                           ("adaptive_avg_pool2d", (2, 3, 5, 7), (0, 1))]
    (tmp_path / "shapes.json").write_text('[{"input": [2, 3, -1, 7], "output": [1, 1]}]')
    with pytest.raises(ValueError, match="--shapes entry 0 input sizes must be integers >= 0"):
        cli._shapes_from_args(args)


@pytest.mark.parametrize("entries, mentions", [
    ([], "must hold a non-empty JSON list"),
    ([{"input": "2xax30", "output": 7}], "--shapes entry 0 input must be an input shape such as"),
    ([{"input": [2, 4, 30]}], '--shapes entry 0 must be an object with "input" and "output"'),
    ([{"input": [2, 4, 30], "output": -7}], "--shapes entry 0 output sizes must be integers >= 0"),
    ([{"input": 30, "output": 7}], "--shapes entry 0 input must be a list of sizes"),
    ([{"input": [2, 4, 30], "output": 7, "dtype": "float16"}], "--shapes entry 0 has unknown keys ['dtype']"),
], ids=["empty", "bad-text", "no-output", "negative-output", "number-input", "unknown-key"])
def test_bad_shapes_files_are_one_line_and_exit_2(capsys, user_cache, tmp_path, entries, mentions):
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps(entries))
    code, _, err = run(capsys, "tune", "--op", "adaptive_avg_pool1d", "--shapes", str(shapes))
    assert mentions in assert_one_error_line(code, err)


@pytest.mark.parametrize("second, mentions", [
    ({"input": [30], "output": 7}, "--shapes entry 1 input"),
    ({"input": [2, 4, 30], "output": [7, 7]}, "--shapes entry 1 output"),
    ({"input": [2, 4, 30], "output": 0}, "--shapes entry 1 output 0 gives an empty output"),
    ({"input": [100000, 100000, 30], "output": 7}, "--shapes entry 1 output gives an output of shape"),
], ids=["input-rank", "output-rank", "empty-output", "too-large"])
def test_a_shapes_entry_the_library_refuses_is_named_by_its_index(capsys, user_cache, tmp_path, second, mentions):
    """Errors that the library raises for one entry of a --shapes file (the problem's rank, an
    empty output, a problem too large for the device) name that entry, not --input/--output."""
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps([{"input": [2, 4, 30], "output": 7}, second]))
    code, _, err = run(capsys, "tune", "--op", "adaptive_avg_pool1d", "--shapes", str(shapes))
    line = assert_one_error_line(code, err)
    assert mentions in line and "--input" not in line
    assert not (user_cache / cache_mod.USER_FILE).exists()


def test_a_shapes_file_that_is_not_utf8_is_named(capsys, user_cache, tmp_path):
    shapes = tmp_path / "shapes.json"
    shapes.write_bytes(b"\xff\xfe[]")
    code, _, err = run(capsys, "tune", "--op", "adaptive_avg_pool1d", "--shapes", str(shapes))
    assert f"--shapes {shapes}: 'utf-8' codec can't decode" in assert_one_error_line(code, err)


@pytest.mark.parametrize("options, mentions", [
    (["--input", "100000x100000x5x5", "--output", "3"], "--output gives an output of shape"),
    (["--input", "1x2x5x5", "--output", "3", "--direction", "forward", "--variants", "plane_reduce"],
     "--variants: no variant can run adaptive_avg_pool2d forward"),
], ids=["too-large", "no-variant-runs-it"])
def test_a_problem_the_device_cannot_tune_is_refused_before_tuning(capsys, user_cache, options, mentions):
    code, _, err = run(capsys, "tune", "--op", "adaptive_avg_pool2d", *options)
    assert mentions in assert_one_error_line(code, err)
    assert not (user_cache / cache_mod.USER_FILE).exists()


def test_shapes_entries_take_what_the_options_take(tmp_path):
    """An output number (as --output 7) and the options' text ("2x4x30", "7xNone") are entries too."""
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps([{"input": [2, 4, 30], "output": 7}, {"input": "2x4x30", "output": "7"},
                                  {"op": "adaptive_max_pool2d", "input": "2x4x9x9", "output": "7xNone"}]))
    args = cli.build_parser().parse_args(["tune", "--op", "adaptive_avg_pool1d", "--shapes", str(shapes)])
    assert cli._shapes_from_args(args) == [("adaptive_avg_pool1d", (2, 4, 30), 7), ("adaptive_avg_pool1d", (2, 4, 30), 7),
                                           ("adaptive_max_pool2d", (2, 4, 9, 9), (7, None))]


def test_merging_a_file_with_nothing_to_merge_is_an_error(capsys, user_cache, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1}')
    code, _, err = run(capsys, "cache", "merge", str(bad))
    assert str(bad) in assert_one_error_line(code, err)
    assert not (user_cache / cache_mod.USER_FILE).exists()


@pytest.mark.parametrize("argv, mentions", [
    (["tune", "--preset", "se_block", "--op", "adaptive_max_pool3d"], "--op goes with --input/--output or --shapes"),
    (["tune", "--preset", "se_block", "--output", "3"], "--output goes with --input; --preset gives the output sizes"),
    (["tune", "--preset", ""], "--preset must be one of"),
    (["bench", "--preset", ""], "--preset must be one of"),
    (["bench", "--preset", "nope"], "--preset must be one of"),
    (["bench", "--dtype", "foo"], "--dtype must be one of"),
    (["bench", "--device", "nope"], "--device must be one of"),
    (["explain", "--input", "1x1x30x30", "--output", "40000x40000"], "check --output"),
    (["explain", "--input", "1x1x30x30", "--output", "3", "--device", "nope"], "--device must be one of"),
], ids=["preset-op", "preset-output", "tune-empty-preset", "bench-empty-preset", "bench-unknown-preset",
        "bench-dtype", "bench-device", "explain-too-large", "explain-device"])
def test_options_that_are_dropped_or_named_by_the_library_are_refused_by_option(capsys, user_cache, argv, mentions):
    """An option that the command would drop (--op or --output beside a preset), an empty preset
    (tune read it as no preset, bench as the whole suite) and errors raised below the command
    line name the option, in one line, before any work."""
    code, _, err = run(capsys, *argv)
    line = assert_one_error_line(code, err)
    assert mentions in line
    assert not re.search(r"\b(output_size|input_shape)\b|^(dtype|device) ", line.removeprefix("pool-tuner: error: "))


@pytest.mark.parametrize("special", ["fifo", "device", "directory", "missing"])
def test_a_shapes_file_that_is_no_regular_file_is_refused_without_reading_it(capsys, user_cache, tmp_path, special):
    """A FIFO blocked the command for good, /dev/zero read until memory ran out."""
    path = {"fifo": tmp_path / "fifo.json", "device": Path("/dev/zero"), "directory": tmp_path,
            "missing": tmp_path / "missing.json"}[special]
    if special == "fifo":
        os.mkfifo(path)
    code, _, err = run(capsys, "tune", "--shapes", path)
    assert f"--shapes {path}: " in assert_one_error_line(code, err)


def test_a_shapes_file_larger_than_any_list_of_shapes_is_refused(capsys, user_cache, tmp_path):
    path = tmp_path / "shapes.json"
    path.write_text("[" + " " * cli.MAX_SHAPES_FILE_BYTES + "]")
    code, _, err = run(capsys, "tune", "--shapes", path)
    assert f"bytes, more than the {cli.MAX_SHAPES_FILE_BYTES} such a file may hold" in assert_one_error_line(code, err)


def write_user_records(user_cache, *records):
    user_cache.mkdir(parents=True, exist_ok=True)
    (user_cache / cache_mod.USER_FILE).write_text(
        json.dumps({"schema": cache_mod.SCHEMA_VERSION, "records": {r["key"]: r for r in records}}))


def test_a_partial_field_of_bad_contents_is_a_warning_and_a_miss_never_a_crash_of_cache_show(
        capsys, user_cache, tmp_path):
    """Only the field's type was checked: a merge took {"variants_searched": 5}, and then every
    ``cache show`` ended in "object of type 'int' has no len()" and explain returned it."""
    bad = dict(synthetic_record((2, 3, 5, 7)), partial={"variants_searched": 5, "variants_not_searched": 7})
    good = synthetic_record((2, 3, 9, 4))
    source = tmp_path / "source.json"
    source.write_text(json.dumps({"schema": cache_mod.SCHEMA_VERSION, "records": {bad["key"]: bad, good["key"]: good}}))
    code, out, err = run(capsys, "cache", "merge", source)
    assert code == 0 and "merged 1 records" in out
    assert "'partial'" in err and "not merged" in err
    assert set(user_records(user_cache)) == {good["key"]}

    write_user_records(user_cache, bad, good)  # in the user cache itself
    dispatch.forget()
    code, out, err = run(capsys, "cache", "show")
    assert code == 0 and "'partial'" in err and "ignored" in err
    assert "2x3x9x4" in out and "2x3x5x7" not in out and "PARTIAL" not in out
    dispatch.forget()
    with pytest.warns(cache_mod.CacheWarning, match="'variants_searched'"):
        info = pt.explain(OP, (2, 3, 5, 7), (3, 4))
    assert info["partial"] is None and info["source"] != "cache"


def test_a_malformed_measured_field_is_a_warning_and_a_miss(capsys, user_cache):
    """design.md (Measured dispatch): a record with a malformed ``measured`` field is a CacheWarning
    and a miss.  Only its type was checked, so explain said source "measured", tier exact."""
    bad = dict(synthetic_record((2, 3, 5, 7)), measured={"rounds": "x", "seconds": None})
    write_user_records(user_cache, bad)
    code, out, err = run(capsys, "explain", "--input", "2x3x5x7", "--output", "3x4")
    assert code == 0 and "'measured'" in err and "'rounds'" in err
    info = json.loads(out)
    assert info["source"] not in ("measured", "cache") and info["measured"] is None


def test_cache_merge_from_or_into_what_is_no_file_names_the_path(capsys, user_cache, tmp_path):
    """A directory gave "[Errno 21] Is a directory: 3" (a file descriptor's number); a destination
    under a plain file gave "File exists: 'afile'"."""
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"schema": cache_mod.SCHEMA_VERSION,
                                "records": {synthetic_record((2, 3, 5, 7))["key"]: synthetic_record((2, 3, 5, 7))}}))
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    for argv, path, problem in [
        (["cache", "merge", tmp_path / "adir"], tmp_path / "adir", "is a directory"),
        (["cache", "merge", good, "--into", tmp_path / "adir"], tmp_path / "adir", "is a directory"),
        (["cache", "merge", good, "--into", tmp_path / "afile" / "sub.json"], tmp_path / "afile", "is a file, not a directory"),
        (["cache", "merge", good, "--into", tmp_path / "afile" / "x" / "sub.json"], tmp_path / "afile",
         "is a file, not a directory"),
    ]:
        code, out, err = run(capsys, *argv)
        line = assert_one_error_line(code, err)
        assert f"{path} {problem}" in line, line
        assert "Errno" not in line and "File exists" not in line, line
    assert not (user_cache / cache_mod.USER_FILE).exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("a")) == ["adir", "afile"], "no lock file left"
