"""OpenCL backend on PyOpenCL: devices, program building with an in-memory cache, launching.

Implements the device contract of ``backends.base``: ``build`` (template text -> kernel object,
cached per context), ``launch`` (kernel, grid, arguments), plus device arrays in and out.  A
``pyopencl.array.Array`` input is processed on its own queue and context; numpy inputs use the
device's default context and a profiling-enabled queue.

Device ids are ``opencl:<platform slug>:<device index>`` (``opencl:pocl:0``): the slug comes from
the platform's name (``platform_slug``), so an id keeps its meaning when another OpenCL driver is
installed and the ICD loader's platform order changes.  The ids of older releases,
``opencl:<platform index>:<device index>``, are refused with the id to use now
(``missing``).

Threads: OpenCL calls are thread-safe except ``clSetKernelArg`` on one kernel object, and a launch
sets a shared kernel's arguments and then enqueues it -- two steps, between which another thread
could set its own buffers (results of the wrong arrays, or freed memory).  So every kernel this
module builds (``LockedKernel``) carries a lock held from its first argument to its enqueue.  The
default queue, its memory pool and the device list are made once under a lock; built programs and
kernels are ``memo`` tables (bounded, shared limit).

Fork and PoCL's environment: pool_tuner never sets a variable of PoCL's (``pocl_env``), so the
user's OpenCL code and child processes see the devices and settings they would without it.  PoCL's
threaded CPU driver runs kernels on worker threads started when PoCL is first listed; a forked
child has none of them, so every command it enqueues there waits forever, in a new context as much
as in the parent's.  After ``os.fork`` the child forgets every queue, memory pool and built kernel
of the parent (keeping them alive: releasing them could wait forever on a lock of the driver that
another thread of the parent held, ``memo.keep_alive``), and such a device gets a ``host_fallback``: calls on host memory (numpy arrays, CPU
tensors) are computed on the host (``pool_tuner.host_fallback``), device arrays are refused with
what to do (docs/design.md, "The user's process").
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
import math
import os
import re
import threading

import numpy as np

from .. import memo, switches
from ..shapes import c_strides
from . import pocl_env
from .base import Conveniences, DeviceInfo, DeviceLimits

try:  # PyOpenCL is a hard dependency, but keep a clear message if the install is broken.
    import pyopencl as cl
    import pyopencl.array as cl_array
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    cl = cl_array = None
    _IMPORT_ERROR = exc
else:
    _IMPORT_ERROR = None

BACKEND = __name__.rsplit(".", 1)[-1]  #: the ids' prefix: the module's name (base.Backend)
SIMULATOR_PLATFORMS = ("Oclgrind",)
POCL_PLATFORM = "Portable Computing Language"
#: Platform slugs that are not the slugified platform name (see ``platform_slug``).
PLATFORM_SLUGS = {POCL_PLATFORM: "pocl"}
#: Set to 0 (before importing pool_tuner) to allocate every result afresh (a switch: ``switches``).
MEMORY_POOL_ENV = "POOL_TUNER_MEMORY_POOL"
memory_pool_enabled = switches.switch(MEMORY_POOL_ENV, True, "the memory pool")


def pocl_affinity() -> str:
    """Whether PoCL pins its worker threads in this process, in words (``pocl_env.affinity_note``)."""
    return pocl_env.affinity_note()


def platform_slug(platform_name: str) -> str:
    """The platform's part of a device id: a short name for known platforms (``pocl``), else the
    platform's name in lower case with trademark marks dropped and every run of other characters
    than letters and digits as one ``-`` (``Oclgrind`` -> ``oclgrind``, ``Intel(R) OpenCL
    Graphics`` -> ``intel-opencl-graphics``)."""
    if platform_name in PLATFORM_SLUGS:
        return PLATFORM_SLUGS[platform_name]
    plain = re.sub(r"\((r|tm|c)\)", " ", platform_name.lower())
    return re.sub(r"[^a-z0-9]+", "-", plain).strip("-") or "platform"


def device_type(cl_device, is_simulator: bool) -> str:
    """The fingerprint's ``type`` of a device: its kind as the device flags decide it."""
    if is_simulator:
        return "simulator"
    return ("gpu" if cl_device.type & cl.device_type.GPU else "cpu" if cl_device.type & cl.device_type.CPU
            else "accelerator")


class OpenCLDevice(Conveniences):
    """One OpenCL device, identified as ``opencl:<platform slug>:<number>`` (see the module
    docstring): ``number`` counts the devices pool_tuner lists on the platform; ``platform_index``
    and ``device_index`` are the ICD loader's numbering, which Kernel Tuner takes."""

    def __init__(self, platform_index: int, device_index: int, cl_device, slug: str, number: int | None = None):
        self.cl_device = cl_device
        self.platform_index = platform_index
        self.device_index = device_index
        name = cl_device.name.strip()
        platform_name = cl_device.platform.name.strip()
        is_simulator = platform_name in SIMULATOR_PLATFORMS
        self.is_pocl = platform_name == POCL_PLATFORM
        # Oclgrind advertises every device type bit, so decide "GPU" by platform first.
        is_cpu = not is_simulator and bool(cl_device.type & cl.device_type.CPU)
        self.info = DeviceInfo(
            backend=BACKEND,
            id=f"{BACKEND}:{slug}:{device_index if number is None else number}",
            name=name,
            platform_name=platform_name,
            is_gpu=not is_simulator and bool(cl_device.type & cl.device_type.GPU),
            is_cpu=is_cpu,
            is_simulator=is_simulator,
            supports_float64=bool(cl_device.double_fp_config),
            # CPU devices (PoCL) compute in host memory: numpy arrays can be used in place.
            shares_host_memory=bool(cl_device.host_unified_memory) and not is_simulator,
            # PyTorch has no OpenCL backend: the benchmark compares with PyTorch on the CPU.
            torch_device="cpu",
            source_suffix=".cl",
            limits=DeviceLimits(max_work_group_size=int(cl_device.max_work_group_size),
                                local_mem_size=int(cl_device.local_mem_size),
                                device_type="cpu" if device_type(cl_device, is_simulator) == "cpu" else "gpu"),
            memory_bytes=int(cl_device.global_mem_size),
            max_allocation_bytes=int(cl_device.max_mem_alloc_size),
            # Read now: in a forked child cl_device becomes the fork fallback, whose own name and
            # compute units must not change this device's identity.  ``version`` is the OpenCL
            # version string, which on PoCL names the LLVM target its compiler generates code for
            # (``...-znver3``); ``type`` is ``cpu``, ``gpu``, ``simulator`` or ``accelerator``.
            fingerprint={
                "backend": BACKEND,
                "platform": platform_name,
                "name": name,
                "vendor": cl_device.vendor.strip(),
                "type": device_type(cl_device, is_simulator),
                "version": cl_device.version.strip(),
                "driver": cl_device.driver_version.strip(),
                "compute_units": int(cl_device.max_compute_units),
            },
            # PoCL reads its variables once, when OpenCL is first listed: now.
            runtime_note=f"PoCL: {pocl_affinity()}" if self.is_pocl and is_cpu else None,
        )
        self._default_queue = None
        self._pool = None  # the MemoryPool of the default queue, made on first use
        # host-memory launches (host_memory_aliases, host_buffers), found and made on first use
        self._host_memory_aliases = self._host_buffers = None
        self._lock = threading.Lock()  # making the default queue and its pool; allocating from it
        self.arrays = OpenCLCallerArrays(self)
        if _pocl_started_before_fork:
            self._lose_worker_threads()

    def __repr__(self):
        return f"<{self.info.describe()}>"

    def _after_fork_in_child(self) -> None:
        """Forget the parent's queue, pool and lock (see the module docstring); the queue and the
        pool's buffers are kept alive, never released (``memo.keep_alive``)."""
        self._lock = threading.Lock()
        memo.keep_alive(self._default_queue, self._pool, self._host_memory_aliases, self._host_buffers)
        self._default_queue = self._pool = None
        self._host_memory_aliases = self._host_buffers = None
        if _pocl_started_before_fork:
            self._lose_worker_threads()

    def _lose_worker_threads(self) -> None:
        """In a forked child of a process that started PoCL: a device run by PoCL's worker threads
        gets its host fallback (a new description: the one it had describes the parent's device)."""
        name = self.info.name
        if self.is_pocl and pocl_env.runs_worker_threads(name):
            self.info = dataclasses.replace(self.info, host_fallback=(
                f"this is a forked child of a process that started PoCL, whose worker threads that run {name}'s "
                f"kernels stay in the parent; numpy arrays and CPU tensors are pooled on the host by the float64 "
                f"reference instead (pool_tuner.host_fallback)"))

    # ------------------------------------------------------------------ queues and arrays

    @property
    def queue(self):
        """The default queue (own context, profiling enabled), created once, on first use."""
        queue = self._default_queue
        if queue is None:
            with self._lock:
                if self._default_queue is None:
                    context = cl.Context([self.cl_device])
                    self._default_queue = cl.CommandQueue(
                        context, properties=cl.command_queue_properties.PROFILING_ENABLE
                    )
                queue = self._default_queue
        return queue

    def holds_default_queue_of(self, array) -> bool:
        """Whether ``array`` lives on this device's default queue: an identity test, the cheap
        first try of ``backends.device_of_array``."""
        return array.queue is self._default_queue and array.queue is not None

    def owns(self, array) -> bool:
        return array.queue.device.int_ptr == self.cl_device.int_ptr

    def copy(self, destination, source, queue=None) -> None:
        """``clEnqueueCopyBuffer`` of ``source`` into ``destination`` (device arrays, each from its
        first element -- a slice of a flat array too -- or buffers), or a blocking read or write where
        one side is a numpy array.  Bytes are copied as they are, so every dtype copies (PyOpenCL's
        own slice assignment runs a kernel that has no float16 or bfloat16)."""
        if isinstance(destination, cl_array.Array) and isinstance(source, cl_array.Array):
            cl.enqueue_copy(queue or self.queue, destination.base_data, source.base_data, byte_count=source.nbytes,
                            dst_offset=destination.offset, src_offset=source.offset)
            return
        data = [a.data if isinstance(a, cl_array.Array) else a for a in (destination, source)]
        cl.enqueue_copy(queue or self.queue, *data)

    def empty(self, shape, dtype, queue=None, fill=None):
        """A C-contiguous device array, uninitialised unless ``fill`` is given: then filled by
        PyOpenCL's fill kernel, which PyOpenCL shares between threads (one per context and dtype),
        hence ``_PYOPENCL_KERNELS``.

        Arrays made on the device's own queue come from a ``pyopencl.tools.MemoryPool``: memory
        of arrays that were freed is reused instead of fresh memory being mapped, which on
        host-memory devices (PoCL) costs a page fault per 4 KiB at first touch -- 80 ms of a
        100 ms call writing 268 MB -- and a buffer creation and release per call (~10 us).
        Freed memory stays held for reuse (like PyTorch's CUDA caching allocator) until
        ``pool_tuner.release_memory()``; ``POOL_TUNER_MEMORY_POOL=0`` (read at import) turns the
        pool off.  Only the device's in-order queue has a pool, so reused memory is never still in
        use by a pending command on another queue (arrays on a caller's own queue get fresh
        buffers).

        This is on every call's path, and right after a blocking wait the host runs it with cold
        caches, where each Python step costs several times its warm price: the array is made
        through PyOpenCL's fast constructor path (the checked one costs ~15 us warm), with its
        strides memoised per shape and no environment lookup."""
        queue = queue or self.queue
        dtype = np.dtype(dtype)
        shape = tuple(shape)
        strides, size = _contiguous_layout(shape, dtype.itemsize)
        if size == 0:
            return cl_array.empty(queue, shape, dtype)
        array = self._allocate(queue, shape, dtype, strides, size)
        if fill is not None:  # through an unsigned view of its bits: PyOpenCL cannot fill 16-bit floats
            bits = np.array(fill, dtype).view(f"u{dtype.itemsize}")[()]
            with _PYOPENCL_KERNELS:
                array.view(bits.dtype).fill(bits, queue=queue)
        return array

    def _allocate(self, queue, shape, dtype, strides, size):
        """An uninitialised array (``empty``): from the pool on the default queue."""
        if queue is self._default_queue and memory_pool_enabled:
            with self._lock:  # PyOpenCL does not document its MemoryPool as thread-safe
                if self._pool is None:
                    import pyopencl.tools as cl_tools

                    self._pool = cl_tools.MemoryPool(cl_tools.ImmediateAllocator(queue))
                data = self._pool.allocate(size * dtype.itemsize)
        else:
            data = cl.Buffer(queue.context, cl.mem_flags.READ_WRITE, size * dtype.itemsize)
        return _array(queue, shape, dtype, data, strides, size)

    def release_memory(self) -> int:
        """Free the memory the pool holds for reuse; returns the number of blocks freed."""
        with self._lock:
            if self._pool is None:
                return 0
            freed = self._pool.held_blocks
            self._pool.free_held()
        return freed

    # ------------------------------------------------------------------ kernels

    def build(self, context, source: str, kernel_name: str):
        """Build ``source`` for this device in ``context`` (cached) and return the kernel.
        Oclgrind 21.10 cannot run some optimised LLVM IR (``freeze``, noalias scope intrinsics), so
        it gets unoptimised builds; its results are exact either way."""
        options = ("-cl-opt-disable",) if self.info.is_simulator else ()
        return _build(context, self.cl_device, source, kernel_name, options)

    @staticmethod
    def launch(queue, kernel, groups: int, block: tuple, args, timed: bool = False):
        """Launch ``groups`` work-groups of shape ``block`` (a 1-d grid of groups) on ``args``:
        device arrays or buffers, then numpy scalars (``dispatch.Launch.scalars``).  ``kernel`` (a
        ``LockedKernel`` from ``build``) is locked from setting its arguments to enqueueing it (see
        the module docstring).  ``timed``: wait, and return the kernel's time in ms by its
        profiling event (``queue`` must profile, as the default queue does)."""
        global_size = (groups * block[0],) + tuple(block[1:])
        buffers = [a.data if isinstance(a, cl_array.Array) else a for a in args]
        with kernel.launch_lock:
            kernel.set_typed_args(buffers)
            event = cl.enqueue_nd_range_kernel(queue, kernel, global_size, tuple(block))
        if not timed:
            return event
        event.wait()
        return (event.profile.end - event.profile.start) * 1e-6

    def prepare(self, launch, nbytes: tuple, n_inputs: int):
        """Only where ``info.shares_host_memory``: a function running ``launch`` on the default
        queue over host memory, called as ``run(None, *addresses, scalars=None)`` with the
        addresses of the inputs then the outputs (``nbytes`` each, the first ``n_inputs`` read
        only), and the call's run-time scalars where not the launch's, returning once the outputs
        are written (see ``HostLaunch``)."""
        return HostLaunch(self, launch, nbytes, n_inputs)

    @property
    def host_memory_aliases(self) -> bool:
        """Whether a buffer made over host memory (``USE_HOST_PTR``) *is* that memory on this
        device, found by trying it once per process (and again in a forked child): then such
        buffers may be kept for the same address and size, read without mapping, and a kernel
        sees the host's latest writes.  The OpenCL standard promises neither (host pointers are
        only synchronised by mapping), so devices where the trial fails get fresh buffers and a map
        after every kernel."""
        if self._host_memory_aliases is None:
            self._host_memory_aliases = self.info.shares_host_memory and _host_memory_aliases(self.queue)
        return self._host_memory_aliases

    @host_memory_aliases.setter
    def host_memory_aliases(self, value: bool) -> None:
        self._host_memory_aliases = value

    @property
    def host_buffers(self) -> "HostBuffers":
        """The buffers over host memory kept for this device's default queue."""
        if self._host_buffers is None:
            self._host_buffers = HostBuffers(self.queue.context)
        return self._host_buffers

class OpenCLCallerArrays:
    """The caller's ``pyopencl.array.Array``s on one OpenCL device (``base.CallerArrays``): work
    on them goes to their own queue, results are arrays of the same kind."""

    def __init__(self, device: OpenCLDevice):
        self._device = device

    @staticmethod
    def queue_of(array):
        """The array's own queue."""
        return array.queue

    def check_first_call(self, queue, name: str) -> None:
        """A device array on a device whose kernels cannot run in this process is refused, with
        what to do, instead of hanging."""
        info = self._device.info
        if info.host_fallback is not None:
            raise RuntimeError(f"{name} is a pyopencl array on {info.describe()}, whose kernels cannot run here: "
                               f"{info.host_fallback}; pass {name}.get() (a numpy array), or start worker processes "
                               f"with the 'spawn' or 'forkserver' start method")

    @staticmethod
    def wrap_input(array, name: str):
        """A caller's device array as a kernel argument (kernels take no offsets)."""
        if array.offset:
            raise ValueError(f"{name} must start at the beginning of its buffer (offset 0); pass {name}.copy()")
        return array

    @staticmethod
    def deliver(array, queue):
        """A result is already the caller's kind of array (a ``pyopencl.array.Array``)."""
        return array

    @staticmethod
    def track(array, handle) -> None:
        """Let ``array``'s own waits (``finish``, ``get``) include the kernel (the event ``handle``)
        that writes it."""
        array.add_event(handle)

    @staticmethod
    def strided_view(array, shape, strides):
        """``array``'s memory seen with another shape and strides (channels-last results), from
        its first element: a pyramid's levels are parts of one buffer, each at its own offset."""
        shape = tuple(shape)
        return _array(array.queue, shape, array.dtype, array.base_data, tuple(strides), math.prod(shape),
                      array.offset, array.events)


def _array(queue, shape: tuple, dtype: np.dtype, data, strides: tuple, size: int, offset: int = 0, events=None):
    """A device array over ``data`` through PyOpenCL's fast constructor path, which takes the
    shape, strides and size as given: its checked path costs several times a small kernel's launch
    (numpy checks of the shape), and every call makes an array (``empty``), channels-last ones two
    (``strided_view``)."""
    try:
        return cl_array.Array(None, shape, dtype, data=data, offset=offset, strides=strides, events=events,
                              _fast=True, _size=size, _context=queue.context, _queue=queue)
    except TypeError:  # the fast path changed: the checked constructor
        return cl_array.Array(queue, shape, dtype, data=data, offset=offset, strides=strides, events=events)


@functools.lru_cache(maxsize=1024)
def _contiguous_layout(shape: tuple, itemsize: int) -> tuple:
    """``(strides, size)`` of a C-contiguous array of ``shape``."""
    return c_strides(shape, itemsize), math.prod(shape)


if cl is not None:
    class LockedKernel(cl.Kernel):
        """A kernel with the lock that ``launch`` holds from setting its arguments to enqueueing it,
        and ``max_work_group_size``, the most work-items per work-group it can launch with on the
        device it was built for (on CPU devices it can be below the device maximum)."""

        def __init__(self, program, name: str, cl_device):
            super().__init__(program, name)
            self.launch_lock = threading.Lock()
            self._typed = False
            self.max_work_group_size = int(self.get_work_group_info(cl.kernel_work_group_info.WORK_GROUP_SIZE,
                                                                    cl_device))

        def set_typed_args(self, args) -> None:
            """Set the arguments (memory objects, then numpy scalars).  The first call tells PyOpenCL
            the numpy type of each scalar argument (None: a memory object) as ``args`` have them --
            every launch of a kernel passes the same kinds: PyOpenCL then packs scalars through an
            invoker generated for these types instead of working out each scalar's type on every
            call, the slowest step of an undeclared launch."""
            if not self._typed:
                self.set_scalar_arg_dtypes([a.dtype if isinstance(a, np.generic) else None for a in args])
                self._typed = True
            self.set_args(*args)


#: Held from setting the arguments of one of PyOpenCL's own kernels (``pyopencl.array`` fills), which
#: PyOpenCL memoises per context and so shares between threads, to enqueueing it.
_PYOPENCL_KERNELS = threading.Lock()

#: Built programs and their kernels, filed under the program's key (``memo``): the kernels of one
#: program (bandwidth.cl has four) share one build and leave with it.
_PROGRAMS = memo.table("opencl.programs")
_KERNELS = memo.table("opencl.kernels")


def _build(context, cl_device, source: str, kernel_name: str, options: tuple = ()):
    program_key = (context, cl_device, source, options)
    kernel = _KERNELS.peek((program_key, kernel_name))
    if kernel is None:
        program = _PROGRAMS.peek(program_key)
        if program is None:
            program = cl.Program(context, source).build(options=list(options), devices=[cl_device])
            _PROGRAMS.put(program_key, program_key, program)
        kernel = _KERNELS.put(program_key, (program_key, kernel_name), LockedKernel(program, kernel_name, cl_device))
    return kernel


_listing: tuple | None = None
_listing_lock = threading.Lock()


#: How many host-memory buffers a device keeps (``HostBuffers``).
HOST_BUFFER_LIMIT = 64


class HostBuffers:
    """Buffers over host memory, by address, size and access, for devices where such a buffer is
    the memory itself (``OpenCLDevice.host_memory_aliases``).

    Making a buffer is cheap but its first use costs PoCL as much as a small kernel, and a model
    calls each layer on memory that the allocator hands out again and again at the same addresses.
    A buffer is made over the raw address (it holds no reference to the array that owned the
    memory), so keeping it keeps nothing alive, and it is only used again for a live array at the
    same address and size, whose memory it then is.  At most ``HOST_BUFFER_LIMIT`` are kept, the
    least recently used dropped first."""

    def __init__(self, context):
        self._context = context
        self._buffers: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, address: int, nbytes: int, writable: bool):
        key = (address, nbytes, writable)
        with self._lock:
            buffer = self._buffers.get(key)
            if buffer is not None:
                self._buffers.move_to_end(key)
                return buffer
            buffer = self._buffers[key] = host_buffer(self._context, address, nbytes, writable)
            if len(self._buffers) > HOST_BUFFER_LIMIT:
                self._buffers.popitem(last=False)
            return buffer

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()


def host_buffer(context, address: int, nbytes: int, writable: bool):
    """A ``USE_HOST_PTR`` buffer over ``nbytes`` of host memory at ``address``."""
    flags = cl.mem_flags.USE_HOST_PTR | (cl.mem_flags.READ_WRITE if writable else cl.mem_flags.READ_ONLY)
    return cl.Buffer(context, flags, hostbuf=(ctypes.c_char * nbytes).from_address(address))


class HostLaunch:
    """One built kernel with its grid, run over host memory (``OpenCLDevice.prepare``): the
    call path of numpy arrays and CPU tensors on devices that share host memory.  A call sets the
    arguments and enqueues under the kernel's lock, then waits; where host memory aliases
    (``host_memory_aliases``) the buffers come from the device's ``HostBuffers``, elsewhere they
    are made afresh and the outputs mapped once the kernel is done."""

    __slots__ = ("queue", "kernel", "global_size", "local_size", "scalars", "nbytes", "writable", "buffers")

    def __init__(self, device, launch, nbytes: tuple, n_inputs: int):
        self.queue = device.queue
        self.kernel = launch.kernel
        self.global_size = (launch.groups * launch.block[0],) + tuple(launch.block[1:])
        self.local_size = tuple(launch.block)
        self.scalars = launch.scalars
        self.nbytes = nbytes
        self.writable = tuple(i >= n_inputs for i in range(len(nbytes)))
        self.buffers = device.host_buffers if device.host_memory_aliases else None

    def __call__(self, stream, *addresses, scalars: tuple | None = None) -> None:
        """Run over the memory at ``addresses``; ``stream`` is None (the device's default queue);
        ``scalars``: this call's run-time scalars in place of the launch's (GeM's learnt ``p``)."""
        if self.buffers is not None:
            get = self.buffers.get
            buffers = [get(a, n, w) for a, n, w in zip(addresses, self.nbytes, self.writable)]
        else:
            context = self.queue.context
            buffers = [host_buffer(context, a, n, w) for a, n, w in zip(addresses, self.nbytes, self.writable)]
        with self.kernel.launch_lock:
            self.kernel.set_typed_args((*buffers, *(self.scalars if scalars is None else scalars)))
            event = cl.enqueue_nd_range_kernel(self.queue, self.kernel, self.global_size, self.local_size)
        event.wait()
        if self.buffers is None:
            for buffer, nbytes, writable in zip(buffers, self.nbytes, self.writable):
                if writable:
                    mapped, done = cl.enqueue_map_buffer(self.queue, buffer, cl.map_flags.READ, 0, (nbytes,), np.uint8)
                    done.wait()
                    mapped.base.release(self.queue)


_ALIAS_PROBE = """
__kernel void copy_twice(__global const short* a, __global short* b) { b[get_global_id(0)] = 2 * a[get_global_id(0)]; }
"""


def _host_memory_aliases(queue) -> bool:
    """The trial behind ``OpenCLDevice.host_memory_aliases``: buffers over deliberately unaligned
    host memory, written by the host after the buffers were made, read back without mapping,
    twice over the same buffers."""
    kernel = cl.Program(queue.context, _ALIAS_PROBE).build().copy_twice
    storage = np.zeros(2 * 64 + 2, np.int16)
    source, target = storage[1:65], storage[66:130]  # 2 bytes past any alignment
    buffers = [host_buffer(queue.context, a.ctypes.data, a.nbytes, w) for a, w in ((source, False), (target, True))]
    for round_ in (1, 2):
        source[:] = np.arange(64, dtype=np.int16) + round_
        target[:] = -1
        kernel.set_args(*buffers)
        cl.enqueue_nd_range_kernel(queue, kernel, (64,), None).wait()
        if not np.array_equal(target, 2 * source):
            return False
    return True


def list_devices() -> tuple:
    """Every OpenCL device of every platform, in ICD order (stable for a given installation),
    listed once per process; PoCL's fork fallback is not listed (see the module docstring)."""
    listing = _listing
    if listing is None:
        listing = _list_once()
    return listing


def _list_once() -> tuple:
    global _listing
    with _listing_lock:
        if _listing is None:
            _listing = enumerate_devices()
        return _listing


def enumerate_devices() -> tuple:
    """List the devices afresh (``list_devices`` lists once and keeps the result)."""
    if cl is None:
        return ()
    found = []
    try:
        platforms = cl.get_platforms()
    except cl.Error:  # no ICD / no platform installed
        return ()
    slugs = _unique_slugs([platform.name.strip() for platform in platforms])
    for p_index, platform in enumerate(platforms):
        try:
            devices = list(enumerate(platform.get_devices()))
        except cl.Error:
            continue
        for number, (d_index, device) in enumerate(devices):
            found.append(OpenCLDevice(p_index, d_index, device, slugs[p_index], number))
    return tuple(found)


#: Whether this process is a forked child of a process in which PoCL was loaded (``pocl_loaded``):
#: its worker threads, if it started them, stayed in that process.
_pocl_started_before_fork = False


def pocl_loaded() -> bool:
    """Whether PoCL's library is loaded in this process (by pool_tuner or by the user's own OpenCL
    code), read from the process's memory map: where it cannot be read, assumed loaded."""
    try:
        with open("/proc/self/maps") as maps:
            return any("libpocl" in line for line in maps)
    except OSError:
        return True


def _before_fork() -> None:
    """Read whether PoCL is loaded, once it is no more (a loaded driver stays loaded)."""
    global _pocl_loaded_in_parent
    _pocl_loaded_in_parent = _pocl_loaded_in_parent or pocl_loaded()


#: ``pocl_loaded()`` in the process that forks, read just before it forks.
_pocl_loaded_in_parent = False


def _after_fork_in_child() -> None:
    """A forked child: a fresh listing lock, and every listed device off the parent's OpenCL state
    (``OpenCLDevice._after_fork_in_child``); ``memo`` empties the built kernels."""
    global _listing_lock, _PYOPENCL_KERNELS, _pocl_started_before_fork
    _listing_lock, _PYOPENCL_KERNELS = threading.Lock(), threading.Lock()
    _pocl_started_before_fork = _pocl_loaded_in_parent
    for device in _listing or ():
        device._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def _unique_slugs(platform_names: list) -> list:
    """``platform_slug`` of each platform; where two platforms have the same slug (two ICDs of
    one driver), the second gets ``-2``, the third ``-3``, in ICD order."""
    slugs, seen = [], {}
    for name in platform_names:
        slug = platform_slug(name)
        seen[slug] = seen.get(slug, 0) + 1
        slugs.append(slug if seen[slug] == 1 else f"{slug}-{seen[slug]}")
    return slugs


_NUMERIC_ID = re.compile(rf"{BACKEND}:(\d+):(\d+)")


def missing(device_id: str | None) -> str | None:
    """Why no device has ``device_id``: an id of the older numeric form ``opencl:<platform
    index>:<device index>``, whose numbering changes when an OpenCL driver is installed (PoCL was
    ``opencl:0:0``, then ``opencl:1:0`` beside Oclgrind), is refused, naming the device at that
    position now.  For None: why PyOpenCL lists nothing (it failed to load), if it did."""
    if device_id is None:
        return None if _IMPORT_ERROR is None else str(_IMPORT_ERROR)
    text = device_id
    match = _NUMERIC_ID.fullmatch(text)
    if match is None:
        return None
    p_index, d_index = int(match[1]), int(match[2])
    here = [d for d in list_devices() if (d.platform_index, d.device_index) == (p_index, d_index)]
    now = f"{text} is now {here[0].info.id!r} ({here[0].info.name})" if here else "no device is at that position now"
    return (f"numeric OpenCL ids (opencl:<platform index>:<device index>) are no longer accepted, as the "
            f"platform index changed whenever another OpenCL driver was installed; {now}")


def device_of_array(x):
    """The device of a ``pyopencl.array.Array`` (None for other objects)."""
    if not is_device_array(x):
        return None
    devices = list_devices()
    for d in devices:  # the common case first: an array on a device's default queue
        if d.holds_default_queue_of(x):
            return d
    for d in devices:
        if d.owns(x):
            return d
    raise ValueError(f"the pyopencl array is on {x.queue.device.name.strip()!r} (platform "
                     f"{x.queue.device.platform.name.strip()!r}), a device pool_tuner does not serve; it serves "
                     f"{', '.join(d.info.describe() for d in devices) or 'no OpenCL device'}. Pass the array's .get() "
                     f"(a numpy array), or an array made on a queue of one of those devices")


def import_error():
    return _IMPORT_ERROR


def is_device_array(x) -> bool:
    return cl_array is not None and isinstance(x, cl_array.Array)
