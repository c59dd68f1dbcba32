"""pool_tuner never pins PoCL's worker threads itself (POCL_AFFINITY is the user's: setting it would
pin the user's own OpenCL code and every child process too); it says whether they are pinned and
whether pinning would be safe here (backends/pocl_env.py)."""

import os
import subprocess
import sys

import pytest

from pool_tuner.backends import pocl_env

AFFINITY = pocl_env.AFFINITY_ENV


@pytest.fixture
def four_cpus(monkeypatch):
    """A machine of 4 online CPUs on which the process may run on all of them (tests narrow it)."""
    monkeypatch.setattr(pocl_env, "online_cpus", lambda: 4)
    allowed = {0, 1, 2, 3}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(allowed), raising=False)
    return allowed


def test_pinning_is_advised_where_it_is_safe(four_cpus):
    environ = {}
    said = pocl_env.affinity_note(environ)
    assert environ == {}
    assert "not pinned" in said and "set POCL_AFFINITY=1" in said


@pytest.mark.parametrize("value", ["0", "1", ""])
def test_a_users_setting_is_reported(four_cpus, value):
    environ = {AFFINITY: value}
    four_cpus.clear()
    assert f"POCL_AFFINITY={value!r} as set by the user" in pocl_env.affinity_note(environ)
    assert environ == {AFFINITY: value}


@pytest.mark.parametrize("name", pocl_env.WORKER_COUNT_ENVS)
def test_not_advised_when_the_worker_count_is_chosen(four_cpus, name):
    # More workers than CPUs with pinning makes PoCL abort ("PTHREAD ERROR ... Invalid argument").
    said = pocl_env.affinity_note({name: "6"})
    assert f"{name} is set" in said and "not safe" in said


@pytest.mark.parametrize("allowed", [{0, 1}, {2, 3}, {0, 1, 3}, {1, 2, 3}])
def test_not_advised_when_the_process_may_not_run_on_every_cpu(four_cpus, allowed):
    four_cpus.intersection_update(allowed)
    assert "may not run on every CPU" in pocl_env.affinity_note({})


def test_not_advised_without_cpu_affinity(four_cpus, monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert "no CPU affinity" in pocl_env.affinity_note({})


CHILD = """
import os, sys
import numpy as np
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
                    reason="needs two CPUs, to tell a pinned worker from the process")
@pytest.mark.parametrize("users", [None, "1"])
def test_in_a_fresh_process_pinning_is_the_users_choice(users):
    """Without the user's POCL_AFFINITY no thread is pinned and the variable stays unset; with
    POCL_AFFINITY=1 (where pinning is safe) PoCL pins a worker to CPU 0 alone (read from /proc).
    Results are right either way."""
    env = {k: v for k, v in os.environ.items() if k != AFFINITY and k not in pocl_env.WORKER_COUNT_ENVS}
    if users is not None:
        env[AFFINITY] = users
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    value, correct, cpus_of_threads, said = done.stdout.strip().split("|")
    assert correct == "True", said
    assert value == str(users), said
    if users is None:
        assert "'0'" not in cpus_of_threads or len(os.sched_getaffinity(0)) == 1, cpus_of_threads
    elif os.sched_getaffinity(0) == set(range(pocl_env.online_cpus())):
        assert "'0'" in cpus_of_threads, cpus_of_threads  # a worker allowed CPU 0 only
