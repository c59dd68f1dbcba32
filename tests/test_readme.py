"""The README's Python examples run as pasted and print what their comments say; the tables the docs
print from code (the variant table, the rule features) are the code's; every link between the docs resolves."""

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


DOCS = [README, README.parent / "docs" / "design.md", README.parent / "docs" / "benchmarks.md"]


def test_the_design_doc_prints_the_variant_table_as_it_is():
    """The variant table has one source, the registry (``variants.markdown_table``); docs/design.md
    prints it, and this fails when that copy is stale (paste the function's output over it)."""
    from pool_tuner.variants import markdown_table

    design = DOCS[1]
    if not design.exists():
        pytest.skip("docs/ is not beside the tests (installed package)")
    assert markdown_table() in design.read_text(), (
        "docs/design.md does not print the current variant table: paste pool_tuner.variants.markdown_table()")


def anchors(path: Path):
    """GitHub's anchors of a Markdown file's headings (outside code blocks)."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    seen: dict = {}
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_link_between_the_docs_reaches_a_file_and_heading_that_exist(doc):
    if not doc.exists():
        pytest.skip(f"{doc.name} is not beside the tests (installed package)")
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # an external address
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and path.suffix == ".md" and anchor not in set(anchors(path)):
            broken.append(f"{target}: no heading with anchor #{anchor} in {path.name}")
    assert not broken, broken


def test_the_design_doc_lists_the_features_a_default_rule_may_test():
    """docs/design.md's legend of the rules' features is ``default_rules.FEATURES``, as it is."""
    from pool_tuner import default_rules

    design = DOCS[1]
    if not design.exists():
        pytest.skip("docs/ is not beside the tests (installed package)")
    legend = "\n".join(f"- `{name}` — {meaning}" for name, meaning in default_rules.FEATURES.items())
    assert legend in design.read_text(), "docs/design.md's list of rule features differs from default_rules.FEATURES"
