"""The CUDA backend (PyCUDA): every variant of every op and direction, run through the public
functions on the device's arrays by the harness the OpenCL device runs too (tests/device_matrix.py,
proven on PoCL by tests/test_device_matrix.py), against the float64 reference; device arrays of
other libraries taken without a copy; device listing that never fails.

The runtime tests skip with a reason when ``backends.cuda.list_devices()`` is empty (no PyCUDA, no
driver or no GPU); the listing/import tests at the end run everywhere.
"""

import subprocess
import sys

import numpy as np
import pytest

from pool_tuner import backends, dispatch, ops, reference
from pool_tuner.backends import cuda
from pool_tuner.problem import OPS, Problem
from pool_tuner.variants import REGISTRY

from conftest import random_input
from device_matrix import (REPRESENTATIVE, TOLERANCES, check_case, check_gem_backward, dtype_layout_cases,
                           gem_backward_cases, variant_cases)

DEVICES = cuda.list_devices()
_WHY = cuda.import_error()
needs_gpu = pytest.mark.skipif(
    not DEVICES, reason="no CUDA GPU / PyCUDA not installed" + (f" ({type(_WHY).__name__}: {_WHY})" if _WHY else "")
)


def _no_gpu_placeholder(count: int):
    """Without a CUDA device, one skipped case per test (with the reason) instead of hundreds."""
    return [pytest.param(*(None,) * count, id="no-cuda-gpu", marks=needs_gpu)]


def _variant_cases(with_shapes: bool):
    return variant_cases(with_shapes) if DEVICES else _no_gpu_placeholder(6)


def _dtype_layout_cases():
    return dtype_layout_cases() if DEVICES else _no_gpu_placeholder(5)


@pytest.fixture(scope="module")
def device():
    return DEVICES[0]


# ---------------------------------------------------------------------- runtime (GPU)

@needs_gpu
def test_device_interface(device):
    assert device.info.id == f"cuda:{device.ordinal}" and device.info.id.startswith("cuda:")
    assert device.info.name and device.info.is_gpu and not device.info.is_cpu and not device.info.is_simulator
    assert device.info.supports_float64
    assert device.info.limits.max_work_group_size >= 1024 and device.info.limits.local_mem_size >= 48 * 1024
    fp = device.info.fingerprint
    assert fp["backend"] == "cuda" and fp["name"] == device.info.name
    assert set(fp) >= {"backend", "name", "compute_capability", "multiprocessors", "driver"}
    assert backends.resolve_device(device.info.id) is device
    assert backends.default_device().info.backend == "cuda"


@needs_gpu
def test_build_is_cached(device):
    problem = Problem.create("adaptive_avg_pool2d", (2, 3, 10, 9), (4, 7))
    variant = REGISTRY[("adaptive_avg_pool2d", "forward")]["thread_per_output"]
    source = variant.program(variant.default, problem)
    assert device.build(device.queue.context, source, variant.kernel_name) is device.build(None, source,
                                                                                          variant.kernel_name)


@needs_gpu
@pytest.mark.parametrize("op,direction,variant,layout,shape,size", _variant_cases(with_shapes=True))
def test_every_variant_on_the_shape_matrix(device, op, direction, variant, layout, shape, size, rng):
    check_case(device, op, direction, "float32", layout, variant, shape, size, rng)


@needs_gpu
@pytest.mark.parametrize("op,direction,dtype,layout,variant", _dtype_layout_cases())
def test_every_dtype_and_layout(device, op, direction, dtype, layout, variant, rng):
    shape, size = REPRESENTATIVE[OPS[op].ndim]
    check_case(device, op, direction, dtype, layout, variant, shape, size, rng)


@needs_gpu
@pytest.mark.parametrize("op,direction,variant,layout,shape,size", _variant_cases(with_shapes=False))
def test_smallest_and_largest_configurations(device, op, direction, variant, layout, shape, size, rng):
    check_case(device, op, direction, "float32", layout, variant, shape, size, rng, which=("smallest", "largest"))


@needs_gpu
@pytest.mark.parametrize("ndim,dtype,layout", gem_backward_cases() if DEVICES else _no_gpu_placeholder(3))
def test_gem_backward(device, ndim, dtype, layout, rng):
    """GeM's backward runs kernels of its own (no variants): every rank, dtype and layout."""
    check_gem_backward(device, ndim, dtype, layout, rng)


@pytest.fixture
def index_64_forced(monkeypatch):
    """Every problem takes the 64-bit index path (``Problem.index_64``), with no plan or kernel of
    the 32-bit one kept from before or after."""
    dispatch.forget()
    ops._PLANS.clear()
    monkeypatch.setattr(Problem, "index_64", property(lambda self: True))
    yield
    dispatch.forget()
    ops._PLANS.clear()


@needs_gpu
@pytest.mark.parametrize("op,direction,variant,layout,shape,size", _variant_cases(with_shapes=False))
def test_64_bit_index_path(device, op, direction, variant, layout, shape, size, rng, index_64_forced):
    """INDEX_64 forced on a small problem: the 64-bit offset arithmetic gives the same results."""
    check_case(device, op, direction, "float32", layout, variant, shape, size, rng)


@needs_gpu
def test_foreign_arrays_are_used_without_a_copy(device, rng):
    x = random_input(rng, (2, 3, 10, 9))
    own = device.to_device(x)
    assert cuda.is_device_array(own) and cuda.device_of_array(own) is device

    class Foreign:  # any object with __cuda_array_interface__ (Numba, JAX, ...)
        __cuda_array_interface__ = own.__cuda_array_interface__

    foreign = Foreign()
    assert cuda.is_device_array(foreign)
    wrapped = device.arrays.wrap_input(foreign, "x")
    assert wrapped.ptr == own.ptr and wrapped.shape == x.shape and wrapped.base is foreign
    np.testing.assert_array_equal(wrapped.get(), x)
    assert not cuda.is_device_array(x)


@needs_gpu
def test_torch_cuda_tensors_are_read_through_their_interface(device, rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch has no CUDA support")
    x = torch.from_numpy(random_input(rng, (2, 3, 10, 9))).to(f"cuda:{device.ordinal}")
    assert cuda.is_device_array(x) and cuda.device_of_array(x) is device
    wrapped = device.arrays.wrap_input(x, "x")
    assert wrapped.ptr == x.data_ptr()
    problem = Problem.create("adaptive_avg_pool2d", tuple(x.shape), (4, 7))
    variant = REGISTRY[("adaptive_avg_pool2d", "forward")]["thread_per_output"]
    params = variant.check_config({}, problem, device.info.limits)
    kernel = device.build(None, variant.program(params, problem), variant.kernel_name)
    out = torch.empty(problem.output_shape, device=x.device)
    device.launch(None, kernel, variant.groups(params, problem), variant.block(params),
                  [wrapped, out, *problem.scalars]).wait()
    expected = torch.nn.functional.adaptive_avg_pool2d(x, (4, 7))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- pool_tuner.torch on CUDA tensors (GPU)
#
# The driver-API path (pool_tuner.torch_cuda): results from PyTorch's allocator, launches on its
# current stream, no PyCUDA object per call.  Its logic is checked without a GPU in
# test_torch_cuda.py; these check what only a GPU shows.

def _torch_cuda():
    """torch with CUDA, or skip with the reason."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch has no CUDA support (torch.cuda.is_available() is False)")
    return torch


def _cuda_tensor(torch, rng, shape, dtype="float32"):
    """A fresh random CUDA tensor and its values as float64 (after rounding to ``dtype``)."""
    x = torch.from_numpy(random_input(rng, shape, np.float64)).to("cuda", getattr(torch, dtype))
    return x, x.double().cpu().numpy()


def _check_forward_backward(torch, rng, kind, dtype, shape=(2, 3, 10, 9), size=(4, 7), pool=None):
    """pool_tuner.torch's 2d pooling of ``kind`` forward and backward on a CUDA tensor against the
    float64 reference."""
    import pool_tuner.torch as ptt

    op = f"adaptive_{kind}_pool2d"
    x, x64 = _cuda_tensor(torch, rng, shape, dtype)
    x.requires_grad_()
    pool = pool or getattr(ptt, op)
    y = pool(x, size)
    grad, g64 = _cuda_tensor(torch, rng, tuple(y.shape), dtype)
    (grad_in,) = torch.autograd.grad(y, x, grad)
    tolerance = TOLERANCES[dtype]
    if kind == "avg":
        np.testing.assert_allclose(y.detach().double().cpu().numpy(), reference.forward(op, x64, size), **tolerance)
        expected = reference.backward(op, g64, shape)
    else:
        values, indices = reference.forward(op, x64, size)
        np.testing.assert_array_equal(y.detach().double().cpu().numpy(), values)
        expected = reference.backward(op, g64, shape, indices)
    np.testing.assert_allclose(grad_in.double().cpu().numpy(), expected, **tolerance)


@needs_gpu
def test_torch_all_dtypes_forward_and_backward_in_one_process(rng):
    """float32, float64, float16 and then bfloat16 in the same process, forward and backward
    (bfloat16 used to fail here with ``cuCtxGetDevice failed`` after the other dtypes had run)."""
    torch = _torch_cuda()
    for dtype in ("float32", "float64", "float16", "bfloat16"):
        for kind in ("avg", "max"):
            _check_forward_backward(torch, rng, kind, dtype)


@needs_gpu
def test_torch_calls_make_no_pycuda_object_once_warm(rng, monkeypatch):
    """After one call of each signature, forward and backward (backward on autograd's thread) run
    with PyCUDA unreachable: nothing on the call path touches it."""
    torch = _torch_cuda()
    for kind in ("avg", "max"):
        _check_forward_backward(torch, rng, kind, "float32")

    def no_pycuda():
        raise AssertionError("a warm pool_tuner.torch call used PyCUDA")

    monkeypatch.setattr(cuda, "_pycuda", no_pycuda)
    for kind in ("avg", "max"):
        _check_forward_backward(torch, rng, kind, "float32")


@needs_gpu
@pytest.mark.own_process
def test_torch_cuda_graph_capture_and_replay(rng):
    """Forward and backward captured with torch.cuda.graph after a warm-up on a side stream (as
    PyTorch prescribes); replays on new inputs match the reference."""
    import pool_tuner.torch as ptt

    torch = _torch_cuda()
    op, size, shape = "adaptive_avg_pool2d", (4, 7), (2, 3, 10, 9)
    x = torch.zeros(shape, device="cuda", requires_grad=True)
    grad = torch.zeros((2, 3) + size, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            torch.autograd.grad(ptt.adaptive_avg_pool2d(x, size), x, grad)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ptt.adaptive_avg_pool2d(x, size)
        (grad_in,) = torch.autograd.grad(y, x, grad)
    for _ in range(2):
        x32, g32 = random_input(rng, shape), random_input(rng, (2, 3) + size)
        with torch.no_grad():
            x.copy_(torch.from_numpy(x32))
            grad.copy_(torch.from_numpy(g32))
        graph.replay()
        torch.cuda.synchronize()
        np.testing.assert_allclose(y.detach().double().cpu().numpy(),
                                   reference.forward(op, x32.astype(np.float64), size), **TOLERANCES["float32"])
        np.testing.assert_allclose(grad_in.double().cpu().numpy(),
                                   reference.backward(op, g32.astype(np.float64), shape), **TOLERANCES["float32"])


@needs_gpu
def test_torch_calls_from_a_fresh_thread_on_its_own_stream(rng):
    """A DataLoader-like worker thread (no CUDA work done on it before) runs seen and new
    signatures on a stream of its own, forward and backward (backward on autograd's thread), and
    the results match.  Afterwards the worker's current CUDA context is the device's primary one
    (PyTorch's runtime calls bind it, and so would pool_tuner's launch path on a thread with none)."""
    import ctypes
    import threading

    from pool_tuner.backends import cuda_driver

    torch = _torch_cuda()
    _check_forward_backward(torch, rng, "avg", "float32")  # a signature seen on the main thread
    errors, contexts = [], []

    def current_context():
        context = ctypes.c_void_p()
        cuda_driver.check(cuda_driver.library().cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
        return context.value

    def worker():
        try:
            contexts.append(current_context())
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                _check_forward_backward(torch, rng, "avg", "float32")  # seen
                _check_forward_backward(torch, rng, "max", "float16", shape=(3, 5, 17, 6), size=(5, 4))  # new
            contexts.append(current_context())
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert not errors, errors
    print(f"worker thread's current context: at start {contexts[0]}, after the calls {contexts[1]}")
    assert contexts[1] == cuda_driver.primary_context(torch.cuda.current_device())


# ---------------------------------------------------------------------- listing (everywhere)

def test_importing_pool_tuner_does_not_import_pycuda():
    # Listing devices may import PyCUDA (when installed); importing pool_tuner alone never does.
    code = "import sys, pool_tuner; print(any(m.startswith('pycuda') for m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr


def test_listing_never_raises_and_cuda_devices_come_first():
    devices = cuda.list_devices()
    assert isinstance(devices, tuple)
    assert all(d.info.id.startswith("cuda:") for d in devices)
    listed = backends.all_devices()
    assert listed[: len(devices)] == list(devices)
    if not devices:
        assert getattr(backends.default_device(), "backend", None) != "cuda"


def test_cuda_arrays_are_recognised_without_pycuda():
    class Foreign:
        __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0, False), "version": 3}

    class CpuTensorLike:
        @property
        def __cuda_array_interface__(self):
            raise AttributeError("not on a CUDA device")

    assert cuda.is_device_array(Foreign())
    assert not cuda.is_device_array(CpuTensorLike())
    assert not cuda.is_device_array(np.zeros(2))
    if not DEVICES:
        with pytest.raises(RuntimeError, match=r"pool-tuner\[cuda\]"):
            cuda.device_of_array(Foreign())
