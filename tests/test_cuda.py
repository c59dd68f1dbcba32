"""The CUDA backend (PyCUDA): every variant of every op and direction, run through the backend's
own ``build``/``launch`` on GPUArrays, against the float64 reference; device arrays of other
libraries taken without a copy; device listing that never fails.

The runtime tests skip with a reason when ``backends.cuda.list_devices()`` is empty (no PyCUDA, no
driver or no GPU); the listing/import tests at the end run everywhere.
"""

import subprocess
import sys

import numpy as np
import pytest

from pool_tuner import backends, compile_check, kernel_source, reference
from pool_tuner.backends import cuda
from pool_tuner.problem import DTYPES, LAYOUT_NAMES, OPS, Problem
from pool_tuner.variants import REGISTRY

from conftest import random_input

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes ships with the test environment
    ml_dtypes = None

DEVICES = cuda.list_devices()
_WHY = cuda.import_error()
needs_gpu = pytest.mark.skipif(
    not DEVICES, reason="no CUDA GPU / PyCUDA not installed" + (f" ({type(_WHY).__name__}: {_WHY})" if _WHY else "")
)

#: Per rank: divisible, non-divisible (overlapping windows), upsampling, global, O = I, long windows.
SHAPES = {
    1: [((2, 3, 16), (4,)), ((2, 5, 13), (5,)), ((1, 2, 5), (7,)), ((2, 4, 50), (1,)), ((2, 3, 9), (9,)),
        ((2, 3, 100), (3,))],
    2: [((2, 3, 8, 8), (4, 4)), ((2, 3, 10, 9), (4, 7)), ((1, 2, 5, 5), (7, 7)), ((2, 4, 7, 7), (1, 1)),
        ((2, 3, 6, 5), (6, 5)), ((2, 3, 64, 64), (6, 3))],
    3: [((1, 2, 4, 4, 4), (2, 2, 2)), ((2, 3, 5, 6, 7), (3, 4, 2)), ((1, 2, 3, 3, 3), (5, 4, 5)),
        ((2, 2, 6, 6, 6), (1, 1, 1)), ((1, 2, 3, 4, 5), (3, 4, 5)), ((1, 2, 16, 16, 16), (3, 2, 1))],
}
#: The shape of each rank used for the dtype x layout and configuration matrices.
REPRESENTATIVE = {ndim: shapes[1] for ndim, shapes in SHAPES.items()}
TOLERANCES = {
    "float64": dict(rtol=1e-12, atol=1e-12),
    "float32": dict(rtol=1e-5, atol=1e-6),
    "float16": dict(rtol=2e-3, atol=2e-3),
    "bfloat16": dict(rtol=1.6e-2, atol=1.6e-2),
}
INDEX_POISON = np.iinfo(np.int64).min
BFLOAT16_NAN_BITS = 0x7FC0


# ---------------------------------------------------------------------- helpers

def host_dtype(dtype: str):
    if dtype == "bfloat16":
        if ml_dtypes is None:
            pytest.skip("bfloat16 needs ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def as_float64(a):
    a = np.asarray(a)
    return a.astype(np.float32).astype(np.float64) if a.dtype.name == "bfloat16" else a.astype(np.float64)


def to_memory(problem: Problem, logical: np.ndarray) -> np.ndarray:
    """A logical channels-first array in the problem's memory order, bfloat16 as its uint16 bits."""
    if problem.channels_last:
        logical = np.moveaxis(logical, len(logical.shape) - problem.ndim - 1, -1)
    host = np.ascontiguousarray(logical)
    return host.view(np.uint16) if host.dtype.name == "bfloat16" else host


def from_memory(problem: Problem, memory: np.ndarray, dtype) -> np.ndarray:
    logical = memory.view(dtype)
    if problem.channels_last:
        logical = np.moveaxis(logical, -1, len(logical.shape) - problem.ndim - 1)
    return logical


def legal_configs(variant, problem, device, which=("default",)):
    """The requested configurations among default / smallest / largest legal, deduplicated."""
    picks = variant.representative_configurations(problem, device.info.limits)
    unique = []
    for name in which:
        if name in picks and picks[name] not in unique:
            unique.append(picks[name])
    return unique


def run_variant(device, problem: Problem, variant, params, inputs, force_index_64=False):
    """Render, build and launch one kernel on GPUArrays; return its outputs as logical host arrays.

    ``inputs``: the logical host arrays the kernel reads (x; or grad_out[, indices]).  Outputs are
    poisoned before the launch so that an element a kernel does not write cannot pass."""
    defines = variant.defines(params, problem)
    if force_index_64:
        defines["INDEX_64"] = 1
    source = kernel_source.render(variant.template, defines)
    kernel = device.build(device.queue.context, source, variant.kernel_name)
    block = variant.block(params)
    if block[0] * block[1] > kernel.max_work_group_size:
        pytest.skip(f"{variant.name} {params}: blocks of {block} exceed the built kernel's limit")
    dtype = host_dtype(problem.dtype)
    nan = BFLOAT16_NAN_BITS if problem.dtype == "bfloat16" else np.nan
    if problem.direction == "forward":
        outputs = [(problem.output_shape, dtype, nan)]
        if problem.kind == "max":
            outputs.append((problem.output_shape, np.dtype(np.int64), INDEX_POISON))
    else:
        outputs = [(problem.input_shape, dtype, nan)]
    device_inputs = [device.to_device(to_memory(problem, a)) for a in inputs]
    device_outputs = []
    for shape, out_dtype, poison in outputs:
        storage = np.dtype(np.uint16) if out_dtype.name == "bfloat16" else out_dtype
        out = device.empty(problem.memory_shape(shape), storage, fill=poison)
        device_outputs.append(out)
    # kernel arguments: forward (x, out[, indices]); backward (grad_out[, indices], grad_in); the planes
    args = [*device_inputs, *device_outputs, *problem.scalars]
    device.launch(device.queue, kernel, variant.groups(params, problem), block, args).wait()
    assert device.launch(device.queue, kernel, variant.groups(params, problem), block, args, timed=True) >= 0
    return [from_memory(problem, out.get(), out_dtype) for out, (_, out_dtype, _) in zip(device_outputs, outputs)]


def check_case(device, op, direction, dtype, layout, variant_name, shape, output_size, rng, which=("default",),
               force_index_64=False):
    kind, ndim = OPS[op]
    problem = Problem.create(op, shape, output_size, dtype, layout, direction)
    variant = REGISTRY[(op, direction)][variant_name]
    configs = legal_configs(variant, problem, device, which)
    if not configs:
        pytest.skip(f"{variant_name} has no legal configuration for {problem}")
    dt = host_dtype(dtype)
    x = random_input(rng, problem.input_shape, np.float64).astype(dt)
    x64 = as_float64(x)
    for params in configs:
        if direction == "forward":
            got = run_variant(device, problem, variant, params, [x], force_index_64)
            if kind == "avg":
                values = as_float64(got[0])
                assert not np.isnan(values).any(), f"{params}: outputs never written (poison left)"
                np.testing.assert_allclose(values, reference.forward(op, x64, output_size), **TOLERANCES[dtype],
                                           err_msg=str(params))
            else:
                ref_values, ref_indices = reference.forward(op, x64, output_size)
                np.testing.assert_array_equal(as_float64(got[0]), ref_values, err_msg=str(params))
                np.testing.assert_array_equal(got[1], ref_indices, err_msg=str(params))
        else:
            grad_out = random_input(rng, problem.output_shape, np.float64).astype(dt)
            g64 = as_float64(grad_out)
            if kind == "avg":
                got = run_variant(device, problem, variant, params, [grad_out], force_index_64)
                expected = reference.backward(op, g64, problem.input_shape)
            else:
                _, indices = reference.forward(op, x64, output_size)
                got = run_variant(device, problem, variant, params, [grad_out, indices], force_index_64)
                expected = reference.backward(op, g64, problem.input_shape, indices)
            grad_in = as_float64(got[0])
            assert not np.isnan(grad_in).any(), f"{params}: gradients never written (poison left)"
            np.testing.assert_allclose(grad_in, expected, **TOLERANCES[dtype], err_msg=str(params))


def _has_legal_config(op, direction, name, shape, size, dtype="float32", layout=None) -> bool:
    """Whether the variant can run the problem at all on a CUDA GPU (channels_vector, for one,
    needs channels-last memory); cases without are not generated rather than skipped."""
    problem = Problem.create(op, shape, size, dtype, layout, direction)
    return bool(compile_check.representative_configs(REGISTRY[(op, direction)][name], problem))


def _layout_for(name, ndim):
    """channels_vector vectorises over channels: it runs on channels-last memory only."""
    return LAYOUT_NAMES[ndim][1] if name == "channels_vector" else LAYOUT_NAMES[ndim][0]


def _no_gpu_placeholder(count: int):
    """Without a CUDA device, one skipped case per test (with the reason) instead of hundreds."""
    return [pytest.param(*(None,) * count, id="no-cuda-gpu", marks=needs_gpu)]


def _variant_cases(with_shapes: bool):
    if not DEVICES:
        return _no_gpu_placeholder(6)
    cases = []
    for (op, direction), table in REGISTRY.items():
        ndim = OPS[op][1]
        for name in table:
            layout = _layout_for(name, ndim)
            for shape, size in (SHAPES[ndim] if with_shapes else [REPRESENTATIVE[ndim]]):
                if _has_legal_config(op, direction, name, shape, size, layout=layout):
                    cases.append(pytest.param(op, direction, name, layout, shape, size,
                                              id=f"{op}-{direction}-{name}-{layout}-{shape}->{size}"))
    return cases


def _dtype_layout_cases():
    if not DEVICES:
        return _no_gpu_placeholder(5)
    cases = []
    for (op, direction), table in REGISTRY.items():
        ndim = OPS[op][1]
        shape, size = REPRESENTATIVE[ndim]
        for dtype in DTYPES:
            for layout in LAYOUT_NAMES[ndim]:
                for name in table:
                    if _has_legal_config(op, direction, name, shape, size, dtype, layout):
                        cases.append(pytest.param(op, direction, dtype, layout, name,
                                                  id=f"{op}-{direction}-{dtype}-{layout}-{name}"))
    return cases


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
    source = kernel_source.render(variant.template, variant.defines(variant.default, problem))
    assert device.build(device.queue.context, source, variant.kernel_name) is device.build(None, source,
                                                                                          variant.kernel_name)


@needs_gpu
@pytest.mark.parametrize("op,direction,variant,layout,shape,size", _variant_cases(with_shapes=True))
def test_every_variant_on_the_shape_matrix(device, op, direction, variant, layout, shape, size, rng):
    check_case(device, op, direction, "float32", layout, variant, shape, size, rng)


@needs_gpu
@pytest.mark.parametrize("op,direction,dtype,layout,variant", _dtype_layout_cases())
def test_every_dtype_and_layout(device, op, direction, dtype, layout, variant, rng):
    shape, size = REPRESENTATIVE[OPS[op][1]]
    check_case(device, op, direction, dtype, layout, variant, shape, size, rng)


@needs_gpu
@pytest.mark.parametrize("op,direction,variant,layout,shape,size", _variant_cases(with_shapes=False))
def test_smallest_and_largest_configurations(device, op, direction, variant, layout, shape, size, rng):
    check_case(device, op, direction, "float32", layout, variant, shape, size, rng, which=("smallest", "largest"))


@needs_gpu
@pytest.mark.parametrize("op,direction,variant,layout,shape,size", _variant_cases(with_shapes=False))
def test_64_bit_index_path(device, op, direction, variant, layout, shape, size, rng):
    """INDEX_64 forced on a small problem: the 64-bit offset arithmetic gives the same results."""
    check_case(device, op, direction, "float32", layout, variant, shape, size, rng, force_index_64=True)


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
    kernel = device.build(None, kernel_source.render(variant.template, variant.defines(params, problem)),
                          variant.kernel_name)
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
