"""The default-dispatch rules (pool_tuner.default_rules): how they are read and applied, that the
shipped ones decide shapes outside the grid they were derived from (with correct results), that
they are what the grid data derives, and that the docs print them as they are."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import pool_tuner as pt
from pool_tuner import backends, default_rules, dispatch, reference
from pool_tuner.problem import Problem

from conftest import random_input
from test_forward import to_channels_last

ROOT = Path(__file__).resolve().parent.parent

#: A rule list exercising each mechanism: a backward variant legal only in float32/float64, a
#: forward rule on a numeric range whose configuration is illegal for narrow windows, fallbacks.
SYNTHETIC = {"devices": {"test": {"rules": [
    {"name": "scatter", "when": {"direction": "backward"}, "variant": "plane_scatter"},
    {"name": "wide", "when": {"direction": "forward", "window": {"min": 10}}, "variant": "thread_per_output",
     "config": {"row_lanes": 4}},
    {"name": "max-global", "when": {"direction": "forward", "kind": "max", "problem_class": "global"},
     "variant": "global_planes"},
    {"name": "forward", "when": {"direction": "forward"}, "variant": "thread_per_output"},
    {"name": "backward", "when": {"direction": "backward"}, "variant": "thread_per_input"},
]}}}


@pytest.fixture(scope="module")
def synthetic():
    return default_rules.parse(SYNTHETIC)["test"]


def decide(op, shape, out, synthetic, **kwargs):
    return default_rules.decide(Problem.create(op, shape, out, **kwargs), backends.default_device(), synthetic)


def test_the_first_rule_that_holds_fires(synthetic):
    assert decide("adaptive_avg_pool2d", (2, 3, 40, 40), (4, 4), synthetic).rule.name == "wide"  # window 10x10
    assert decide("adaptive_avg_pool2d", (2, 3, 8, 8), (4, 4), synthetic).rule.name == "forward"  # window 2x2
    assert decide("adaptive_max_pool2d", (2, 3, 3, 3), (1, 1), synthetic).rule.name == "max-global"


def test_a_rule_whose_variant_cannot_run_the_problem_passes_it_on(synthetic):
    assert decide("adaptive_avg_pool2d", (2, 3, 8, 8), (4, 4), synthetic, direction="backward").rule.name == "scatter"
    in_half = decide("adaptive_avg_pool2d", (2, 3, 8, 8), (4, 4), synthetic, dtype="float16", direction="backward")
    assert (in_half.rule.name, in_half.variant.name) == ("backward", "thread_per_input")


def test_a_rule_configuration_that_is_illegal_here_runs_the_variant_default_and_says_so(synthetic):
    """row_lanes=4 needs window rows of 4 contiguous inputs; 12 -> 1 along W has them, 40 -> 10
    along W (windows of 4) has them too, but 10 -> 3 along W (windows of 4 and 5 under 10 rows)
    is checked against the longest run."""
    legal = decide("adaptive_avg_pool2d", (1, 2, 40, 12), (4, 1), synthetic)
    assert legal.rule.name == "wide" and legal.params["row_lanes"] == 4 and legal.config_note is None
    narrow = decide("adaptive_avg_pool2d", (1, 2, 40, 3), (4, 3), synthetic)
    assert narrow.rule.name == "wide" and narrow.config_note and "row_lanes" in narrow.config_note
    variant = narrow.variant
    problem = Problem.create("adaptive_avg_pool2d", (1, 2, 40, 3), (4, 3))
    assert narrow.params == variant.check_config({}, problem, backends.default_device().limits)


@pytest.mark.parametrize("change,message", [
    ({"when": {"direction": "forward", "colour": "red"}}, "unknown feature 'colour'"),
    ({"when": {"direction": "forward", "window": 10}}, "window needs"),
    ({"when": {"direction": "forward", "kind": 1}}, "kind needs a word"),
    ({"variant": "no_such_variant"}, "variant must be one of"),
])
def test_a_bad_rule_is_refused_with_what_is_wrong(change, message):
    bad = json.loads(json.dumps(SYNTHETIC))
    bad["devices"]["test"]["rules"][1].update(change)
    with pytest.raises(ValueError, match=message):
        default_rules.parse(bad)


def test_a_rule_list_without_a_last_rule_for_a_direction_is_refused():
    bad = json.loads(json.dumps(SYNTHETIC))
    bad["devices"]["test"]["rules"] = [r for r in bad["devices"]["test"]["rules"] if r["name"] != "backward"]
    with pytest.raises(ValueError, match="last rule for every backward pass"):
        default_rules.parse(bad)


#: Shapes outside the grid of benchmarks/dispatch_grid.py: other plane sizes, ranks, dtypes, windows.
OUTSIDE_THE_GRID = [
    ("adaptive_avg_pool2d", (3, 5, 13, 11), (1, 1), "float32", None, "forward"),
    ("adaptive_max_pool2d", (3, 5, 13, 11), (1, 1), "float64", None, "backward"),
    ("adaptive_avg_pool2d", (2, 7, 30, 17), (4, 5), "float16", None, "forward"),
    ("adaptive_avg_pool2d", (2, 7, 30, 17), (4, 5), "float16", None, "backward"),
    ("adaptive_max_pool2d", (2, 6, 9, 10), (13, 3), "float32", "NHWC", "forward"),
    ("adaptive_max_pool3d", (1, 3, 5, 6, 7), (2, 1, 3), "float32", "NDHWC", "backward"),
    ("adaptive_avg_pool1d", (2, 3, 100), (7,), "bfloat16", None, "forward"),
    ("adaptive_avg_pool2d", (1, 2, 6, 3000), (3, 3), "float64", None, "forward"),
]


@pytest.mark.parametrize("op,shape,out,dtype,layout,direction", OUTSIDE_THE_GRID)
def test_the_shipped_rules_decide_shapes_outside_the_grid_and_their_kernels_are_right(
        op, shape, out, dtype, layout, direction, user_cache, rng):
    """With no record at all (the tests' shipped cache is empty), dispatch is the rules': explain
    names the rule, which is the first shipped rule that holds and whose variant is legal, and the
    call it dispatches matches the float64 reference."""
    device = backends.default_device()
    problem = Problem.create(op, shape, out, dtype, layout, direction=direction)
    info = pt.explain(op, shape, out, dtype=dtype, layout=layout, direction=direction)
    values = default_rules.features(problem)
    expected = next(r for r in default_rules.rules(default_rules.device_type(device))
                    if r.holds(values) and dispatch.variants_mod.variants_for(op, direction)[r.variant].is_legal(
                        {}, problem, device.limits))
    assert (info["source"], info["rule"], info["variant"]) == ("default", expected.name, expected.variant)
    if dtype == "bfloat16":
        return  # numpy has no bfloat16 without ml_dtypes; the decision is what this case checks
    ndim, tolerance = problem.ndim, (2e-2 if dtype == "float16" else 1e-5)
    in_memory = (lambda a: to_channels_last(a, ndim)) if problem.channels_last else (lambda a: a)
    x = random_input(rng, shape, np.dtype(dtype))
    values, indices = reference.forward(op, x.astype(np.float64), out) if problem.kind == "max" else (
        reference.forward(op, x.astype(np.float64), out), None)
    if direction == "forward":
        got = getattr(pt, op)(in_memory(x), out)
        assert np.allclose(np.asarray(got, np.float64), values, rtol=tolerance, atol=tolerance)
        return
    grad = random_input(rng, problem.output_shape, np.dtype(dtype))
    want = reference.backward(op, grad.astype(np.float64), shape, indices)
    args = (in_memory(grad),) + (() if indices is None else (in_memory(indices),)) + (shape,)
    got = getattr(pt, f"{op}_backward")(*args)
    assert np.allclose(np.asarray(got, np.float64), want, rtol=tolerance, atol=tolerance)


def test_every_shipped_rule_names_a_known_variant_and_each_list_ends_in_fallbacks():
    for device_type in ("cpu", "gpu"):
        table = default_rules.rules(device_type)
        for direction, fallback in (("forward", "thread_per_output"), ("backward", "thread_per_input")):
            last = [r for r in table if r.when == (("direction", direction),)][-1]
            assert last.variant == fallback


def test_the_design_doc_prints_the_rules_as_they_are():
    """docs/design.md is where the rules are printed (the README links there)."""
    path = ROOT / "docs" / "design.md"
    if not path.exists():
        pytest.skip("docs/ is not beside the tests (installed package)")
    text = path.read_text()
    for device_type in ("cpu", "gpu"):
        table = default_rules.markdown_table(default_rules.rules(device_type))
        assert table in text, f"docs/design.md does not print the current {device_type} rules (markdown_table)"


def test_the_shipped_cpu_rules_are_what_the_shipped_grid_derives():
    script = ROOT / "benchmarks" / "derive_rules.py"
    if not script.exists():
        pytest.skip("benchmarks/ is not beside the tests (installed package)")
    spec = importlib.util.spec_from_file_location("derive_rules", script)
    derive_rules = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(derive_rules)
    assert derive_rules.main(["--check"]) == 0
