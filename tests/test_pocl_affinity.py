"""pool_tuner asks PoCL to pin its worker threads (POCL_AFFINITY=1) only where that cannot abort the
process or move threads out of the process's CPUs, never overrides a user's own setting, and lets
a child process that inherits its setting check again (backends/opencl.py, request_pocl_affinity)."""

import os
import subprocess
import sys

import pytest

from pool_tuner.backends import opencl

AFFINITY, MARK = opencl.POCL_AFFINITY_ENV, opencl.POCL_AFFINITY_MARK_ENV


@pytest.fixture
def four_cpus(monkeypatch):
    """A machine of 4 online CPUs on which the process may run on all of them (tests narrow it)."""
    monkeypatch.setattr(opencl, "online_cpus", lambda: 4)
    allowed = {0, 1, 2, 3}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(allowed), raising=False)
    return allowed


def test_sets_the_variable_and_its_mark_when_every_cpu_is_allowed(four_cpus):
    environ = {}
    said = opencl.request_pocl_affinity(environ)
    assert environ == {AFFINITY: "1", MARK: "1"}
    assert "POCL_AFFINITY=1 set by pool_tuner" in said


@pytest.mark.parametrize("value", ["0", "1", ""])
def test_a_users_setting_is_kept(four_cpus, value):
    environ = {AFFINITY: value}
    four_cpus.clear()  # even where pinning would not be safe: it is the user's choice
    said = opencl.request_pocl_affinity(environ)
    assert environ == {AFFINITY: value}
    assert f"POCL_AFFINITY={value!r} as set by the user" in said


@pytest.mark.parametrize("name", opencl.POCL_WORKER_COUNT_ENVS)
def test_left_alone_when_the_worker_count_is_chosen(four_cpus, name):
    # More workers than CPUs with pinning makes PoCL abort ("PTHREAD ERROR ... Invalid argument").
    environ = {name: "6"}
    said = opencl.request_pocl_affinity(environ)
    assert environ == {name: "6"}
    assert f"{name} is set" in said


@pytest.mark.parametrize("allowed", [{0, 1}, {2, 3}, {0, 1, 3}, {1, 2, 3}])
def test_left_alone_when_the_process_may_not_run_on_every_cpu(four_cpus, allowed):
    four_cpus.intersection_update(allowed)
    environ = {}
    said = opencl.request_pocl_affinity(environ)
    assert environ == {}
    assert "may not run on every CPU" in said


def test_left_alone_without_cpu_affinity(four_cpus, monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    environ = {}
    assert "no CPU affinity" in opencl.request_pocl_affinity(environ)
    assert environ == {}


@pytest.mark.parametrize("safe", [True, False])
def test_an_inherited_setting_is_checked_again(four_cpus, safe):
    """A child process inherits the variable and its mark: kept where pinning is safe for it,
    both dropped where it is not (a child started on fewer CPUs)."""
    if not safe:
        four_cpus.discard(0)
    environ = {AFFINITY: "1", MARK: "1"}
    said = opencl.request_pocl_affinity(environ)
    if safe:
        assert environ == {AFFINITY: "1", MARK: "1"} and "set by pool_tuner" in said
    else:
        assert environ == {} and "may not run on every CPU" in said


CHILD = """
import os, sys
import numpy as np
if sys.argv[1] == "one_cpu":
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
import pool_tuner as pt
from pool_tuner import reference
from pool_tuner.backends import opencl
x = np.random.default_rng().uniform(-1, 1, (2, 3, 9, 7)).astype(np.float32)
y = pt.adaptive_avg_pool2d(x, (4, 3))
expected = reference.forward("adaptive_avg_pool2d", x.astype(np.float64), (4, 3))
cpus_of_threads = set()
for task in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{task}/status") as status:
        cpus_of_threads |= {line.split()[1] for line in status if line.startswith("Cpus_allowed_list")}
print(os.environ.get("POCL_AFFINITY"), float(abs(y - expected).max()) < 1e-6, sorted(cpus_of_threads),
      opencl.pocl_affinity(), sep="|")
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or not os.path.isdir("/proc/self/task"),
                    reason="CPU affinity and /proc are Linux-only")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
                    reason="needs two CPUs, to tell a pinned worker from the process and to restrict the child to one")
@pytest.mark.parametrize("cpus, inherited", [("all", False), ("one_cpu", False), ("one_cpu", True)])
def test_decision_in_a_fresh_process(cpus, inherited):
    """In a fresh process pool_tuner sets the variable exactly when pinning is safe, PoCL then pins
    a worker to CPU 0 alone (read from /proc), and pooling gives right results either way -- also
    in a child that inherited pool_tuner's setting and was then restricted to one CPU."""
    env = {k: v for k, v in os.environ.items() if k not in (AFFINITY, MARK) + opencl.POCL_WORKER_COUNT_ENVS}
    if inherited:
        env.update({AFFINITY: "1", MARK: "1"})
    done = subprocess.run([sys.executable, "-c", CHILD, cpus], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    value, correct, cpus_of_threads, said = done.stdout.strip().split("|")
    assert correct == "True", said
    pinned = cpus == "all" and os.sched_getaffinity(0) == set(range(opencl.online_cpus()))
    assert value == ("1" if pinned else "None"), said
    if pinned:
        assert "'0'" in cpus_of_threads, cpus_of_threads  # a worker allowed CPU 0 only
