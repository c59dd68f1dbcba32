"""benchmarks/nearest_bound.py: the shapes the nearest-shape bound hands to the default rules."""

import json
from pathlib import Path

import pytest

from conftest import load_benchmark
from pool_tuner import backends, cache, dispatch, kernel_source
from pool_tuner.problem import Problem

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def script(monkeypatch, tmp_path, user_cache):
    """The script, with one record of this device shipped: global pooling of 32x2048x7x7."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    device = backends.default_device()
    problem = Problem.create("adaptive_avg_pool2d", (32, 2048, 7, 7), 1)
    best = {"variant": "thread_per_output", "params": {"block_size_x": 64, "outputs_per_thread": 1, "row_lanes": 1},
            "time_ms": 0.5}
    record = cache.make_record(problem, device.info.fingerprint,
                               cache.record_kernel_hash(problem, device.info.fingerprint), best, [])
    (tmp_path / "fleet.json").write_text(json.dumps({"schema": cache.SCHEMA_VERSION, "records": {record["key"]: record}}))
    monkeypatch.setattr(kernel_source, "shipped_cache_dir", lambda: tmp_path)
    dispatch.forget()
    yield load_benchmark("nearest_bound")
    dispatch.forget()


def test_it_lists_the_shapes_beyond_a_bound_with_their_record_and_the_rules_choice(script, capsys):
    assert script.main(["--list-only", "--grid", "", "--bound", "2"]) == 0
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if "regnet_y_se_14" in line]
    assert "at 3.79 from 32x2048x7x7: record thread_per_output" in line and "rules " in line
    # at 0.66, within the bound, but a CPU's global pooling takes only its own shape's records
    assert "efficientnet_b0_head: adaptive_avg_pool2d forward NCHW 32x1280x7x7->1x1 at 0.66 from 32x2048x7x7" in out
    assert "inception_grid_17_to_5:" not in out  # another class


def test_a_bound_above_the_shipped_one_is_refused(script):
    with pytest.raises(SystemExit):
        script.main(["--list-only", "--grid", "", "--bound", str(dispatch.NEAREST_MAX_DISTANCE["cpu"] + 1)])
