"""The CUDA driver API through ctypes: kernels loaded into a device's primary context and launched
on any stream handle.  This is the launch path of CUDA tensors from PyTorch (``pool_tuner.torch``).

Why not PyCUDA at call time: a PyCUDA launch takes a PyCUDA ``Stream`` (or none), never a stream
handle made by another library, so it cannot honour ``torch.cuda.current_stream()`` or CUDA graph
capture; the PyCUDA objects a call makes and frees (arrays, events, context pushes) are tied to
PyCUDA's per-thread context stack, which breaks on threads PyCUDA did not set up (PyTorch's
autograd thread: allocations that are never released, ``cuCtxGetDevice failed``).  Here a call
makes no driver object at all: the kernel, grid, block, ctypes argument array and run-time scalars
are fixed once (``PreparedLaunch``), and each call fills in device pointers and calls
``cuLaunchKernel``.

The cubins come from pool_tuner's own compiler cache (``backends.cuda_compile``).  PyCUDA's
``Module`` and ``Function`` do not expose their driver handles (PyCUDA 2026.1 binds no ``handle``
for either), so the image is loaded here with ``cuModuleLoadData``, once per image and device
(``backends.cuda`` memoises it), and kept for the life of the process.

Contexts: kernels are loaded into, and launched in, the device's *primary* context -- the one the
CUDA runtime, PyTorch and CuPy use -- retained here once per device and never released.  A launch
asks the driver which context is current on the calling thread (``cuCtxGetCurrent``, a
thread-local read).  PyTorch does not guarantee one: a fresh thread that has only allocated
tensors (served from the caching allocator, no runtime call) may have none, and a thread whose
current device is another GPU has that GPU's.  So when the current context is not the device's
primary context, the launch pushes it and pops it afterwards, leaving the thread as it found it.
PyCUDA's own context stack is never consulted.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import threading

import numpy as np

#: ``CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK``: the most threads per block the loaded kernel allows.
_MAX_THREADS_PER_BLOCK = 0

_c_void_p_p = ctypes.POINTER(ctypes.c_void_p)
#: Driver functions and their argument types (every one returns a ``CUresult``, a C int).  The
#: versioned names are the symbols ``cuda.h`` maps the plain names to.
_SIGNATURES = {
    "cuInit": [ctypes.c_uint],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [_c_void_p_p, ctypes.c_int],
    "cuCtxGetCurrent": [_c_void_p_p],
    "cuCtxPushCurrent_v2": [ctypes.c_void_p],
    "cuCtxPopCurrent_v2": [_c_void_p_p],
    "cuModuleLoadData": [_c_void_p_p, ctypes.c_char_p],
    "cuModuleGetFunction": [_c_void_p_p, ctypes.c_void_p, ctypes.c_char_p],
    "cuFuncGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_void_p],
    # function, grid x/y/z, block x/y/z, dynamic shared bytes, stream, kernelParams, extra
    "cuLaunchKernel": [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, _c_void_p_p, _c_void_p_p],
    "cuPointerGetAttribute": [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64],
    "cuStreamSynchronize": [ctypes.c_void_p],
}


class DriverError(RuntimeError):
    """A CUDA driver call that did not return ``CUDA_SUCCESS``."""

    def __init__(self, call: str, status: int):
        self.call, self.status = call, status
        super().__init__(f"{call} failed: {_error_name(status)} ({status})")


@functools.cache
def library():
    """libcuda with the signatures above declared, or None when there is no CUDA driver."""
    for name in ("libcuda.so.1", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        return declare_signatures(lib)
    return None


def declare_signatures(lib):
    """Declare the argument and result types of the driver functions pool_tuner calls on ``lib``
    (libcuda, or a stand-in with the same symbols); returns ``lib``."""
    for function, argtypes in _SIGNATURES.items():
        getattr(lib, function).argtypes = argtypes
        getattr(lib, function).restype = ctypes.c_int
    return lib


def _driver():
    lib = library()
    if lib is None:
        raise RuntimeError("the CUDA driver library (libcuda) could not be loaded")
    return lib


def _error_name(status: int) -> str:
    lib = library()
    name = ctypes.c_char_p()
    if lib is not None and lib.cuGetErrorName(status, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return "CUDA error"


def check(status: int, call: str) -> None:
    if status != 0:
        raise DriverError(call, status)


_LOCK = threading.Lock()


@functools.cache
def primary_context(ordinal: int) -> int:
    """The handle of device ``ordinal``'s primary context, retained for the life of the process."""
    lib = _driver()
    with _LOCK:
        check(lib.cuInit(0), "cuInit")
        device = ctypes.c_int()
        check(lib.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
        context = ctypes.c_void_p()
        check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    return context.value


@contextlib.contextmanager
def made_current(lib, context: int):
    """``context`` current on this thread for the block: pushed (and popped after) only when
    another context, or none, is current."""
    current = ctypes.c_void_p()
    check(lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if current.value == context:
        yield
        return
    check(lib.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
    try:
        yield
    finally:
        check(lib.cuCtxPopCurrent_v2(ctypes.byref(current)), "cuCtxPopCurrent")


@dataclasses.dataclass(frozen=True)
class DriverKernel:
    """A kernel loaded into a device's primary context: its ``CUfunction`` handle and limits."""

    ordinal: int
    context: int
    function: int
    name: str
    max_threads_per_block: int


def load_module(ordinal: int, image: bytes) -> int:
    """Load a compiled module image (cubin) into device ``ordinal``'s primary context; its
    ``CUmodule`` handle.  The module stays loaded for the life of the process: the caller memoises
    it (``backends.cuda``), so each image is loaded once per device."""
    lib = _driver()
    module = ctypes.c_void_p()
    with made_current(lib, primary_context(ordinal)):
        check(lib.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
    return module.value


def get_kernel(ordinal: int, module: int, name: str) -> DriverKernel:
    """Kernel ``name`` of a module loaded by ``load_module`` on device ``ordinal``."""
    lib = _driver()
    context = primary_context(ordinal)
    function, limit = ctypes.c_void_p(), ctypes.c_int()
    with made_current(lib, context):
        check(lib.cuModuleGetFunction(ctypes.byref(function), module, name.encode()), f"cuModuleGetFunction({name})")
        check(lib.cuFuncGetAttribute(ctypes.byref(limit), _MAX_THREADS_PER_BLOCK, function), "cuFuncGetAttribute")
    return DriverKernel(ordinal, context, function.value, name, limit.value)


def load_kernel(ordinal: int, image: bytes, name: str) -> DriverKernel:
    """``load_module`` then ``get_kernel``: kernel ``name`` of a freshly loaded ``image``."""
    return get_kernel(ordinal, load_module(ordinal, image), name)


def _unconverted(lib, name: str):
    """Driver function ``name`` without declared argument types, for calls whose arguments are
    ctypes objects made in advance: ctypes then passes them as they are instead of converting
    every argument on every call."""
    function = lib[name]
    function.restype = ctypes.c_int
    return function


class PreparedLaunch:
    """One kernel with its grid, block and argument layout fixed: ``launch(stream, *pointers)``
    writes the device pointers and the raw stream handle ``stream`` (0: the legacy default
    stream) into ctypes objects made here, once, and calls ``cuLaunchKernel`` with them.  Every
    pool_tuner kernel takes device pointers, then run-time scalars (``dispatch.Launch.scalars``:
    numpy scalars, such as the plane count) which belong to the call signature and so are fixed
    here too.

    The slots are shared by all calls, so filling them and launching happen under a lock: ctypes
    releases the GIL inside each driver call, and two threads must not launch each other's
    pointers.  ``cuLaunchKernel`` copies the argument values (also when a stream is being captured
    into a CUDA graph), so the slots are free again as soon as it returns."""

    __slots__ = ("kernel", "grid", "block", "_lib", "_slots", "_scalars", "_stream", "_current", "_current_ref",
                 "_get_current", "_launch", "_lock")

    def __init__(self, kernel: DriverKernel, groups: int, block: tuple, n_pointers: int, scalars: tuple, lib=None):
        self.kernel = kernel
        self.grid = int(groups)
        self.block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
        self._lib = lib = _driver() if lib is None else lib
        self._slots = tuple(ctypes.c_uint64() for _ in range(n_pointers))  # CUdeviceptr values
        self._scalars = tuple(np.ctypeslib.as_ctypes_type(s.dtype)(s) for s in scalars)
        arguments = self._slots + self._scalars
        params = (ctypes.c_void_p * len(arguments))(*(ctypes.addressof(a) for a in arguments))
        self._stream = ctypes.c_void_p()
        self._current = ctypes.c_void_p()
        self._current_ref = ctypes.pointer(self._current)
        self._get_current = _unconverted(lib, "cuCtxGetCurrent")
        dims = [ctypes.c_uint(n) for n in (self.grid, 1, 1) + self.block]
        self._launch = functools.partial(_unconverted(lib, "cuLaunchKernel"), ctypes.c_void_p(kernel.function),
                                         *dims, ctypes.c_uint(0), self._stream, params, None)
        self._lock = threading.Lock()

    def __call__(self, stream: int, *pointers: int) -> None:
        if len(pointers) != len(self._slots):
            raise TypeError(f"{self.kernel.name} takes {len(self._slots)} device pointers, got {len(pointers)}")
        with self._lock:
            for slot, pointer in zip(self._slots, pointers):
                slot.value = pointer
            self._stream.value = stream
            status = self._get_current(self._current_ref)
            if status:
                raise DriverError("cuCtxGetCurrent", status)
            if self._current.value == self.kernel.context:
                status = self._launch()
            else:  # a thread without (or with another) current context: see the module docstring
                lib = self._lib
                check(lib.cuCtxPushCurrent_v2(self.kernel.context), "cuCtxPushCurrent")
                try:
                    status = self._launch()
                finally:
                    check(lib.cuCtxPopCurrent_v2(ctypes.byref(self._current)), "cuCtxPopCurrent")
        if status:
            raise DriverError(f"cuLaunchKernel({self.kernel.name})", status)
