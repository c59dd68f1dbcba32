"""The rough edges a new user met (issue 36), each through a public entry point: the command line's
pyramid levels, version, empty batches and bench output; messages that name the argument that is
wrong; a huge output refused before anything is allocated; ``pool_tuner.onnx`` without PyTorch;
the fused presets in the README, ``bench`` and ``examples/quickstart.py``."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pool_tuner as pt
from pool_tuner import bench, cli, presets

from conftest import random_input

REPO = Path(__file__).resolve().parents[1]


def run(capsys, *argv):
    capsys.readouterr()
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _python(code: str, timeout=300, **env):
    environ = dict(os.environ, PYTHONPATH=str(REPO), **env)
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------ command line


def test_the_cli_takes_pyramid_levels(capsys, user_cache):
    code, out, err = run(capsys, "explain", "--op", "adaptive_avg_pool_pyramid2d", "--input", "2x3x12x12",
                         "--output", "1,2,3x3,6")
    assert code == 0, err
    info = json.loads(out)
    assert info["output_shape"][2:] == [1, 1, 2, 2, 3, 3, 6, 6]
    code, out, err = run(capsys, "tune", "--op", "adaptive_max_pool_pyramid2d", "--input", "1x2x9x9", "--output", "1,3",
                         "--direction", "forward", "--strategy", "random_sample", "--max-fevals", "2", "--quiet")
    assert code == 0, err
    assert "adaptive_max_pool_pyramid2d forward" in out


def test_a_list_of_levels_for_a_single_level_op_says_which_ops_take_one(capsys):
    code, _, err = run(capsys, "explain", "--input", "2x3x12x12", "--output", "1,2")
    assert code == 2 and "pyramid" in err and "adaptive_avg_pool_pyramid2d" in err


@pytest.mark.parametrize("bad", ["nan", "3.5"])
def test_the_output_error_quotes_an_output_size(capsys, bad):
    code, _, err = run(capsys, "explain", "--input", "2x3x12x12", "--output", bad)
    assert code == 2 and "1x1" in err and "32x2048x7x7" not in err, err


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"pool-tuner {pt.__version__}"


@pytest.mark.parametrize("shape", ["0x3x8x8", "2x0x8x8"])
def test_the_cli_takes_an_empty_batch_as_the_api_does(capsys, shape):
    code, out, err = run(capsys, "explain", "--input", shape, "--output", "2")
    assert code == 0, err
    assert json.loads(out)["output_shape"] == [int(n) for n in shape.split("x")[:2]] + [2, 2]
    code, _, err = run(capsys, "explain", "--input", "2x3x0x8", "--output", "2")
    assert code == 2 and "--input" in err and "pooled" in err


def test_bench_writes_outside_the_clone_by_default():
    assert cli.build_parser().parse_args(["bench"]).out is None
    default = cli.default_bench_dir().resolve()
    assert REPO not in default.parents and Path.cwd().resolve() not in default.parents


def _report(before, after, cpus=2):
    return {"date": "2026-11-26T00:00:00+00:00", "device": "opencl:pocl:0 x", "copy_gbs": 10.0, "torch": {},
            "memory_gbs": {"copy": 10.0}, "runtime_note": None, "rows": [], "summary": {},
            "load_average": {"before": before, "after": after, "cpus": cpus}}


def test_bench_prints_the_load_average_and_warns_when_it_is_high():
    quiet = bench.format_table(_report(0.3, 1.9))
    assert "load average (1 min): 0.30 before, 1.90 after the run, on 2 CPUs" in quiet and "WARNING" not in quiet
    for before, after in ((4.2, 5.0), (0.2, 3.5)):
        busy = bench.format_table(_report(before, after))
        assert "WARNING: the machine was busy" in busy and f"{before:.2f}" in busy


def test_bench_says_why_it_does_not_take_a_fused_preset(capsys):
    for name in presets.FUSED_PRESETS:
        code, _, err = run(capsys, "bench", "--preset", name)
        assert code == 2 and "benchmarks/pyramid.py" in err, err


# ------------------------------------------------------------------ messages


def test_a_negative_scalar_output_size_is_named_as_given():
    with pytest.raises(ValueError, match=r"^output_size must be >= 0, got -1$"):
        pt.adaptive_avg_pool2d(np.ones((1, 2, 4, 4), np.float32), -1)


def test_explains_input_shape_is_named_as_given():
    with pytest.raises(ValueError, match=r"^input_shape\[1\] must be >= 0, got -3$"):
        pt.explain("adaptive_avg_pool2d", (2, -3, 4, 4), 2)


def test_a_wrong_rank_input_shape_in_a_backward_call_names_input_shape(rng):
    grad = random_input(rng, (2, 3, 2, 2))
    for input_shape in ((3, 8, 8), (2, 3, 8)):
        with pytest.raises(ValueError, match=r"^input_shape .* has 3 dimensions and grad_out .* has 4"):
            pt.adaptive_avg_pool2d_backward(grad, input_shape)


def test_a_non_contiguous_device_array_gets_a_hint_to_copy(rng):
    import pyopencl.array as cl_array

    device = pt.backends.default_device()
    if device.info.backend != "opencl":
        pytest.skip("the default device is not an OpenCL device")
    x = cl_array.to_device(device.queue, random_input(rng, (2, 3, 8, 8)))
    with pytest.raises(ValueError, match="contiguous copy"):
        pt.adaptive_avg_pool2d(x.transpose((0, 1, 3, 2)), 2)
    with pytest.raises(ValueError, match=r"pass x\.copy\(\)"):
        pt.adaptive_avg_pool2d(x[1:], 2)


HUGE = """
import resource, numpy as np
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # an allocation of what cannot be had fails fast
import pool_tuner as pt
x = np.ones((2, 3, 8, 8), np.float32)
for call in (lambda: pt.adaptive_avg_pool2d(x, (2**31 - 1, 1)), lambda: pt.explain("adaptive_avg_pool2d", x.shape, (2**31 - 1, 1))):
    try:
        call()
    except ValueError as exc:
        print("ValueError:", exc)
"""


def test_an_output_that_cannot_be_had_is_refused_before_allocating():
    done = _python(HUGE)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2, done.stdout
    for line in lines:
        assert line.startswith("ValueError: output_size gives an output of shape (2, 3, 2147483647, 1)"), line
        assert "GiB" in line


def test_pool_tuner_onnx_without_torch_says_what_to_install():
    done = _python("import sys; sys.modules['torch'] = None\n"
                   "try:\n    import pool_tuner.onnx\nexcept ImportError as exc:\n    print(type(exc).__name__, exc)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ImportError pool_tuner.onnx needs PyTorch"), done.stdout
    assert 'pip install "pool-tuner[onnx]"' in done.stdout


# ------------------------------------------------------------------ presets


def test_the_readme_lists_every_preset():
    readme = (REPO / "README.md").read_text()
    listed = re.search(r"^Presets: (.*?)\.\s", readme, re.MULTILINE | re.DOTALL).group(1)
    for name in list(presets.PRESETS) + list(presets.FUSED_PRESETS):
        assert f"`{name}`" in listed, name


def test_quickstart_runs_a_fused_preset(tmp_path):
    script = REPO / "examples" / "quickstart.py"
    env = dict(os.environ, PYTHONPATH=str(REPO), POOL_TUNER_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, str(script), "pspnet_ppm_fused", "--repeat", "1"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert "8x2048x1x1, 8x2048x2x2, 8x2048x3x3, 8x2048x6x6" in line
    error = float(re.search(r"max\|err\|=(\S+)", line).group(1))
    assert error < 1e-5, line
