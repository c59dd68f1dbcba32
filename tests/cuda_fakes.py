"""Stand-ins for a CUDA GPU, so that the driver-API launch path runs without one: ``FakeDriver``
plays libcuda (per-thread current contexts, loaded modules, launches whose arguments it reads back
from the ctypes argument array as the driver would), ``fake_cuda_device`` makes a real
``CudaDevice`` without PyCUDA."""

import ctypes
import threading

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
