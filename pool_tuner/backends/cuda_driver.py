"""The CUDA driver API through ctypes: kernels loaded into a context and launched on any stream
handle, device memory, and the few stream operations around a launch (fills, copies, a stream
waiting for another, timing).  Every CUDA launch of pool_tuner goes through here: CUDA tensors from
PyTorch (``pool_tuner.torch``, a ``PreparedLaunch`` per call signature) and ``backends.cuda``'s
``launch`` (``launch`` below, for ``pool_tuner.ops`` on CUDA arrays, the tuner and the benchmark).

Why not PyCUDA at call time: a PyCUDA launch takes a PyCUDA ``Stream`` (or none), never a stream
handle made by another library, so it cannot honour ``torch.cuda.current_stream()`` or CUDA graph
capture, nor the stream a CUDA array's ``__cuda_array_interface__`` names; the PyCUDA objects a
call makes and frees (arrays, events, context pushes) are tied to PyCUDA's per-thread context
stack, which breaks on threads PyCUDA did not set up (PyTorch's autograd thread: allocations that
are never released, ``cuCtxGetDevice failed``).  Here a launch makes no driver object at all: for
a ``PreparedLaunch`` the kernel, grid, block, ctypes argument array and run-time scalars are fixed
once, and each call fills in device pointers and calls ``cuLaunchKernel``; ``launch`` makes its
ctypes arguments per call.

The cubins come from pool_tuner's own compiler cache (``backends.cuda_compile``).  PyCUDA's
``Module`` and ``Function`` do not expose their driver handles (PyCUDA 2026.1 binds no ``handle``
for either), so the image is loaded here with ``cuModuleLoadData``, once per image and context
(``backends.cuda`` memoises it), and kept for the life of the process.

Contexts -- the one rule, as PyTorch and CuPy have it: everything runs in the calling thread's
*current* context (``current_context``).  When no context is current, the device's primary context
(the one the CUDA runtime, PyTorch, CuPy and Numba use) is made current with ``cuCtxSetCurrent``
and left current, as the runtime does on a thread's first call.  Nothing here pushes or pops a
context around a call: a caller whose arrays live in a context of its own (``pycuda.autoinit``
makes one) has that context current, so the launch, the results and the caller's later reads all
happen in it.  A current context of another device, or an input owned by another context
(``pointer_context``), is the caller's mistake, refused by ``backends.cuda`` with a ``ValueError``
that names both.  Kernels are loaded per context (a module belongs to the context that loaded it).
"""

from __future__ import annotations

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
    "cuCtxSetCurrent": [ctypes.c_void_p],
    "cuCtxGetDevice": [ctypes.POINTER(ctypes.c_int)],
    "cuCtxSynchronize": [],
    "cuCtxPushCurrent_v2": [ctypes.c_void_p],
    "cuCtxPopCurrent_v2": [_c_void_p_p],
    "cuModuleLoadData": [_c_void_p_p, ctypes.c_char_p],
    "cuModuleGetFunction": [_c_void_p_p, ctypes.c_void_p, ctypes.c_char_p],
    "cuFuncGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_void_p],
    # function, grid x/y/z, block x/y/z, dynamic shared bytes, stream, kernelParams, extra
    "cuLaunchKernel": [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, _c_void_p_p, _c_void_p_p],
    "cuPointerGetAttribute": [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64],
    "cuStreamSynchronize": [ctypes.c_void_p],
    "cuStreamIsCapturing": [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)],
    "cuStreamWaitEvent": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint],
    "cuEventCreate": [_c_void_p_p, ctypes.c_uint],
    "cuEventRecord": [ctypes.c_void_p, ctypes.c_void_p],
    "cuEventSynchronize": [ctypes.c_void_p],
    "cuEventElapsedTime": [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p],
    "cuEventDestroy_v2": [ctypes.c_void_p],
    # destination, value, count, stream
    "cuMemsetD8Async": [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p],
    "cuMemsetD16Async": [ctypes.c_uint64, ctypes.c_ushort, ctypes.c_size_t, ctypes.c_void_p],
    "cuMemsetD32Async": [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p],
    # destination, pitch, value, width, height, stream
    "cuMemsetD2D32Async": [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_uint, ctypes.c_size_t, ctypes.c_size_t,
                           ctypes.c_void_p],
    "cuMemcpyDtoDAsync_v2": [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p],
    "cuMemAlloc_v2": [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t],
    "cuMemFree_v2": [ctypes.c_uint64],
    # destination, source, bytes
    "cuMemcpyHtoD_v2": [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t],
    "cuMemcpyDtoH_v2": [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t],
}
#: ``CU_EVENT_DISABLE_TIMING``: an event only for ordering, which records faster than a timed one.
_EVENT_DISABLE_TIMING = 0x2
#: ``CU_STREAM_CAPTURE_STATUS_NONE``: the stream is not being captured into a graph.
_CAPTURE_STATUS_NONE = 0


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


#: ``CUDA_ERROR_INVALID_CONTEXT``: what the driver answers for work in no context or the wrong one.
INVALID_CONTEXT = 201


class ContextError(ValueError):
    """The calling thread's current context cannot run this call: it is another device's, or the
    call's arrays are owned by another context.  The message names both and what to do."""


def current_context(ordinal: int) -> int:
    """The calling thread's current context, which must be device ``ordinal``'s; when none is
    current, device ``ordinal``'s primary context, made current (``cuCtxSetCurrent``) and left so.
    Raises ``ContextError`` when the current context is another device's."""
    lib = _driver()
    primary = primary_context(ordinal)  # memoised; its first call initialises the driver (cuInit)
    context = ctypes.c_void_p()
    check(lib.cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
    if not context.value:
        check(lib.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
        return primary
    device = context_device()
    if device != ordinal:
        raise ContextError(
            f"the calling thread's current CUDA context ({context.value:#x}) is device {device}'s, but this call "
            f"runs on cuda:{ordinal}; make a context of cuda:{ordinal} current first (torch.cuda.set_device("
            f"{ordinal}), cupy.cuda.Device({ordinal}).use(), or push a PyCUDA context made on it)")
    return context.value


def context_device() -> int:
    """The device ordinal of the calling thread's current context."""
    device = ctypes.c_int()
    check(_driver().cuCtxGetDevice(ctypes.byref(device)), "cuCtxGetDevice")
    return device.value


#: ``CU_POINTER_ATTRIBUTE_CONTEXT``, ``CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL``.
_POINTER_CONTEXT, _POINTER_DEVICE_ORDINAL = 1, 9


def pointer_context(pointer: int) -> int | None:
    """The context that allocated device memory ``pointer``; None when the driver cannot tell (not
    memory it allocated, memory of a stream-ordered pool, which belongs to no context)."""
    lib = library()
    if lib is None or not pointer:
        return None
    context = ctypes.c_void_p()
    if lib.cuPointerGetAttribute(ctypes.byref(context), _POINTER_CONTEXT, pointer) != 0:
        return None
    return context.value or None


def pointer_device(pointer: int) -> int | None:
    """The ordinal of the device holding ``pointer``, or None when the driver cannot tell."""
    lib = library()
    if lib is None or not pointer:
        return None
    ordinal = ctypes.c_int(-1)
    status = lib.cuPointerGetAttribute(ctypes.byref(ordinal), _POINTER_DEVICE_ORDINAL, pointer)
    return ordinal.value if status == 0 and ordinal.value >= 0 else None


@dataclasses.dataclass(frozen=True)
class DriverKernel:
    """A kernel loaded into one context: its ``CUfunction`` handle and limits.  ``origin`` is how
    it was built (``backends.cuda``: architecture and source), so that the same kernel can be
    loaded into another context."""

    ordinal: int
    context: int
    function: int
    name: str
    max_threads_per_block: int
    origin: tuple = dataclasses.field(default=(), compare=False, repr=False)

    @property
    def max_work_group_size(self) -> int:
        """The most threads per block it can launch with, by the name every backend's built
        kernels share (``Device.build``)."""
        return self.max_threads_per_block


def load_module(ordinal: int, image: bytes) -> int:
    """Load a compiled module image (cubin) into the current context (``current_context``); its
    ``CUmodule`` handle.  The module stays loaded for the life of the process: the caller memoises
    it per context (``backends.cuda``)."""
    lib = _driver()
    current_context(ordinal)
    module = ctypes.c_void_p()
    check(lib.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
    return module.value


def get_kernel(ordinal: int, module: int, name: str, origin: tuple = ()) -> DriverKernel:
    """Kernel ``name`` of a module that ``load_module`` loaded into the current context."""
    lib = _driver()
    context = current_context(ordinal)
    function, limit = ctypes.c_void_p(), ctypes.c_int()
    check(lib.cuModuleGetFunction(ctypes.byref(function), module, name.encode()), f"cuModuleGetFunction({name})")
    check(lib.cuFuncGetAttribute(ctypes.byref(limit), _MAX_THREADS_PER_BLOCK, function), "cuFuncGetAttribute")
    return DriverKernel(ordinal, context, function.value, name, limit.value, origin)


def load_kernel(ordinal: int, image: bytes, name: str) -> DriverKernel:
    """``load_module`` then ``get_kernel``: kernel ``name`` of a freshly loaded ``image``."""
    return get_kernel(ordinal, load_module(ordinal, image), name)


# ---------------------------------------------------------------------- memory

def allocate(nbytes: int) -> int:
    """``nbytes`` of device memory (``cuMemAlloc``), owned by the current context."""
    pointer = ctypes.c_uint64()
    check(_driver().cuMemAlloc_v2(ctypes.byref(pointer), nbytes), "cuMemAlloc")
    return pointer.value


def free(pointer: int) -> None:
    """Free memory ``allocate`` gave, with its context current."""
    check(_driver().cuMemFree_v2(pointer), "cuMemFree")


def copy_to_device(pointer: int, host: np.ndarray) -> None:
    """Copy the C-contiguous ``host`` to device memory ``pointer`` (waits for the legacy default
    stream, as every synchronous copy does)."""
    check(_driver().cuMemcpyHtoD_v2(pointer, host.ctypes.data, host.nbytes), "cuMemcpyHtoD")


def copy_to_host(host: np.ndarray, pointer: int) -> None:
    """Copy device memory ``pointer`` into the C-contiguous ``host`` (after the work queued on the
    legacy default stream, as every synchronous copy is)."""
    check(_driver().cuMemcpyDtoH_v2(host.ctypes.data, pointer, host.nbytes), "cuMemcpyDtoH")


def _ctypes_scalar(value: np.generic):
    """A numpy scalar as the ctypes object of its type (a kernel's run-time scalar)."""
    return np.ctypeslib.as_ctypes_type(value.dtype)(value)


def _parameter_array(arguments) -> ctypes.Array:
    """``cuLaunchKernel``'s ``kernelParams``: the address of each argument's ctypes object."""
    return (ctypes.c_void_p * len(arguments))(*(ctypes.addressof(a) for a in arguments))


def launch(kernel: DriverKernel, groups: int, block: tuple, stream: int, arguments) -> None:
    """Launch ``kernel`` once: ``groups`` blocks of shape ``block`` on the stream handle
    ``stream``, with ``arguments`` -- device pointers (ints) and numpy scalars, in the kernel's
    order, in the current context, which must be the one ``kernel`` is loaded into.  The argument
    array is made for this call alone (a ``PreparedLaunch`` fixes one per call signature instead),
    so threads share nothing and no lock is needed."""
    lib = _driver()
    values = [_ctypes_scalar(a) if isinstance(a, np.generic) else ctypes.c_uint64(a) for a in arguments]
    block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
    status = lib.cuLaunchKernel(kernel.function, int(groups), 1, 1, *block, 0, stream, _parameter_array(values),
                                None)
    if status:
        raise DriverError(f"cuLaunchKernel({kernel.name})", status)


# ---------------------------------------------------------------------- streams

#: ``CUDA_ERROR_STREAM_CAPTURE_IMPLICIT``: asked about the legacy default stream while a blocking
#: stream captures (work there would join the capture, so it counts as capturing).
_ERROR_CAPTURE_IMPLICIT = 906


def is_capturing(stream: int) -> bool:
    """Whether ``stream`` is being captured into a CUDA graph (or, for the legacy default stream,
    would join one)."""
    lib = _driver()
    status = ctypes.c_int()
    result = lib.cuStreamIsCapturing(stream, ctypes.byref(status))
    if result == _ERROR_CAPTURE_IMPLICIT:
        return True
    check(result, "cuStreamIsCapturing")
    return status.value != _CAPTURE_STATUS_NONE


def synchronize(stream: int | None) -> None:
    """Wait on the host until the work sent to ``stream`` so far has finished (None: all the work
    of the current context)."""
    lib = _driver()
    if stream is None:
        check(lib.cuCtxSynchronize(), "cuCtxSynchronize")
    else:
        check(lib.cuStreamSynchronize(stream), "cuStreamSynchronize")


class StreamJoin:
    """``join(stream, producer)``: work sent to ``stream`` from now on waits for the work sent to
    ``producer`` so far, on the device, with no host wait.  One event, made on first use and kept,
    is recorded on ``producer`` and waited for on ``stream`` each time: ``cuStreamWaitEvent``
    waits for the record made before it, so recording the event again later does not change an
    earlier wait.  A record and its wait are one step under a lock, so that two threads never
    wait for each other's record.  An event belongs to the context that made it: one join per
    context (``backends.cuda``), used with that context current."""

    def __init__(self):
        self._event = None
        self._lock = threading.Lock()

    def __call__(self, stream: int, producer: int) -> None:
        lib = _driver()
        with self._lock:
            if self._event is None:
                event = ctypes.c_void_p()
                check(lib.cuEventCreate(ctypes.byref(event), _EVENT_DISABLE_TIMING), "cuEventCreate")
                self._event = event.value
            check(lib.cuEventRecord(self._event, producer), "cuEventRecord")
            check(lib.cuStreamWaitEvent(stream, self._event, 0), "cuStreamWaitEvent")


def fill(pointer: int, pattern: int, width: int, count: int, stream: int) -> None:
    """Set ``count`` elements of ``width`` bytes (1, 2, 4 or 8) at ``pointer`` to the bit
    pattern ``pattern``, on ``stream``.  The driver has no 8-byte fill: an 8-byte element is two
    4-byte words, each set by a 2-d fill one word wide with a pitch of 8 bytes."""
    lib = _driver()
    if width == 8:
        for offset, word in ((0, pattern & 0xFFFFFFFF), (4, pattern >> 32)):
            check(lib.cuMemsetD2D32Async(pointer + offset, 8, word, 1, count, stream), "cuMemsetD2D32Async")
        return
    name = {1: "cuMemsetD8Async", 2: "cuMemsetD16Async", 4: "cuMemsetD32Async"}[width]
    check(getattr(lib, name)(pointer, pattern, count, stream), name)


def copy(destination: int, source: int, nbytes: int, stream: int) -> None:
    """Copy ``nbytes`` of device memory from ``source`` to ``destination`` on ``stream``."""
    check(_driver().cuMemcpyDtoDAsync_v2(destination, source, nbytes, stream), "cuMemcpyDtoDAsync")


def elapsed_ms(stream: int, work) -> float:
    """Run ``work()`` (launches on ``stream``) between two events recorded on ``stream``, wait
    for the second, and return the milliseconds between them.  Two events per call: this is the
    timing path (the tuner's race), never a pooling call's."""
    lib = _driver()
    events = []
    try:
        for _ in range(2):
            event = ctypes.c_void_p()
            check(lib.cuEventCreate(ctypes.byref(event), 0), "cuEventCreate")
            events.append(event.value)
        check(lib.cuEventRecord(events[0], stream), "cuEventRecord")
        work()
        check(lib.cuEventRecord(events[1], stream), "cuEventRecord")
        check(lib.cuEventSynchronize(events[1]), "cuEventSynchronize")
        ms = ctypes.c_float()
        check(lib.cuEventElapsedTime(ctypes.byref(ms), events[0], events[1]), "cuEventElapsedTime")
        return float(ms.value)
    finally:
        for event in events:
            lib.cuEventDestroy_v2(event)


def _unconverted(lib, name: str):
    """Driver function ``name`` without declared argument types, for calls whose arguments are
    ctypes objects made in advance: ctypes then passes them as they are instead of converting
    every argument on every call."""
    function = lib[name]
    function.restype = ctypes.c_int
    return function


class PreparedLaunch:
    """One kernel with its grid, block and argument layout fixed: ``launch(stream, *pointers,
    scalars=None)`` writes the device pointers and the raw stream handle ``stream`` (0: the legacy
    default stream) into ctypes objects made here, once, and calls ``cuLaunchKernel`` with them.
    Every pool_tuner kernel takes device pointers, then run-time scalars (``dispatch.Launch.scalars``:
    numpy scalars, such as the plane count), whose slots are made here too with the launch's
    values; a call's ``scalars`` (of the same types: GeM's learnt ``p``) are written into those
    slots instead, and the launch's own values back on the next call without them, so a run-time
    argument that changes on every call costs no new argument storage.

    The slots are shared by all calls, so filling them and launching happen under a lock: ctypes
    releases the GIL inside each driver call, and two threads must not launch each other's
    pointers.  ``cuLaunchKernel`` copies the argument values (also when a stream is being captured
    into a CUDA graph), so the slots are free again as soon as it returns.

    The launch runs in the calling thread's current context, which must be the kernel's (the
    primary context, where PyTorch's tensors live); a thread with no current context gets the
    kernel's made current (``cuCtxSetCurrent``) and keeps it, as the module docstring says.  The
    driver refuses a launch with no context current, or of a kernel whose module another
    context loaded, so the current context is asked for only when a launch is refused
    (``_launch_refused``): a warm call is one driver call, as a launch of PyTorch's own is."""

    __slots__ = ("kernel", "grid", "block", "_lib", "_slots", "_scalars", "_defaults", "_written", "_stream",
                 "_current", "_current_ref", "_get_current", "_launch", "_lock")

    def __init__(self, kernel: DriverKernel, groups: int, block: tuple, n_pointers: int, scalars: tuple, lib=None):
        self.kernel = kernel
        self.grid = int(groups)
        self.block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
        self._lib = lib = _driver() if lib is None else lib
        self._slots = tuple(ctypes.c_uint64() for _ in range(n_pointers))  # CUdeviceptr values
        self._scalars = tuple(_ctypes_scalar(s) for s in scalars)
        self._defaults = self._written = tuple(scalars)  # the launch's values; those in the slots now
        params = _parameter_array(self._slots + self._scalars)
        self._stream = ctypes.c_void_p()
        self._current = ctypes.c_void_p()
        self._current_ref = ctypes.pointer(self._current)
        self._get_current = _unconverted(lib, "cuCtxGetCurrent")
        dims = [ctypes.c_uint(n) for n in (self.grid, 1, 1) + self.block]
        self._launch = functools.partial(_unconverted(lib, "cuLaunchKernel"), ctypes.c_void_p(kernel.function),
                                         *dims, ctypes.c_uint(0), self._stream, params, None)
        self._lock = threading.Lock()

    def __call__(self, stream: int, *pointers: int, scalars: tuple | None = None) -> None:
        if len(pointers) != len(self._slots):
            raise TypeError(f"{self.kernel.name} takes {len(self._slots)} device pointers, got {len(pointers)}")
        if scalars is None:
            scalars = self._defaults
        elif len(scalars) != len(self._scalars):
            raise TypeError(f"{self.kernel.name} takes {len(self._scalars)} run-time scalars, got {len(scalars)}")
        with self._lock:
            for slot, pointer in zip(self._slots, pointers):
                slot.value = pointer
            if scalars is not self._written:
                for slot, value in zip(self._scalars, scalars):
                    slot.value = value.item()
                self._written = scalars
            self._stream.value = stream
            status = self._launch()
            if status:
                status = self._launch_refused(status)
        if status:
            raise DriverError(f"cuLaunchKernel({self.kernel.name})", status)

    def _launch_refused(self, status: int) -> int:
        """After a refused launch (its ``status``): under the kernel's own context, that status;
        under none, the launch again with the kernel's context made current (and kept); under
        another, a ``ContextError`` naming both (``_bind_kernel_context``)."""
        asked = self._get_current(self._current_ref)
        if asked:
            raise DriverError("cuCtxGetCurrent", asked)
        if self._current.value == self.kernel.context:
            return status
        self._bind_kernel_context()
        return self._launch()

    def _bind_kernel_context(self) -> None:
        """No current context: make the kernel's current, and keep it so.  Another context current:
        a ``ContextError`` naming both."""
        kernel = self.kernel
        if self._current.value:
            primary = kernel.context == primary_context(kernel.ordinal)
            which = (f"cuda:{kernel.ordinal}'s primary context, where PyTorch's tensors live" if primary else
                     f"a context of cuda:{kernel.ordinal} other than its primary one, such as pycuda.autoinit's")
            raise ContextError(
                f"the calling thread's current CUDA context ({self._current.value:#x}, device {context_device()}) "
                f"is not the one {kernel.name} runs in ({kernel.context:#x}, {which}); pop the other context "
                f"(PyCUDA: context.pop()) or make {kernel.context:#x} current before calling")
        check(self._lib.cuCtxSetCurrent(kernel.context), "cuCtxSetCurrent")
