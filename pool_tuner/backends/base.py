"""The device contract: what every backend implements, and all that the rest of pool_tuner uses.

``ops``, ``dispatch``, ``tuner``, ``bench`` and ``cli`` see a device only through ``Device`` below
and a backend module only through ``Backend``: no ``isinstance`` on a backend's class, no attribute
of one backend's library (PyOpenCL's platforms, PyCUDA's contexts) outside that backend's file.

The contract is a few methods, as Kernel Tuner's backend class and tinygrad's runtime files are:
describe the device (``info``, one frozen ``DeviceInfo``: identity, kind flags, limits, memory,
fingerprint), compile and load a kernel (``build``; the kernel knows its work-group limit), launch
(``launch``, timed or not; ``prepare`` for one fixed launch run again and again by address), a default
queue (a queue's ``finish()`` synchronises), allocate and free (``empty``, zeroed or poisoned on
request, and ``release_memory``), copy in and out (``copy``), and the adapter for the caller's own
device arrays (``arrays``, a ``CallerArrays``).  What follows from these (``to_device``, ``to_host``,
``synchronize``) is written once, in ``Conveniences``.  What is not the backend's lives above it:
Kernel Tuner's arguments and where a tuning runs (``pool_tuner.device_tuning``), what makes the same
device model and family of a fingerprint (``cache.FINGERPRINT_LEVELS``), PoCL's environment
(``backends/pocl_env.py``), output poisoning (the test suite's ``conftest.py``).

A new backend (HIP, Metal, ...) writes only these methods plus its language's branch of the kernel
prelude: one file, ``backends/<name>.py`` (``<name>`` is its ids' prefix), named in
``backends.BACKENDS``, that implements

* at module level (``Backend``): ``list_devices()`` (every usable device, ``()`` when the library,
  driver or hardware is missing -- never raising), ``device_of_array(x)`` (the device holding one of
  its arrays, None for arrays it does not know) and ``missing(device_id)`` (why an id of its prefix
  names no device, or why it lists none; None for nothing to say);
* a device class with every member of ``Device`` (inheriting ``Conveniences``), and its
  ``CallerArrays``;
* kernels: the templates in ``kernels/`` compile for it through ``kernels/prelude.h`` (one
  ``#ifdef`` branch per language), and the benchmark's memory streams need
  ``kernels/bandwidth<info.source_suffix>``.

To be tuned it adds its entry to ``pool_tuner.device_tuning``; for records of other drivers or
devices of its family to apply, its rule to ``cache.FINGERPRINT_LEVELS``.
``tests/test_device_contract.py`` checks that both backends have every member, and that the
contract stays small.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import numpy as np


@dataclasses.dataclass(frozen=True)
class DeviceLimits:
    """The device properties that decide whether a configuration can launch (``variants`` checks
    every configuration against them)."""

    max_work_group_size: int
    local_mem_size: int
    #: ``"cpu"`` for a CPU device, ``"gpu"`` for every other (the words of the default rules): a
    #: variant shaped for one kind is a candidate only there (``Variant.device_types``).
    device_type: str


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What a device is, read once when it is listed: identity, kind, limits and fingerprint.  One
    frozen object, so that what the rest of pool_tuner may read of a device is one member of the
    contract, and no call can change it.  A device whose circumstances change (a forked child of a
    process that started PoCL) gets a new one."""

    #: The backend's name, the first part of ``id``.
    backend: str
    #: ``<backend>:...``, the same on every run and whatever other drivers are installed.
    id: str
    name: str
    #: The driver or platform the device belongs to, in words (``pool-tuner devices`` shows it).
    platform_name: str
    is_gpu: bool
    is_cpu: bool
    #: A simulator (Oclgrind): exact but slow, never chosen by default.
    is_simulator: bool
    supports_float64: bool
    #: Device arrays can live in host memory, so numpy arrays are used in place (``prepare``).
    shares_host_memory: bool
    #: Where PyTorch runs on the same hardware (``"cuda:0"``), or ``"cpu"`` where PyTorch has no
    #: backend for it (OpenCL): the benchmark's side-by-side.
    torch_device: str
    #: The file suffix of this backend's kernel sources (``kernels/bandwidth<suffix>``).
    source_suffix: str
    #: What variants' legality checks use.
    limits: DeviceLimits
    #: Device memory in bytes, and the largest single allocation.
    memory_bytes: int
    max_allocation_bytes: int
    #: What identifies this device's performance in the tuning cache (JSON-ready, with a
    #: ``backend`` field); the cache key holds its hash, so a record's key names exactly the device
    #: it was tuned on.  What of it makes the same model and family is the cache's
    #: (``cache.FINGERPRINT_LEVELS``).
    fingerprint: dict = dataclasses.field(hash=False)
    #: What the backend set up in this process that changes this device's timings (PoCL's worker
    #: pinning), in words, or None; ``pool-tuner devices`` and ``bench.json`` show it.
    runtime_note: str | None = None
    #: Why this device's kernels cannot run in this process (a forked child of a process that
    #: started PoCL's worker threads), in words, or None: then calls on host memory are computed by
    #: ``pool_tuner.host_fallback`` and ``explain`` shows it.
    host_fallback: str | None = None

    def describe(self) -> str:
        """``<id> <name>``."""
        return f"{self.id} {self.name}"


class TuningUnavailable(RuntimeError):
    """A device cannot be tuned in this process (``device_tuning.run``) (a missing compiler, a driver
    too old for it, ...); the message says why and what to do.  Calls then use the untuned
    decision (``tuner.tune_on_miss``)."""


@runtime_checkable
class Device(Protocol):
    """One device of one backend: what a kernel needs to run on it.

    Queues are the backend's own objects (an OpenCL command queue; CUDA: a context and a stream);
    every queue has a ``context`` attribute, the unit that builds are cached per, and a
    ``finish()`` that waits for everything sent to it.  Device arrays are the backend's own array
    type (``pyopencl.array.Array``, ``cuda_arrays.CudaArray``) in memory order, bfloat16 as its
    uint16 bits.  What follows from these members (``to_device``, ``to_host``, ``synchronize``)
    a device class inherits from ``Conveniences``."""

    # -------------------------------------------------------------- what it is
    #: Identity, kind, limits and fingerprint (``DeviceInfo``).
    info: DeviceInfo

    # -------------------------------------------------------------- kernels
    def build(self, context, source: str, kernel_name: str):
        """Compile rendered ``source`` for this device in ``context`` and load kernel
        ``kernel_name`` (both cached).  The kernel's ``max_work_group_size`` is the most work-items
        per work-group it can launch with."""

    def launch(self, queue, kernel, groups: int, block: tuple, args, timed: bool = False):
        """Launch ``groups`` work-groups of shape ``block`` (a 1-d grid of groups) on ``args``
        (device arrays and numpy scalars); returns a handle with ``wait()`` for ``track``.
        ``timed``: wait for the kernel and return its own time in milliseconds as the device
        measures it instead (OpenCL profiling events, CUDA events): the same on every backend."""

    def prepare(self, launch, nbytes: tuple, n_inputs: int):
        """``launch`` (a ``dispatch.Launch``) made ready to run again and again, its argument
        storage made once: a function ``run(stream, *addresses, scalars=None)`` of the addresses
        of the inputs then the outputs (``nbytes`` each, the first ``n_inputs`` read only) and,
        where given, the call's run-time scalars in place of ``launch.scalars`` (same number and
        types: a learnt GeM ``p`` changes every call, the storage does not).  Where
        ``info.shares_host_memory``, over host memory on the default queue (``stream`` None),
        returning once the outputs are written; elsewhere over device memory, on the raw stream
        handle ``stream`` (CUDA: PyTorch's current stream), without waiting."""

    # -------------------------------------------------------------- queues
    @property
    def queue(self):
        """The device's default queue (own context; kernel timing enabled)."""

    # -------------------------------------------------------------- memory
    def empty(self, shape, dtype, queue=None, fill=None):
        """A C-contiguous device array, uninitialised, or with every element ``fill`` (of its
        dtype: a 16-bit bit pattern through a uint16 view of a float16 or bfloat16 array) in
        ``queue``'s order of work: zeros for results with nothing to compute, the test suite's
        poison."""

    def release_memory(self) -> int:
        """Free memory held for reuse by later results; returns the number of blocks freed."""

    def copy(self, destination, source, queue=None) -> None:
        """Copy ``source`` into ``destination`` (same size): device arrays, or a C-contiguous numpy
        array on one side (copy in, copy out; returns once a copy out has arrived)."""

    # -------------------------------------------------------------- the caller's arrays
    #: How this backend takes the caller's device arrays and hands results back (``CallerArrays``).
    arrays: CallerArrays


class Conveniences:
    """What every device does through the contract's own members, inherited by each device class
    so that a backend writes none of it."""

    def to_device(self, host: np.ndarray, queue=None):
        """A device array holding a copy of ``host`` (copy in)."""
        host = np.ascontiguousarray(host)
        array = self.empty(host.shape, host.dtype, queue)
        if host.size:
            self.copy(array, host, queue)
        return array

    def to_host(self, array) -> np.ndarray:
        """A numpy copy of device ``array``, waiting for the work that writes it (copy out)."""
        host = np.empty(array.shape, array.dtype)
        if host.size:
            self.copy(host, array)
        return host

    def synchronize(self, queue=None) -> None:
        """Wait until everything sent to ``queue`` (default: the default queue) has finished."""
        (queue or self.queue).finish()


@runtime_checkable
class CallerArrays(Protocol):
    """The caller's device arrays on one device: the adapter between the arrays a user passes
    (``pyopencl.array.Array``; CUDA: anything with ``__cuda_array_interface__``) and the device's
    own arrays and queues.  Only calls on device arrays use it."""

    def queue_of(self, array):
        """The queue that work on ``array`` (a caller's array of this device) goes to: OpenCL, the
        array's own queue; CUDA, the stream its ``__cuda_array_interface__`` names, else the legacy
        default stream."""

    def check_first_call(self, queue, name: str) -> None:
        """Raise ``ValueError`` (naming array ``name``) when a call signature's first call, which
        builds kernels, cannot run on ``queue`` now (CUDA: its stream is being captured into a
        graph)."""

    def wrap_input(self, array, name: str):
        """A caller's device array as a kernel argument (``name`` for error messages)."""

    def track(self, array, handle) -> None:
        """Let ``array``'s own waits include the launch ``handle`` that writes it."""

    def deliver(self, array, queue):
        """A result made on ``queue`` (from ``queue_of`` of the caller's array) as the kind of
        array the caller gave: OpenCL, the array itself; CUDA, an array of the input's library."""

    def strided_view(self, array, shape, strides):
        """``array``'s memory seen with another shape and strides (channels-last results)."""


@runtime_checkable
class Backend(Protocol):
    """What a backend module provides at module level (a module satisfies a Protocol by its
    attributes).  Its id prefix is the module's name (``backends/cuda.py``: ``cuda:0``)."""

    def list_devices(self) -> tuple:
        """Every usable device of this backend, in a fixed order; ``()`` when none, never raising."""

    def device_of_array(self, x):
        """The device holding ``x`` if ``x`` is one of this backend's arrays, else None."""

    def missing(self, device_id: str | None) -> str | None:
        """Why this backend lists no device of id ``device_id`` (one with its prefix) -- what to use
        instead, such as the id an older format's now is -- or, for None, why it lists no device at
        all (its library failed to load); None when it has nothing to say."""
