"""CUDA backend on PyCUDA (the ``pool-tuner[cuda]`` extra): devices, cached builds, launches, arrays.

Implements the device contract of ``backends.base``: ``id`` (``cuda:<n>``, CUDA's numbering),
``fingerprint``, ``limits``, ``build`` (template text -> kernel, cached), ``launch`` (timed by
CUDA events), arrays, and Kernel Tuner's arguments (its PyCUDA backend).  A
device's ``queue`` is a ``CudaQueue`` (context and stream handle), the counterpart of an OpenCL
command queue.  What identifies a device (``CudaProperties``) is read once, when it is listed; identity,
fingerprint, limits and Kernel Tuner's arguments need no PyCUDA afterwards.

Contexts: one rule, ``backends.cuda_driver``'s -- everything (loading kernels, allocating,
copying, launching) runs in the calling thread's current context, and a thread with none gets the
device's primary context made current and left so.  A queue names that context (``CudaQueue``);
kernels are loaded once per context; an input owned by another context is refused
(``wrap_input``).  Nothing is pushed or popped around a call.

Arrays: any object exposing ``__cuda_array_interface__`` (PyCUDA ``GPUArray``s, PyTorch CUDA
tensors, CuPy arrays, Numba device arrays, ...) is read through that interface as a ``CudaArray``
over the same memory, and each result is handed back as the input's kind of array
(``backends.cuda_arrays``).  Results stay on the device.

Streams: kernels are loaded and launched through the driver API (``backends.cuda_driver``), never
through PyCUDA, because only the driver API launches on another library's stream handle.  Work on
a caller's CUDA array goes to the stream its ``__cuda_array_interface__`` names, a PyTorch
tensor's to PyTorch's current stream (``queue_of``, ``launch_stream``), after the streams of the launch's other arrays (``launch``), with no host wait;
results name that stream in their own interface.  docs/design.md, "CUDA contexts" and "CUDA arrays
and streams", states the rules.  ``CudaDevice.prepare`` fixes a built kernel's launch for
``pool_tuner.torch``'s calls on PyTorch's current stream (``cuda_driver.PreparedLaunch``).  Cubins come from
pool_tuner's own compiler cache (``backends.cuda_compile``): nvcc runs once per kernel source,
never on a hit.

Threads: a launch shares nothing between threads (its argument array is its own); the event a
device uses to order one stream after another is recorded and waited for under a lock
(``cuda_driver.StreamJoin``, one per context).  The memory pools, the joins and the device list are
made once, under a lock.

Importing this module never imports PyCUDA: it is loaded on first use, and ``list_devices()``
returns ``()`` when PyCUDA is not installed, when there is no driver or no GPU, or on any other
failure (``import_error()`` then says why).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib.util
import itertools
import math
import os
import shutil
import sys
import threading

import numpy as np

from . import cuda_compile, cuda_driver
from .cuda_arrays import CudaArray, MemoryPool, ResultKind, as_cuda_array, cuda_array_interface, wait_for
from .base import Conveniences, DeviceInfo, DeviceLimits

BACKEND = __name__.rsplit(".", 1)[-1]  #: the ids' prefix: the module's name (base.Backend)
#: The largest grid (x dimension) a launch may use on every architecture pool_tuner targets.
MAX_GRID_X = 2**31 - 1
#: The legacy default stream, as ``__cuda_array_interface__`` names it and as a stream handle of the
#: driver API (``CU_STREAM_LEGACY``): where work goes when no stream is named.
LEGACY_STREAM = 1
#: The per-thread default stream (``CU_STREAM_PER_THREAD``): one handle naming each thread's own stream.
PER_THREAD_STREAM = 2

#: Results of calls on numpy arrays, and of the tuner and the benchmark: pool_tuner's ``CudaArray``.
_OWN_KIND = ResultKind(None)


_IMPORT_ERROR: BaseException | None = None


@functools.cache
def _pycuda():
    """``(driver, gpuarray)`` of PyCUDA, imported on first use; None if PyCUDA is unusable."""
    global _IMPORT_ERROR
    try:
        import pycuda.driver as drv
        import pycuda.gpuarray as gpuarray

        drv.init()
    except Exception as exc:  # noqa: BLE001 - no PyCUDA, no libcuda, no driver, no device, ...
        _IMPORT_ERROR = exc
        return None
    return drv, gpuarray


def import_error():
    """Why the CUDA backend is unavailable (an exception), or None."""
    _pycuda()
    return _IMPORT_ERROR


def missing(device_id: str | None) -> str | None:
    """Why no device has ``device_id`` (a ``cuda:...`` id, or None for any): when the backend
    itself is unavailable, why."""
    if import_error() is None:
        return None
    return f"the CUDA backend is unavailable ({import_error()}); install it with `pip install pool-tuner[cuda]`"


@dataclasses.dataclass(frozen=True)
class CudaQueue:
    """Where work goes: a context (the driver handle of the caller's current context) and a stream
    handle as ``__cuda_array_interface__`` and the driver API both write it (1: the legacy default
    stream, 2: the per-thread default stream, else a ``CUstream``); ``kind``: how results are
    allocated and handed back (``cuda_arrays.ResultKind`` of the caller's array; None: pool_tuner's
    own ``CudaArray``)."""

    context: int
    stream: int = LEGACY_STREAM
    kind: ResultKind | None = dataclasses.field(default=None, compare=False)

    def finish(self) -> None:
        """Wait on the host for the work sent to the stream so far."""
        cuda_driver.synchronize(self.stream)


@dataclasses.dataclass(frozen=True)
class CudaProperties:
    """What pool_tuner reads of a CUDA device, once, when listing it."""

    name: str
    compute_capability: tuple
    multiprocessors: int
    max_threads_per_block: int
    #: Static __shared__ arrays are limited to this (48 KiB), whatever the opt-in maximum.
    max_shared_memory_per_block: int
    total_memory: int
    driver_version: int

    @classmethod
    def query(cls, cu_device) -> CudaProperties:
        drv = _pycuda()[0]
        attr = drv.device_attribute
        return cls(
            name=cu_device.name().strip(),
            compute_capability=tuple(cu_device.compute_capability()),
            multiprocessors=int(cu_device.get_attribute(attr.MULTIPROCESSOR_COUNT)),
            max_threads_per_block=int(cu_device.get_attribute(attr.MAX_THREADS_PER_BLOCK)),
            max_shared_memory_per_block=int(cu_device.get_attribute(attr.MAX_SHARED_MEMORY_PER_BLOCK)),
            total_memory=int(cu_device.total_memory()),
            driver_version=int(drv.get_driver_version()),
        )


class CudaDevice(Conveniences):
    """One CUDA device, identified as ``cuda:<ordinal>`` (CUDA's device numbering)."""

    def __init__(self, ordinal: int, properties: CudaProperties):
        self.ordinal = ordinal
        self.properties = properties
        self.info = DeviceInfo(
            backend=BACKEND,
            id=f"{BACKEND}:{ordinal}",
            name=properties.name,
            platform_name="CUDA",
            is_gpu=True,
            is_cpu=False,
            is_simulator=False,
            supports_float64=True,
            # Device memory is separate from host memory (numpy inputs are copied in and out).
            shares_host_memory=False,
            torch_device=f"cuda:{ordinal}",
            source_suffix=".cu",
            limits=DeviceLimits(max_work_group_size=properties.max_threads_per_block,
                                local_mem_size=properties.max_shared_memory_per_block, device_type="gpu"),
            memory_bytes=properties.total_memory,
            max_allocation_bytes=properties.total_memory,
            fingerprint={
                "backend": BACKEND,
                "name": properties.name,
                "compute_capability": "{}.{}".format(*properties.compute_capability),
                "multiprocessors": properties.multiprocessors,
                "driver": properties.driver_version,
            },
        )
        self._pools = {}  # (context, stream handle[, thread]) -> MemoryPool (``memory_pool``)
        self._joins = {}  # context -> cuda_driver.StreamJoin (``launch``)
        self._lock = threading.Lock()  # making the pools and joins
        self.arrays = CudaCallerArrays(self)

    @property
    def arch(self) -> str:
        """nvcc's target for this device, e.g. ``sm_90``."""
        return "sm_{}{}".format(*self.properties.compute_capability)

    def current_context(self) -> int:
        """The calling thread's current context, this device's primary one made current when there
        is none (``cuda_driver.current_context``: the one context rule)."""
        return cuda_driver.current_context(self.ordinal)

    def _join(self, context: int) -> cuda_driver.StreamJoin:
        """Orders one stream after another for ``launch`` in ``context`` (one event per context,
        made on first use)."""
        join = self._joins.get(context)
        if join is None:
            with self._lock:
                join = self._joins.setdefault(context, cuda_driver.StreamJoin())
        return join

    def __repr__(self):
        return f"<{self.info.describe()}>"

    # ------------------------------------------------------------------ context and queue

    @property
    def queue(self) -> CudaQueue:
        """The default queue: the calling thread's current context and the legacy default stream."""
        return CudaQueue(self.current_context())

    # ------------------------------------------------------------------ arrays

    def empty(self, shape, dtype, queue: CudaQueue | None = None, fill=None) -> CudaArray:
        """A C-contiguous ``CudaArray`` in the queue's context, naming its stream: allocated as the
        queue's result kind says (PyTorch's allocator for torch tensors), else from the memory pool
        of the context and stream (``memory_pool``); uninitialised, or every element ``fill`` by the
        driver's memset of its bits on the queue's stream, ordered with the launch that follows."""
        queue = queue or self.queue
        dtype = np.dtype(dtype)
        size = math.prod(shape)
        pool = self.memory_pool(queue.context, queue.stream)
        owner, ptr = (queue.kind or _OWN_KIND).allocate(size * dtype.itemsize, pool)
        if fill is not None and size:
            bits = np.array(fill, dtype).view(f"u{dtype.itemsize}")[()]
            cuda_driver.fill(ptr, int(bits), dtype.itemsize, size, queue.stream)
        return CudaArray(shape, dtype, ptr, stream=queue.stream, base=owner)

    def memory_pool(self, context: int, stream: int) -> MemoryPool:
        """The ``MemoryPool`` of results made in ``context`` on ``stream``, made on first use.  A
        result dropped -- on any thread -- returns its block to the pool, and the next result of
        that size on that stream reuses it (``release_memory`` frees what the pools hold).  One
        pool per stream: a block whose last user was queued on one stream could otherwise be handed
        to a launch on another while that work still reads it; on one stream, later work runs
        after earlier work.  The per-thread default stream (handle 2) is another stream on every
        thread, so its pools are per thread too: a block dropped by one thread with work still
        queued on that thread's stream must not go to another thread's launch on its own."""
        key = (context, stream, _thread_number()) if stream == PER_THREAD_STREAM else (context, stream)
        pool = self._pools.get(key)
        if pool is None:
            with self._lock:
                pool = self._pools.get(key) or self._ended_threads_pool(context, key) or MemoryPool(context, stream)
                self._pools[key] = pool
        return pool

    def _ended_threads_pool(self, context: int, key) -> MemoryPool | None:
        """For a thread's first per-thread-stream pool in ``context`` (under the lock): the pool of a
        thread that has ended, taken over once the context's work has finished (its stream's
        included) -- so that threads that come and go reuse their predecessors' blocks instead of
        leaving them held for good."""
        if len(key) != 3:
            return None
        ended = next((k for k in self._pools if len(k) == 3 and k[0] == context and k[2] in _ENDED_THREADS), None)
        if ended is None:
            return None
        cuda_driver.synchronize(None)
        _ENDED_THREADS.discard(ended[2])
        return self._pools.pop(ended)

    def copy(self, destination, source, queue: CudaQueue | None = None) -> None:
        """Copy ``source`` into ``destination``: between device arrays on the queue's stream (after
        the work queued on the stream ``source`` names, on the device, as ``launch`` waits), from
        or to a C-contiguous numpy array synchronously (in the current context), after the work
        queued on the stream the device array names (``cuda_arrays.wait_for``: a synchronous copy
        waits for the legacy default stream and the blocking streams only)."""
        if isinstance(destination, np.ndarray):
            self.current_context()
            source = as_cuda_array(source)
            wait_for(source.stream)
            cuda_driver.copy_to_host(destination, source.ptr)
        elif isinstance(source, np.ndarray):
            self.current_context()
            destination = as_cuda_array(destination)
            wait_for(destination.stream)
            cuda_driver.copy_to_device(destination.ptr, np.ascontiguousarray(source))
        else:  # on the queue's stream, after the work queued on the stream the source names (as ``launch``)
            source, queue = as_cuda_array(source), queue or self.queue
            if source.stream is not None and source.stream != queue.stream:
                self._join(queue.context)(queue.stream, source.stream)
            cuda_driver.copy(as_cuda_array(destination).ptr, source.ptr, source.nbytes, queue.stream)

    @staticmethod
    def prepare(launch, nbytes: tuple, n_inputs: int) -> cuda_driver.PreparedLaunch:
        """``launch`` (a ``dispatch.Launch``) with its grid, block and argument storage fixed, as a
        ``cuda_driver.PreparedLaunch``: ``run(stream, *pointers, scalars=None)`` is one
        ``cuLaunchKernel`` on the raw stream handle ``stream`` with the device pointers of the
        inputs then the outputs (one per entry of ``nbytes``) and the call's run-time scalars (or
        the launch's), in the calling thread's current context."""
        if launch.groups < 1 or launch.groups > MAX_GRID_X:
            raise ValueError(f"a launch needs 1 to {MAX_GRID_X} blocks, got {launch.groups}")
        return cuda_driver.PreparedLaunch(launch.kernel, launch.groups, launch.block, len(nbytes), launch.scalars)

    def release_memory(self) -> int:
        """Free the device memory the pools hold for reuse; returns the number of blocks freed."""
        with self._lock:
            pools = list(self._pools.values())
        return sum(pool.free_held() for pool in pools)

    # ------------------------------------------------------------------ kernels

    def build(self, context, source: str, kernel_name: str) -> cuda_driver.DriverKernel:
        """Compile ``source`` for this device and return kernel ``kernel_name``, loaded through
        the driver API into the calling thread's current context (cached per context; ``context``
        is what the caller files the kernel under, the current context's handle for a queue's)."""
        return _build_for_driver(self.current_context(), self.ordinal, self.arch, source, kernel_name)

    def compile(self, source: str) -> None:
        """Compile ``source`` for this device into the compiler's cache (``cuda_compile``), loading
        nothing: any thread, no context needed; a later ``build`` of the same source finds it
        there.  Raises ``cuda_compile.CudaCompileError`` when nvcc fails."""
        _compile(source, self.arch)

    def _in_context(self, kernel: cuda_driver.DriverKernel, context: int) -> cuda_driver.DriverKernel:
        """``kernel`` as loaded into ``context`` (the current one): a plan made in one context and
        called in another launches its kernel from a module of the other."""
        if kernel.context == context:
            return kernel
        return _build_for_driver(context, self.ordinal, *kernel.origin, kernel.name)

    def launch(self, queue: CudaQueue | None, kernel, groups: int, block: tuple, args, timed: bool = False):
        """Launch ``groups`` blocks of shape ``block`` (a 1-d grid; ``block`` is ``(x,)`` or
        ``(x, y)``) with ``args``: device arrays / pointers (``CudaArray``, ``__cuda_array_interface__``
        objects, ints) or numpy scalars, on the queue's stream,
        through the driver API.  An array that names another stream than the queue's (its
        interface's ``stream``; None names none) is waited for on the device first
        (``cuda_driver.StreamJoin``), never on the host.  Records no event per call
        (a ``timed`` launch records two, between which it waits and returns the milliseconds): the
        returned ``CudaLaunch`` waits by synchronising the stream."""
        queue = queue or self.queue
        if timed:
            return cuda_driver.elapsed_ms(queue.stream, lambda: self.launch(queue, kernel, groups, block, args))
        if groups < 1 or groups > MAX_GRID_X:
            raise ValueError(f"a launch needs 1 to {MAX_GRID_X} blocks, got {groups}")
        values, producers = [], set()
        for a in args:
            value, producer = _kernel_arg(a)
            values.append(value)
            if producer is not None and producer != queue.stream:
                producers.add(producer)
        kernel = self._in_context(kernel, queue.context)
        join = self._join(queue.context) if producers else None
        for producer in producers:
            join(queue.stream, producer)
        cuda_driver.launch(kernel, groups, block, queue.stream, values)
        return CudaLaunch(self, queue)


_THREADS = threading.local()
_THREAD_NUMBERS = itertools.count()
#: The numbers of threads that have ended (``_ThreadMark``), whose pools a new thread may take over.
_ENDED_THREADS: set = set()


class _ThreadMark:
    """A thread's number, kept in its thread-local data, which is dropped when the thread ends."""

    __slots__ = ("number",)

    def __init__(self, number: int):
        self.number = number

    def __del__(self):
        _ENDED_THREADS.add(self.number)  # set.add: atomic under the GIL


def _thread_number() -> int:
    """A number of the calling thread, never reused (``threading.get_ident`` is reused once a
    thread ends, and a new thread's per-thread default stream is not the ended one's)."""
    mark = getattr(_THREADS, "mark", None)
    if mark is None:
        mark = _THREADS.mark = _ThreadMark(next(_THREAD_NUMBERS))
    return mark.number


class CudaCallerArrays:
    """The caller's CUDA arrays on one device (``base.CallerArrays``): any object with
    ``__cuda_array_interface__`` (PyCUDA, CuPy, PyTorch, numba, ``CudaArray``), worked on in the
    calling thread's current context on the stream it names, results of the caller's kind."""

    def __init__(self, device: CudaDevice):
        self._device = device

    def queue_of(self, array) -> CudaQueue:
        """The queue of a caller's array: the current context, the stream its interface names
        (``launch_stream``), and results of the array's own kind."""
        return CudaQueue(self._device.current_context(), launch_stream(array), ResultKind(array))

    def check_first_call(self, queue: CudaQueue, name: str) -> None:
        """A first call compiles and loads kernels and may tune, which a stream being captured
        into a CUDA graph forbids, and whose failure there would be an obscure capture error: so
        it is refused with what to do instead."""
        if cuda_driver.is_capturing(queue.stream):
            raise ValueError(
                f"pool_tuner met a new call signature while {name}'s stream is being captured into a CUDA graph: "
                "its first call compiles and loads kernels, which capture forbids; call each signature once "
                "before capture")

    def wrap_input(self, array, name: str) -> CudaArray:
        """A caller's array as a ``CudaArray`` over the same memory (no copy).  Memory owned by
        another context than the current one is refused: the kernel could not read it."""
        try:
            wrapped = as_cuda_array(array)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        owner = cuda_driver.pointer_context(wrapped.ptr)
        if owner is not None:
            current, ordinal = self._device.current_context(), self._device.ordinal
            if owner != current:
                raise cuda_driver.ContextError(
                    f"{name} is memory of CUDA context {owner:#x} (device {cuda_driver.pointer_device(wrapped.ptr)}), "
                    f"but the calling thread's current context is {current:#x} (cuda:{ordinal}); pool_tuner "
                    f"works in the current context, as PyTorch and CuPy do: make {name}'s context current before "
                    f"the call (PyCUDA: push it; the runtime's primary context: pop the other one), or copy {name} "
                    "into the current context")
        return wrapped

    @staticmethod
    def track(array, handle) -> None:
        """Nothing to do: a result names the stream it is written on."""

    @staticmethod
    def deliver(array, queue: CudaQueue):
        """A result as the kind of array the caller gave (``cuda_arrays.ResultKind``)."""
        return array if queue.kind is None else queue.kind.deliver(array)

    @staticmethod
    def strided_view(array, shape, strides) -> CudaArray:
        """``array``'s memory seen with another shape and strides (channels-last results), naming
        the same stream."""
        return as_cuda_array(array).strided(shape, strides)


@dataclasses.dataclass(frozen=True)
class CudaLaunch:
    """A launch on a queue: ``wait`` waits for everything sent to that queue so far (no event is
    recorded per launch)."""

    device: CudaDevice
    queue: CudaQueue

    def wait(self) -> None:
        self.device.current_context()
        self.queue.finish()


# Loaded modules and their kernels are kept for the life of the process: a plan may launch a
# kernel at any time, and unloading a module whose kernel is still launched is undefined behaviour.
# Each source is compiled once (``cuda_compile``'s cache) and loaded once per context, with that
# context current (the caller's).

@functools.cache
def _driver_module(context: int, ordinal: int, arch: str, source: str) -> int:
    return cuda_driver.load_module(ordinal, _compile(source, arch))


@functools.cache
def _build_for_driver(context: int, ordinal: int, arch: str, source: str, kernel_name: str) -> cuda_driver.DriverKernel:
    return cuda_driver.get_kernel(ordinal, _driver_module(context, ordinal, arch, source), kernel_name, (arch, source))


def forget_builds() -> None:
    """Drop the memoised modules and kernels (for tests that swap the driver for a fake one; the
    modules themselves stay loaded)."""
    for memoised in (_driver_module, _build_for_driver):
        memoised.cache_clear()


def _compile(source: str, arch: str) -> bytes:
    """The cubin of ``source`` for ``arch`` from pool_tuner's compiler cache (``cuda_compile``),
    built with the nvcc ``find_nvcc`` finds.  The architecture is given, so that compiling needs
    no current context."""
    return cuda_compile.cubin(source, arch, find_nvcc())[1]


# ---------------------------------------------------------------------- finding nvcc

class NvccNotFoundError(RuntimeError):
    pass


def find_nvcc(nvcc: str | None = None) -> str:
    """Path of the nvcc to use: ``nvcc`` if given (a name on PATH or a path), else ``nvcc`` on PATH,
    else ``$CUDA_HOME``/``$CUDA_PATH``/``/usr/local/cuda`` ``bin/nvcc``, else the one of the PyPI
    package ``nvidia-cuda-nvcc``.  Raises ``NvccNotFoundError`` with a one-line message."""
    if nvcc is not None:
        found = shutil.which(nvcc)
        if found is None:
            raise NvccNotFoundError(f"nvcc not found: {nvcc!r} is not an executable file or a command on PATH")
        return found
    found = shutil.which("nvcc")
    if found:
        return found
    roots = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")] + ["/usr/local/cuda"]
    candidates = [os.path.join(r, "bin", "nvcc") for r in roots if r]
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(glob.glob(os.path.join(root, "*", "bin", "nvcc")))
    for candidate in candidates:
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise NvccNotFoundError(
        "nvcc not found: put the CUDA toolkit's bin/ on PATH, set CUDA_HOME, or `pip install nvidia-cuda-nvcc`"
    )


def _kernel_arg(a):
    """``(value, producer)`` of one kernel argument: the value ``cuda_driver.launch`` takes (a
    numpy scalar, or a device pointer as an int) and, for an array, the stream its interface
    names (None: none named)."""
    if isinstance(a, (np.generic, int)):
        return a, None
    if isinstance(a, CudaArray):
        return a.ptr, a.stream
    interface = cuda_array_interface(a)
    if interface is not None:
        return int(interface["data"][0]), interface.get("stream")
    try:
        return int(a), None  # DeviceAllocation and other pointer holders
    except TypeError:
        raise TypeError(f"cannot pass a {type(a).__name__} to a CUDA kernel") from None


# ---------------------------------------------------------------------- device listing

_LISTING = threading.Lock()


@functools.cache
def list_devices() -> tuple:
    """Every CUDA device in CUDA's order; ``()`` when PyCUDA, the driver or a GPU is missing.
    Listed once per process: concurrent first calls wait for the first one's listing."""
    with _LISTING:
        return _listed()


@functools.cache
def _listed() -> tuple:
    loaded = _pycuda()
    if loaded is None:
        return ()
    drv = loaded[0]
    try:
        return tuple(CudaDevice(i, CudaProperties.query(drv.Device(i))) for i in range(drv.Device.count()))
    except Exception as exc:  # noqa: BLE001 - a broken driver must not break import or listing
        global _IMPORT_ERROR
        _IMPORT_ERROR = exc
        return ()


# ---------------------------------------------------------------------- arrays of other libraries

def is_device_array(x) -> bool:
    """Whether ``x`` is a CUDA device array this backend can take (needs no PyCUDA to answer)."""
    if cuda_array_interface(x) is not None:
        return True
    loaded = _pycuda() if "pycuda" in type(x).__module__ else None
    return loaded is not None and isinstance(x, loaded[1].GPUArray)


def launch_stream(x) -> int:
    """The stream that work on the CUDA array ``x`` goes to: the one its
    ``__cuda_array_interface__`` names (1: the legacy default stream, 2: the per-thread default
    stream, else a ``CUstream`` handle); for a PyTorch tensor, whose interface names none,
    PyTorch's current stream on its device (``torch_current_stream``), where PyTorch's own work on
    it runs; else the legacy default stream.  The interface forbids 0; it is read as the driver
    reads a null handle, the legacy default stream."""
    interface = cuda_array_interface(x)
    stream = interface.get("stream") if interface is not None else None
    if stream is None:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(x, torch.Tensor):
            stream = torch_current_stream(x)
    return LEGACY_STREAM if not stream else int(stream)


def torch_current_stream(tensor) -> int:
    """The raw handle of PyTorch's current stream on ``tensor``'s device (0: its default stream,
    the legacy one).  Under ``with torch.cuda.stream(s)`` that is ``s``, a non-blocking stream
    that orders with nothing else: work on the legacy stream would run beside the producer of
    ``tensor``, and beside the readers of the result, which PyTorch's allocator also hands out on
    ``s``."""
    import torch

    return torch.cuda.current_stream(tensor.device).cuda_stream


def array_device_ordinal(x) -> int | None:
    """The CUDA ordinal of the device holding ``x``, or None if it cannot be told."""
    device = getattr(x, "device", None)
    index = getattr(device, "index", None)  # torch.device
    if isinstance(index, int):
        return index
    index = getattr(device, "id", None)  # cupy.cuda.Device
    if isinstance(index, int):
        return index
    interface = cuda_array_interface(x)
    if interface is not None and interface["data"][0]:
        return cuda_driver.pointer_device(int(interface["data"][0]))
    return None


def device_of_array(x):
    """The ``CudaDevice`` holding ``x`` (GPUArray or ``__cuda_array_interface__`` object), or None
    if ``x`` is not a CUDA array.  Raises ``RuntimeError`` for a CUDA array when no CUDA device is
    usable (PyCUDA missing, ...)."""
    if not is_device_array(x):
        return None
    ordinal = array_device_ordinal(x)
    return device_by_ordinal(0 if ordinal is None else ordinal)


def device_by_ordinal(ordinal: int, name: str = "x"):
    """The ``CudaDevice`` with CUDA ordinal ``ordinal``, which holds array ``name``.  Raises
    ``RuntimeError`` when no CUDA device is usable (PyCUDA missing, ...), ``ValueError`` for an
    ordinal pool_tuner does not list."""
    devices = list_devices()
    if not devices:
        raise RuntimeError(
            f"{name} is a CUDA array but pool_tuner's CUDA backend is unavailable ({import_error()}); "
            "install it with `pip install pool-tuner[cuda]`"
        )
    for device in devices:
        if device.ordinal == ordinal:
            return device
    raise ValueError(f"{name} is on CUDA device {ordinal}, which pool_tuner cannot see")
