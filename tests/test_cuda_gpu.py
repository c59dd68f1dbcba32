"""What only a CUDA GPU can show of the CUDA path (issue 28): tuning on the CUDA tuning thread,
autotuning from autograd's thread, tensors of more than 2^31 elements, CUDA graph capture, stream
ordering (PyTorch's current stream; the stream a CUDA array's interface names), a foreign context
on a worker thread, leaks measured in a process of their own, and compute-sanitizer over the
variant matrix.  Everything here skips, with the reason, without a GPU;
the logic behind each is tested without one in test_torch_cuda.py, test_cuda_driver.py,
test_cuda_compile.py, test_cuda_backend.py and test_cuda_tuning_replay.py.

On a GPU machine run these first, so that one fault fails no other case (cases marked
``own_process`` each in a process of their own; docs/gpu.md):

    python benchmarks/isolated_tests.py tests/test_cuda_gpu.py tests/test_cuda.py --out /tmp/gpu_tests
"""

import ctypes
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from pool_tuner import cache, compile_check, dispatch, tuner
from pool_tuner.backends import cuda, cuda_driver, cuda_tuning
from pool_tuner.problem import OPS, Problem
from pool_tuner.variants import REGISTRY

torch = pytest.importorskip("torch")

DEVICES = cuda.list_devices()
_WHY = ("" if DEVICES else f"no CUDA device for pool_tuner ({cuda.import_error() or 'none listed'})") or \
       ("" if torch.cuda.is_available() else "this PyTorch has no CUDA (torch.cuda.is_available() is False)")
pytestmark = pytest.mark.skipif(bool(_WHY), reason=f"needs a CUDA GPU: {_WHY}")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def device():
    return DEVICES[0]


@pytest.fixture
def ptt():
    import pool_tuner.torch as ptt

    return ptt


def _current_context() -> int | None:
    context = ctypes.c_void_p()
    cuda_driver.check(cuda_driver.library().cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
    return context.value


# ---------------------------------------------------------------------- tuning (Build item 1)

SMALL_SEARCH = dict(strategy="random_sample", max_fevals=3, time_limit=60.0)


@pytest.mark.own_process
@pytest.mark.parametrize("op,direction", [("adaptive_avg_pool2d", "forward"), ("adaptive_avg_pool2d", "backward"),
                                          ("adaptive_max_pool2d", "forward"), ("adaptive_max_pool2d", "backward")])
def test_tuning_forward_and_backward_on_cuda_0(user_cache, device, op, direction):
    result = tuner.tune(op, (2, 8, 10, 9), (4, 7), device=device, direction=direction, **SMALL_SEARCH)
    errors = [f["error"] for v in result.variants for f in v.failures]
    assert result.stored and result.best_time_ms > 0, errors
    assert not [e for e in errors if "context" in e.lower()], errors


@pytest.mark.own_process
def test_tuning_from_two_threads(user_cache, device):
    results, errors = [], []

    def tune(size):
        try:
            results.append(tuner.tune("adaptive_avg_pool2d", (2, 8, 10, 9), size, device=device, **SMALL_SEARCH))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=tune, args=(size,)) for size in ((4, 7), (3, 5))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors, errors
    assert len(results) == 2 and all(r.stored for r in results)


@pytest.mark.own_process
def test_autotune_through_a_training_step(user_cache, device, ptt, monkeypatch):
    """POOL_TUNER_AUTOTUNE=1: the forward tunes on the main thread, the backward on autograd's
    thread; both end on the CUDA tuning thread, both records are stored, and the next step tunes
    nothing."""
    monkeypatch.setenv(tuner.AUTOTUNE_ENV, "1")
    monkeypatch.setattr(tuner, "DEFAULT_MAX_FEVALS", 3)
    monkeypatch.setattr(tuner, "BRUTE_FORCE_LIMIT", 3)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), ptt.AdaptiveAvgPool2d((3, 5)),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 3 * 5, 2)).cuda()
    x = torch.randn(2, 4, 11, 13, device="cuda")
    model(x).sum().backward()
    for direction in ("forward", "backward"):
        problem = Problem.create("adaptive_avg_pool2d", (2, 4, 11, 13), (3, 5), direction=direction)
        assert dispatch.tuning_cache().lookup(cache.cache_key(problem, device)) is not None, direction
    tuned = []
    monkeypatch.setattr(tuner, "autotune", lambda problem, device: tuned.append(problem))
    model(x).sum().backward()
    assert not tuned
    assert cuda_tuning.tuning_thread().is_alive()


@pytest.mark.own_process
def test_a_process_that_tuned_on_cuda_exits_cleanly(tmp_path):
    """Kernel Tuner's PyCUDA backend registers, the first time it sets up a device, an exit hook
    that pops the context it pushed -- on the main thread at exit, while it was pushed on the CUDA
    tuning thread.  The process must still exit without an error or a traceback, and without
    PyCUDA objects of Kernel Tuner's left to be freed off that thread (backends/cuda_tuning.py)."""
    code = ("import pool_tuner.tuner as t; t.tune('adaptive_avg_pool2d', (2, 8, 10, 9), (4, 7), "
            f"device={DEVICES[0].info.id!r}, strategy='random_sample', max_fevals=2, store=False)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=dict(os.environ, POOL_TUNER_CACHE_DIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
    assert "out-of-thread context could not be cleaned up" not in proc.stderr, proc.stderr[-3000:]


# ---------------------------------------------------------------------- more than 2^31 elements
#
# Checked against the float64 reference on pieces of planes -- the first, those around element
# 2^31 (where a 32-bit offset wraps) and the last -- never against PyTorch's kernels: PyTorch's own
# adaptive_avg_pool1d backward faults on HUGE[1] (test_pool_tuner_computes_where_pytorch_faults),
# and a fault leaves the process's CUDA context unusable.  Every element of every result is checked
# to be written (outputs are poisoned with NaN, conftest.py).  Each case runs in a process of its
# own (own_process; benchmarks/isolated_tests.py) because a kernel that faults here would fail
# every later test in its process.

#: Per rank, a float16 input of a little over 2^31 elements, and an output size.
HUGE = {1: ((1, 2**16 + 1, 2**15), (5,)), 2: ((2, 64, 4096, 4097), (3, 5)), 3: ((1, 128, 64, 512, 513), (2, 3, 5))}
#: Elements of a piece of planes checked against the float64 reference (at least one plane).
PIECE_ELEMENTS = 2**22


def _checked_planes(shape) -> list:
    """Slices of the planes of a HUGE input that are checked: the first, the ones holding element
    2^31, the last -- each piece about ``PIECE_ELEMENTS`` elements."""
    planes, plane = shape[0] * shape[1], math.prod(shape[2:])
    count = max(1, PIECE_ELEMENTS // plane)
    starts = sorted({0, min(planes - count, max(0, 2**31 // plane - count // 2)), planes - count})
    return [slice(start, start + count) for start in starts]


def _piece(t, spatial, part) -> np.ndarray:
    """Planes ``part`` of ``t`` (a tensor of planes of ``spatial`` sizes, in any leading shape or
    flat) on the host, float64 (indices int64), shaped ``(1, planes, *spatial)``."""
    host = t.detach().reshape(-1, *spatial)[part].cpu().numpy()
    return (host if host.dtype == np.int64 else host.astype(np.float64)).reshape(1, -1, *spatial)


def _assert_all_written(t):
    assert not torch.isnan(t).any(), "elements left unwritten (still the NaN poison)"


def _variant_params():
    if _WHY:  # one skipped case, with the reason, instead of one per variant
        return [pytest.param(None, None, None, id="no-cuda-gpu")]
    cases = []
    for (op, direction), table in REGISTRY.items():
        if OPS[op].multi_level:  # test_multi_level_more_than_2_31_elements_in_float16
            continue
        shape, size = HUGE[OPS[op][1]]
        problem = Problem.create(op, shape, size, "float16", direction=direction)
        for name, variant in table.items():
            if variant.representative_configurations(problem, compile_check.CUDA_LIMITS):
                cases.append(pytest.param(op, direction, name, id=f"{op}-{direction}-{name}"))
    return cases


@pytest.mark.own_process
@pytest.mark.parametrize("op,direction,variant", _variant_params())
def test_more_than_2_31_elements_in_float16(device, ptt, op, direction, variant):
    """Every variant (its default configuration) that takes the problem, both directions, against
    the float64 reference on pieces (the max backward with the indices of pool_tuner's forward)."""
    from pool_tuner import reference

    kind, ndim = OPS[op]
    shape, size = HUGE[ndim]
    spatial, out_spatial = shape[2:], tuple(size)
    torch.manual_seed(0)
    x = torch.rand(shape, device="cuda", dtype=torch.float16)
    ours = getattr(ptt, op)
    if direction == "forward":
        values, indices = ours(x, size, return_indices=True, variant=variant) if kind == "max" else \
            (ours(x, size, variant=variant), None)
        _assert_all_written(values)
        for part in _checked_planes(shape):
            x64 = _piece(x, spatial, part)
            if kind == "avg":
                np.testing.assert_allclose(_piece(values, out_spatial, part), reference.forward(op, x64, size),
                                           rtol=2e-3, atol=2e-3, err_msg=f"planes {part}")
            else:
                got, got_indices = _piece(values, out_spatial, part), _piece(indices, out_spatial, part)
                np.testing.assert_array_equal(got, reference.forward(op, x64, size)[0], err_msg=f"planes {part}")
                gathered = np.take_along_axis(x64.reshape(*x64.shape[:2], -1), got_indices.reshape(*x64.shape[:2], -1),
                                              -1)
                np.testing.assert_array_equal(gathered.reshape(got.shape), got)  # ties may pick another position
        return
    out_shape = shape[:2] + out_spatial
    grad = torch.rand(out_shape, device="cuda", dtype=torch.float16)
    options = ptt._encode_options(variant=variant)
    if kind == "avg":
        got, indices = getattr(torch.ops.pool_tuner, f"{op}_backward")(grad, list(shape), options), None
    else:
        _, indices = ours(x, size, return_indices=True)
        got = getattr(torch.ops.pool_tuner, f"{op}_backward")(grad, indices, list(shape), options)
    _assert_all_written(got)
    del x
    for part in _checked_planes(shape):
        piece_indices = None if indices is None else _piece(indices, out_spatial, part)
        expected = reference.backward(op, _piece(grad, out_spatial, part), (1, part.stop - part.start) + spatial,
                                      piece_indices)
        np.testing.assert_allclose(_piece(got, spatial, part), expected, rtol=2e-3, atol=2e-3,
                                   err_msg=f"planes {part}")


@pytest.mark.own_process
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("op", ["adaptive_avg_pool2d", "adaptive_max_pool2d"])
def test_global_blocks_over_more_than_2_31_elements(device, ptt, op, layout):
    """global_blocks (the global-pooling variant shaped for GPUs, the GPU rules' choice) on HUGE[2]
    pooled to 1x1: 128 planes of about 2^24 elements, 64-bit offsets, against the float64 reference on
    pieces; maxima and their first positions exactly."""
    from pool_tuner import reference

    shape = HUGE[2][0]
    assert Problem.create(op, shape, 1).index_64
    torch.manual_seed(0)
    x = torch.rand(shape, device="cuda", dtype=torch.float16)
    if layout == "NHWC":
        x = x.contiguous(memory_format=torch.channels_last)
    ours = getattr(ptt, op)
    values, indices = ours(x, 1, return_indices=True, variant="global_blocks") if "max" in op else \
        (ours(x, 1, variant="global_blocks"), None)
    _assert_all_written(values)
    values = values.reshape(-1).double().cpu().numpy()
    indices = None if indices is None else indices.reshape(-1).cpu().numpy()
    for plane in sorted({p for part in _checked_planes(shape) for p in range(part.start, part.stop)}):
        x64 = x[plane // shape[1], plane % shape[1]].double().cpu().numpy()[None, None]
        expected = reference.forward(op, x64, 1)
        if indices is None:
            np.testing.assert_allclose(values[plane], expected.item(), rtol=2e-3, atol=2e-3, err_msg=f"plane {plane}")
        else:
            assert (values[plane], indices[plane]) == (expected[0].item(), expected[1].item()), f"plane {plane}"


@pytest.mark.own_process
@pytest.mark.parametrize("shape,dtype", [((1, 4, 4096, 4096), "float32"), ((1, 2, 32768, 32769), "float16")],
                         ids=["4x4096x4096-float32", "2x32768x32769-float16"])
@pytest.mark.parametrize("op", ["adaptive_avg_pool2d", "adaptive_max_pool2d"])
def test_global_blocks_splits_a_few_huge_planes(device, ptt, op, shape, dtype):
    """A few huge planes (the second of more than 2^31 elements): global_blocks's default cuts each
    plane into parts over work-groups and merges them in a second pass -- the same bits twice,
    means within float32's (float16's) tolerance of the float64 mean, maxima and their first
    positions exactly."""
    problem = Problem.create(op, shape, 1, dtype)
    assert REGISTRY[op, "forward"]["global_blocks"].default_for(problem)["split"] > 1
    torch.manual_seed(0)
    x = torch.rand(shape, device="cuda", dtype=getattr(torch, dtype))
    ours = getattr(ptt, op)

    def run():
        if "max" in op:
            return ours(x, 1, return_indices=True, variant="global_blocks")
        return (ours(x, 1, variant="global_blocks"),)

    first = run()
    assert all(torch.equal(a, b) for a, b in zip(first, run()))
    _assert_all_written(first[0])
    values = first[0].reshape(-1).double().cpu()
    planes = x.reshape(shape[0] * shape[1], -1)
    for plane in range(planes.shape[0]):
        if "max" in op:
            largest = planes[plane].max()
            position = int((planes[plane] == largest).nonzero()[0])
            assert (values[plane].item(), int(first[1].reshape(-1)[plane])) == (largest.double().item(), position)
        else:
            mean = planes[plane].mean(dtype=torch.float64).item()
            tolerance = 1e-5 if dtype == "float32" else 2e-3
            assert values[plane].item() == pytest.approx(mean, rel=tolerance, abs=tolerance), f"plane {plane}"


@pytest.mark.own_process
@pytest.mark.parametrize("offset", [0, 1, 2])
@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "bfloat16"])
@pytest.mark.parametrize("op", ["adaptive_avg_pool2d", "adaptive_max_pool2d"])
def test_global_blocks_vector_loads_and_warp_rounds(ptt, op, dtype, offset):
    """global_blocks reading 4 positions per load with its last merge rounds in the warp
    (__shfl_down_sync), on an input that starts on a 16-element boundary and on views one or two
    elements past it (an unaligned wide load would fault: the kernel reads those element by element):
    the float64 reference's results, max's values and positions exactly."""
    from pool_tuner import reference

    shape = (4, 96, 28, 28)
    torch.manual_seed(offset)
    storage = torch.rand(math.prod(shape) + 16, device="cuda", dtype=getattr(torch, dtype))
    x = storage[offset:offset + math.prod(shape)].view(shape)
    for team in (8, 64, 256):
        config = {"vector_width": 4, "warp_shuffle": 1, "threads_per_plane": team, "accumulators": 2}
        ours = getattr(ptt, op)
        got = ours(x, 1, return_indices=True, variant="global_blocks", config=config) if "max" in op else \
            (ours(x, 1, variant="global_blocks", config=config),)
        torch.cuda.synchronize()
        expected = reference.forward(op, x.double().cpu().numpy(), 1)
        if "max" in op:
            np.testing.assert_array_equal(got[0].double().cpu().numpy(), expected[0])
            np.testing.assert_array_equal(got[1].cpu().numpy(), expected[1])
        else:
            np.testing.assert_allclose(got[0].double().cpu().numpy(), expected, rtol=2e-3, atol=2e-3)


#: PyTorch's adaptive_avg_pool1d backward on HUGE[1] in a process of its own; it prints "computed"
#: where PyTorch computes it.
PYTORCH_HUGE_1D_BACKWARD = textwrap.dedent("""
    import torch
    x = torch.rand({shape}, device="cuda", dtype=torch.float16, requires_grad=True)
    y = torch.nn.functional.adaptive_avg_pool1d(x, {size})
    (grad,) = torch.autograd.grad(y, x, torch.rand_like(y))
    torch.cuda.synchronize()
    print("computed")
""")


@pytest.mark.own_process
def test_pool_tuner_computes_where_pytorch_faults(ptt):
    """float16 (1, 65537, 32768) -> 5, adaptive_avg_pool1d backward: PyTorch's kernel faults with
    an illegal memory access (its int32 offsets pass 2^31; PyTorch issues #176784, #193096,
    #188957 are the same class), shown in a process of its own; pool_tuner's module gives the
    gradient, checked against the float64 reference on pieces.  Skipped where PyTorch computes it."""
    from pool_tuner import reference

    shape, size = HUGE[1]
    proc = subprocess.run([sys.executable, "-c", PYTORCH_HUGE_1D_BACKWARD.format(shape=shape, size=size)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode == 0 and "computed" in proc.stdout:
        pytest.skip(f"PyTorch {torch.__version__} computes adaptive_avg_pool1d backward on float16 {shape} -> "
                    f"{size} now: nothing to show")
    assert re.search(r"illegal memory access|ILLEGAL_ADDRESS", proc.stderr), \
        f"PyTorch failed otherwise than by the fault this test shows:\n{proc.stderr[-3000:]}"
    torch.manual_seed(0)
    x = torch.rand(shape, device="cuda", dtype=torch.float16, requires_grad=True)
    y = ptt.AdaptiveAvgPool1d(size)(x)
    grad = torch.rand_like(y)
    (got,) = torch.autograd.grad(y, x, grad)
    _assert_all_written(got)
    for part in _checked_planes(shape):
        expected = reference.backward("adaptive_avg_pool1d", _piece(grad, size, part),
                                      (1, part.stop - part.start) + shape[2:])
        np.testing.assert_allclose(_piece(got, shape[2:], part), expected, rtol=2e-3, atol=2e-3,
                                   err_msg=f"planes {part}")


def _multi_level_variant_params():
    if _WHY:
        return [pytest.param(None, None, None, id="no-cuda-gpu")]
    cases = []
    for (op, direction), table in REGISTRY.items():
        if OPS[op].multi_level:
            shape, size = HUGE[OPS[op].ndim]
            problem = Problem.create(op, shape, _huge_levels(op, size), "float16", direction=direction)
            cases += [pytest.param(op, direction, name, id=f"{op}-{direction}-{name}")
                      for name, variant in table.items()
                      if variant.representative_configurations(problem, compile_check.CUDA_LIMITS)]
    return cases


def _huge_levels(op, size):
    """A pyramid's levels on a HUGE input (global pooling and ``size``), avgmax's one size."""
    return [1, size] if OPS[op].pyramid else size


@pytest.mark.own_process
@pytest.mark.parametrize("op,direction,variant", _multi_level_variant_params())
def test_multi_level_more_than_2_31_elements_in_float16(device, ptt, op, direction, variant):
    """Every multi-level variant that takes the problem, both directions, against the float64
    reference on pieces, level by level (the backward with the indices of pool_tuner's forward,
    packed flat as the op takes them)."""
    from pool_tuner import reference

    operation = OPS[op]
    shape, size = HUGE[operation.ndim]
    spatial = shape[2:]
    levels = operation.resolve_levels(_huge_levels(op, size), spatial)
    kinds = operation.level_kinds(len(levels))
    torch.manual_seed(0)
    x = torch.rand(shape, device="cuda", dtype=torch.float16)
    flat_sizes = [n for level in (levels if operation.pyramid else levels[:1]) for n in level]
    forward = getattr(torch.ops.pool_tuner, op)
    counts = [shape[0] * shape[1] * math.prod(level) for level in levels]
    max_counts = [count for kind, count in zip(kinds, counts) if kind == "max"]
    if direction == "forward":
        out = forward(x, flat_sizes, ptt._encode_options(variant=variant))
        values, indices = out if operation.selects else (out, None)
        _assert_all_written(values)
        for part in _checked_planes(shape):
            x64 = _piece(x, spatial, part)
            want_values, want_indices = reference.forward(op, x64, _huge_levels(op, size))
            got_values = torch.split(values, counts)
            got_indices = iter(torch.split(indices, max_counts) if indices is not None else ())
            for kind, level, got, want in zip(kinds, levels, got_values, want_values):
                got = _piece(got, level, part)
                if kind == "avg":
                    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3, err_msg=f"{level}, planes {part}")
                    continue
                np.testing.assert_array_equal(got, want, err_msg=f"{level}, planes {part}")
                positions = _piece(next(got_indices), level, part)
                gathered = np.take_along_axis(x64.reshape(*x64.shape[:2], -1), positions.reshape(*x64.shape[:2], -1),
                                              -1)
                np.testing.assert_array_equal(gathered.reshape(got.shape), got)  # ties may pick another position
        return
    grads = [torch.rand(count, device="cuda", dtype=torch.float16) for count in counts]
    extra = []
    if operation.selects:
        _, indices = forward(x, flat_sizes, ptt._encode_options())
        extra = [indices]
    backward = getattr(torch.ops.pool_tuner, f"{op}_backward")
    got = backward(torch.cat(grads), *extra, list(shape), flat_sizes, False, ptt._encode_options(variant=variant))
    _assert_all_written(got)
    del x
    for part in _checked_planes(shape):
        level_indices = [_piece(i, level, part) for i, level in
                         zip(torch.split(extra[0], max_counts), [lv for k, lv in zip(kinds, levels) if k == "max"])] \
            if extra else None
        expected = reference.backward(op, [_piece(g, level, part) for g, level in zip(grads, levels)],
                                      (1, part.stop - part.start) + spatial, level_indices)
        np.testing.assert_allclose(_piece(got, spatial, part), expected, rtol=4e-3, atol=4e-3,
                                   err_msg=f"planes {part}")


# ---------------------------------------------------------------------- multi-level ops on CUDA tensors (issue 26)

#: (ndim, shape, pyramid levels, memory format): divisible and not, unequal axes, upsampling.
PYRAMIDS = [
    (1, (2, 3, 17), [1, 5, 20], torch.contiguous_format),
    (2, (2, 6, 13, 11), [1, 2, (3, None), 6], torch.contiguous_format),
    (2, (2, 6, 12, 12), [1, 2, 3, 6], torch.channels_last),
    (3, (1, 2, 5, 6, 7), [1, 2, (3, 4, 5)], torch.contiguous_format),
    (3, (2, 3, 4, 4, 4), [(1, 2, 3), 4], torch.channels_last_3d),
]
GPU_TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-12),
                  torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _cuda_input(rng, shape, dtype, memory_format, nans=False):
    from conftest import random_input

    x = random_input(rng, shape, np.float64)
    if nans:  # NaN in some windows, two in some: values NaN, the index the last NaN's
        flat = x.reshape(-1)
        flat[rng.choice(flat.size, size=max(2, flat.size // 7), replace=False)] = np.nan
    return torch.from_numpy(x).to(device="cuda", dtype=dtype).contiguous(memory_format=memory_format)


def _host64(t):
    return t.detach().double().cpu().numpy()


@pytest.mark.parametrize("dtype", list(GPU_TOLERANCES))
@pytest.mark.parametrize("ndim,shape,sizes,memory_format", PYRAMIDS)
@pytest.mark.parametrize("kind", ["avg", "max"])
def test_pyramids_on_cuda_tensors(ptt, rng, kind, ndim, shape, sizes, memory_format, dtype):
    """Values, indices and gradients of the pyramids on CUDA tensors against the float64 reference
    and PyTorch's per-level CUDA calls; results in the input's memory format."""
    from pool_tuner import reference

    op = f"adaptive_{kind}_pool_pyramid{ndim}d"
    x = _cuda_input(rng, shape, dtype, memory_format).requires_grad_()
    pool = getattr(torch.nn.functional, f"adaptive_{kind}_pool{ndim}d")
    if kind == "avg":
        values, indices = ptt.adaptive_avg_pool_pyramid(x, sizes, ndim=ndim), None
        expected, _ = reference.forward(op, _host64(x), sizes)
    else:
        values, indices = ptt.adaptive_max_pool_pyramid(x, sizes, return_indices=True, ndim=ndim)
        expected, expected_indices = reference.forward(op, _host64(x), sizes)
        for got, want in zip(indices, expected_indices):
            assert got.is_cuda and np.array_equal(got.cpu().numpy(), want)
    for level, (got, want, size) in enumerate(zip(values, expected, sizes)):
        assert got.is_cuda and got.dtype == dtype
        np.testing.assert_allclose(_host64(got), want, **GPU_TOLERANCES[dtype])
        if kind == "avg":
            torch.testing.assert_close(got, pool(x, size), **GPU_TOLERANCES[dtype])
        else:
            theirs, their_indices = pool(x, size, return_indices=True)
            assert torch.equal(got, theirs) and torch.equal(indices[level], their_indices)
        if got[0, 0].numel() > 1 and memory_format != torch.contiguous_format:
            assert got.is_contiguous(memory_format=memory_format)
    weights = [torch.from_numpy(rng.uniform(0.5, 2.0, tuple(v.shape))).to(device="cuda", dtype=dtype) for v in values]
    (grad,) = torch.autograd.grad(values, x, weights)
    expected_grad = reference.backward(op, [_host64(w) for w in weights], shape,
                                       None if indices is None else [i.cpu().numpy() for i in indices])
    np.testing.assert_allclose(_host64(grad), expected_grad, **GPU_TOLERANCES[dtype])
    theirs = [pool(x, size) if kind == "avg" else pool(x, size, return_indices=True)[0] for size in sizes]
    (their_grad,) = torch.autograd.grad(theirs, x, weights)
    torch.testing.assert_close(grad, their_grad, **GPU_TOLERANCES[dtype])


@pytest.mark.parametrize("ndim,shape,sizes,memory_format", PYRAMIDS)
def test_max_pyramid_nans_on_cuda_tensors(ptt, rng, ndim, shape, sizes, memory_format):
    from pool_tuner import reference

    x = _cuda_input(rng, shape, torch.float32, memory_format, nans=True)
    values, indices = ptt.adaptive_max_pool_pyramid(x, sizes, return_indices=True, ndim=ndim)
    expected, expected_indices = reference.forward(f"adaptive_max_pool_pyramid{ndim}d", _host64(x), sizes)
    for got, got_indices, want, want_indices in zip(values, indices, expected, expected_indices):
        np.testing.assert_array_equal(_host64(got), want)  # NaN where the reference has NaN
        assert np.array_equal(got_indices.cpu().numpy(), want_indices)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("mode", ["avg+max", "cat"])
def test_avgmax_on_cuda_tensors(ptt, rng, mode, memory_format, dtype):
    from pool_tuner import reference

    x = _cuda_input(rng, (3, 8, 13, 11), dtype, memory_format).requires_grad_()
    got = ptt.adaptive_avgmax_pool2d(x, (3, 4), mode)
    (avg, mx), (indices,) = reference.forward("adaptive_avgmax_pool2d", _host64(x), (3, 4))
    want = 0.5 * (avg + mx) if mode == "avg+max" else np.concatenate([avg, mx], axis=1)
    np.testing.assert_allclose(_host64(got), want, **GPU_TOLERANCES[dtype])
    F = torch.nn.functional
    theirs = (0.5 * (F.adaptive_avg_pool2d(x, (3, 4)) + F.adaptive_max_pool2d(x, (3, 4))) if mode == "avg+max" else
              torch.cat((F.adaptive_avg_pool2d(x, (3, 4)), F.adaptive_max_pool2d(x, (3, 4))), 1))
    torch.testing.assert_close(got, theirs, **GPU_TOLERANCES[dtype])
    weight = torch.from_numpy(rng.uniform(0.5, 2.0, tuple(got.shape))).to(device="cuda", dtype=dtype)
    (grad,) = torch.autograd.grad(got, x, weight)
    w = _host64(weight)
    grads = [0.5 * w, 0.5 * w] if mode == "avg+max" else [w[:, :8], w[:, 8:]]
    expected = reference.backward("adaptive_avgmax_pool2d", grads, tuple(x.shape), [indices])
    np.testing.assert_allclose(_host64(grad), expected, **GPU_TOLERANCES[dtype])
    (their_grad,) = torch.autograd.grad(theirs, x, weight)
    torch.testing.assert_close(grad, their_grad, **GPU_TOLERANCES[dtype])


def test_gradgradcheck_of_the_multi_level_ops_on_cuda_tensors(ptt, rng):
    x = _cuda_input(rng, (2, 3, 9, 7), torch.float64, torch.contiguous_format).requires_grad_()
    for fn in (lambda t: ptt.adaptive_avg_pool_pyramid(t, [1, 2, (3, 4), 5]),
               lambda t: ptt.adaptive_max_pool_pyramid(t, [1, (2, 3), 4]),
               lambda t: ptt.adaptive_avgmax_pool2d(t, (3, 2), "avg+max"),
               lambda t: ptt.adaptive_avgmax_pool2d(t, 2, "cat")):
        assert torch.autograd.gradcheck(fn, (x,)) and torch.autograd.gradgradcheck(fn, (x,))


# ---------------------------------------------------------------------- CUDA graphs (Build item 2)

def _warm_up_and_capture(step):
    """``step()`` three times on a side stream (PyTorch's prescribed warm-up), then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


@pytest.mark.own_process
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "copied"])
def test_capture_of_max_pooling_with_indices_and_both_backward_passes(ptt, layout):
    size, shape = (4, 7), (2, 6, 10, 9)
    source = torch.zeros(shape, device="cuda")
    grad = torch.zeros((2, 6) + size, device="cuda")

    def layout_of(t):
        if layout == "channels_last":
            return t.to(memory_format=torch.channels_last)
        if layout == "copied":  # neither layout: pool_tuner copies it to contiguous first
            return t.transpose(2, 3).contiguous().transpose(2, 3)
        return t

    def step():
        x = layout_of(source).requires_grad_()
        values, indices = ptt.adaptive_max_pool2d(x, size, return_indices=True)
        (max_grad,) = torch.autograd.grad(values, x, grad)
        (avg_grad,) = torch.autograd.grad(ptt.adaptive_avg_pool2d(x, size), x, grad)
        return values, indices, max_grad, avg_grad

    graph, (values, indices, max_grad, avg_grad) = _warm_up_and_capture(step)
    for seed in (1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():
            source.copy_(torch.rand(shape, device="cuda"))
            grad.copy_(torch.rand(grad.shape, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        x = source.clone().requires_grad_()
        expected_values, expected_indices = torch.nn.functional.adaptive_max_pool2d(x, size, return_indices=True)
        torch.testing.assert_close(values, expected_values)
        torch.testing.assert_close(indices, expected_indices)
        torch.testing.assert_close(max_grad, torch.autograd.grad(expected_values, x, grad)[0])
        torch.testing.assert_close(avg_grad, torch.autograd.grad(torch.nn.functional.adaptive_avg_pool2d(x, size),
                                                                 x, grad)[0])


@pytest.mark.own_process
def test_a_first_call_inside_capture_is_refused(ptt):
    x = torch.rand((2, 3, 17, 11), device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="call each signature once before capture"):
        with torch.cuda.graph(graph):
            ptt.adaptive_avg_pool2d(x, (5, 2))


# ---------------------------------------------------------------------- streams and contexts

def test_results_are_ordered_on_the_current_stream(ptt):
    """The launch follows earlier work on PyTorch's current stream and is not done before it."""
    size = (4, 7)
    x = torch.rand((2, 3, 10, 9), device="cuda")
    ptt.adaptive_avg_pool2d(x, size)  # built before timing anything
    source = torch.rand_like(x)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # keeps the stream busy for a while
    x.copy_(source)
    y = ptt.adaptive_avg_pool2d(x, size)
    assert not torch.cuda.current_stream().query(), "the stream finished before the sleep could have"
    torch.cuda.synchronize()
    torch.testing.assert_close(y, torch.nn.functional.adaptive_avg_pool2d(source, size))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        doubled = source * 2
        z = ptt.adaptive_avg_pool2d(doubled, size)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(z, torch.nn.functional.adaptive_avg_pool2d(source * 2, size))


class _OnStream:
    """A tensor as another library hands a CUDA array over: shape, byte strides, dtype and a
    ``__cuda_array_interface__`` naming the stream its writes are queued on (PyTorch's own names
    none)."""

    def __init__(self, tensor, stream):
        self.tensor, self.shape = tensor, tuple(tensor.shape)
        self.dtype = np.dtype(str(tensor.dtype).removeprefix("torch."))
        self.strides = tuple(s * tensor.element_size() for s in tensor.stride())
        self.__cuda_array_interface__ = {**tensor.__cuda_array_interface__, "stream": stream.cuda_stream,
                                         "version": 3}


def test_pt_calls_on_a_cuda_array_run_on_the_stream_its_interface_names():
    """``pt.adaptive_avg_pool2d`` on an array whose interface names a side stream still busy
    (``torch.cuda._sleep``, then the write of the input): the call returns without waiting for it,
    the launch runs after the write, and the result names the side stream.  Only that stream is
    synchronised before the result is read."""
    import pool_tuner as pt

    size = (4, 7)
    x = torch.rand((2, 3, 10, 9), device="cuda")
    side = torch.cuda.Stream()
    pt.adaptive_avg_pool2d(_OnStream(x, side), size)  # built before timing anything
    source = torch.rand_like(x)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keeps the side stream busy for a while
        x.copy_(source)
    y = pt.adaptive_avg_pool2d(_OnStream(x, side), size)
    assert not side.query(), "the call waited on the host for the side stream"
    assert y.__cuda_array_interface__["stream"] == side.cuda_stream
    side.synchronize()
    expected = torch.nn.functional.adaptive_avg_pool2d(source, size)
    np.testing.assert_allclose(y.get(), expected.cpu().numpy(), rtol=1e-5, atol=1e-6)


def test_max_backward_waits_for_indices_written_on_another_stream():
    """``grad_out`` named on one side stream, ``indices`` on another that is still writing them:
    the launch on grad_out's stream waits for the indices' stream on the device, so syncing
    grad_out's stream alone gives the right gradient."""
    import pool_tuner as pt

    size, shape = (4, 7), (2, 3, 10, 9)
    x = torch.rand(shape, device="cuda")
    values, indices = torch.nn.functional.adaptive_max_pool2d(x, size, return_indices=True)
    grad = torch.rand_like(values)
    grad_stream, indices_stream = torch.cuda.Stream(), torch.cuda.Stream()
    written = torch.zeros_like(indices)
    pt.adaptive_max_pool2d_backward(_OnStream(grad, grad_stream), _OnStream(written, indices_stream), shape)
    torch.cuda.synchronize()
    with torch.cuda.stream(indices_stream):
        torch.cuda._sleep(200_000_000)
        written.copy_(indices)
    result = pt.adaptive_max_pool2d_backward(_OnStream(grad, grad_stream), _OnStream(written, indices_stream), shape)
    assert not indices_stream.query(), "the call waited on the host for the indices' stream"
    grad_stream.synchronize()
    x.requires_grad_()
    (expected,) = torch.autograd.grad(torch.nn.functional.adaptive_max_pool2d(x, size), x, grad)
    np.testing.assert_allclose(result.get(), expected.cpu().numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["avg+max", "cat"])
def test_avgmax_on_a_cuda_array_joins_and_splits_on_its_stream(mode):
    """``pt.adaptive_avgmax_pool2d`` and its backward on arrays whose interface names a busy side
    stream: the pooling, the join (kernels/avgmax_join.c), the split and the backward all run on
    that stream without a host wait; values, indices and the gradient match PyTorch's."""
    import pool_tuner as pt

    shape, size = (3, 6, 13, 11), (2, 3)
    x = torch.rand(shape, device="cuda")
    side = torch.cuda.Stream()
    result, indices = pt.adaptive_avgmax_pool2d(_OnStream(x, side), size, mode, return_indices=True)
    grad = torch.rand(result.shape, device="cuda")
    pt.adaptive_avgmax_pool2d_backward(_OnStream(grad, side), indices, shape, mode)  # built before the busy stream
    source = torch.rand_like(x)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        x.copy_(source)
    result, indices = pt.adaptive_avgmax_pool2d(_OnStream(x, side), size, mode, return_indices=True)
    grad_in = pt.adaptive_avgmax_pool2d_backward(_OnStream(grad, side), indices, shape, mode)
    assert not side.query(), "the call waited on the host for the side stream"
    assert result.__cuda_array_interface__["stream"] == side.cuda_stream
    assert grad_in.__cuda_array_interface__["stream"] == side.cuda_stream
    side.synchronize()
    leaf = source.clone().requires_grad_()
    avg = torch.nn.functional.adaptive_avg_pool2d(leaf, size)
    mx, expected_indices = torch.nn.functional.adaptive_max_pool2d(leaf, size, return_indices=True)
    expected = 0.5 * (avg + mx) if mode == "avg+max" else torch.cat((avg, mx), 1)
    (expected_grad,) = torch.autograd.grad(expected, leaf, grad)
    np.testing.assert_allclose(result.get(), expected.detach().cpu().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(indices.get(), expected_indices.cpu().numpy())
    np.testing.assert_allclose(grad_in.get(), expected_grad.cpu().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.own_process
def test_a_second_context_current_on_a_worker_thread_is_refused_naming_both(ptt, device):
    """A worker thread with its own (non-primary) context current: PyTorch's tensors live in the
    primary context, which the kernel cannot reach from the worker's, so the call is refused with a
    ValueError naming both contexts -- and the worker's context stays current (nothing pushed or
    popped around the call)."""
    import pycuda.driver as drv

    x = torch.rand((2, 3, 10, 9), device="cuda")
    ptt.adaptive_avg_pool2d(x, (4, 7))
    torch.cuda.synchronize()
    results, errors = {}, []

    def worker():
        context = drv.Device(device.ordinal).make_context()
        try:
            mine = _current_context()
            with pytest.raises(ValueError, match="current CUDA context .* is not the one"):
                ptt.adaptive_avg_pool2d(x, (4, 7))
            results["still_mine"] = _current_context() == mine
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
        finally:
            context.pop()
            context.detach()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert not errors, errors
    assert results["still_mine"]


# ---------------------------------------------------------------------- device arrays of every library

#: Per library, a script run in a process of its own (pycuda.autoinit leaves a context of its own
#: current for the rest of a process): a call through ``pool_tuner.adaptive_*`` on that library's
#: array, channels-first and channels-last, forward and max backward, the result checked to be that
#: library's kind and read with that library's own call against the float64 reference, then
#: everything dropped and freed (PyCUDA aborts the process at a free in the wrong context).
_LIBRARY_CHECK = textwrap.dedent("""
    import gc
    import numpy as np
    import pool_tuner as pt
    from pool_tuner import reference

    def check(to_device, to_host, kind):
        rng = np.random.default_rng(0)
        for channels_last in (False, True):
            x = rng.random((2, 3, 10, 9)).astype(np.float32)
            device_x = to_device(np.moveaxis(np.ascontiguousarray(np.moveaxis(x, 1, -1)), -1, 1) if channels_last
                                 else x)
            y = pt.adaptive_avg_pool2d(device_x, (4, 7))
            assert isinstance(y, kind), type(y)
            np.testing.assert_allclose(to_host(y), reference.forward("adaptive_avg_pool2d", x.astype(np.float64),
                                                                     (4, 7)), rtol=1e-5, atol=1e-6)
        values, indices = pt.adaptive_max_pool2d(to_device(x), (4, 7), return_indices=True)
        expected_values, expected_indices = reference.forward("adaptive_max_pool2d", x.astype(np.float64), (4, 7))
        np.testing.assert_array_equal(to_host(values), expected_values)
        np.testing.assert_array_equal(to_host(indices), expected_indices)
        grad = rng.random((2, 3, 4, 7)).astype(np.float32)
        grad_in = pt.adaptive_max_pool2d_backward(to_device(grad), indices, x.shape)
        np.testing.assert_allclose(to_host(grad_in), reference.backward("adaptive_max_pool2d", grad.astype(np.float64),
                                                                        x.shape, expected_indices), rtol=1e-6)
        del y, values, indices, grad_in, device_x
        gc.collect()
        pt.release_memory()
        print("ok")
""")
_LIBRARIES = {
    "pycuda.autoinit": ("pycuda", "import pycuda.autoinit\nimport pycuda.gpuarray as ga\n"
                                  "check(ga.to_gpu, lambda a: a.get(), ga.GPUArray)"),
    "pycuda.autoprimaryctx": ("pycuda", "import pycuda.autoprimaryctx\nimport pycuda.gpuarray as ga\n"
                                        "check(ga.to_gpu, lambda a: a.get(), ga.GPUArray)"),
    "cupy": ("cupy", "import cupy\ncheck(cupy.asarray, cupy.asnumpy, cupy.ndarray)"),
    "torch": ("torch", "import torch\ncheck(lambda a: torch.from_numpy(a).cuda(), lambda t: t.cpu().numpy(), "
                       "torch.Tensor)"),
    "numba": ("numba", "from numba import cuda\nfrom numba.cuda.cudadrv.devicearray import DeviceNDArray\n"
                       "check(cuda.to_device, lambda a: a.copy_to_host(), DeviceNDArray)"),
}


@pytest.mark.parametrize("library", list(_LIBRARIES))
def test_device_arrays_of_every_library(tmp_path, library):
    import importlib.util

    module, calls = _LIBRARIES[library]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    script = tmp_path / "library_check.py"
    script.write_text(_LIBRARY_CHECK + calls + "\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.stdout + proc.stderr)[-3000:]
    assert "Traceback" not in proc.stderr and "PyCUDA WARNING" not in proc.stderr, proc.stderr[-3000:]


# ---------------------------------------------------------------------- leaks, alone in a process

LEAK_SCRIPT = textwrap.dedent("""
    import json, os, sys, warnings
    import torch
    import pool_tuner.torch as ptt

    def process_memory():
        try:
            import pynvml
        except ImportError:
            return None
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == os.getpid():
                return process.usedGpuMemory
        return None

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(64, 64, 3, padding=1), ptt.AdaptiveAvgPool2d((5, 7)),
                                torch.nn.Flatten(), torch.nn.Linear(64 * 5 * 7, 10)).cuda()
    optimiser = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64, 23, 37, device="cuda")
    target = torch.randint(0, 10, (32,), device="cuda")

    def step():
        optimiser.zero_grad()
        torch.nn.functional.cross_entropy(model(x), target).backward()
        optimiser.step()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), process_memory()
        for _ in range(1000):
            step()
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), process_memory()
    print(json.dumps({"before": before, "after": after, "warnings": [str(w.message) for w in caught]}))
""")


@pytest.mark.own_process
def test_training_leaks_nothing_measured_in_its_own_process():
    """1000 SGD steps through pool_tuner's AdaptiveAvgPool2d (backward on autograd's thread) in a
    process of its own: PyTorch's allocated and reserved memory and this process's device memory
    (NVML's per-process accounting, where pynvml is installed) end where they began, and nothing
    is reported about memory that could not be freed.  Other processes on the GPU (pytest-xdist's
    workers) cannot move these figures."""
    import json

    proc = subprocess.run([sys.executable, "-c", LEAK_SCRIPT], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    (allocated0, reserved0, process0), (allocated1, reserved1, process1) = report["before"], report["after"]
    print(f"allocated {allocated0} -> {allocated1}, reserved {reserved0} -> {reserved1}, "
          f"process (NVML) {process0} -> {process1}")
    assert allocated1 == allocated0 and reserved1 == reserved0
    if process0 is not None and process1 is not None:
        assert process1 - process0 <= 2 * 2**20, "the process's device memory grew over 1000 steps"
    messages = report["warnings"] + [proc.stderr]
    assert not any("could not be cleaned up" in m or "out-of-thread" in m for m in messages), messages


# ---------------------------------------------------------------------- compute-sanitizer

SANITIZER_SUBSET = "test_every_variant_on_the_shape_matrix and adaptive_avg_pool2d"


@pytest.mark.own_process
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_over_variants(tool):
    """A slice of the variant matrix under compute-sanitizer; the whole matrix is the documented
    command of docs/design.md ("GPU tests"), too slow for every run."""
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not on PATH")
    command = [sanitizer, "--tool", tool, "--error-exitcode", "99", sys.executable, "-m", "pytest", "-q", "-n", "0",
               "-p", "no:cacheprovider", "tests/test_cuda.py", "-k", SANITIZER_SUBSET]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=580, cwd=ROOT,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
