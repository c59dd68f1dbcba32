"""CUDA arrays of every library, and pool_tuner's own: how a caller's array is read, where results
come from and what kind of array they are handed back as.

Reading: any object with ``__cuda_array_interface__`` (PyTorch CUDA tensors, CuPy arrays, Numba
device arrays, PyCUDA ``GPUArray``s, ...) is read through that interface alone -- shape, strides,
typestr, data pointer and stream -- never through the object's own attributes, which differ from
library to library (a torch tensor has no ``strides``).  ``as_cuda_array`` gives a ``CudaArray``
over the same memory that keeps the caller's object alive.

Results: allocated in the calling thread's current context (``cuda_driver.current_context``), by
the caller's library where it allocates from a pointer-free call -- PyTorch (``torch.empty`` on
the tensor's device: its caching allocator) -- else from pool_tuner's ``MemoryPool`` of that
context and stream.  ``ResultKind`` hands a result back as the input's kind: a torch tensor, a
PyCUDA ``GPUArray`` (naming its stream, ``StreamArray``), a CuPy array (``cupy.asarray``) or a
Numba device array (``numba.cuda.as_cuda_array``) over the same memory, each readable with its
own library's calls; any other input gets a ``CudaArray``, which exposes
``__cuda_array_interface__`` (with its stream) and ``get()``.

Memory: a dropped result's block goes back to its pool, on whatever thread drops it, with no
driver call -- so no free can run in the wrong context, or in none (PyCUDA aborts the process
when that happens to its own allocations).  The next result of that size on that stream reuses
it: work on one stream runs in order, so the block's last reader has finished by then.
``MemoryPool.free_held`` (``pool_tuner.release_memory``) frees the held blocks with their context
current.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import sys
import threading

import numpy as np

from . import cuda_driver


def cuda_array_interface(x) -> dict | None:
    """``x.__cuda_array_interface__``, or None when ``x`` has none (CPU tensors raise, too).  The
    type is asked first: most arrays that have none (numpy, PyOpenCL) answer without an exception."""
    if isinstance(x, np.ndarray) or not (hasattr(type(x), "__cuda_array_interface__")
                                         or "__cuda_array_interface__" in getattr(x, "__dict__", ())):
        return None
    try:
        interface = x.__cuda_array_interface__
    except Exception:  # noqa: BLE001 - e.g. torch raises for CPU tensors
        return None
    return interface if isinstance(interface, dict) else None


def c_strides(shape, itemsize: int) -> tuple:
    """Byte strides of a C-contiguous array of ``shape``."""
    strides, step = [], itemsize
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class CudaArray:
    """pool_tuner's CUDA array: ``shape``, numpy ``dtype``, byte ``strides``, the device pointer
    ``ptr``, the ``stream`` its contents are written on (a handle as ``__cuda_array_interface__``
    writes it; None: none named) and ``base``, what keeps the memory alive (a pool block, a
    tensor, the caller's array).  ``__cuda_array_interface__`` (version 3, naming the stream) lets
    any library read it; ``get()`` copies it to numpy, in the context that owns it."""

    __slots__ = ("shape", "dtype", "strides", "ptr", "stream", "base", "__weakref__")

    def __init__(self, shape, dtype, ptr: int, strides=None, stream=None, base=None):
        self.shape, self.dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        self.strides = c_strides(self.shape, self.dtype.itemsize) if strides is None else tuple(strides)
        self.ptr, self.stream, self.base = int(ptr), stream, base

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def c_contiguous(self) -> bool:
        return all(n == 1 or s == e for n, s, e in zip(self.shape, self.strides,
                                                       c_strides(self.shape, self.dtype.itemsize)))

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False),
                "strides": None if self.c_contiguous else self.strides, "stream": self.stream, "version": 3}

    def view(self, dtype) -> CudaArray:
        """The memory of a C-contiguous array as a flat array of ``dtype``."""
        dtype = np.dtype(dtype)
        return CudaArray((self.nbytes // dtype.itemsize,), dtype, self.ptr, stream=self.stream, base=self)

    def strided(self, shape, strides) -> CudaArray:
        """The same memory seen with another shape and byte strides."""
        return CudaArray(shape, self.dtype, self.ptr, strides, self.stream, self)

    def reshape(self, shape) -> CudaArray:
        """A C-contiguous array seen with another shape of the same size."""
        shape = tuple(int(s) for s in shape)
        if math.prod(shape) != self.size or not self.c_contiguous:
            raise ValueError(f"cannot view a CudaArray of shape {self.shape} as {shape}")
        return CudaArray(shape, self.dtype, self.ptr, stream=self.stream, base=self)

    def __getitem__(self, index: slice) -> CudaArray:
        """``flat[start:stop]``: a contiguous slice of a flat array, over the same memory (the
        levels of a multi-level op's flat result, ``pool_tuner.pyramid``)."""
        start, stop, step = self._flat_slice(index)
        return CudaArray((stop - start,), self.dtype, self.ptr + start * self.dtype.itemsize, stream=self.stream,
                         base=self)

    def _flat_slice(self, index) -> tuple:
        if len(self.shape) != 1 or not isinstance(index, slice) or self.strides != (self.dtype.itemsize,):
            raise TypeError("a CudaArray can only be sliced when it is flat and contiguous")
        start, stop, step = index.indices(self.size)
        if step != 1:
            raise ValueError("a CudaArray slice must be contiguous (step 1)")
        return start, max(start, stop), step

    def get(self) -> np.ndarray:
        """A numpy copy, after the work queued on the stream the array names (``wait_for``) and on
        the legacy default stream (and every blocking stream); the context that owns the memory
        must be current, as for any driver copy."""
        span = sum((n - 1) * s for n, s in zip(self.shape, self.strides)) + self.dtype.itemsize if self.size else 0
        host = np.empty(span, np.uint8)
        if span:
            wait_for(self.stream)
            cuda_driver.copy_to_host(host, self.ptr)
        return np.lib.stride_tricks.as_strided(host.view(self.dtype) if span else np.empty(0, self.dtype),
                                               self.shape, self.strides).copy()

    def __repr__(self):
        return f"CudaArray(shape={self.shape}, dtype={self.dtype}, ptr={self.ptr:#x}, stream={self.stream})"


def wait_for(stream) -> None:
    """Wait on the host for the work queued so far on ``stream``, a stream an array names, before a
    synchronous copy of the array: such a copy is ordered with the legacy default stream (1) and
    the blocking streams only, never with a non-blocking stream (as PyTorch's side streams and
    CuPy's non-blocking ones are), which could still be writing the array.  None (no stream named:
    the data is ready) and the legacy default stream need no wait."""
    if stream and stream != 1:
        cuda_driver.synchronize(int(stream))


def interface_dtype(interface: dict, x) -> np.dtype:
    """The numpy dtype an interface's ``typestr`` names; bfloat16, which exports itself as two raw
    bytes (``<V2``), is told by the object's own dtype."""
    dtype = np.dtype(interface["typestr"])
    if dtype.kind == "V" and dtype.itemsize == 2 and str(getattr(x, "dtype", "")).endswith("bfloat16"):
        import ml_dtypes

        dtype = np.dtype(ml_dtypes.bfloat16)
    return dtype


def as_cuda_array(x) -> CudaArray:
    """A ``CudaArray`` over the memory of ``x`` (its ``__cuda_array_interface__``), naming the
    stream the interface names (0, which the interface forbids, names none) and keeping ``x``
    alive.  Raises ``TypeError`` when ``x`` has no interface, ``ValueError`` for a masked one."""
    if isinstance(x, CudaArray):
        return x
    interface = cuda_array_interface(x)
    if interface is None:
        raise TypeError(f"x must expose __cuda_array_interface__, got {type(x).__name__}")
    if interface.get("mask") is not None:
        raise ValueError("x must not be a masked array")
    dtype = interface_dtype(interface, x)
    shape = tuple(int(s) for s in interface["shape"])
    strides = interface.get("strides")
    return CudaArray(shape, dtype, int(interface["data"][0]), None if strides is None else tuple(strides),
                     interface.get("stream") or None, x)


class _Block:
    """A block of a ``MemoryPool``, handed back to it when dropped (on any thread)."""

    __slots__ = ("ptr", "nbytes", "pool")

    def __init__(self, ptr: int, nbytes: int, pool: MemoryPool):
        self.ptr, self.nbytes, self.pool = ptr, nbytes, pool

    def __del__(self):
        self.pool.held.setdefault(self.nbytes, []).append(self.ptr)  # list.append: atomic under the GIL


class MemoryPool:
    """Device memory of one context for results written on one stream: blocks handed back when
    their array is dropped are reused for the next result of the same size (see the module
    docstring).  ``allocate`` runs with ``context`` current (it is the call's)."""

    def __init__(self, context: int, stream: int):
        self.context, self.stream = context, stream
        self.held: dict[int, list] = {}
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> _Block:
        """A block of ``nbytes``: a held one, else fresh memory (``cuMemAlloc``) -- except while the
        pool's stream is being captured into a CUDA graph, where ``cuMemAlloc`` is refused and
        invalidates the capture: such a miss is a ``ValueError`` that says what to do."""
        with self._lock:
            free = self.held.get(nbytes)
            ptr = free.pop() if free else None
        if ptr is None and nbytes:
            if cuda_driver.is_capturing(self.stream):
                raise ValueError(
                    f"pool_tuner needs {nbytes} bytes of new device memory for a result while stream {self.stream:#x} "
                    "is being captured into a CUDA graph, and allocating then would invalidate the capture: its "
                    "pool has no free block of that size (the warm-up ran on another stream, or its result is still "
                    "alive). Warm up each call on the capturing stream itself and release (drop) its results before "
                    "capture begins")
            ptr = cuda_driver.allocate(nbytes)
        return _Block(ptr or 0, nbytes, self)

    @property
    def held_blocks(self) -> int:
        return sum(len(blocks) for blocks in self.held.values())

    def free_held(self) -> int:
        """Free the held blocks with the pool's context current (made current for the frees, the
        thread's own current context restored after); returns how many."""
        with self._lock:
            blocks = [ptr for ptrs in self.held.values() for ptr in ptrs if ptr]
            count = self.held_blocks
            self.held.clear()
        if blocks:
            with _context_current(self.context):
                for ptr in blocks:
                    cuda_driver.free(ptr)
        return count


@contextlib.contextmanager
def _context_current(context: int):
    """``context`` current for a block of frees, the thread's own restored after.  Freeing is the
    one thing pool_tuner does in a context other than the caller's current one: a block belongs
    to the context that allocated it, and ``release_memory`` frees the blocks of every context."""
    lib = cuda_driver.library()
    current = ctypes.c_void_p()
    cuda_driver.check(lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if current.value == context:
        yield
        return
    cuda_driver.check(lib.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
    try:
        yield
    finally:
        cuda_driver.check(lib.cuCtxPopCurrent_v2(ctypes.byref(current)), "cuCtxPopCurrent")


# ---------------------------------------------------------------------- results in the input's kind

def _library(x) -> str:
    """The library an array comes from: ``"torch"`` for any tensor (subclasses included), else
    the top-level package of its type."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    return type(x).__module__.split(".")[0]


class ResultKind:
    """How results of a call on array ``like`` are allocated and handed back (module docstring).
    ``allocate(nbytes)`` gives what keeps the memory alive and its pointer; ``deliver(array)``
    turns a ``CudaArray`` result into ``like``'s kind of array over the same memory."""

    __slots__ = ("like", "library")

    def __init__(self, like):
        if isinstance(like, CudaArray):  # pool_tuner's own intermediate: allocate as its memory was
            like = _memory_owner(like)
        self.like, self.library = like, _library(like)

    def allocate(self, nbytes: int, pool: MemoryPool):
        """``(owner, ptr)`` of ``nbytes`` of fresh device memory."""
        if self.library == "torch":
            import torch

            tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.like.device)
            return tensor, tensor.data_ptr()
        block = pool.allocate(nbytes)
        return block, block.ptr

    def deliver(self, array: CudaArray):
        if self.library == "torch":
            return _as_tensor(array, self.like)
        if self.library == "pycuda":
            return _as_gpuarray(array, self.like)
        if self.library == "cupy":
            import cupy

            return cupy.asarray(array)
        if self.library == "numba":
            from numba import cuda as numba_cuda

            return numba_cuda.as_cuda_array(array)
        return array


def _memory_owner(array: CudaArray):
    """The pool block or torch tensor behind a result (the end of its chain of views)."""
    owner = array.base
    while isinstance(owner, CudaArray):
        owner = owner.base
    return owner


def _as_tensor(array: CudaArray, like):
    """A result allocated by torch (``ResultKind.allocate``) as a tensor of ``like``'s dtype (int64
    for indices) with the result's shape and strides, over the same storage."""
    import torch

    memory = _memory_owner(array)
    if not isinstance(memory, torch.Tensor):  # memory of pool_tuner's pool: a tensor over it, keeping it alive
        return torch.as_tensor(array, device=like.device)
    dtype = torch.int64 if array.dtype == np.int64 and like.dtype != torch.int64 else like.dtype
    itemsize = array.dtype.itemsize
    return memory.view(dtype).as_strided(array.shape, tuple(s // itemsize for s in array.strides),
                                         (array.ptr - memory.data_ptr()) // itemsize)


def _as_gpuarray(array: CudaArray, like):
    """A result as a PyCUDA ``GPUArray`` of the class ``like``'s derives from, naming its stream
    (``stream_array_type``) and keeping the result's memory alive (``base``; PyCUDA takes any int
    as ``gpudata`` and never frees what it did not allocate)."""
    gpuarray_type = next(c for c in type(like).__mro__ if c.__name__ == "GPUArray")
    result = stream_array_type(gpuarray_type)(array.shape, array.dtype, gpudata=array.ptr, strides=array.strides,
                                              base=array)
    result.stream = array.stream
    return result


@functools.cache
def stream_array_type(gpuarray_type: type) -> type:
    """``StreamArray``: PyCUDA's ``GPUArray`` with a ``stream``, a stream handle as
    ``__cuda_array_interface__`` writes it, which its own interface names: the stream its contents
    are written on, so that a consumer that follows the interface orders its reads after that
    stream's work.  Arrays PyCUDA derives from one (``result * 2``, ``view``) are PyCUDA's own and
    name no stream, as PyCUDA's arrays do not."""

    class StreamArray(gpuarray_type):
        stream = None

        @property
        def __cuda_array_interface__(self):
            return {**super().__cuda_array_interface__, "stream": self.stream}

    return StreamArray
