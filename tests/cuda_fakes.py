"""Stand-ins for a CUDA GPU, so that the driver-API launch path runs without one.

``FakeDriver`` plays libcuda as far as contexts go, failing where the driver fails: each thread
has its own context stack (``cuCtxGetCurrent``/``cuCtxSetCurrent``/push/pop as the driver
defines them; a fresh thread has none current); memory belongs to the context that allocated it
(``cuMemAlloc``) and holds bytes that copies move; copies, fills, frees, module loads and launches
fail with ``CUDA_ERROR_INVALID_CONTEXT`` (201) when no context is current or when the memory or
the kernel's module belongs to another context; streams a test flags ``non_blocking`` keep the
memory their launches, fills and copies touch ``pending`` until synchronised or joined to a
blocking stream, and a synchronous copy (``cuMemcpyDtoH``/``HtoD``) of pending memory raises --
the real driver orders such copies with the legacy default stream and the blocking streams only,
so it would copy while that work still runs; ``cuPointerGetAttribute`` answers for its own
allocations (context, device) and for memory ``adopt`` registers (CPU tensors standing in for
CUDA ones, owned by the primary context as PyTorch's are), not for made-up addresses.  Launches are recorded with their
arguments read back from the ctypes argument array as the driver would: where the module's image
is pool_tuner's kernel source (the tests' stand-in compiler returns it), by the parameter list the
kernel declares there -- each argument read at its declared size and type (a float32 ``p`` as a
float), and a launch with another number of arguments refused -- since the driver reads each
argument at the size the kernel's signature gives, whatever the caller stored there.

``FakePyCuda`` plays PyCUDA on top of it: ``Context.push``/``pop`` through the driver's stack
(``pop`` of an empty stack fails as PyCUDA's does), ``autoinit()`` (a context of its own, pushed,
as ``pycuda.autoinit`` does) and ``autoprimaryctx()`` (the primary context, pushed), ``GPUArray``s
whose memory (``DeviceAllocation``) is allocated in the current context, read with ``get()`` by a
driver copy in the current context, and freed when dropped -- where a free in no or the wrong
context is the case in which PyCUDA aborts the process: recorded in ``fatal`` for the test to
assert on.  ``fake_cuda_device`` makes a real ``CudaDevice`` without PyCUDA."""

import ctypes
import math
import re
import subprocess
import threading
import types

import numpy as np

from pool_tuner.backends import cuda, cuda_compile

PRIMARY_CONTEXT = 0xC0
OTHER_CONTEXT = 0xD0  # a context of another device (device 1)
MAX_THREADS = 1024
INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT
INVALID_VALUE = 1  # CUDA_ERROR_INVALID_VALUE
CAPTURE_UNSUPPORTED = 900  # CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED


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
        self.contexts = {PRIMARY_CONTEXT: 0, OTHER_CONTEXT: 1}  # context -> device ordinal
        self.primary = {0: PRIMARY_CONTEXT, 1: OTHER_CONTEXT}
        self.functions = {}  # function handle -> context of its module
        self.function_modules = {}  # function handle -> its module's handle
        self.parameters = {}  # function handle -> its declared parameters' ctypes types (None: unknown)
        self.memory = {}  # device address -> (context, bytearray)
        self.adopted = []  # (address, bytes, context) of memory not the fake's own (``adopt``)
        self._next_address = 0x7_0000_0000
        self.max_threads = MAX_THREADS
        self._local = threading.local()
        self.on_get_current = None  # called inside cuCtxGetCurrent (tests use it to force thread switches)
        self.on_launch = None  # called inside cuLaunchKernel before it reads the arguments (the same)
        self.capturing = set()  # stream handles being captured into a graph
        self.non_blocking = set()  # stream handles made with CU_STREAM_NON_BLOCKING (``pending``)
        self.pending = {}  # non-blocking stream -> allocations (bases) its unfinished work touches
        self._recorded = {}  # event -> (stream, allocations pending there when it was recorded)
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
        ordinal = _value(device)
        self.calls.append(("cuDevicePrimaryCtxRetain", ordinal))
        _target(context).value = self.primary[ordinal]
        return 0

    def create_context(self, ordinal=0):
        """A new context of device ``ordinal`` (``cuCtxCreate``: not pushed here)."""
        context = 0xA0 + len(self.contexts)
        self.contexts[context] = ordinal
        return context

    def cuCtxGetCurrent(self, out):
        if self.on_get_current is not None:
            self.on_get_current()
        _target(out).value = self.current()
        return 0

    def cuCtxSetCurrent(self, context):
        """The driver's rule: replace the top of the stack (push onto an empty one); NULL pops."""
        context = _value(context)
        self.calls.append(("set", context))
        stack = self._stack()
        if not context:
            if stack:
                stack.pop()
        elif stack:
            stack[-1] = context
        else:
            stack.append(context)
        return 0

    def cuCtxGetDevice(self, out):
        if self.current() is None:
            return INVALID_CONTEXT
        _target(out).value = self.contexts[self.current()]
        return 0

    def cuCtxSynchronize(self):
        if self.current() is None:
            return INVALID_CONTEXT
        self.pending.clear()
        return self._record("cuCtxSynchronize")

    def cuCtxPushCurrent_v2(self, context):
        self.calls.append(("push", _value(context)))
        self._stack().append(_value(context))
        return 0

    def cuCtxPopCurrent_v2(self, out):
        self.calls.append("pop")
        if not self._stack():
            return INVALID_CONTEXT
        _target(out).value = self._stack().pop()
        return 0

    def cuModuleLoadData(self, module, image):
        if self.current() is None:
            return INVALID_CONTEXT
        self.modules.append((bytes(image), self.current()))
        _target(module).value = 0x100 + len(self.modules)
        return 0

    def cuModuleGetFunction(self, function, module, name):
        self.calls.append(("cuModuleGetFunction", _value(_target(module)), name))
        image = self.modules[_value(_target(module)) - 0x101][0]
        parameters = kernel_parameters(image, _value(name).decode() if isinstance(_value(name), bytes) else name)
        if parameters is NOT_FOUND:
            return NOT_FOUND_STATUS
        handle = 0xF001 + len(self.functions)  # one per function, as the driver's: a module may hold several
        _target(function).value = handle
        self.functions[handle] = self.current()
        self.parameters[handle] = parameters
        self.function_modules[handle] = _value(_target(module))
        return 0

    # memory: owned by the context that allocated it; bytes that copies move
    def _allocation(self, pointer):
        """``(base, context, bytes)`` of the allocation holding ``pointer``, or None (made up)."""
        for base, (context, data) in self.memory.items():
            if base <= pointer < base + max(len(data), 1):
                return base, context, data
        return None

    def _owner(self, pointer):
        """The context owning ``pointer``: of a fake allocation, or of memory ``adopt`` registered;
        None for a made-up address."""
        found = self._allocation(pointer)
        if found is not None:
            return found[1]
        for base, nbytes, context in self.adopted:
            if base <= pointer < base + max(nbytes, 1):
                return context
        return None

    def adopt(self, address, nbytes, context=PRIMARY_CONTEXT):
        """Register memory that is not the fake's own -- the host memory of a CPU tensor standing
        in for a CUDA tensor -- as owned by ``context`` (PyTorch's allocator allocates in the
        primary context): ``cuPointerGetAttribute`` names that context for it, and a launch or
        copy under another context is refused, as the real driver refuses another context's
        memory (a kernel launched there reads illegal addresses).  Its bytes are not the fake's to
        move: copies and fills leave them alone."""
        self.adopted.append((address, nbytes, context))

    def _touch(self, stream, *pointers):
        """Work queued on a non-blocking ``stream`` touches the allocations of ``pointers``: they
        stay pending until the stream is synchronised (or the context is), or a blocking stream
        waits for an event recorded after the work (``cuStreamWaitEvent``)."""
        stream = _value(stream)
        bases = {found[0] for found in map(self._allocation, map(_value, pointers)) if found is not None}
        self._check_ordered(stream, bases)
        if stream in self.non_blocking:
            self.pending.setdefault(stream, set()).update(bases)

    def _check_ordered(self, stream, bases):
        """The driver's rule for work on two streams: work queued on ``stream`` runs beside what is
        still queued on a non-blocking stream unless ``stream`` waited for it (an event recorded
        there, then ``cuStreamWaitEvent``; a non-blocking waiter takes the work over as pending).
        Work touching memory that another non-blocking stream's unfinished work touches, with no
        such wait, races it: the real driver runs both; the fake refuses, so that a test fails."""
        for other, touched in self.pending.items():
            unordered = (touched & bases) - self.pending.get(stream, set()) if other != stream else set()
            if unordered:
                raise AssertionError(f"work on stream {stream:#x} touches memory {min(unordered):#x} that work still "
                                     f"queued on non-blocking stream {other:#x} touches, with no wait for that stream")

    def _check_synchronous_copy(self, pointer, call):
        """The driver's rule for synchronous copies (``cuMemcpyDtoH``/``HtoD``): they are ordered
        with the legacy default stream, hence with every blocking stream, but never with a
        non-blocking stream -- a copy of memory whose writer is still queued there races it.  The
        real driver copies whatever the memory holds; the fake refuses, so that a test fails."""
        found = self._allocation(_value(pointer))
        if found is None:
            return
        for stream, bases in self.pending.items():
            if found[0] in bases:
                raise AssertionError(f"{call} of memory {found[0]:#x} that work still queued on non-blocking stream "
                                     f"{stream:#x} touches: a synchronous copy does not wait for that stream")

    def _check_memory(self, *pointers):
        """201 when no context is current or a known pointer belongs to another context."""
        if self.current() is None:
            return INVALID_CONTEXT
        for pointer in pointers:
            owner = self._owner(_value(pointer))
            if owner is not None and owner != self.current():
                return INVALID_CONTEXT
        return 0

    def allocate_in(self, context, nbytes):
        """Memory owned by ``context`` (as if another thread or library had allocated it there)."""
        address = self._next_address
        self._next_address += max(nbytes, 1) + 0x1000 - max(nbytes, 1) % 0x1000
        self.memory[address] = (context, bytearray(nbytes))
        return address

    def cuMemAlloc_v2(self, pointer, nbytes):
        """Fails while any stream captures: under the global capture mode (PyTorch's and the
        runtime's default) ``cuMemAlloc`` during a capture is refused and invalidates the capture."""
        if self.current() is None:
            return INVALID_CONTEXT
        if self.capturing:
            return CAPTURE_UNSUPPORTED
        address = self.allocate_in(self.current(), _value(nbytes))
        _target(pointer).value = address
        self.calls.append(("cuMemAlloc", address, _value(nbytes)))
        return 0

    def cuMemFree_v2(self, pointer):
        pointer = _value(pointer)
        status = self._check_memory(pointer)
        if status:
            return status
        del self.memory[pointer]
        self.calls.append(("cuMemFree", pointer))
        return 0

    def cuMemcpyHtoD_v2(self, destination, source, nbytes):
        destination, source, nbytes = map(_value, (destination, source, nbytes))
        status = self._check_memory(destination)
        if status:
            return status
        self._check_synchronous_copy(destination, "cuMemcpyHtoD")
        found = self._allocation(destination)
        if found is not None:
            base, _, data = found
            data[destination - base: destination - base + nbytes] = ctypes.string_at(source, nbytes)
        return self._record("cuMemcpyHtoD", destination, nbytes)

    def cuMemcpyDtoH_v2(self, destination, source, nbytes):
        destination, source, nbytes = map(_value, (destination, source, nbytes))
        status = self._check_memory(source)
        if status:
            return status
        self._check_synchronous_copy(source, "cuMemcpyDtoH")
        found = self._allocation(source)
        if found is not None:
            base, _, data = found
            ctypes.memmove(destination, bytes(data[source - base: source - base + nbytes]), nbytes)
        return self._record("cuMemcpyDtoH", source, nbytes)

    def cuFuncGetAttribute(self, value, attribute, function):
        assert attribute == 0  # CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK
        _target(value).value = self.max_threads
        return 0

    def __getitem__(self, name):
        """``lib[name]``: a function object of its own (ctypes hands out a new one each time)."""
        return FakeFunction(getattr(self, name))

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        if self.on_launch is not None:
            self.on_launch()
        function, gx, gy, gz, bx, by, bz, shared, stream = map(_value, (function, gx, gy, gz, bx, by, bz, shared, stream))
        slots = [ctypes.c_void_p.from_address(ctypes.addressof(params) + i * ctypes.sizeof(ctypes.c_void_p)).value
                 for i in range(len(params))]
        declared = self.parameters.get(function)
        if declared is not None and len(declared) != len(slots):
            return INVALID_VALUE  # the kernel would read arguments that were never given
        arguments = [(kind or ctypes.c_uint64).from_address(slot).value
                     for kind, slot in zip(declared or (None,) * len(slots), slots)]
        if self.current() is None or self.functions.get(function, self.current()) != self.current():
            return INVALID_CONTEXT  # no context, or a kernel of another context's module
        if self._check_memory(*arguments):
            return INVALID_CONTEXT  # memory of another context
        self._touch(stream, *arguments)
        self.launches.append({
            "function": function, "grid": (gx, gy, gz), "block": (bx, by, bz), "shared": shared,
            "stream": stream, "extra": extra, "params_address": ctypes.addressof(params),
            "arguments": arguments, "context": self.current(), "thread": threading.get_ident(),
        })
        return self.launch_status

    # streams, events, fills and copies: recorded in ``calls`` as (name, plain arguments...)
    def _record(self, name, *args):
        self.calls.append((name, *map(_value, args)))
        return 0

    def cuPointerGetAttribute(self, data, attribute, pointer):
        context = self._owner(_value(pointer))
        if context is None:
            return INVALID_VALUE  # not a pointer the driver knows (its device is taken to be 0)
        _target(data).value = {1: context, 9: self.contexts[context]}[_value(attribute)]  # CONTEXT, DEVICE_ORDINAL
        return 0

    def cuStreamSynchronize(self, stream):
        if self.current() is None:
            return INVALID_CONTEXT
        self.pending.pop(_value(stream), None)
        return self._record("cuStreamSynchronize", stream)

    def cuStreamIsCapturing(self, stream, status):
        _target(status).value = 1 if _value(stream) in self.capturing else 0  # ACTIVE or NONE
        return 0

    def cuEventCreate(self, event, flags):
        if self.current() is None:
            return INVALID_CONTEXT
        self.events += 1
        _target(event).value = 0xE000 + self.events
        return self._record("cuEventCreate", flags)

    def cuEventRecord(self, event, stream):
        self._recorded[_value(event)] = (_value(stream), set(self.pending.get(_value(stream), ())))
        return self._record("cuEventRecord", event, stream)

    def cuStreamWaitEvent(self, stream, event, flags):
        """A non-blocking stream that waits takes over the recorded work as pending too; a
        blocking one orders every later synchronous copy after it, so that work is no longer
        pending for them."""
        producer, bases = self._recorded.get(_value(event), (None, set()))
        if _value(stream) in self.non_blocking:
            self.pending.setdefault(_value(stream), set()).update(bases)
        elif producer in self.pending:
            self.pending[producer] -= bases
        return self._record("cuStreamWaitEvent", stream, event)

    def cuEventSynchronize(self, event):
        return self._record("cuEventSynchronize", event)

    def cuEventElapsedTime(self, ms, start, end):
        _target(ms).value = 0.25
        return 0

    def cuEventDestroy_v2(self, event):
        return self._record("cuEventDestroy", event)

    def _fill(self, pointer, pitch, word: bytes, count):
        """Write ``word`` at ``count`` places ``pitch`` bytes apart, where the memory is known."""
        found = self._allocation(pointer)
        if found is not None:
            base, _, data = found
            for i in range(count):
                at = pointer - base + i * pitch
                data[at: at + len(word)] = word

    def cuMemsetD8Async(self, pointer, value, count, stream):
        pointer, value, count = map(_value, (pointer, value, count))
        status = self._check_memory(pointer)
        if not status:
            self._fill(pointer, 1, bytes([value]), count)
        if not status:
            self._touch(stream, pointer)
        return status or self._record("cuMemsetD8Async", pointer, value, count, stream)

    def cuMemsetD16Async(self, pointer, value, count, stream):
        pointer, value, count = map(_value, (pointer, value, count))
        status = self._check_memory(pointer)
        if not status:
            self._fill(pointer, 2, value.to_bytes(2, "little"), count)
        if not status:
            self._touch(stream, pointer)
        return status or self._record("cuMemsetD16Async", pointer, value, count, stream)

    def cuMemsetD32Async(self, pointer, value, count, stream):
        pointer, value, count = map(_value, (pointer, value, count))
        status = self._check_memory(pointer)
        if not status:
            self._fill(pointer, 4, value.to_bytes(4, "little"), count)
        if not status:
            self._touch(stream, pointer)
        return status or self._record("cuMemsetD32Async", pointer, value, count, stream)

    def cuMemsetD2D32Async(self, pointer, pitch, value, width, height, stream):
        pointer, pitch, value, width, height = map(_value, (pointer, pitch, value, width, height))
        status = self._check_memory(pointer)
        if not status:
            self._fill(pointer, pitch, value.to_bytes(4, "little") * width, height)
        if not status:
            self._touch(stream, pointer)
        return status or self._record("cuMemsetD2D32Async", pointer, pitch, value, width, height, stream)

    def cuMemcpyDtoDAsync_v2(self, destination, source, nbytes, stream):
        if not self._check_memory(destination, source):
            self._touch(stream, destination, source)
        return self._check_memory(destination, source) or self._record("cuMemcpyDtoDAsync", destination, source,
                                                                       nbytes, stream)

    def cuGetErrorName(self, status, out):
        _target(out).value = b"CUDA_ERROR_FAKE"
        return 0


NOT_FOUND = object()
NOT_FOUND_STATUS = 500  # CUDA_ERROR_NOT_FOUND: no kernel of that name in the module
_POINTER = ctypes.c_uint64  # a device pointer, read as its 64-bit address


def kernel_parameters(image: bytes, name: str):
    """The ctypes types of the parameters kernel ``name`` declares in ``image``, when ``image`` is
    pool_tuner's CUDA source (``KERNEL void name(...)`` or ``extern "C" __global__ void
    name(...)``), read after the C preprocessor (the CUDA branch of prelude.h, as nvcc sees it;
    ``#include``s left out) with its typedefs resolved; None for an image that is no such source
    (the tests' made-up cubins); ``NOT_FOUND`` when it is source without that kernel."""
    text = image.decode("utf-8", "replace").removeprefix("cubin:")  # the stand-in compiler's mark
    if "KERNEL void" not in text and "__global__ void" not in text:
        return None
    source = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#include"))
    expanded = subprocess.run(["cpp", "-P", "-w"], input=source, capture_output=True, text=True, check=True).stdout
    found = re.search(r"\bvoid\s+" + re.escape(name) + r"\s*\(([^)]*)\)", expanded)
    if found is None:
        return NOT_FOUND
    typedefs = {alias: base for base, alias in re.findall(r"typedef\s+([^;]*?)\s+(\w+)\s*;", expanded)}
    types = []
    for parameter in filter(None, (p.strip() for p in found.group(1).split(","))):
        if "*" in parameter:
            types.append(_POINTER)
            continue
        words = parameter.split()[:-1]  # the type, without the parameter's name
        for _ in range(4):
            words = [w for word in words for w in typedefs.get(word, word).split()]
        if "double" in words:
            types.append(ctypes.c_double)
        elif "float" in words:
            types.append(ctypes.c_float)
        elif "long" in words:
            types.append(ctypes.c_int64)
        else:
            types.append(ctypes.c_int32)
    return tuple(types)


def _preprocess(source: str) -> subprocess.CompletedProcess:
    """``source`` through the C preprocessor as nvcc's front end sees it (CUDA's branch of
    prelude.h: ``__CUDACC__`` defined), its ``#include`` lines left out."""
    text = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#include"))
    return subprocess.run(["cpp", "-P", "-w", "-D__CUDACC__"], input=text, capture_output=True, text=True)


def fake_compile(source: str, arch: str) -> bytes:
    """The stand-in for nvcc: the "cubin" is the source itself, marked, which ``FakeDriver`` reads
    kernels' parameter lists from.  It fails where nvcc's preprocessor fails -- an ``#error`` a
    program reaches (a GeM program without GeM's operator header stops at operators.h's), a
    malformed directive -- with nvcc's error (``CudaCompileError``) and the preprocessor's message."""
    preprocessed = _preprocess(source)
    if preprocessed.returncode:
        raise cuda_compile.CudaCompileError(f"nvcc failed with status 1 (fake nvcc for {arch}):\n"
                                            f"{preprocessed.stderr}")
    return b"cubin:" + source.encode()


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
    return cuda.CudaDevice(ordinal, properties)


class PyCudaError(RuntimeError):
    """PyCUDA's ``LogicError``/``Error``: a driver call's failure, named as PyCUDA names it."""


class FakePyCuda:
    """PyCUDA on a ``FakeDriver`` (see the module docstring): ``driver``, ``gpuarray`` and
    ``tools`` as the modules ``pycuda.driver``, ``pycuda.gpuarray``, ``pycuda.tools``; ``fatal``
    lists the frees PyCUDA would have aborted the process for."""

    def __init__(self, driver: FakeDriver):
        self.lib, self.fatal, self.pools = driver, [], []
        fake = self

        def check(status, call):
            if status:
                raise PyCudaError(f"{call} failed: invalid device context" if status == INVALID_CONTEXT
                                  else f"{call} failed: {status}")

        class Context:
            def __init__(self, handle):
                self.handle = handle

            def push(self):
                check(driver.cuCtxPushCurrent_v2(self.handle), "cuCtxPushCurrent")

            @staticmethod
            def pop():
                out = ctypes.c_void_p()
                check(driver.cuCtxPopCurrent_v2(ctypes.byref(out)), "context::pop")

            @staticmethod
            def synchronize():
                check(driver.cuCtxSynchronize(), "cuCtxSynchronize")

        class Device:
            def __init__(self, ordinal):
                self.ordinal = ordinal

            def retain_primary_context(self):
                return Context(driver.primary[self.ordinal])

            def make_context(self):
                context = Context(driver.create_context(self.ordinal))
                context.push()
                return context

        class DeviceAllocation:
            """Memory of the context current when it was made; freed in the current one when
            dropped (PyCUDA aborts when that is no context or another)."""

            def __init__(self, nbytes):
                if driver.current() is None:
                    raise PyCudaError("explicit_context_dependent failed: invalid device context - no currently "
                                      "active context?")
                pointer = ctypes.c_uint64()
                check(driver.cuMemAlloc_v2(ctypes.byref(pointer), nbytes), "cuMemAlloc")
                self.pointer, self.context = pointer.value, driver.current()

            def __int__(self):
                return self.pointer

            __index__ = __int__

            def __del__(self):
                if driver.cuMemFree_v2(self.pointer):
                    fake.fatal.append(f"cuMemFree failed: invalid device context (allocated in {self.context:#x}, "
                                      f"freed with {driver.current()} current)")

        class GPUArray:
            """What pool_tuner and its tests use of PyCUDA's ``GPUArray``."""

            def __init__(self, shape, dtype, allocator=None, base=None, gpudata=None, strides=None):
                self.shape, self.dtype, self.base = tuple(shape), np.dtype(dtype), base
                self.size = math.prod(self.shape)
                self.nbytes = self.size * self.dtype.itemsize
                contiguous = tuple(int(np.prod(self.shape[i + 1:])) * self.dtype.itemsize
                                   for i in range(len(self.shape)))
                self.strides = contiguous if strides is None else tuple(strides)
                self.flags = types.SimpleNamespace(c_contiguous=self.strides == contiguous)
                if gpudata is None and self.size:
                    gpudata = (allocator or DeviceAllocation)(self.nbytes)
                self.gpudata = gpudata

            @property
            def __cuda_array_interface__(self):
                return {"shape": self.shape, "typestr": self.dtype.str, "data": (int(self.gpudata or 0), False),
                        "strides": None if self.flags.c_contiguous else self.strides, "version": 3}

            def get(self):
                span = sum((n - 1) * s for n, s in zip(self.shape, self.strides)) + self.dtype.itemsize
                host = np.empty(span if self.size else 0, np.uint8)
                if self.size:
                    check(driver.cuMemcpyDtoH_v2(host.ctypes.data, int(self.gpudata), span), "cuMemcpyDtoH")
                    return np.lib.stride_tricks.as_strided(host.view(self.dtype), self.shape, self.strides).copy()
                return np.empty(self.shape, self.dtype)

        GPUArray.__module__ = "pycuda.gpuarray"

        def to_gpu(host):
            host = np.ascontiguousarray(host)
            array = GPUArray(host.shape, host.dtype)
            if host.size:
                check(driver.cuMemcpyHtoD_v2(int(array.gpudata), host.ctypes.data, host.nbytes), "cuMemcpyHtoD")
            return array

        class DeviceMemoryPool:
            """Blocks of the context current when each was allocated, kept when dropped;
            ``free_held`` frees them in the current context."""

            def __init__(self):
                self.held = []
                fake.pools.append(self)

            @property
            def held_blocks(self):
                return len(self.held)

            def allocate(self, nbytes):
                block = DeviceAllocation(nbytes)
                self.held.append(block)  # a pooled block: dropping the array keeps it here
                return block

            def free_held(self):
                self.held.clear()

        self.driver = types.SimpleNamespace(Context=Context, Device=Device, DeviceAllocation=DeviceAllocation,
                                            init=lambda: None, Event=None, Stream=None)
        self.gpuarray = types.SimpleNamespace(GPUArray=GPUArray, to_gpu=to_gpu)
        self.tools = types.SimpleNamespace(DeviceMemoryPool=DeviceMemoryPool)

    def autoinit(self):
        """What ``import pycuda.autoinit`` does: a new context of device 0, pushed."""
        return self.driver.Device(0).make_context()

    def autoprimaryctx(self):
        """What ``import pycuda.autoprimaryctx`` does: device 0's primary context, pushed."""
        context = self.driver.Device(0).retain_primary_context()
        context.push()
        return context


class ForeignArray:
    """A CUDA array of another library (Numba, CuPy, ...): shape, byte strides and dtype in its
    ``__cuda_array_interface__`` (strides None when C-contiguous, as the interface asks), naming
    ``stream`` (left out when ``stream`` is ``...``).  It has no ``strides`` attribute of its own:
    pool_tuner must read the interface."""

    def __init__(self, shape, pointer, stream=..., dtype=np.float32, strides=None):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.byte_strides = strides
        self.pointer, self.stream = pointer, stream

    @property
    def __cuda_array_interface__(self):
        interface = {"shape": self.shape, "strides": self.byte_strides, "data": (self.pointer, False),
                     "typestr": self.dtype.str, "version": 3}
        if self.stream is not ...:
            interface["stream"] = self.stream
        return interface


def install_fake_gpu(monkeypatch):
    """One fake GPU for pool_tuner: ``(device, pycuda, driver)``, the fake driver as libcuda (no
    context current on any thread yet), the fake PyCUDA as ``pycuda``, kernels "compiled" to their
    source, pool_tuner's memoised modules and plans forgotten (call ``forget_fake_gpu`` after)."""
    driver = FakeDriver()
    pycuda = FakePyCuda(driver)
    device = fake_cuda_device()
    monkeypatch.setattr(cuda, "_pycuda", lambda: (pycuda.driver, pycuda.gpuarray))
    monkeypatch.setattr(cuda.cuda_driver, "library", lambda: driver)
    monkeypatch.setattr(cuda, "_compile", fake_compile)
    monkeypatch.setattr(cuda, "list_devices", lambda: (device,))
    forget_fake_gpu()
    return device, pycuda, driver


def forget_fake_gpu():
    """Forget every kernel, launch and plan made on a fake driver (their handles mean nothing to
    the next one)."""
    from pool_tuner import dispatch, ops

    cuda.cuda_driver.primary_context.cache_clear()
    cuda.forget_builds()
    dispatch.forget()
    ops._PLANS.clear()
