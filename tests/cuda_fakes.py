"""Stand-ins for a CUDA GPU, so that the driver-API launch path runs without one: ``FakeDriver``
plays libcuda (per-thread current contexts, loaded modules, launches whose arguments it reads back
from the ctypes argument array as the driver would, and the stream calls around them),
``FakePyCuda`` plays what the backend uses of PyCUDA (arrays, memory pools, contexts),
``fake_cuda_device`` makes a real ``CudaDevice`` without PyCUDA."""

import ctypes
import math
import threading
import types

import numpy as np

from pool_tuner.backends import cuda

PRIMARY_CONTEXT = 0xC0
OTHER_CONTEXT = 0xD0
MAX_THREADS = 1024


def _target(argument):
    """The ctypes object behind an argument passed directly, through ``ctypes.byref`` or as a
    ``ctypes.pointer``."""
    if hasattr(argument, "contents"):
        return argument.contents
    return getattr(argument, "_obj", argument)


def _value(argument):
    """A plain value, whether passed as a Python int (declared argument types) or a ctypes object."""
    return getattr(argument, "value", argument)


class FakeDriver:
    """Records driver calls; each launch as a dict with its arguments read through ``kernelParams``
    as 64-bit values (the device pointers, then the plane count)."""

    def __init__(self):
        self.calls = []
        self.launches = []
        self.modules = []
        self.launch_status = 0
        self.max_threads = MAX_THREADS
        self._local = threading.local()
        self.on_get_current = None  # called inside cuCtxGetCurrent (tests use it to force thread switches)
        self.capturing = set()  # stream handles being captured into a graph
        self.events = 0  # events made

    # contexts: a per-thread stack, as the driver keeps one
    def _stack(self):
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def set_current(self, context):
        self._local.stack = [] if context is None else [context]

    def current(self):
        stack = self._stack()
        return stack[-1] if stack else None

    def cuInit(self, flags):
        self.calls.append("cuInit")
        return 0

    def cuDeviceGet(self, device, ordinal):
        _target(device).value = ordinal
        return 0

    def cuDevicePrimaryCtxRetain(self, context, device):
        self.calls.append(("cuDevicePrimaryCtxRetain", _target(device).value))
        _target(context).value = PRIMARY_CONTEXT
        return 0

    def cuCtxGetCurrent(self, out):
        if self.on_get_current is not None:
            self.on_get_current()
        _target(out).value = self.current()
        return 0

    def cuCtxPushCurrent_v2(self, context):
        self.calls.append(("push", context))
        self._stack().append(context)
        return 0

    def cuCtxPopCurrent_v2(self, out):
        self.calls.append("pop")
        _target(out).value = self._stack().pop()
        return 0

    def cuModuleLoadData(self, module, image):
        self.modules.append((bytes(image), self.current()))
        _target(module).value = 0x100 + len(self.modules)
        return 0

    def cuModuleGetFunction(self, function, module, name):
        self.calls.append(("cuModuleGetFunction", _value(_target(module)), name))
        _target(function).value = 0xF000 + len(self.modules)
        return 0

    def cuFuncGetAttribute(self, value, attribute, function):
        assert attribute == 0  # CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK
        _target(value).value = self.max_threads
        return 0

    def __getitem__(self, name):
        """``lib[name]``: a function object of its own (ctypes hands out a new one each time)."""
        return FakeFunction(getattr(self, name))

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        function, gx, gy, gz, bx, by, bz, shared, stream = map(_value, (function, gx, gy, gz, bx, by, bz, shared, stream))
        slots = [ctypes.c_void_p.from_address(ctypes.addressof(params) + i * ctypes.sizeof(ctypes.c_void_p)).value
                 for i in range(len(params))]
        self.launches.append({
            "function": function, "grid": (gx, gy, gz), "block": (bx, by, bz), "shared": shared,
            "stream": stream, "extra": extra, "params_address": ctypes.addressof(params),
            "arguments": [ctypes.c_uint64.from_address(slot).value for slot in slots],
            "context": self.current(), "thread": threading.get_ident(),
        })
        return self.launch_status

    # streams, events, fills and copies: recorded in ``calls`` as (name, plain arguments...)
    def _record(self, name, *args):
        self.calls.append((name, *map(_value, args)))
        return 0

    def cuPointerGetAttribute(self, data, attribute, pointer):
        return 1  # CUDA_ERROR_INVALID_VALUE: not a pointer the driver knows (its device is taken to be 0)

    def cuStreamSynchronize(self, stream):
        return self._record("cuStreamSynchronize", stream)

    def cuStreamIsCapturing(self, stream, status):
        _target(status).value = 1 if _value(stream) in self.capturing else 0  # ACTIVE or NONE
        return 0

    def cuEventCreate(self, event, flags):
        self.events += 1
        _target(event).value = 0xE000 + self.events
        return self._record("cuEventCreate", flags)

    def cuEventRecord(self, event, stream):
        return self._record("cuEventRecord", event, stream)

    def cuStreamWaitEvent(self, stream, event, flags):
        return self._record("cuStreamWaitEvent", stream, event)

    def cuEventSynchronize(self, event):
        return self._record("cuEventSynchronize", event)

    def cuEventElapsedTime(self, ms, start, end):
        _target(ms).value = 0.25
        return 0

    def cuEventDestroy_v2(self, event):
        return self._record("cuEventDestroy", event)

    def cuMemsetD8Async(self, pointer, value, count, stream):
        return self._record("cuMemsetD8Async", pointer, value, count, stream)

    def cuMemsetD16Async(self, pointer, value, count, stream):
        return self._record("cuMemsetD16Async", pointer, value, count, stream)

    def cuMemsetD32Async(self, pointer, value, count, stream):
        return self._record("cuMemsetD32Async", pointer, value, count, stream)

    def cuMemsetD2D32Async(self, pointer, pitch, value, width, height, stream):
        return self._record("cuMemsetD2D32Async", pointer, pitch, value, width, height, stream)

    def cuMemcpyDtoDAsync_v2(self, destination, source, nbytes, stream):
        return self._record("cuMemcpyDtoDAsync", destination, source, nbytes, stream)

    def cuGetErrorName(self, status, out):
        _target(out).value = b"CUDA_ERROR_FAKE"
        return 0


class FakeFunction:
    """A driver function as ``lib[name]`` gives it: with a settable ``restype``."""

    def __init__(self, function):
        self.function, self.restype = function, None

    def __call__(self, *args):
        return self.function(*args)


def fake_cuda_device(ordinal=0, compute_capability=(9, 0)):
    """A real ``CudaDevice`` (its driver target, describe, ...) made from properties given here
    instead of read through PyCUDA."""
    properties = cuda.CudaProperties(name="Fake GPU", compute_capability=compute_capability, multiprocessors=132,
                                     max_threads_per_block=MAX_THREADS, max_shared_memory_per_block=48 * 1024,
                                     total_memory=80 * 2**30, driver_version=13000)
    device = cuda.CudaDevice(ordinal, properties)
    device.__dict__["cu_device"] = None
    return device


class FakeGPUArray:
    """What the backend and ``pool_tuner.ops`` use of PyCUDA's ``GPUArray``, over made-up device
    addresses; its interface names no stream, as PyCUDA's does not."""

    def __init__(self, shape, dtype, allocator=None, base=None, gpudata=None, strides=None):
        self.shape, self.dtype, self.base = tuple(shape), np.dtype(dtype), base
        self.size = math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize
        contiguous = tuple(int(np.prod(self.shape[i + 1:])) * self.dtype.itemsize for i in range(len(self.shape)))
        self.strides = contiguous if strides is None else tuple(strides)
        self.flags = types.SimpleNamespace(c_contiguous=self.strides == contiguous)
        self.gpudata = gpudata if gpudata is not None else (allocator(self.nbytes) if self.size else None)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "strides": self.strides, "data": (int(self.gpudata or 0), False),
                "typestr": self.dtype.str, "stream": None, "version": 3}

    def view(self, dtype):
        dtype = np.dtype(dtype)
        return FakeGPUArray((self.nbytes // dtype.itemsize,), dtype, gpudata=self.gpudata, base=self)


class FakePyCuda:
    """What the backend uses of ``pycuda.driver``, ``pycuda.gpuarray`` and ``pycuda.tools``,
    recording the events and streams made (none should be, per call), the pools and their
    allocations (made-up addresses, 0x1000 apart)."""

    def __init__(self):
        self.events, self.streams, self.allocations, self.pools = [], [], [], []
        fake = self

        class Event:
            def __init__(self, *args):
                fake.events.append(self)

        class Stream:
            def __init__(self, *args):
                fake.streams.append(self)

        class Context:
            @staticmethod
            def pop():
                pass

            @staticmethod
            def synchronize():
                pass

        class DeviceMemoryPool:
            def __init__(self):
                self.held_blocks, self.freed = 0, 0
                fake.pools.append(self)

            def allocate(self, nbytes):
                fake.allocations.append(nbytes)
                return 0x1000 * len(fake.allocations)

            def free_held(self):
                self.freed += self.held_blocks
                self.held_blocks = 0

        self.driver = types.SimpleNamespace(Event=Event, Stream=Stream, Context=Context)
        self.gpuarray = types.SimpleNamespace(GPUArray=FakeGPUArray)
        self.tools = types.SimpleNamespace(DeviceMemoryPool=DeviceMemoryPool)


class FakeContext:
    """PyCUDA's primary context as the backend uses it."""

    def push(self):
        pass

    def synchronize(self):
        pass


class ForeignArray:
    """A CUDA array of another library (Numba, CuPy, ...): shape, strides (bytes) and dtype, and a
    ``__cuda_array_interface__`` naming ``stream`` (left out when ``stream`` is ``...``)."""

    def __init__(self, shape, pointer, stream=..., dtype=np.float32):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.strides = tuple(int(np.prod(self.shape[i + 1:])) * self.dtype.itemsize for i in range(len(self.shape)))
        self.pointer, self.stream = pointer, stream

    @property
    def __cuda_array_interface__(self):
        interface = {"shape": self.shape, "strides": None, "data": (self.pointer, False), "typestr": self.dtype.str,
                     "version": 3}
        if self.stream is not ...:
            interface["stream"] = self.stream
        return interface
