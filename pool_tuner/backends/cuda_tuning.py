"""The CUDA tuning thread: one long-lived thread per process on which all CUDA tuning runs --
Kernel Tuner's searches and pool_tuner's race -- while the thread that asked waits.

Why one thread: Kernel Tuner's PyCUDA backend makes the device's primary context current on
PyCUDA's per-thread context stack only the first time it sets up a device, on whichever thread that
happens (a class attribute remembers the device), and its ``drv.Stream()``, events and
allocations need that stack on the calling thread.  Tuning from a second thread -- PyTorch's
autograd thread running a backward pass under ``POOL_TUNER_AUTOTUNE=1``, a user's worker --
therefore failed with ``invalid device context`` on every configuration.  PyCUDA objects must also
be freed on the thread whose context stack made them, or they leak ("out-of-thread context could
not be cleaned up"): the race's arrays and events are made and dropped on this thread too.  Kernel
Tuner's own are not dropped when its run ends: its ``PyCudaFunctions`` (holding the module, the
stream and the two events of the run) and the ``PyCudaRuntimeObserver`` it makes refer to each
other, so only Python's cycle collector frees them -- on whichever thread it next runs, usually
another one, or at exit, after the context was popped (the first H100 lease's dispatch_grid log:
"module/stream/event in out-of-thread context could not be cleaned up").  So each piece of work
ends with a collection on this thread (``_Job.run``), while the context that made them is still
current here.

``run(work)`` from any other thread queues ``work`` and waits for its result or exception; from the
tuning thread itself (a tuning that races, ``tune_on_miss`` that tunes) it calls ``work`` directly.

Exit: Kernel Tuner's PyCUDA backend pushes the primary context here, on the tuning thread, and
registers an exit hook that pops it -- on the main thread, which has nothing to pop ("Exception
ignored in atexit callback ... context::pop failed").  So after the first tuning that set it up,
an exit hook of pool_tuner's is registered, which runs before Kernel Tuner's (exit hooks run
last-registered first; the tuning thread, a daemon, still runs then): it pops the context here,
where it was pushed, and leaves Kernel Tuner's hook nothing to pop.  That context is Kernel
Tuner's alone: pool_tuner's calls never use this thread's context stack.

Ctrl-C: the interrupt reaches the waiting (main) thread, not this one; ``run`` forwards it as a
``KeyboardInterrupt`` raised inside the work (``PyThreadState_SetAsyncExc``), where the tuner
catches it, stores what was measured and raises ``TuningInterrupted``, which ``run`` re-raises in
the waiting thread, as a tuning on the calling thread would.

Kernel Tuner's toolkit: its PyCUDA backend compiles with PyCUDA's ``DynamicSourceModule`` -- PTX
linked against ``libcudadevrt`` through the driver -- and takes nvcc from ``PATH`` and the library
from ``CUDA_ROOT``.  ``toolkit_environment`` sets both, for the duration of a tuning, to the nvcc
pool_tuner's own builds use (``cuda.find_nvcc``), so tuning works wherever calls do (nvcc found
only through ``CUDA_HOME`` or pip's ``nvidia-cuda-nvcc``).  The environment is process-wide: other
threads see the two variables changed while a CUDA tuning runs.  PTX can only be JIT-compiled by a
driver at least as new as the nvcc that wrote it, so ``check_driver`` refuses, with what to do, a
driver older than the nvcc.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import gc
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading

from .base import TuningUnavailable


class _Job:
    """One piece of work queued for the tuning thread, and its outcome."""

    def __init__(self, work):
        self.work = work
        self.result = self.error = None
        self.done = threading.Event()
        self.lock = threading.Lock()  # guards ``running``/``cancelled`` against the forwarding of Ctrl-C
        self.running = self.cancelled = False

    def run(self) -> None:
        with self.lock:
            if self.cancelled:  # the waiting thread was interrupted before the work began
                return
            self.running = True
        try:
            self.result = self.work()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self.error = exc
        finally:
            with self.lock:
                self.running = False
            # The cycles the work left (Kernel Tuner's PyCUDA objects) freed here, on the thread
            # whose context stack made them; after ``running`` is cleared, so that no Ctrl-C
            # forwarded into the work lands in the collection.
            gc.collect()
            self.done.set()


#: Seconds between the waiting thread's looks for a Ctrl-C.
_POLL_S = 0.1
_STATE_LOCK = threading.Lock()
_thread: threading.Thread | None = None
_jobs: queue.Queue = queue.Queue()


def _serve(jobs: queue.Queue) -> None:
    while True:
        try:
            jobs.get().run()
            _pop_kernel_tuner_context_at_exit()
        except KeyboardInterrupt:  # a forwarded Ctrl-C that landed after its work had ended
            continue


#: Seconds the exit hook waits for the tuning thread to pop Kernel Tuner's context.
_EXIT_WAIT_S = 10.0
_exit_hook_registered = False


class _Popped:
    """What Kernel Tuner's exit hook finds once its context is popped: nothing left to pop."""

    @staticmethod
    def pop() -> None:
        pass


def _pop_kernel_tuner_context_at_exit() -> None:
    """Once a tuning has set up Kernel Tuner's PyCUDA backend, register ``_pop_kernel_tuner_context``
    to run at exit, after Kernel Tuner's own hook was registered (see the module docstring)."""
    global _exit_hook_registered
    functions = getattr(sys.modules.get("kernel_tuner.backends.pycuda"), "PyCudaFunctions", None)
    if _exit_hook_registered or functions is None or functions.last_selected_context is None:
        return
    _exit_hook_registered = True
    atexit.register(_pop_kernel_tuner_context, functions)


def _pop_kernel_tuner_context(functions) -> None:
    """Pop the context Kernel Tuner pushed, on the tuning thread that pushed it."""
    context, functions.last_selected_context = functions.last_selected_context, _Popped()
    thread = _thread
    if isinstance(context, _Popped) or thread is None or not thread.is_alive():
        return
    job = _Job(context.pop)
    _jobs.put(job)
    job.done.wait(_EXIT_WAIT_S)


def tuning_thread() -> threading.Thread:
    """The tuning thread, started on first use."""
    global _thread
    with _STATE_LOCK:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_serve, args=(_jobs,), name="pool_tuner-cuda-tuning", daemon=True)
            _thread.start()
        return _thread


def on_tuning_thread() -> bool:
    return threading.current_thread() is _thread


def run(work):
    """``work()`` on the tuning thread; its result, or its exception raised here."""
    if on_tuning_thread():
        return work()
    thread = tuning_thread()
    job = _Job(work)
    _jobs.put(job)
    try:
        while not job.done.wait(_POLL_S):  # short waits: Ctrl-C is seen even when its signal hit another thread
            pass
    except KeyboardInterrupt:
        with job.lock:
            if not job.running:  # not begun (and now never will) or already over
                job.cancelled = True
                raise
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(KeyboardInterrupt))
        job.done.wait()  # the tuner stores what it measured, then raises TuningInterrupted
    if job.error is not None:
        raise job.error
    return job.result


def _after_fork_in_child() -> None:
    """A forked child has no tuning thread (only the forking thread survives a fork)."""
    global _thread, _jobs, _STATE_LOCK
    _thread, _jobs, _STATE_LOCK = None, queue.Queue(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------------- Kernel Tuner's toolkit

@functools.cache
def nvcc_release(nvcc: str) -> tuple[int, int]:
    """``(major, minor)`` of ``nvcc --version``'s release line."""
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"could not run {nvcc} --version: {exc}") from None
    found = re.search(r"release (\d+)\.(\d+)", text)
    if found is None:
        raise RuntimeError(f"{nvcc} --version names no release: {text.strip()[:200]!r}")
    return int(found[1]), int(found[2])


@functools.cache
def toolkit_root(nvcc: str) -> str:
    """The CUDA toolkit directory of ``nvcc``, as nvcc itself reports it (``TOP`` of
    ``nvcc -dryrun``), so that a wrapper script on PATH still leads to its toolkit."""
    with tempfile.TemporaryDirectory(prefix="pool_tuner_nvcc_") as scratch:
        source = os.path.join(scratch, "empty.cu")
        open(source, "w").close()
        try:
            proc = subprocess.run([nvcc, "-dryrun", "-cubin", source], capture_output=True, text=True, timeout=60,
                                  cwd=scratch)
        except (OSError, subprocess.SubprocessError):
            proc = None
    found = re.search(r"^#\$ TOP=(.+)$", (proc.stdout + proc.stderr) if proc else "", re.M)
    return os.path.normpath(found[1].strip()) if found else os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def check_driver(driver_version: int, nvcc: str, device: str) -> None:
    """Refuse to tune when the CUDA driver (``cuDriverGetVersion``, e.g. 12040) is older than
    ``nvcc``: Kernel Tuner's PTX would fail to load in every configuration."""
    major, minor = nvcc_release(nvcc)
    if driver_version < major * 1000 + minor * 10:
        driver = f"{driver_version // 1000}.{driver_version % 1000 // 10}"
        raise TuningUnavailable(
            f"{device} cannot be tuned with {nvcc} (CUDA {major}.{minor}): the driver supports CUDA {driver}, and "
            f"Kernel Tuner's PyCUDA backend compiles PTX, which only a driver at least as new as the nvcc can load; "
            f"put an nvcc of CUDA {driver} or older first on PATH (or set CUDA_HOME to that toolkit), or update "
            f"the driver")


def kernel_tuner_environment(nvcc: str) -> dict:
    """``PATH`` and ``CUDA_ROOT`` as Kernel Tuner's PyCUDA backend must see them to compile with
    ``nvcc``; raises ``TuningUnavailable`` when that toolkit lacks the ``libcudadevrt.a`` it links."""
    root = toolkit_root(nvcc)
    if not os.path.isfile(os.path.join(root, "lib64", "libcudadevrt.a")):
        raise TuningUnavailable(
            f"Kernel Tuner's PyCUDA backend links every kernel against libcudadevrt.a, and the toolkit of {nvcc} "
            f"({root}) has no lib64/libcudadevrt.a; use a full CUDA toolkit's nvcc (PATH or CUDA_HOME)")
    path = os.environ.get("PATH", "")
    if shutil.which("nvcc") != nvcc:
        path = os.path.dirname(nvcc) + os.pathsep + path
    return {"PATH": path, "CUDA_ROOT": root}


@contextlib.contextmanager
def environment(values: dict):
    """``os.environ`` updated with ``values`` for the block, then restored."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
