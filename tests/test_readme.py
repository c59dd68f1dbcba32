"""The README's Python examples run as pasted, and print what their comments say."""

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks():
    if not README.exists():  # tests run from an installed copy without the checkout
        pytest.skip("README.md not found beside tests/")
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_examples_run_and_print_what_they_claim():
    blocks = python_blocks()
    assert len(blocks) >= 2
    namespace = {}
    for block in blocks:
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            exec(compile(block, str(README), "exec"), namespace)
        printed = output.getvalue().splitlines()
        calls = [line for line in block.splitlines() if line.startswith("print(")]
        assert len(printed) == len(calls)
        for line, shown in zip(calls, printed):
            claim = line.partition("#")[2].strip()
            if claim and not claim.startswith("e.g."):
                assert shown.strip() == claim.split(":")[0].strip(), f"{line!r} printed {shown!r}"


def test_quickstart_prints_the_dispatch_the_error_and_the_time_per_call(tmp_path):
    """The README's main job, second half: examples/quickstart.py on a preset prints, per shape,
    where dispatch took the kernel from (an empty user cache: the shipped records where they match
    this device, else the default), the kernel, an exact max and a time per call from loops."""
    import os
    import subprocess
    import sys

    import pool_tuner

    script = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"
    if not script.exists():
        pytest.skip("examples/ is not beside the tests (installed package)")
    env = dict(os.environ, POOL_TUNER_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, str(script), "spp_net", "--repeat", "1"], capture_output=True, text=True,
                          timeout=300, check=True, cwd=tmp_path, env=env)
    lines = re.findall(r"^adaptive_max_pool2d 32x256x13x13 -> 32x256x(\d)x\d: source=(\w+) variant=(\w+) .*"
                       r"max\|err\|=(\S+) ([\d.]+) ms/call \(loops of (\d+) calls\)$", done.stdout, re.M)
    assert [size for size, *_ in lines] == ["4", "2", "1"], done.stdout
    for _, source, variant, error, ms, calls in lines:
        assert source in ("cache", "default") and variant in pool_tuner.variants("adaptive_max_pool2d")
        assert float(error) == 0.0  # max pooling selects an input element exactly
        assert float(ms) > 0 and int(calls) >= 3
