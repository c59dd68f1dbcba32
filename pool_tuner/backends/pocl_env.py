"""PoCL's environment variables, as pool_tuner reads them -- it never writes one.

PoCL reads its variables (``POCL_DEVICES``, ``POCL_AFFINITY``, its worker counts) once per
process, when OpenCL is first listed, and the driver it then starts serves every OpenCL user of
the process.  A variable set for pool_tuner would therefore change the user's own OpenCL code
(which devices ``platform.get_devices()`` lists, whether their worker threads are pinned), and
would be inherited by every child process.  So pool_tuner leaves all of them to the user, and this
module only says, in words, what they mean for pool_tuner's calls: whether PoCL pins its workers
(``affinity_note``, shown by ``pool-tuner devices`` and ``bench``), whether pinning them would be
safe in this process (``pinning_hazard``), and whether a PoCL device runs kernels on worker
threads, which a forked child does not have (``runs_worker_threads``; docs/design.md, "The user's
process").
"""

from __future__ import annotations

import os

AFFINITY_ENV = "POCL_AFFINITY"
#: PoCL variables that change how many worker threads it starts (or CPUs it counts).
WORKER_COUNT_ENVS = ("POCL_MAX_PTHREAD_COUNT", "POCL_PTHREAD_MIN_THREADS", "POCL_CPU_MAX_CU_COUNT",
                     "POCL_CPU_MIN_CU_COUNT")
#: Name prefixes of PoCL's CPU devices whose kernels run on worker threads started with the driver
#: (``pthread`` up to PoCL 3, ``cpu`` from PoCL 4); the single-threaded driver (``basic``,
#: ``cpu-minimal``) runs them on the thread that waits.
WORKER_THREAD_DRIVERS = ("pthread-", "cpu-")
SINGLE_THREAD_DRIVERS = ("basic-", "cpu-minimal-")


def online_cpus() -> int:
    """How many CPUs are online (os.cpu_count() can be overridden on Python 3.13+)."""
    try:
        return int(os.sysconf("SC_NPROCESSORS_ONLN"))
    except (AttributeError, ValueError, OSError):
        return os.cpu_count() or 0


def pinning_hazard(environ=os.environ) -> str | None:
    """Why pinning PoCL's workers (worker i to CPU i) could fail in this process, or None.

    PoCL starts one worker per CPU it counts and, pinning, moves worker i to CPU i: a CPU outside
    the process's cgroup cpuset (or offline) makes it abort the whole process ("PTHREAD ERROR ...
    Invalid argument"; so did POCL_MAX_PTHREAD_COUNT=4 on 2 CPUs), and one outside a `taskset`
    mask moves the worker out of the mask.  So pinning is safe only where the process may run on
    every online CPU 0, 1, ... and no variable changes the number of workers."""
    for name in WORKER_COUNT_ENVS:
        if name in environ:
            return f"{name} is set"
    if not hasattr(os, "sched_getaffinity"):
        return "no CPU affinity on this platform"
    if os.sched_getaffinity(0) != set(range(online_cpus())):
        return "this process may not run on every CPU"
    return None


def affinity_note(environ=os.environ) -> str:
    """Whether PoCL pins its worker threads in this process, and what the user may do about it."""
    if AFFINITY_ENV in environ:
        return f"{AFFINITY_ENV}={environ[AFFINITY_ENV]!r} as set by the user"
    hazard = pinning_hazard(environ)
    advice = (f"pinning is not safe in this process ({hazard})" if hazard is not None else
              f"set {AFFINITY_ENV}=1 before the process first uses OpenCL to pin them, which helps small "
              f"layers (docs/design.md, \"PoCL worker pinning\")")
    return f"{AFFINITY_ENV} not set: PoCL's worker threads are not pinned; {advice}"


def runs_worker_threads(device_name: str) -> bool:
    """Whether a PoCL CPU device of this name runs kernels on worker threads started with the
    driver, which a forked child process does not inherit."""
    return device_name.startswith(WORKER_THREAD_DRIVERS) and not device_name.startswith(SINGLE_THREAD_DRIVERS)
