"""The one CUDA context rule and device arrays of every GPU library, through ``pool_tuner``'s
public functions on the fake driver and the fake PyCUDA (tests/cuda_fakes.py), which fail where
the real ones fail: work in no context or the wrong one is ``CUDA_ERROR_INVALID_CONTEXT``, and a
PyCUDA allocation freed so is the case where PyCUDA aborts the process (``fatal``).

The rule: allocate, copy and launch in the calling thread's current context; with none current,
bind the device's primary context (``cuCtxSetCurrent``) and leave it bound; never push or pop
around a call; modules per context; an input owned by another context refused, naming both.
Results come back as the input's kind of array.  test_cuda_gpu.py runs the same with the real
libraries on a GPU."""

import gc
import subprocess
import sys
import textwrap
import threading
import types

import numpy as np
import pytest

import pool_tuner as pt
from pool_tuner.backends import cuda

from cuda_fakes import OTHER_CONTEXT, PRIMARY_CONTEXT, ForeignArray, fake_cuda_device, forget_fake_gpu, install_fake_gpu

SHAPE, SIZE, OUT = (2, 3, 10, 9), (4, 7), (2, 3, 4, 7)


@pytest.fixture
def gpu(monkeypatch):
    """``(device, pycuda, driver)``: the fake GPU, no context current on any thread yet."""
    found = install_fake_gpu(monkeypatch)
    yield found
    pt.release_memory()
    forget_fake_gpu()


def _host(shape=SHAPE, dtype=np.float32):
    return np.random.default_rng(0).random(shape).astype(dtype)


def _pushes_and_pops(calls) -> list:
    return [c for c in calls if c == "pop" or (isinstance(c, tuple) and c[0] == "push")]


# ---------------------------------------------------------------------- PyCUDA


def test_a_gpuarray_of_pycuda_autoinit_gives_a_gpuarray_read_and_freed_in_its_context(gpu):
    """On a GPU (main at a90e77d): the result's ``get()`` raised ``cuMemcpyDtoH failed: invalid
    device context`` and PyCUDA aborted the process at garbage collection -- the result was
    allocated in the primary context, pushed around the call, and read in autoinit's."""
    device, pycuda, driver = gpu
    context = pycuda.autoinit()
    calls = len(driver.calls)
    x = pycuda.gpuarray.to_gpu(_host())
    y = pt.adaptive_avg_pool2d(x, SIZE)
    assert isinstance(y, pycuda.gpuarray.GPUArray) and y.shape == OUT
    got = y.get()  # PyCUDA's own read, in the current context
    assert got.shape == OUT and np.isnan(got).all(), "the poisoned result (the fake kernel writes nothing)"
    (launch,) = driver.launches
    assert launch["context"] == context.handle and launch["arguments"][:2] == [int(x.gpudata), int(y.gpudata)]
    assert {c for _, c in driver.modules} == {context.handle}, "the kernel was loaded into another context"
    assert driver.memory[int(y.gpudata)][0] == context.handle
    assert _pushes_and_pops(driver.calls[calls:]) == []
    assert driver.current() == context.handle
    del x, y, got
    gc.collect()
    pt.release_memory()
    assert pycuda.fatal == []


def test_a_gpuarray_of_pycuda_autoprimaryctx(gpu):
    device, pycuda, driver = gpu
    pycuda.autoprimaryctx()
    x = pycuda.gpuarray.to_gpu(_host())
    values, indices = pt.adaptive_max_pool2d(x, SIZE, return_indices=True)
    assert isinstance(values, pycuda.gpuarray.GPUArray) and values.get().shape == OUT
    assert indices.dtype == np.int64 and indices.get().shape == OUT
    assert [launch["context"] for launch in driver.launches] == [PRIMARY_CONTEXT]
    assert _pushes_and_pops(driver.calls) == [("push", PRIMARY_CONTEXT)]  # autoprimaryctx's own, none of ours
    del x, values, indices
    gc.collect()
    assert pycuda.fatal == []


def test_a_result_dropped_on_a_thread_without_a_context_is_no_fatal_free(gpu):
    """A result's block goes back to pool_tuner's pool when dropped, on any thread: no driver call,
    so nothing PyCUDA would abort for."""
    _, pycuda, driver = gpu
    pycuda.autoinit()
    x = pycuda.gpuarray.to_gpu(_host())
    results = [pt.adaptive_avg_pool2d(x, SIZE)]
    frees = len([c for c in driver.calls if c[0] == "cuMemFree"])
    thread = threading.Thread(target=results.clear)
    thread.start()
    thread.join()
    gc.collect()
    assert pycuda.fatal == [] and len([c for c in driver.calls if c[0] == "cuMemFree"]) == frees
    assert pt.release_memory() == 1 and pycuda.fatal == []


# ---------------------------------------------------------------------- other libraries


@pytest.fixture
def torch_streams(monkeypatch):
    """PyTorch's current stream as ``torch.cuda.current_stream`` gives it (a CPU build has none):
    ``streams.handle`` (0, the default stream, until a test sets it), the devices asked in
    ``streams.devices``."""
    torch = pytest.importorskip("torch")
    streams = types.SimpleNamespace(handle=0, devices=[])

    def current_stream(device=None):
        streams.devices.append(device)
        return types.SimpleNamespace(cuda_stream=streams.handle)

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    return streams


class _TensorStandIn:
    """Makes CPU tensors stand in for CUDA ones: a subclass exposing ``__cuda_array_interface__``
    as PyTorch writes it (version 2, no stream, strides None when contiguous) and, as a CUDA
    tensor, no ``strides`` attribute (with ``torch_streams`` for PyTorch's current stream)."""

    @staticmethod
    def make(tensor):
        torch = pytest.importorskip("torch")

        class CudaTensorStandIn(torch.Tensor):
            @property
            def __cuda_array_interface__(self):
                itemsize = self.element_size()
                typestr = {torch.float32: "<f4", torch.float16: "<f2", torch.int64: "<i8"}[self.dtype]
                strides = None if self.is_contiguous() else tuple(s * itemsize for s in self.stride())
                return {"typestr": typestr, "shape": tuple(self.shape), "strides": strides,
                        "data": (self.data_ptr(), False), "version": 2}

        return tensor.as_subclass(CudaTensorStandIn)


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels-last"])
def test_a_torch_cuda_tensor_gives_a_torch_tensor_from_torch_allocator(gpu, torch_streams, channels_last):
    """On a GPU (main at a90e77d): ``AttributeError: 'Tensor' object has no attribute 'strides'``
    (the front end read ``.strides`` of the object instead of its interface)."""
    torch = pytest.importorskip("torch")
    _, _, driver = gpu
    x = torch.rand(SHAPE)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    y = pt.adaptive_avg_pool2d(_TensorStandIn.make(x), SIZE)
    assert type(y) is torch.Tensor and tuple(y.shape) == OUT and y.dtype == torch.float32
    assert y.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    (launch,) = driver.launches
    assert launch["arguments"][:2] == [x.data_ptr(), y.data_ptr()]
    assert launch["context"] == PRIMARY_CONTEXT and driver.current() == PRIMARY_CONTEXT
    grad = pt.adaptive_avg_pool2d_backward(_TensorStandIn.make(y), SHAPE)
    assert type(grad) is torch.Tensor and tuple(grad.shape) == SHAPE


def test_a_torch_tensor_is_worked_on_on_pytorchs_current_stream(gpu, torch_streams):
    """PyTorch's interface names no stream, and under ``with torch.cuda.stream(s)`` PyTorch's work
    on a tensor -- its producer, the result's readers, the allocator's reuse of the result's
    memory -- runs on ``s``, a non-blocking stream: pool_tuner's launches go there too (they went
    to the legacy default stream, which orders with neither)."""
    torch = pytest.importorskip("torch")
    _, _, driver = gpu
    torch_streams.handle = 0x51DE
    x = torch.rand(SHAPE)
    y = pt.adaptive_avg_pool2d(_TensorStandIn.make(x), SIZE)
    pt.adaptive_avg_pool2d_backward(_TensorStandIn.make(y), SHAPE)
    assert len(driver.launches) == 2 and {launch["stream"] for launch in driver.launches} == {0x51DE}
    assert torch_streams.devices and set(torch_streams.devices) == {x.device}, "the stream of the tensor's device"


def _fake_library(monkeypatch, driver, name: str, convert: str):
    """A stand-in for CuPy or Numba: an array class of module ``name`` over fake-driver memory
    (C-contiguous float32, read back by a driver copy in the current context), and the module's
    function ``convert`` (``cupy.asarray``, ``numba.cuda.as_cuda_array``) that builds one from any
    ``__cuda_array_interface__``, keeping its owner alive."""

    class DeviceArray:
        def __init__(self, interface, owner=None):
            self.interface, self.owner = interface, owner
            self.shape = tuple(interface["shape"])

        @property
        def __cuda_array_interface__(self):
            return self.interface

        def get(self):
            assert self.interface["typestr"] == "<f4" and self.interface["strides"] is None
            host = np.empty(self.shape, np.float32)
            assert driver.cuMemcpyDtoH_v2(host.ctypes.data, self.interface["data"][0], host.nbytes) == 0
            return host

    DeviceArray.__module__ = name
    module = types.ModuleType(name.split(".")[0])
    target = module
    if "." in name:
        target = types.ModuleType(name)
        setattr(module, name.split(".")[1], target)
        monkeypatch.setitem(sys.modules, name, target)
    setattr(target, convert, lambda obj: DeviceArray(obj.__cuda_array_interface__, obj))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return DeviceArray


@pytest.mark.parametrize("name, convert", [("cupy", "asarray"), ("numba.cuda", "as_cuda_array")],
                         ids=["cupy", "numba"])
def test_arrays_of_cupy_and_numba_come_back_as_their_own_arrays(gpu, monkeypatch, name, convert):
    device, _, driver = gpu
    driver.set_current(PRIMARY_CONTEXT)  # as those libraries leave it
    DeviceArray = _fake_library(monkeypatch, driver, name, convert)
    pointer = driver.allocate_in(PRIMARY_CONTEXT, 4 * int(np.prod(SHAPE)))
    x = DeviceArray({"shape": SHAPE, "typestr": "<f4", "data": (pointer, False), "strides": None, "stream": 0x5EED,
                     "version": 3})
    y = pt.adaptive_avg_pool2d(x, SIZE)
    assert type(y) is DeviceArray and y.shape == OUT
    assert y.__cuda_array_interface__["stream"] == 0x5EED and np.isnan(y.get()).all()
    assert driver.launches[0]["arguments"][:2] == [pointer, y.__cuda_array_interface__["data"][0]]


def test_any_other_cuda_array_gives_pool_tuners_own_array(gpu):
    _, _, driver = gpu
    driver.set_current(PRIMARY_CONTEXT)
    pointer = driver.allocate_in(PRIMARY_CONTEXT, 4 * int(np.prod(SHAPE)))
    y = pt.adaptive_avg_pool2d(ForeignArray(SHAPE, pointer, 0x5EED), SIZE)
    assert isinstance(y, cuda.CudaArray) and y.shape == OUT and y.stream == 0x5EED
    assert y.__cuda_array_interface__ == {"shape": OUT, "typestr": "<f4", "data": (y.ptr, False), "strides": None,
                                          "stream": 0x5EED, "version": 3}
    assert np.isnan(y.get()).all()


# ---------------------------------------------------------------------- the rule itself


def test_a_thread_with_no_context_binds_the_primary_one_and_keeps_it(gpu):
    _, _, driver = gpu
    pointer = driver.allocate_in(PRIMARY_CONTEXT, 4 * int(np.prod(SHAPE)))
    seen = []

    def worker():
        pt.adaptive_avg_pool2d(ForeignArray(SHAPE, pointer), SIZE)
        seen.append(driver.current())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [PRIMARY_CONTEXT] and driver.launches[0]["context"] == PRIMARY_CONTEXT
    assert ("set", PRIMARY_CONTEXT) in driver.calls and _pushes_and_pops(driver.calls) == []
    assert driver.current() is None, "the test's own thread was left alone"


def test_an_input_of_another_context_is_refused_naming_both(gpu):
    _, pycuda, driver = gpu
    own = pycuda.autoinit()  # current
    pointer = driver.allocate_in(PRIMARY_CONTEXT, 4 * int(np.prod(SHAPE)))  # e.g. a CuPy array
    with pytest.raises(ValueError, match=f"x is memory of CUDA context {PRIMARY_CONTEXT:#x}.*current context is "
                                         f"{own.handle:#x}"):
        pt.adaptive_avg_pool2d(ForeignArray(SHAPE, pointer), SIZE)
    assert not driver.launches and driver.current() == own.handle


def test_a_current_context_of_another_device_is_refused(gpu):
    _, _, driver = gpu
    driver.set_current(OTHER_CONTEXT)  # device 1's, while the array is device 0's
    with pytest.raises(ValueError, match=r"current CUDA context \(0xd0\) is device 1's.*cuda:0"):
        pt.adaptive_avg_pool2d(ForeignArray(SHAPE, 0xA0000), SIZE)
    assert not driver.launches


def test_one_signature_in_two_contexts_loads_its_kernel_into_each(gpu):
    _, pycuda, driver = gpu
    host = _host()
    pycuda.autoprimaryctx()
    in_primary = pycuda.gpuarray.to_gpu(host)
    pt.adaptive_avg_pool2d(in_primary, SIZE)
    own = pycuda.autoinit()  # pushed over the primary one
    in_own = pycuda.gpuarray.to_gpu(host)
    y = pt.adaptive_avg_pool2d(in_own, SIZE)
    pt.adaptive_avg_pool2d(in_own, SIZE)
    assert [launch["context"] for launch in driver.launches] == [PRIMARY_CONTEXT, own.handle, own.handle]
    assert [c for _, c in driver.modules] == [PRIMARY_CONTEXT, own.handle], "one load per context"
    assert np.isnan(y.get()).all()
    del in_own, y
    gc.collect()
    assert pycuda.fatal == []


# ---------------------------------------------------------------------- Kernel Tuner's exit hook


_TUNED_THEN_EXIT = textwrap.dedent("""
    import threading
    from kernel_tuner.backends import pycuda as kt_pycuda
    from pool_tuner.backends import cuda_tuning

    stacks = threading.local()

    class Context:  # PyCUDA's: pop() pops the calling thread's stack, and fails on an empty one
        def push(self):
            stacks.__dict__.setdefault("stack", []).append(self)

        def pop(self):
            stack = stacks.__dict__.get("stack")
            if not stack:
                raise RuntimeError("context::pop failed: invalid device context")
            stack.pop()
            print("popped on", threading.current_thread().name)

    class Device:
        def __init__(self, ordinal):
            pass

        def retain_primary_context(self):
            context = Context()
            context.get_device = lambda: (_ for _ in ()).throw(SystemExit)  # stop after the context part
            return context

    kt_pycuda.drv = type("drv", (), {"init": staticmethod(lambda: None), "Device": Device})
    kt_pycuda.pycuda_available = True

    def tune():  # what Kernel Tuner's PyCUDA backend does when a tuning sets up the device
        try:
            kt_pycuda.PyCudaFunctions(0)
        except SystemExit:
            pass

    cuda_tuning.run(tune)
    cuda_tuning.run(tune)  # a second tuning of the same device pushes nothing more
""")


def test_a_process_that_tuned_on_cuda_exits_without_a_traceback(tmp_path):
    """Kernel Tuner's PyCUDA backend pushes the primary context on the tuning thread and registers
    an exit hook that pops it -- on the main thread, where nothing was pushed: "Exception ignored
    in atexit callback ... context::pop failed".  The tuning thread pops it first."""
    pytest.importorskip("kernel_tuner")
    script = tmp_path / "tuned.py"
    script.write_text(_TUNED_THEN_EXIT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.strip() == "popped on pool_tuner-cuda-tuning"


# ---------------------------------------------------------------------- the multi-level ops


def test_multi_level_ops_on_torch_tensors_give_torch_tensors(gpu, torch_streams):
    torch = pytest.importorskip("torch")
    x = _TensorStandIn.make(torch.rand(SHAPE))
    values, indices = pt.adaptive_max_pool_pyramid(x, [1, 2], return_indices=True)
    assert [type(v) for v in values + indices] == [torch.Tensor] * 4
    assert [tuple(v.shape) for v in values] == [(2, 3, 1, 1), (2, 3, 2, 2)] and indices[1].dtype == torch.int64
    grads = [_TensorStandIn.make(torch.rand(v.shape)) for v in values]
    grad = pt.adaptive_max_pool_pyramid_backward(grads, [_TensorStandIn.make(i) for i in indices], SHAPE)
    assert type(grad) is torch.Tensor and tuple(grad.shape) == SHAPE
    result, indices = pt.adaptive_avgmax_pool2d(x, (2, 3), "cat", return_indices=True)
    assert type(result) is torch.Tensor and tuple(result.shape) == (2, 6, 2, 3) and type(indices) is torch.Tensor
    grad = pt.adaptive_avgmax_pool2d_backward(_TensorStandIn.make(torch.rand(result.shape)),
                                              _TensorStandIn.make(indices), SHAPE, "cat")
    assert type(grad) is torch.Tensor and tuple(grad.shape) == SHAPE


def test_a_pyramid_of_a_pycuda_autoinit_gpuarray_gives_gpuarrays_read_in_its_context(gpu):
    _, pycuda, driver = gpu
    context = pycuda.autoinit()
    levels = pt.adaptive_avg_pool_pyramid(pycuda.gpuarray.to_gpu(_host()), [1, 2])
    assert all(isinstance(level, pycuda.gpuarray.GPUArray) for level in levels)
    assert [level.get().shape for level in levels] == [(2, 3, 1, 1), (2, 3, 2, 2)]
    assert {launch["context"] for launch in driver.launches} == {context.handle}
    del levels
    gc.collect()
    assert pycuda.fatal == []


def test_results_on_the_per_thread_default_stream_of_two_threads_never_share_a_block(gpu):
    """Handle 2 (``CU_STREAM_PER_THREAD``) names each thread's own stream: a block dropped by one
    thread, whose stream may still be writing it, must not be handed to another live thread's
    launch on its own stream, which does not wait for the first (one pool served both).  A thread
    that has ended leaves its pool to the next new thread, taken over after the context's work
    has finished (a pool per thread ever made held its blocks for good)."""
    _, _, driver = gpu
    driver.set_current(PRIMARY_CONTEXT)
    x = ForeignArray(SHAPE, driver.allocate_in(PRIMARY_CONTEXT, 4 * int(np.prod(SHAPE))), 2)
    addresses, both_called = [], threading.Barrier(2)

    def call(wait=None):
        driver.set_current(PRIMARY_CONTEXT)
        addresses.append(pt.adaptive_avg_pool2d(x, SIZE).ptr)  # dropped at once: its block back to a pool
        if wait is not None:
            wait.wait()  # both threads alive until both have called

    threads = [threading.Thread(target=call, args=(both_called,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    gc.collect()
    assert addresses[0] != addresses[1], "a block dropped on thread A's stream went to live thread B's launch"
    synchronized = len([c for c in driver.calls if c[0] == "cuCtxSynchronize"])
    later = threading.Thread(target=call)
    later.start()
    later.join()
    assert addresses[2] in addresses[:2], "a new thread takes over an ended thread's pool"
    assert len([c for c in driver.calls if c[0] == "cuCtxSynchronize"]) == synchronized + 1, \
        "after the context's work (the ended thread's stream) has finished"
    call()  # a thread's own dropped block is reused on its own stream
    call()
    assert addresses[3] == addresses[4]
    assert {launch["stream"] for launch in driver.launches} == {2}


def test_release_memory_frees_each_context_s_blocks_in_that_context(gpu):
    """Blocks of a context that is not current are freed with it pushed for the frees and popped:
    the thread's current context is as it was."""
    _, pycuda, driver = gpu
    own = pycuda.autoinit()
    pt.adaptive_avg_pool2d(pycuda.gpuarray.to_gpu(_host()), SIZE)  # its result dropped: held by own's pool
    gc.collect()
    own.pop()
    driver.set_current(PRIMARY_CONTEXT)
    calls = len(driver.calls)
    assert pt.release_memory() == 1 and driver.current() == PRIMARY_CONTEXT
    (free,) = [c for c in driver.calls[calls:] if c[0] == "cuMemFree"]
    assert driver.calls[calls:] == [("push", own.handle), free, "pop"]
    assert free[1] not in driver.memory and pycuda.fatal == []


# ---------------------------------------------------------------------- GeM on device arrays


def _forget_gem():
    from pool_tuner import gem

    gem._KERNELS.clear()
    gem._prepared_input_gradient.cache_clear()


@pytest.mark.parametrize("size", [SIZE, 1])
def test_gem_forward_and_backward_on_gpuarrays_launch_in_their_context_with_p_and_eps(gpu, size):
    """GeM on PyCUDA arrays: the forward's p and eps as the kernel's float scalars; the backward's
    outputs' coefficients computed from grad_out and output and sent to the device, the
    input-gradient kernel on device pointers with p and eps (it gathers the coefficients itself:
    no other launch), results as GPUArrays of x's shape, dL/dp its terms (zero: the fake kernel
    writes none) plus the output part."""
    from pool_tuner import gem
    from pool_tuner.problem import Problem

    _forget_gem()
    device, pycuda, driver = gpu
    pycuda.autoprimaryctx()
    p, eps = 2.5, 1e-3
    x = pycuda.gpuarray.to_gpu(_host() + 0.5)
    y = pt.adaptive_gem_pool2d(x, size, p, eps)
    out_shape = tuple(y.shape)
    (forward,) = driver.launches
    assert forward["arguments"] == [int(x.gpudata), int(y.gpudata), 6, p, float(np.float32(eps))]
    grad_host, output_host = _host(out_shape) + 0.5, _host(out_shape) + 0.25
    grad_x, grad_p = pt.adaptive_gem_pool2d_backward(pycuda.gpuarray.to_gpu(grad_host), x, size, p, eps,
                                                     output=pycuda.gpuarray.to_gpu(output_host))
    (gradient,) = driver.launches[1:]
    x_address, coefficients, grad_address, terms, planes, got_p, got_eps, first_input = gradient["arguments"]
    assert (x_address, grad_address, planes, got_p, got_eps, first_input) == (
        int(x.gpudata), int(grad_x.gpudata), 6, p, float(np.float32(eps)), 0)
    problem = Problem.create("adaptive_gem_pool2d", SHAPE, size, "float32", direction="backward")
    want = gem.coefficients(grad_host, output_host, p, problem)
    sent = driver.memory[coefficients][1]
    assert np.frombuffer(bytes(sent), np.float32)[:want.size].tolist() == want.ravel().tolist()
    assert isinstance(grad_x, pycuda.gpuarray.GPUArray) and grad_x.shape == SHAPE
    assert grad_p == pytest.approx(gem.output_term(grad_host, output_host, p))
    assert {launch["context"] for launch in driver.launches} == {PRIMARY_CONTEXT}
    _forget_gem()


def test_gem_backward_of_numpy_arrays_on_a_cuda_device_runs_through_copies(gpu):
    """numpy arrays with device= a CUDA device: copied in, the same launches, the gradient copied
    back (it was a NotImplementedError: the input-gradient pass ran over host memory only)."""
    _forget_gem()
    device, _, driver = gpu
    x = _host() + 0.5
    grad_x, grad_p = pt.adaptive_gem_pool2d_backward(_host(OUT), x, SIZE, 2.5, 1e-3, output=_host(OUT) + 0.25,
                                                     device=device)
    assert isinstance(grad_x, np.ndarray) and grad_x.shape == SHAPE and np.isfinite(grad_p)
    gradient = driver.launches[-1]
    assert gradient["arguments"][4:] == [6, 2.5, float(np.float32(1e-3)), 0]
    assert {launch["context"] for launch in driver.launches} == {PRIMARY_CONTEXT}
    _forget_gem()


@pytest.mark.parametrize("size", [SIZE, 1])
def test_gem_backward_on_arrays_of_a_side_stream_launches_there_and_waits_for_it_before_reading(gpu, size):
    """CUDA arrays naming a stream: every launch of the backward goes on that stream, and the host
    reads grad_out and output only after waiting for it (their producers may still be writing)."""
    _forget_gem()
    _, _, driver = gpu
    side = 0x7F00DEAD0
    out_shape = OUT if size == SIZE else SHAPE[:2] + (1, 1)

    def on_side(host):
        address = driver.allocate_in(PRIMARY_CONTEXT, host.nbytes)
        driver.memory[address][1][:] = host.tobytes()
        return ForeignArray(host.shape, address, side)

    x = on_side(_host() + 0.5)
    pt.adaptive_gem_pool2d_backward(on_side(_host(out_shape)), x, size, 2.5, 1e-3, output=on_side(_host(out_shape)))
    assert driver.launches and {launch["stream"] for launch in driver.launches} == {side}
    reads = [i for i, c in enumerate(driver.calls) if isinstance(c, tuple) and c[0] == "cuMemcpyDtoH"]
    waits = [i for i, c in enumerate(driver.calls) if c == ("cuStreamSynchronize", side)]
    assert waits and reads and waits[0] < reads[0], "grad_out was read before its stream was waited for"
    _forget_gem()


@pytest.mark.parametrize("first", ["autoinit", "primary"])
def test_gem_backward_of_one_problem_in_two_contexts_runs_in_each(gpu, first):
    """GeM's prepared backward is per context: the same problem on arrays of ``pycuda.autoinit``'s
    context, then of the primary one (or the reverse), launches each context's own kernel (it was
    prepared per device and problem only, and the second context's call was refused)."""
    _forget_gem()
    _, _, driver = gpu
    own = driver.create_context(0)
    contexts = [own, PRIMARY_CONTEXT] if first == "autoinit" else [PRIMARY_CONTEXT, own]

    def in_context(context, host):
        address = driver.allocate_in(context, host.nbytes)
        driver.memory[address][1][:] = host.tobytes()
        return ForeignArray(host.shape, address)

    for context in contexts:
        driver.set_current(context)
        grad_x, grad_p = pt.adaptive_gem_pool2d_backward(in_context(context, _host(OUT)), in_context(context, _host() + 0.5),
                                                         SIZE, output=in_context(context, _host(OUT) + 0.25))
        assert driver._allocation(grad_x.ptr)[1] == context and np.isfinite(grad_p)
    assert [launch["context"] for launch in driver.launches] == contexts
    _forget_gem()


NON_BLOCKING = 0x5AFE0  # a stream made with CU_STREAM_NON_BLOCKING (PyTorch's side streams, CuPy's)


def _on_stream(driver, host, stream=...):
    address = driver.allocate_in(PRIMARY_CONTEXT, host.nbytes)
    driver.memory[address][1][:] = host.tobytes()
    return ForeignArray(host.shape, address, stream)


def test_results_on_a_non_blocking_stream_are_read_to_the_host_after_that_stream(gpu):
    """A synchronous copy to the host waits for the legacy default stream and the blocking streams
    only: ``CudaArray.get()`` and ``device.copy(numpy, array)`` read a result naming a
    non-blocking stream while its kernel could still be writing it (the fake raises)."""
    device, _, driver = gpu
    driver.set_current(PRIMARY_CONTEXT)
    driver.non_blocking.add(NON_BLOCKING)
    x = _on_stream(driver, _host(), NON_BLOCKING)
    y = pt.adaptive_avg_pool2d(x, SIZE)
    assert y.stream == NON_BLOCKING and y.get().shape == OUT
    z = pt.adaptive_max_pool2d(x, SIZE)
    host = np.empty(OUT, np.float32)
    device.copy(host, z)
    waits = [i for i, c in enumerate(driver.calls) if c == ("cuStreamSynchronize", NON_BLOCKING)]
    reads = [i for i, c in enumerate(driver.calls) if c[0] == "cuMemcpyDtoH"]
    assert len(waits) == len(reads) == 2 and all(w < r for w, r in zip(waits, reads))


def test_gem_backward_reads_grad_out_and_output_after_their_own_streams(gpu):
    """GeM's backward read grad_out and output on the host after waiting for x's stream only;
    theirs may be non-blocking streams whose kernels are still writing them (the fake raises)."""
    _forget_gem()
    _, _, driver = gpu
    driver.set_current(PRIMARY_CONTEXT)
    driver.non_blocking.add(NON_BLOCKING)
    x = _on_stream(driver, _host() + 0.5)  # names no stream
    on_side = _on_stream(driver, _host() + 0.5, NON_BLOCKING)
    output = pt.adaptive_gem_pool2d(on_side, SIZE)  # written on the non-blocking stream, not yet waited for
    grad_out = pt.adaptive_avg_pool2d(on_side, SIZE)
    grad_x, grad_p = pt.adaptive_gem_pool2d_backward(grad_out, x, SIZE, output=output)
    assert grad_x.shape == SHAPE and ("cuStreamSynchronize", NON_BLOCKING) in driver.calls
    _forget_gem()


def test_a_pyramid_backward_packs_each_level_after_its_own_stream(gpu):
    """A multi-level backward copies every level's gradient into one flat buffer on the first
    level's stream: a level written on another non-blocking stream must be waited for first (on
    the device), or its copy races the kernel still writing it (the fake raises)."""
    _, _, driver = gpu
    driver.set_current(PRIMARY_CONTEXT)
    first, second = NON_BLOCKING, NON_BLOCKING + 0x10
    driver.non_blocking.update({first, second})
    levels = [pt.adaptive_avg_pool2d(_on_stream(driver, _host(), stream), size)
              for stream, size in ((first, 1), (second, 2))]  # each written on its own stream, not waited for
    grad = pt.adaptive_avg_pool_pyramid_backward(levels, SHAPE)
    assert grad.shape == SHAPE and grad.stream == first
    copies = [c for c in driver.calls if c[0] == "cuMemcpyDtoDAsync"]
    assert len(copies) == 2 and {c[4] for c in copies} == {first}


def test_two_devices_with_the_same_shapes_each_run_their_own_plan(gpu, monkeypatch):
    """A plan holds its device: a call on device 1's array whose shapes match an earlier call on
    device 0's must not reuse device 0's plan (on 0511fb1 it did, and was refused for device 1's
    current context)."""
    first, _, driver = gpu
    second = fake_cuda_device(1)
    monkeypatch.setattr(cuda, "list_devices", lambda: (first, second))
    results = []
    for context in (PRIMARY_CONTEXT, OTHER_CONTEXT):
        driver.set_current(context)
        pointer = driver.allocate_in(context, 4 * int(np.prod(SHAPE)))
        results.append(pt.adaptive_avg_pool2d(ForeignArray(SHAPE, pointer), SIZE))
    assert [launch["context"] for launch in driver.launches] == [PRIMARY_CONTEXT, OTHER_CONTEXT]
    assert [c for _, c in driver.modules] == [PRIMARY_CONTEXT, OTHER_CONTEXT]
    assert [driver._allocation(r.ptr)[1] for r in results] == [PRIMARY_CONTEXT, OTHER_CONTEXT]
