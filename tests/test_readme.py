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
