"""``pool_tuner.torch_cuda``, the CUDA-tensor path of pool_tuner.torch, without a GPU: CPU tensors
stand in for CUDA ones, a fake libcuda (tests/cuda_fakes.py) records the launches, and PyTorch's
current stream is a stub.  Checks what the plan decides once per call signature (problem, layout,
result shapes and strides, kernel, grid) and what each call does (pointers, stream handle, fresh
results from torch, nothing rebuilt); the kernels' numbers are checked on a GPU in test_cuda.py."""

import dataclasses
import math
import threading

import pytest

torch = pytest.importorskip("torch")

from pool_tuner import backends, dispatch, gem, ops, plans, torch_cuda  # noqa: E402
from pool_tuner.backends import cuda, cuda_driver  # noqa: E402

from cuda_fakes import PRIMARY_CONTEXT, FakeDriver, fake_cuda_device  # noqa: E402
from poisoning import INDEX_POISON  # noqa: E402

NONE = {"device": None, "variant": None, "config": None}
STREAM = 0x5EED


@pytest.fixture
def gpu(monkeypatch):
    """A fake GPU: the fake driver, one fake CudaDevice, the compiler stubbed and
    PyCUDA unreachable, PyTorch's current stream a settable handle."""
    driver = FakeDriver()
    driver.set_current(PRIMARY_CONTEXT)
    device = fake_cuda_device()
    streams = []

    def no_pycuda():
        raise AssertionError("the torch CUDA path must not use PyCUDA beyond its compiler")

    monkeypatch.setattr(cuda_driver, "library", lambda: driver)
    monkeypatch.setattr(cuda, "list_devices", lambda: (device,))
    monkeypatch.setattr(cuda, "_compile", lambda source, arch: b"cubin:" + source.encode())
    monkeypatch.setattr(cuda, "_pycuda", no_pycuda)
    monkeypatch.setattr(torch_cuda, "current_raw_stream", lambda index: streams.append(index) or driver.stream)
    driver.stream = STREAM
    driver.device, driver.stream_requests = device, streams
    _forget_builds_and_plans()
    yield driver
    _forget_builds_and_plans()


def _forget_builds_and_plans():
    """Every test's fake driver loads its own modules: kernels are memoised per context handle, and
    each fake driver's primary context has the same one."""
    cuda_driver.primary_context.cache_clear()
    cuda.forget_builds()
    dispatch.forget()  # which also empties the plan tables
    gem._KERNELS.clear()
    gem._prepared_input_gradient.cache_clear()


def _x(shape, dtype=torch.float32):
    return torch.rand(shape, dtype=dtype) + 0.5


def _expected_launch(device, problem):
    """(groups, block) of the dispatched kernel, as pool_tuner.ops would launch it."""
    choice = dispatch.choose(problem, device)
    return choice.variant.groups(choice.config, problem), choice.variant.block(choice.config)


def test_forward_launches_on_the_current_stream_into_a_fresh_torch_result(gpu):
    x = _x((2, 3, 10, 9))
    out = torch_cuda.call(ops.adaptive_avg_pool2d, [x], (4, 7), NONE)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 3, 4, 7) and out.dtype == torch.float32
    assert out.is_contiguous()
    assert torch.isnan(out).all(), "the result was poisoned before the launch (the fake kernel writes nothing)"
    (launch,) = gpu.launches
    assert launch["arguments"] == [x.data_ptr(), out.data_ptr(), 2 * 3]  # pointers, then the planes
    assert launch["stream"] == STREAM and launch["context"] == PRIMARY_CONTEXT
    groups, block = _expected_launch(gpu.device, ops.Problem.create("adaptive_avg_pool2d", (2, 3, 10, 9), (4, 7)))
    assert launch["grid"] == (groups, 1, 1) and launch["block"] == block + (1,) * (3 - len(block))


def test_a_repeated_signature_is_one_lookup_and_one_launch(gpu, monkeypatch):
    x = _x((2, 3, 10, 9))
    torch_cuda.call(ops.adaptive_avg_pool2d, [x], (4, 7), NONE)
    choices = []
    monkeypatch.setattr(dispatch, "choose", lambda *a, **k: choices.append(a))
    monkeypatch.setattr(ops.Problem, "create", lambda *a, **k: choices.append(a))
    gpu.stream = 0xBEEF  # the current stream may change between calls: it is asked for each time
    outs = [torch_cuda.call(ops.adaptive_avg_pool2d, [_x((2, 3, 10, 9))], (4, 7), NONE) for _ in range(3)]
    assert not choices, "a cache hit validated or dispatched again"
    assert len(gpu.modules) == 1 and len(gpu.launches) == 4
    assert len({launch["params_address"] for launch in gpu.launches}) == 1, "one argument array for every call"
    assert [launch["stream"] for launch in gpu.launches] == [STREAM] + [0xBEEF] * 3
    assert [launch["arguments"][1] for launch in gpu.launches[1:]] == [o.data_ptr() for o in outs]
    assert len(torch_cuda._PLANS) == 1


def test_signatures_differ_by_strides_dtype_size_and_options(gpu):
    x = _x((2, 3, 10, 9))
    torch_cuda.call(ops.adaptive_avg_pool2d, [x], (4, 7), NONE)
    torch_cuda.call(ops.adaptive_avg_pool2d, [x.to(memory_format=torch.channels_last)], (4, 7), NONE)
    torch_cuda.call(ops.adaptive_avg_pool2d, [x.half()], (4, 7), NONE)
    torch_cuda.call(ops.adaptive_avg_pool2d, [x], (4, 6), NONE)
    torch_cuda.call(ops.adaptive_avg_pool2d, [x], [4, 7], NONE)  # a list: a key of its own, same result
    torch_cuda.call(ops.adaptive_avg_pool2d, [x], (4, 7), dict(NONE, variant="thread_per_output",
                                                                 config={"block_size_x": 64}))
    assert len(torch_cuda._PLANS) == 6
    assert gpu.launches[-1]["block"][0] == 64


@pytest.mark.parametrize("shape,size,memory_format", [
    ((2, 6, 10, 9), (4, 7), torch.channels_last),
    ((1, 4, 5, 6, 7), (3, 4, 2), torch.channels_last_3d),
])
def test_channels_last_is_read_in_place_and_gives_channels_last_results(gpu, shape, size, memory_format):
    x = _x(shape).to(memory_format=memory_format)
    fn = ops.adaptive_max_pool2d if len(shape) == 4 else ops.adaptive_max_pool3d
    values, indices = torch_cuda.call(fn, [x], size, NONE)
    expected = torch.empty(values.shape).to(memory_format=memory_format).stride()
    assert values.stride() == expected and indices.stride() == expected and indices.dtype == torch.int64
    assert (indices == INDEX_POISON).all()
    assert gpu.launches[0]["arguments"] == [x.data_ptr(), values.data_ptr(), indices.data_ptr(), math.prod(shape[:2])]


def test_channels_last_1d_memory_keeps_its_layout(gpu):
    x = _x((2, 13, 5)).transpose(1, 2)  # (N, C, L) stored as (N, L, C)
    out = torch_cuda.call(ops.adaptive_avg_pool1d, [x], (4,), NONE)
    assert out.shape == (2, 5, 4) and out.stride() == (20, 1, 5)
    assert gpu.launches[0]["arguments"][0] == x.data_ptr()


def test_other_strides_are_copied_to_contiguous_first(gpu):
    x = _x((2, 3, 9, 10)).transpose(2, 3)
    out = torch_cuda.call(ops.adaptive_avg_pool2d, [x], (4, 7), NONE)
    assert out.is_contiguous()
    (launch,) = gpu.launches
    assert launch["arguments"][0] != x.data_ptr()


def test_max_backward_takes_indices_into_grad_outs_layout(gpu):
    grad_out = _x((2, 6, 4, 7)).to(memory_format=torch.channels_last)
    indices = torch.zeros((2, 6, 4, 7), dtype=torch.int64)  # contiguous: copied to channels-last
    grad_in = torch_cuda.call(ops.adaptive_max_pool2d_backward, [grad_out, indices], (2, 6, 10, 9), NONE)
    assert grad_in.shape == (2, 6, 10, 9)
    assert grad_in.stride() == torch.empty(2, 6, 10, 9).to(memory_format=torch.channels_last).stride()
    pointers = gpu.launches[0]["arguments"]
    assert pointers[0] == grad_out.data_ptr() and pointers[1] != indices.data_ptr() and pointers[2] == grad_in.data_ptr()
    indices_cl = indices.to(memory_format=torch.channels_last)
    torch_cuda.call(ops.adaptive_max_pool2d_backward, [grad_out, indices_cl], (2, 6, 10, 9), NONE)
    assert gpu.launches[1]["arguments"][1] == indices_cl.data_ptr()


def test_avg_backward(gpu):
    grad_out = _x((2, 3, 4, 7), torch.bfloat16)
    grad_in = torch_cuda.call(ops.adaptive_avg_pool2d_backward, [grad_out], (2, 3, 10, 9), NONE)
    assert grad_in.shape == (2, 3, 10, 9) and grad_in.dtype == torch.bfloat16 and grad_in.is_contiguous()
    problem = ops.Problem.create("adaptive_avg_pool2d", (2, 3, 10, 9), (4, 7), "bfloat16", direction="backward")
    groups, block = _expected_launch(gpu.device, problem)
    assert gpu.launches[0]["grid"][0] == groups and gpu.launches[0]["arguments"] == [grad_out.data_ptr(), grad_in.data_ptr(), 2 * 3]


def test_empty_batches_launch_nothing(gpu):
    out = torch_cuda.call(ops.adaptive_avg_pool2d, [_x((0, 3, 10, 9))], (4, 7), NONE)
    grad_in = torch_cuda.call(ops.adaptive_avg_pool2d_backward, [_x((0, 3, 4, 7))], (0, 3, 10, 9), NONE)
    assert out.shape == (0, 3, 4, 7) and grad_in.shape == (0, 3, 10, 9) and not gpu.launches


def test_bad_arguments_raise_before_any_launch(gpu):
    x = _x((2, 3, 10, 9))
    other = next(d.info.id for d in backends.all_devices() if d is not gpu.device)
    with pytest.raises(ValueError, match=f"device='{other}' does not hold x"):
        torch_cuda.call(ops.adaptive_avg_pool2d, [x], (4, 7), dict(NONE, device=other))
    with pytest.raises(ValueError, match="output_size"):
        torch_cuda.call(ops.adaptive_avg_pool2d, [x], (4, 7, 1), NONE)
    with pytest.raises(TypeError, match="indices must be an int64 tensor"):
        torch_cuda.call(ops.adaptive_max_pool2d_backward, [_x((2, 3, 4, 7)), _x((2, 3, 4, 7))], (2, 3, 10, 9), NONE)
    with pytest.raises(ValueError, match="indices must have the shape of grad_out"):
        torch_cuda.call(ops.adaptive_max_pool2d_backward, [_x((2, 3, 4, 7)), torch.zeros((2, 3, 4, 6), dtype=torch.int64)],
                        (2, 3, 10, 9), NONE)
    with pytest.raises(ValueError, match="block_size_x"):
        torch_cuda.call(ops.adaptive_avg_pool2d, [x], (4, 7), dict(NONE, variant="thread_per_output",
                                                                     config={"block_size_x": 3}))
    assert not gpu.launches and not torch_cuda._PLANS


# ------------------------------------------------------------------ the multi-level ops

PYRAMID = ((1, 1), (2, 3), (4, 4))
PYRAMID_VALUES = 2 * 3 * (1 + 6 + 16)  # every level's outputs of a (2, 3, ...) input


@pytest.mark.parametrize("memory_format,layout", [(torch.contiguous_format, "NCHW"), (torch.channels_last, "NHWC")])
def test_multi_level_forward_launches_once_into_flat_torch_buffers(gpu, memory_format, layout):
    x = _x((2, 3, 10, 9)).to(memory_format=memory_format)
    found = torch_cuda.plan_op("adaptive_max_pool_pyramid2d", "forward", [x], PYRAMID, "")
    values, indices = torch_cuda.run(found, [x])
    assert values.shape == indices.shape == (PYRAMID_VALUES,) and indices.dtype == torch.int64
    assert torch.isnan(values).all() and (indices == INDEX_POISON).all(), "poisoned; the fake kernel writes nothing"
    (launch,) = gpu.launches
    assert launch["arguments"] == [x.data_ptr(), values.data_ptr(), indices.data_ptr(), 2 * 3]  # read in place
    problem = ops.Problem.create("adaptive_max_pool_pyramid2d", (2, 3, 10, 9), PYRAMID, layout=layout)
    groups, block = _expected_launch(gpu.device, problem)
    assert launch["grid"] == (groups, 1, 1) and launch["block"] == block + (1,) * (3 - len(block))
    assert launch["stream"] == STREAM


def test_avgmax_forward_has_one_flat_buffer_of_both_levels(gpu):
    x = _x((2, 3, 10, 9), torch.float16)
    values, indices = torch_cuda.run(torch_cuda.plan_op("adaptive_avgmax_pool2d", "forward", [x], (4, 7), ""), [x])
    assert values.shape == (2 * 2 * 3 * 4 * 7,) and values.dtype == torch.float16 and indices.shape == (2 * 3 * 4 * 7,)
    assert gpu.launches[0]["arguments"] == [x.data_ptr(), values.data_ptr(), indices.data_ptr(), 2 * 3]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_multi_level_backward_reads_flat_buffers_and_writes_the_input_gradient(gpu, layout):
    grad, indices = _x((PYRAMID_VALUES,)), torch.zeros(PYRAMID_VALUES, dtype=torch.int64)
    size = ((2, 3, 10, 9), PYRAMID, layout)
    found = torch_cuda.plan_op("adaptive_max_pool_pyramid2d", "backward", [grad, indices], size, "")
    (grad_in,) = torch_cuda.run(found, [grad, indices])
    expected = torch.empty(2, 3, 10, 9)
    if layout == "NHWC":
        expected = expected.to(memory_format=torch.channels_last)
    assert grad_in.shape == (2, 3, 10, 9) and grad_in.stride() == expected.stride() and torch.isnan(grad_in).all()
    assert gpu.launches[0]["arguments"] == [grad.data_ptr(), indices.data_ptr(), grad_in.data_ptr(), 2 * 3]
    (avg,) = torch_cuda.run(torch_cuda.plan_op("adaptive_avg_pool_pyramid2d", "backward", [grad], size, ""), [grad])
    assert avg.stride() == expected.stride() and gpu.launches[1]["arguments"] == [grad.data_ptr(), avg.data_ptr(), 6]


def test_multi_level_bad_arguments_raise_before_any_launch(gpu):
    size = ((2, 3, 10, 9), PYRAMID, "NCHW")
    with pytest.raises(ValueError, match="grad_out must be the flat buffer of every level"):
        torch_cuda.plan_op("adaptive_avg_pool_pyramid2d", "backward", [_x((PYRAMID_VALUES - 1,))], size, "")
    with pytest.raises(TypeError, match="indices must be an int64 tensor"):
        torch_cuda.plan_op("adaptive_max_pool_pyramid2d", "backward", [_x((PYRAMID_VALUES,))] * 2, size, "")
    with pytest.raises(ValueError, match=r"output_sizes\[1\]"):
        torch_cuda.plan_op("adaptive_avg_pool_pyramid2d", "forward", [_x((2, 3, 10, 9))], (1, -2), "")
    assert not gpu.launches and not torch_cuda._PLANS


def test_pool_tuner_torch_sends_the_multi_level_ops_and_their_gradients_down_the_cuda_path(gpu, monkeypatch):
    """The functional forms and autograd of pool_tuner.torch on the CUDA path (CPU tensors stand in,
    sent there as pool_tuner.torch sends CUDA tensors): levels are views of the launch's buffers,
    the backward launches on the flat gradient of every level and the forward's indices."""
    from pool_tuner import torch as ptt

    def cuda_path(op, direction, tensors, size, options):
        return torch_cuda.run(torch_cuda.plan_op(op, direction, tensors, size, options), tensors)

    monkeypatch.setattr(ptt, "_run", cuda_path)
    x = _x((2, 3, 10, 9)).requires_grad_()
    values, indices = ptt.adaptive_max_pool_pyramid(x, [1, (2, 3), 4], return_indices=True)
    assert [tuple(v.shape) for v in values] == [(2, 3, 1, 1), (2, 3, 2, 3), (2, 3, 4, 4)]
    (forward,) = gpu.launches
    assert forward["arguments"][1:3] == [values[0].data_ptr(), indices[0].data_ptr()]
    assert values[1].data_ptr() == values[0].data_ptr() + 2 * 3 * 4  # level 1 follows level 0's 6 floats
    torch.autograd.backward(values, [torch.ones_like(v) for v in values])
    backward = gpu.launches[1]
    assert backward["arguments"][1] == indices[0].data_ptr() and backward["arguments"][2] == x.grad.data_ptr()
    avgmax = ptt.adaptive_avgmax_pool2d(x.detach(), 3, "cat")
    assert avgmax.shape == (2, 6, 3, 3) and len(gpu.launches) == 3


def test_unhashable_options_are_validated_on_every_call(gpu):
    options = dict(NONE, variant="thread_per_output", config={"block_size_x": [64]})
    for _ in range(2):
        with pytest.raises((TypeError, ValueError), match="block_size_x"):
            torch_cuda.call(ops.adaptive_avg_pool2d, [_x((2, 3, 10, 9))], (4, 7), options)


def test_a_thread_without_a_current_context_binds_the_primary_one_and_keeps_it(gpu):
    x = _x((2, 3, 10, 9))
    torch_cuda.call(ops.adaptive_avg_pool2d, [x], (4, 7), NONE)  # the first call builds, here
    calls = len(gpu.calls)
    current = []

    def worker():
        gpu.set_current(None)  # a fresh thread: no context until something makes one current
        torch_cuda.call(ops.adaptive_avg_pool2d, [x], (4, 7), NONE)
        current.append(gpu.current())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert [launch["context"] for launch in gpu.launches] == [PRIMARY_CONTEXT] * 2
    assert gpu.calls[calls:] == [("set", PRIMARY_CONTEXT)], "bound with cuCtxSetCurrent, nothing pushed or popped"
    assert current == [PRIMARY_CONTEXT], "the primary context stays current on the thread, as the runtime leaves it"


def test_a_call_under_another_current_context_is_refused_naming_both(gpu):
    x = _x((2, 3, 10, 9))
    torch_cuda.call(ops.adaptive_avg_pool2d, [x], (4, 7), NONE)
    own = gpu.create_context(0)  # e.g. pycuda.autoinit's context, current on this thread
    gpu.set_current(own)
    with pytest.raises(ValueError, match=f"current CUDA context \\({own:#x}, device 0\\).*{PRIMARY_CONTEXT:#x}"):
        torch_cuda.call(ops.adaptive_avg_pool2d, [x], (4, 7), NONE)
    assert len(gpu.launches) == 1 and gpu.current() == own


@pytest.mark.parametrize("owner", ["primary", "stream-ordered"])
def test_a_first_call_under_pycuda_autoinits_context_is_refused_naming_both(gpu, owner):
    """With ``pycuda.autoinit``'s context current, the first call on a tensor of PyTorch's (the
    primary context's memory) built its kernel into autoinit's context and launched it there on
    the tensor's memory: illegal addresses on a GPU, which poison the context.  The plan is refused
    before anything is built, naming both contexts; memory the driver names no context for
    (PyTorch's cudaMallocAsync) is taken to be the primary context's."""
    x = _x((2, 3, 10, 9))
    if owner == "primary":
        gpu.adopt(x.data_ptr(), x.numel() * x.element_size(), PRIMARY_CONTEXT)
    own = gpu.create_context(0)
    gpu.set_current(own)
    with pytest.raises(cuda_driver.ContextError, match=f"{PRIMARY_CONTEXT:#x}.*current CUDA context is {own:#x}"):
        torch_cuda.call(ops.adaptive_avg_pool2d, [x], (4, 7), NONE)
    assert not gpu.launches and not gpu.modules and not torch_cuda._PLANS and gpu.current() == own
    gpu.set_current(PRIMARY_CONTEXT)
    torch_cuda.call(ops.adaptive_avg_pool2d, [x], (4, 7), NONE)
    assert [launch["context"] for launch in gpu.launches] == [PRIMARY_CONTEXT]


def test_float_dtypes_reach_the_problem(gpu):
    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        torch_cuda.call(ops.adaptive_avg_pool2d, [_x((2, 3, 10, 9), dtype)], (4, 7), NONE)
    assert [found.problem.dtype for found in torch_cuda._PLANS.values()] == ["float64", "float16", "bfloat16"]
    for (module, _), define in zip(gpu.modules, (b"DTYPE_FLOAT64 1", b"DTYPE_FLOAT16 1", b"DTYPE_BFLOAT16 1")):
        assert define in module


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the benchmark measures instead of refusing")
def test_call_overhead_benchmark_refuses_without_a_gpu():
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parent.parent / "benchmarks" / "cuda_call_overhead.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "needs a CUDA GPU" in result.stderr, result.stderr


def test_forgetting_decisions_forgets_plans(gpu):
    """After tuning (which calls dispatch.forget), the next call must dispatch again."""
    x = _x((2, 3, 10, 9))
    torch_cuda.call(ops.adaptive_avg_pool2d, [x], (4, 7), NONE)
    assert torch_cuda._PLANS
    problem = next(iter(torch_cuda._PLANS.values())).problem
    dispatch.forget(problem, gpu.device)
    assert not torch_cuda._PLANS


def test_a_new_signature_during_graph_capture_is_refused(gpu, monkeypatch):
    """Capture forbids compiling and loading: a first call while the current stream captures must
    say to call the signature once before capture; a seen signature launches as usual."""
    import contextlib

    x = _x((2, 3, 10, 9))
    torch_cuda.call(ops.adaptive_avg_pool2d, [x], (4, 7), NONE)
    capturing = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda index: capturing.append(index) or contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    torch_cuda.call(ops.adaptive_avg_pool2d, [x], (4, 7), NONE)  # seen: no question asked
    assert not capturing and len(gpu.launches) == 2
    with pytest.raises(ValueError, match="call each signature once before capture"):
        torch_cuda.call(ops.adaptive_avg_pool2d, [x], (4, 6), NONE)
    assert capturing == [x.device.index] and len(gpu.launches) == 2 and len(gpu.modules) == 1


@pytest.fixture
def cuda_bench(gpu, monkeypatch):
    """``bench`` on the fake GPU: CPU tensors stand in for CUDA ones (``pool_tuner.torch`` sends
    them down its eager CUDA path, and its custom ops to ``torch_cuda``), a host clock for CUDA
    events, short loops."""
    from pool_tuner import bench
    from pool_tuner import torch as ptt

    def cuda_path(op, direction, tensors, size, options):
        return torch_cuda.run(torch_cuda.plan_op(op, direction, tensors, size, options), tensors)

    monkeypatch.setattr(gpu.device, "info", dataclasses.replace(gpu.device.info, torch_device="cpu"))
    monkeypatch.setattr(ptt, "_eager_cpu_pool", ptt._eager_cuda_pool)
    monkeypatch.setattr(ptt, "_run", cuda_path)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(bench, "time_loop_cuda_events", bench.time_loop)
    monkeypatch.setattr(bench, "LOOP_S", 0.001)
    return bench


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_the_cuda_benchmark_times_pool_tuner_torch_pytorch_and_the_kernels_alone(gpu, cuda_bench, direction):
    import numpy as np

    row = cuda_bench.measure("test", "adaptive_avg_pool2d", (2, 3, 10, 9), (4, 7), direction, gpu.device, 2,
                             np.random.default_rng(0))
    assert row.tuned_ms > 0 and row.default_ms > 0 and row.torch_ms > 0
    assert row.tuned_kernel_ms > 0 and row.default_kernel_ms > 0
    assert {launch["stream"] for launch in gpu.launches} == {STREAM}  # PyTorch's current stream
    assert "pool_tuner.torch" in cuda_bench.CUDA_METHOD["pool_tuner"]
    assert "CUDA events" in cuda_bench.CUDA_METHOD["timing"]


def test_the_kernel_alone_launches_on_buffers_allocated_once(gpu, cuda_bench, monkeypatch):
    problem = ops.Problem.create("adaptive_avg_pool2d", (2, 3, 10, 9), (4, 7))
    x = _x((2, 3, 10, 9))
    candidate = cuda_bench._cuda_kernel_candidate(problem, [x])
    monkeypatch.setattr(torch, "empty_strided", lambda *a, **k: pytest.fail("allocated per call"))
    for _ in range(3):
        candidate.call()
    arguments = [tuple(launch["arguments"]) for launch in gpu.launches]
    assert len(arguments) == 3 and len(set(arguments)) == 1 and arguments[0][0] == x.data_ptr()


# ------------------------------------------------------------------ pool_tuner.torch's eager CUDA path


@pytest.fixture
def eager_cuda(gpu, monkeypatch):
    """``pool_tuner.torch`` with CPU tensors standing in for CUDA ones: wherever its eager path
    would be taken, the CUDA one is (``_eager_cuda_pool``), and its custom ops run ``torch_cuda``;
    returns the list of ``(op, direction)`` that went through a custom op."""
    from pool_tuner import torch as ptt

    through_custom_ops = []

    def cuda_path(op, direction, tensors, size, options):
        through_custom_ops.append((op, direction))
        return torch_cuda.run(torch_cuda.plan_op(op, direction, tensors, size, options), tensors)

    monkeypatch.setattr(ptt, "_eager_cpu_pool", ptt._eager_cuda_pool)
    monkeypatch.setattr(ptt, "_run", cuda_path)
    return through_custom_ops


def _no_planning(monkeypatch):
    """Make everything a warm call must not do -- validate, dispatch, plan, decode options, apply
    the channels-last rule -- fail."""
    from pool_tuner import torch as ptt

    def forbidden(*args, **kwargs):
        raise AssertionError("a warm eager call planned again")

    for owner, name in ((dispatch, "choose"), (ops.Problem, "create"), (torch_cuda, "_make"),
                        (plans, "options_of"), (ptt, "_is_channels_last"), (ptt, "_check_input")):
        monkeypatch.setattr(owner, name, forbidden)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_an_eager_cuda_forward_is_one_lookup_and_one_launch_without_the_custom_op(gpu, eager_cuda, monkeypatch,
                                                                                  memory_format):
    from pool_tuner import torch as ptt

    module = ptt.AdaptiveMaxPool2d((4, 7), return_indices=True)
    x = _x((2, 3, 10, 9)).to(memory_format=memory_format)
    module(x)
    _no_planning(monkeypatch)
    for _ in range(3):
        values, indices = module(x)
        expected = torch.nn.functional.adaptive_max_pool2d(x, (4, 7)).stride()
        assert values.stride() == expected and indices.stride() == expected and indices.dtype == torch.int64
        assert gpu.launches[-1]["arguments"][:3] == [x.data_ptr(), values.data_ptr(), indices.data_ptr()]
    assert len(gpu.launches) == 4 and not eager_cuda


@pytest.mark.parametrize("kind", ["avg", "max"])
def test_an_eager_cuda_training_step_launches_forward_and_backward_without_the_custom_ops(gpu, eager_cuda,
                                                                                          monkeypatch, kind):
    from pool_tuner import torch as ptt

    module = ptt.AdaptiveAvgPool2d((4, 7)) if kind == "avg" else ptt.AdaptiveMaxPool2d((4, 7))

    def step():
        x = _x((2, 3, 10, 9)).requires_grad_()
        out = module(x)
        grad = _x(tuple(out.shape))
        out.backward(grad)
        return x, out, grad

    step()
    _no_planning(monkeypatch)
    launched = len(gpu.launches)
    x, out, grad = step()
    forward, backward = gpu.launches[launched:]
    assert forward["arguments"][:2] == [x.data_ptr(), out.data_ptr()]
    assert backward["arguments"][0] == grad.data_ptr() and x.grad.data_ptr() in backward["arguments"]
    if kind == "max":
        assert backward["arguments"][1] == forward["arguments"][2], "the backward reads the forward's indices"
    assert not eager_cuda and x.grad.shape == x.shape


@pytest.mark.parametrize("kind", ["avg", "max"])
def test_an_eager_cuda_backward_gives_the_gradient_the_input_s_memory_format(gpu, eager_cuda, kind):
    """As PyTorch's: a channels-last input's gradient is channels-last when ``grad_out`` is
    contiguous (the backward reads a channels-last copy of it), and a warm step with ``grad_out``
    in the result's layout reads it in place."""
    from pool_tuner import torch as ptt

    module = ptt.AdaptiveAvgPool2d((4, 7)) if kind == "avg" else ptt.AdaptiveMaxPool2d((4, 7))
    for grad_layout in (torch.contiguous_format, torch.channels_last):
        x = _x((2, 3, 10, 9)).to(memory_format=torch.channels_last).requires_grad_()
        out = module(x)
        grad = _x(tuple(out.shape)).to(memory_format=grad_layout)
        out.backward(grad)
        assert x.grad.is_contiguous(memory_format=torch.channels_last)
        read_in_place = gpu.launches[-1]["arguments"][0] == grad.data_ptr()
        assert read_in_place == (grad_layout == torch.channels_last)
    assert not eager_cuda


@pytest.mark.parametrize("kind", ["avg", "max"])
@pytest.mark.parametrize("ndim,shape,size", [(3, (2, 3, 5, 6, 7), (3, 4, 2)), (2, (3, 10, 9), (4, 7)),
                                             (2, (2, 3, 10, 9), 1), (1, (2, 3, 10), 4)])
def test_an_eager_cuda_call_gives_pytorchs_layouts(gpu, eager_cuda, monkeypatch, kind, ndim, shape, size):
    """A channel-innermost input is read in place; the results and the gradient have PyTorch's
    strides -- contiguous of a channels_last_3d or batch-less input, channels-last of a batched 1d
    or 2d one, also for a max pooling's gradient of a 1x1 result -- and a warm call reads no
    strides to lay them out."""
    from pool_tuner import torch as ptt

    c = len(shape) - ndim - 1
    memory = shape[:c] + shape[c + 1:] + (shape[c],)
    fn = getattr(ptt, f"adaptive_{kind}_pool{ndim}d")
    reference = getattr(torch.nn.functional, f"adaptive_{kind}_pool{ndim}d")
    extra = {"return_indices": True} if kind == "max" else {}
    for warm in (False, True):
        if warm:
            _no_planning(monkeypatch)
        x = _x(memory).movedim(-1, c)
        results = fn(x, size, **extra)
        assert gpu.launches[-1]["arguments"][0] == x.data_ptr()
        for got, expected in zip(*((results, reference(x, size, **extra)) if kind == "max"
                                   else ((results,), (reference(x, size),)))):
            assert got.stride() == expected.stride()
        x.requires_grad_()
        out, expected = fn(x, size), reference(x, size)
        grad = _x(tuple(out.shape))
        assert torch.autograd.grad(out, x, grad)[0].stride() == torch.autograd.grad(expected, x, grad)[0].stride()
    assert not eager_cuda


def _forbid_synchronisation(monkeypatch):
    """Make every way a call could wait for the GPU on the host fail: PyTorch's synchronisations
    and reads of a tensor's values into Python (the driver's own are in the fake driver's
    ``calls``, which a warm call must leave empty)."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a warm call waited for the device on the host")

    for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"),
                        (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "query"),
                        (torch.Tensor, "item"), (torch.Tensor, "tolist"), (torch.Tensor, "cpu"),
                        (torch.Tensor, "numpy"), (torch.Tensor, "__bool__"), (torch.Tensor, "__float__"),
                        (torch.Tensor, "__int__")):
        monkeypatch.setattr(owner, name, forbidden)


class _SqueezeExcitation(torch.nn.Module):
    """torchvision's squeeze-and-excitation block (MobileNetV3, EfficientNet): a global average
    pooling whose gradient comes back through two 1x1 convolutions and a broadcast product."""

    def __init__(self, channels: int):
        from pool_tuner import torch as ptt

        super().__init__()
        self.avgpool = ptt.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2 = torch.nn.Conv2d(channels, 4, 1), torch.nn.Conv2d(4, channels, 1)

    def forward(self, x):
        scale = torch.nn.functional.hardsigmoid(self.fc2(torch.relu(self.fc1(self.avgpool(x)))))
        return scale * x


def test_a_warm_training_step_of_squeeze_excitation_blocks_is_two_launches_per_layer_and_no_wait(gpu, eager_cuda,
                                                                                                 monkeypatch):
    """A model's training step on the CUDA path, as ``benchmarks/models.py --device cuda`` times
    it (zero_grad, forward, loss, backward, SGD step): once warm, each pooling layer is its
    forward and its backward launch, each after one plan lookup, with no plan made, no custom op,
    no driver call besides the launches and nothing that waits for the device on the host."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), _SqueezeExcitation(8),
                                torch.nn.Conv2d(8, 12, 3, stride=2), _SqueezeExcitation(12),
                                torch.nn.Conv2d(12, 16, 1), _SqueezeExcitation(16))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    images, target = _x((4, 3, 12, 12)), _x((4, 16, 5, 5))

    def step():
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(images), target).backward()
        optimizer.step()

    step()
    pooled = {launch["function"] for launch in gpu.launches}
    assert len(pooled) == 4, ("three layers at two resolutions: a forward and a backward kernel per resolution "
                              "(channels-first layers that differ only in their channels share a program)")
    _no_planning(monkeypatch)
    _forbid_synchronisation(monkeypatch)
    lookups = []
    lookup = torch_cuda.plan_of
    monkeypatch.setattr(torch_cuda, "plan_of", lambda key: lookups.append(key) or lookup(key))
    monkeypatch.setattr(torch_cuda, "plan_op", lambda *a, **k: pytest.fail("a warm call looked its plan up twice"))
    launched, called = len(gpu.launches), len(gpu.calls)
    for _ in range(3):
        step()
    warm = gpu.launches[launched:]
    assert len(warm) == 3 * 3 * 2 and {launch["function"] for launch in warm} == pooled
    assert len(lookups) == 3 * 3 * 2, "a warm forward, and a warm backward, is one lookup"
    assert gpu.calls[called:] == [], "a warm step made driver calls besides its launches"
    assert {launch["stream"] for launch in warm} == {STREAM} and not eager_cuda


def test_an_eager_cuda_double_backward_goes_through_the_custom_ops(gpu, eager_cuda):
    """Differentiating the gradient needs the backward's own autograd: the custom backward op's."""
    from pool_tuner import torch as ptt

    x = _x((2, 3, 10, 9)).requires_grad_()
    out = ptt.adaptive_avg_pool2d(x, (4, 7))
    grad_out = _x(tuple(out.shape)).requires_grad_()
    (grad_x,) = torch.autograd.grad(out, x, grad_out, create_graph=True)
    assert eager_cuda == [("adaptive_avg_pool2d", "backward")]
    grad_x.backward(_x(tuple(x.shape)))
    assert eager_cuda[-1] == ("adaptive_avg_pool2d", "forward"), "avg unpooling's adjoint is the forward"
    assert len(gpu.launches) == 3 and grad_out.grad.shape == out.shape


def _call_overhead_script(monkeypatch):
    """benchmarks/cuda_call_overhead.py loaded as a module, set to run on the fake GPU: CPU tensors,
    a host clock for its CUDA events (each run of calls 1 us per call), no synchronisation."""
    import importlib.util
    import pathlib

    from pool_tuner import torch as ptt

    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "cuda_call_overhead.py"
    spec = importlib.util.spec_from_file_location("cuda_call_overhead", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "DEVICE", "cpu")
    monkeypatch.setattr(script, "_require_gpu", lambda: (torch, ptt))
    monkeypatch.setattr(script, "_time_run", lambda torch, fn, calls: [fn() for _ in range(calls)] and (1.0, 1.0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    return script


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_the_call_overhead_benchmark_times_pytorch_pool_tuner_and_the_bare_launch(gpu, eager_cuda, monkeypatch,
                                                                                  direction):
    """benchmarks/cuda_call_overhead.py's cases on the fake GPU (CPU tensors, a host clock): every
    side runs, pool_tuner's and the bare one launching the same kernels."""
    script = _call_overhead_script(monkeypatch)
    from pool_tuner import torch as ptt

    sides, plan = script.sides_of(torch, ptt, "adaptive_max_pool2d", (2, 3, 10, 9), (4, 7), torch.float32, direction)
    assert plan.choice.variant.name
    timings = script._time_rounds(torch, sides, 1, 3)
    assert timings == {side: (1.0, 1.0) for side in ("pytorch", "pool_tuner", "bare")}
    kernels = 1 if direction == "forward" else 2
    assert len(gpu.launches) == 2 * (10 + 3) * kernels
    assert len({launch["function"] for launch in gpu.launches}) == kernels
    assert not eager_cuda


def test_the_call_overhead_benchmark_runs_from_its_command_line_to_its_report(gpu, eager_cuda, monkeypatch, tmp_path,
                                                                              capsys):
    """The whole script, as the GPU session runs it (its main, both directions, the report and the
    JSON), on the fake GPU: a field it reads from a plan that no longer exists, or a report line
    that fails, fails here rather than in a GPU lease."""
    import json

    script = _call_overhead_script(monkeypatch)
    out = tmp_path / "call_overhead.json"
    script.main(["--preset", "spp_net", "--no-tiny", "--direction", "forward,backward", "--calls", "2",
                 "--repeat", "2", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [(row["direction"], tuple(row["output_size"])) for row in rows] == [
        (direction, (size, size)) for direction in ("forward", "backward") for size in (4, 2, 1)]
    for row in rows:
        assert row["variant"] and row["source"]
        assert all(row[f"{side}_{what}_us"] == 1.0 for side in ("pytorch", "pool_tuner", "bare")
                   for what in ("device", "host"))
    report = capsys.readouterr().out
    assert "forward: geomean pool_tuner/pytorch host time per call: 1.00" in report
    assert "backward: geomean pool_tuner/pytorch host time per call: 1.00" in report
    assert not eager_cuda


def test_the_call_overhead_benchmark_times_a_models_pooling_layers_forward_and_backward(gpu, eager_cuda, monkeypatch,
                                                                                       tmp_path):
    """``--shapes``: a model's own layers (a named set, as ``models.py --device cuda`` runs them),
    each a forward and a forward+backward through pool_tuner.torch, the bare launches and PyTorch."""
    import json

    script = _call_overhead_script(monkeypatch)
    assert len(script.parse_shapes("mobilenet_v3_large_b32")) == 9
    out = tmp_path / "call_overhead.json"
    script.main(["--shapes", "4x6x7x7:1,3x5x9:2,2x3x4x5x6:2x1x3", "--direction", "forward,backward", "--calls", "2",
                 "--repeat", "1", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [(row["direction"], row["op"], tuple(row["output_size"])) for row in rows] == [
        (direction, op, size) for direction in ("forward", "backward")
        for op, size in (("adaptive_avg_pool2d", (1, 1)), ("adaptive_avg_pool1d", (2,)),
                         ("adaptive_avg_pool3d", (2, 1, 3)))]
    with pytest.raises(ValueError, match="--shapes takes"):
        script.parse_shapes("4x6:1")


def test_the_host_cost_benchmark_times_every_side_through_the_stub_libcuda(tmp_path):
    """benchmarks/cuda_host_cost.py in a process of its own (it swaps the driver for the C stub
    for the whole process): every side timed, one JSON line."""
    import json
    import os
    import pathlib
    import shutil
    import subprocess
    import sys

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on PATH to build the stub libcuda")
    root = pathlib.Path(__file__).parent.parent
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "cuda_host_cost.py"), "--calls", "3",
                           "--rounds", "2"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr
    times = json.loads(done.stdout.splitlines()[-1])["us_per_call"]
    assert set(times) == {"pool_tuner forward", "torch.nn forward", "bare forward", "pool_tuner training",
                          "torch.nn training"}
    assert all(t > 0 for t in times.values())


# ---------------------------------------------------------------- GeM on CUDA tensors


@pytest.fixture
def gem_cuda(gpu, monkeypatch):
    """pool_tuner.torch's GeM sends the CPU tensors that stand in for CUDA ones down its CUDA path."""
    from pool_tuner import torch as ptt

    monkeypatch.setitem(ptt._GEM_PATHS, "cpu", ptt._GEM_PATHS["cuda"])
    return ptt


def _float32(value):
    return float(torch.tensor(value, dtype=torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gem_forward_on_cuda_passes_p_and_eps_as_the_kernels_scalars_in_one_argument_array(gpu, gem_cuda, dtype):
    """p and eps reach the kernel as launch arguments of the kernel's declared types (the fake reads
    them at those types), a new p every call rewriting only their slots."""
    x = _x((2, 3, 10, 9), dtype)
    ps = [2.5, 3.7, 1.25]
    outs = [gem_cuda.adaptive_gem_pool2d(x, (4, 7), torch.tensor([p], dtype=dtype), eps=1e-3) for p in ps]
    outs.append(gem_cuda.adaptive_gem_pool2d(x, (4, 7)))  # the defaults again
    as_acc = (lambda v: v) if dtype == torch.float64 else _float32
    assert [launch["arguments"] for launch in gpu.launches] == [
        [x.data_ptr(), out.data_ptr(), 2 * 3, as_acc(p), as_acc(eps)]
        for out, p, eps in zip(outs, ps + [3.0], [1e-3] * 3 + [1e-6])]
    assert len({launch["params_address"] for launch in gpu.launches}) == 1, "one argument array for every call"
    assert [launch["stream"] for launch in gpu.launches] == [STREAM] * 4 and len(gpu.modules) == 1
    assert all(out.shape == (2, 3, 4, 7) and out.dtype == dtype for out in outs)


@pytest.mark.parametrize("size", [(4, 7), 1])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_a_gem_training_step_on_cuda_launches_on_the_current_stream(gpu, gem_cuda, size, memory_format):
    """Two launches: the forward, and the input-gradient kernel (it gathers the outputs'
    coefficients itself, so no gather runs before it), with the gradients of x and p shaped like
    them."""
    module = gem_cuda.AdaptiveGeMPool2d(size, p=2.5, eps=1e-3)
    x = _x((2, 3, 10, 9)).to(memory_format=memory_format).requires_grad_()
    out = module(x)
    grad = _x(tuple(out.shape))
    out.backward(grad)
    forward, gradient = gpu.launches
    assert forward["arguments"][0] == x.data_ptr()
    x_address, coefficients, grad_address, terms, planes, p, eps, first_input = gradient["arguments"]
    assert (x_address, grad_address, planes, p, eps, first_input) == (x.data_ptr(), x.grad.data_ptr(), 6, 2.5,
                                                                      _float32(1e-3), 0)
    assert coefficients not in (x_address, grad_address, terms)
    assert {launch["stream"] for launch in gpu.launches} == {STREAM}
    assert x.grad.shape == x.shape and x.grad.stride() == x.stride() and module.p.grad.shape == (1,)


def test_a_gem_backward_on_cuda_prepares_its_input_gradient_launch_once(gpu, gem_cuda):
    module = gem_cuda.AdaptiveGeMPool2d((4, 7))
    for p in (2.5, 3.5):
        with torch.no_grad():
            module.p.fill_(p)
        x = _x((2, 3, 10, 9)).requires_grad_()
        module(x).backward(_x((2, 3, 4, 7)))
    gradients = gpu.launches[1], gpu.launches[3]
    assert [g["arguments"][5] for g in gradients] == [2.5, 3.5]
    assert gradients[0]["params_address"] == gradients[1]["params_address"]


def test_gem_on_cuda_under_another_current_context_is_refused_naming_both(gpu, gem_cuda):
    x = _x((2, 3, 10, 9)).requires_grad_()
    gem_cuda.adaptive_gem_pool2d(x, 1).sum().backward()
    launched = len(gpu.launches)
    own = gpu.create_context(0)
    gpu.set_current(own)
    with pytest.raises(ValueError, match=f"current CUDA context \\({own:#x}, device 0\\).*{PRIMARY_CONTEXT:#x}"):
        gem_cuda.adaptive_gem_pool2d(x.detach(), 1)
    gpu.set_current(PRIMARY_CONTEXT)
    out = gem_cuda.adaptive_gem_pool2d(x, 1)
    gpu.set_current(own)
    with pytest.raises(ValueError, match="current CUDA context"):
        out.sum().backward()
    assert len(gpu.launches) == launched + 1, "only the forward under the primary context launched"


def test_the_fake_driver_refuses_a_launch_without_the_kernels_declared_arguments(gpu):
    """GeM's forward kernel declares p and eps after the plane count: a launch that leaves them
    out fails, as the real driver reading unset arguments would not be trusted to."""
    found = torch_cuda.plan_op("adaptive_gem_pool2d", "forward", [_x((2, 3, 10, 9))], (4, 7), "")
    short = dataclasses.replace(found.launch, scalars=found.launch.scalars[:1])
    prepared = found.device.prepare(short, found.nbytes, 1)
    with pytest.raises(cuda_driver.DriverError, match="CUDA_ERROR"):
        prepared(STREAM, *(t.data_ptr() for t in (_x((2, 3, 10, 9)), _x((2, 3, 4, 7)))))


#: PyTorch ops that launch nothing on a GPU: views, metadata and allocation
_NO_LAUNCH = {"aten::detach", "aten::reshape", "aten::view", "aten::empty", "aten::empty_strided", "aten::movedim",
              "aten::permute", "aten::as_strided", "aten::result_type", "aten::alias", "aten::lift_fresh",
              "aten::item", "aten::_local_scalar_dense"}


def _gem_backward_on_the_device(step):
    """What GeM's backward does on the device in a profiled ``step``: the PyTorch ops called
    directly by it that launch a kernel (a dtype or layout change only where it copies),
    its host reads of device values, and the peak of its allocations beyond what it returns
    (bytes, in time order of the allocator's events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        step()
    events = profile.events()
    # the backward custom op, or in eager mode the backward of pool_tuner.torch's autograd.Function
    (backward,) = [e for e in events if e.name.startswith("pool_tuner::adaptive_gem_pool") and
                   e.name.endswith("_backward") or e.name == "_EagerGeMBackward"]

    def copies(event):
        return any(c.name == "aten::copy_" or copies(c) for c in event.cpu_children)

    children = [c.name for c in backward.cpu_children]
    launches = [name for name, c in zip(children, backward.cpu_children) if name not in _NO_LAUNCH and (
        name not in ("aten::to", "aten::contiguous", "aten::clone") or copies(c))]
    reads = children.count("aten::item")
    start, end = backward.time_range.start, backward.time_range.end
    # PyTorch's ops with what each allocates, and the frees between them ("[memory]"), not the
    # custom op's own total of those
    changes = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in events
                     if e.self_cpu_memory_usage and start <= e.time_range.start <= end
                     and (e.name == "[memory]" or e.name.startswith("aten::")))
    running = peak = 0
    for _, change in changes:
        running += change
        peak = max(peak, running)
    return launches, reads, peak


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_warm_gem_backward_on_cuda_is_its_kernel_few_output_sized_ops_and_no_large_temporary(
        gpu, gem_cuda, monkeypatch, dtype, size):
    """After the first step of a signature, a GeM backward on CUDA tensors is the input-gradient
    launch, a few output-sized PyTorch ops (the outputs' coefficients and the p-gradient
    reduction): no problem validated again, no host arithmetic on the windows (nor its copy to the
    device, which waits as a synchronisation does), no float64 copies of the outputs.  Its temporaries stay
    within two output-sized arrays in the accumulation dtype (there were six to seven, float64
    copies of the outputs among them: 2.5 times a regional GeM's float16 input on an H100)."""
    module = gem_cuda.AdaptiveGeMPool2d(size, p=2.5, eps=1e-3)
    x = _x((4, 64, 7, 7)).to(dtype).requires_grad_()
    grad = _x((4, 64, size, size)).to(dtype)

    def step():
        x.grad = module.p.grad = None
        module(x).backward(grad)

    step()
    terms = gem.input_gradient_groups(ops.Problem.create(
        "adaptive_gem_pool2d", tuple(x.shape), size, str(dtype).removeprefix("torch."), direction="backward"))
    monkeypatch.setattr(gem, "window_areas", lambda problem: pytest.fail("a warm backward computed window areas"))
    monkeypatch.setattr(ops.Problem, "create", lambda *args, **kwargs: pytest.fail("a warm step validated a problem"))
    launched = len(gpu.launches)
    launches, reads, peak = _gem_backward_on_the_device(step)
    assert len(gpu.launches) - launched == 2, "the forward and the input-gradient kernel"
    assert reads <= 1, "p is read once"
    # the coefficients (a float16 output widened, pow, two products, a division), the output
    # terms (xlogy, a product, a sum), the input terms' sum and the difference
    assert len(launches) <= 10, launches
    returned = x.numel() * x.element_size()
    # the CPU tensors standing in widen a float16 operand of a float32 op into a temporary, which
    # CUDA's kernels do in registers
    widened = grad.numel() * 4 if dtype == torch.float16 else 0
    assert peak - returned <= 2 * grad.numel() * 4 + widened + terms * 4 + 1024


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_a_gem_training_step_on_cuda_reads_p_once(gpu, gem_cuda, memory_format):
    """A CUDA p read on the host waits for the device: the forward reads it, and the backward runs
    with the forward's value (p is saved for it, so it cannot change in between)."""
    module = gem_cuda.AdaptiveGeMPool2d(3, p=2.5, eps=1e-3)
    x = _x((2, 3, 10, 9)).to(memory_format=memory_format).requires_grad_()
    grad = _x((2, 3, 3, 3))
    module(x).backward(grad)
    x.grad = module.p.grad = None
    launched = len(gpu.launches)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        module(x).backward(grad)
    reads = [e for e in profile.events() if e.name == "aten::_local_scalar_dense"]
    assert len(reads) == 1
    forward, gradient = gpu.launches[launched:]
    assert gradient["arguments"][5] == 2.5 and gradient["arguments"][2] == x.grad.data_ptr()
    assert x.grad.stride() == x.stride() and module.p.grad.shape == (1,)


def test_plain_eager_gem_calls_skip_the_custom_ops(gpu, gem_cuda, monkeypatch):
    """Forward alone and a training step run GeM's passes directly: one launch each, no custom op's
    dispatch layers (which torch.compile, export and torch.func still take)."""
    x = _x((2, 3, 10, 9))
    module = gem_cuda.AdaptiveGeMPool2d((4, 7))
    module(x)  # warm: the plan is made

    def custom_op(*args):
        raise AssertionError("a plain eager call went through a GeM custom op")

    monkeypatch.setattr(gem_cuda, "_GEM_OPS", {ndim: (custom_op, custom_op) for ndim in (1, 2, 3)})
    launched = len(gpu.launches)
    with torch.no_grad():
        module(x)
    module(x.requires_grad_()).sum().backward()
    assert len(gpu.launches) - launched == 3 and x.grad.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_gem_backward_on_cuda_sends_the_numpy_paths_coefficients_and_output_part(gpu, gem_cuda, monkeypatch, dtype,
                                                                                 memory_format):
    """The CUDA backward's output-sized steps (PyTorch's ops on the device) give the kernel the
    coefficients of the numpy path in the problem's memory order (within a few ulps: PyTorch's
    ``pow`` is not numpy's), and ``dL/dp`` its output part (the fake kernel's terms set to zero
    here)."""
    import ctypes

    import numpy as np

    sent = {}

    def kernel(device, problem, arguments, stream, x_address, coefficients_address, grad_address, terms_address):
        acc = gem.accumulation_dtype(problem)
        count = math.prod(problem.output_shape)
        sent["coefficients"] = np.frombuffer(ctypes.string_at(coefficients_address, count * np.dtype(acc).itemsize),
                                             acc).copy()
        sent["problem"] = problem
        ctypes.memset(terms_address, 0, gem.input_gradient_groups(problem) * np.dtype(acc).itemsize)

    monkeypatch.setattr(gem, "input_gradient_on_device", kernel)
    p = torch.tensor([2.5], dtype=torch.float64 if dtype == torch.float64 else torch.float32, requires_grad=True)
    x = _x((2, 3, 10, 9), dtype).to(memory_format=memory_format).requires_grad_()
    y = torch.rand((2, 3, 4, 3), dtype=dtype) + 0.5  # stands in for the output (the fake forward writes none)
    g = torch.randn((2, 3, 4, 3), dtype=dtype)
    with torch.no_grad():
        y = y.to(memory_format=memory_format)
        grad_x, grad_p = gem_cuda._gem_backward(2, g, x.detach(), y, p, {"p": 2.5, "eps": 1e-3}, "")
    want = gem.coefficients(g.numpy(), y.numpy(), 2.5, sent["problem"])
    np.testing.assert_allclose(sent["coefficients"], want.ravel(), rtol=1e-13 if dtype == torch.float64 else 1e-6)
    assert float(grad_p) == pytest.approx(gem.output_term(g.numpy(), y.numpy(), 2.5), rel=1e-5)
    assert grad_p.shape == p.shape and grad_p.dtype == p.dtype and grad_x.stride() == x.stride()
