"""pool_tuner asks PoCL to pin its worker threads (POCL_AFFINITY=1) only where that cannot abort
the process, and never overrides a user's own setting (backends/opencl.py, pin_pocl_threads)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from pool_tuner.backends import opencl

ALL_CPUS = set(range(os.cpu_count() or 1))


@pytest.fixture
def every_cpu_allowed(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(ALL_CPUS), raising=False)


def test_sets_the_variable_when_every_cpu_is_allowed(every_cpu_allowed):
    environ = {}
    said = opencl.pin_pocl_threads(environ)
    assert environ == {"POCL_AFFINITY": "1"}
    assert "POCL_AFFINITY=1 set by pool_tuner" in said


@pytest.mark.parametrize("value", ["0", "1", ""])
def test_a_users_setting_is_kept(every_cpu_allowed, value):
    environ = {"POCL_AFFINITY": value}
    said = opencl.pin_pocl_threads(environ)
    assert environ == {"POCL_AFFINITY": value}
    assert "as set before pool_tuner was imported" in said


def test_left_alone_when_the_worker_count_is_chosen(every_cpu_allowed):
    # More workers than CPUs with pinning makes PoCL abort ("PTHREAD ERROR ... Invalid argument").
    environ = {"POCL_MAX_PTHREAD_COUNT": str(len(ALL_CPUS) + 2)}
    said = opencl.pin_pocl_threads(environ)
    assert "POCL_AFFINITY" not in environ
    assert "POCL_MAX_PTHREAD_COUNT" in said


def test_left_alone_when_the_process_may_not_run_on_every_cpu(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(ALL_CPUS) - {0} or {1}, raising=False)
    environ = {}
    said = opencl.pin_pocl_threads(environ)
    assert environ == {}
    assert "may not run on every CPU" in said


CHILD = """
import os, sys
import numpy as np
if sys.argv[1] == "restricted":
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
import pool_tuner as pt
from pool_tuner.backends import opencl
x = np.random.default_rng().uniform(-1, 1, (2, 3, 9, 7)).astype(np.float32)
y = pt.adaptive_avg_pool2d(x, (4, 3))
expected = np.stack([np.stack([x[:, :, (9 * i) // 4:-(-9 * (i + 1) // 4), (7 * j) // 3:-(-7 * (j + 1) // 3)].mean(axis=(2, 3))
                               for j in range(3)], -1) for i in range(4)], -2)
print(os.environ.get("POCL_AFFINITY"), float(abs(y - expected).max()) < 1e-6, opencl.pocl_affinity, sep="|")
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux-only")
@pytest.mark.parametrize("affinity", ["inherited", "restricted"])
def test_import_time_decision_in_a_fresh_process(affinity):
    """In a fresh process, importing pool_tuner sets the variable exactly when it is safe, and
    pooling on the default device gives right results either way."""
    if affinity == "restricted" and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs to restrict the child to one")
    env = {k: v for k, v in os.environ.items() if k not in ("POCL_AFFINITY", "POCL_MAX_PTHREAD_COUNT")}
    done = subprocess.run([sys.executable, "-c", CHILD, affinity], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    value, correct, said = done.stdout.strip().split("|")
    assert correct == "True"
    pinned = affinity == "inherited" and os.sched_getaffinity(0) == ALL_CPUS
    assert value == ("1" if pinned else "None"), said
