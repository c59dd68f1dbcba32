"""The CUDA variant matrix (tests/test_cuda.py) on the fakes (tests/cuda_fakes.py): the failures an
H100 showed, failing here as the real nvcc and driver did, and the matrix's own calls passing them.

* A GeM program rendered with ``operators.h`` in its operator's place (what the matrix's first
  harness built) stops at operators.h's ``#error`` in nvcc; the fake compiler stops there too, and
  ``kernel_source.render`` no longer has a default operator header to fall back on.
* A launch with fewer arguments than the kernel declares (avgmax's forward given one output and the
  plane count: 3 arguments for its 4 parameters) made the driver read past the argument array --
  ``CUDA_ERROR_INVALID_VALUE``, or a crash; the fake driver refuses it with the same status.
* Every launch the matrix makes now -- through the public functions, every op, direction and
  variant -- has exactly the parameters its kernel declares.
"""

import numpy as np
import pytest

import pool_tuner as pt
from pool_tuner import kernel_source
from pool_tuner.backends import cuda, cuda_compile, cuda_driver
from pool_tuner.problem import OPS, Problem
from pool_tuner.variants import REGISTRY

from conftest import random_input
from cuda_fakes import INVALID_VALUE, fake_compile, forget_fake_gpu, install_fake_gpu
from device_matrix import (REPRESENTATIVE, call_backward, call_forward, case_input, check_round_trip, configurations, problem_of,
                           to_device, variant_cases)

try:
    NVCC, NO_NVCC = cuda.find_nvcc(), None
except cuda.NvccNotFoundError as why:
    NVCC, NO_NVCC = None, str(why)


@pytest.fixture
def fake_gpu(monkeypatch):
    device, _, driver = install_fake_gpu(monkeypatch)
    yield device, driver
    forget_fake_gpu()


def _gem_sources():
    """A GeM program with its own operator header, and with operators.h in that header's place."""
    problem = Problem.create("adaptive_gem_pool1d", (1, 2, 5), (7,))
    variant = REGISTRY[(problem.op, "forward")]["gem_plane_windows"]
    params = variant.default_for(problem)
    wrong = kernel_source.render(variant.template, variant.defines(params, problem), kernel_source.OPERATOR_HEADER)
    return variant.program(params, problem), wrong


def test_a_gem_program_without_its_operator_fails_in_the_fake_compiler():
    right, wrong = _gem_sources()
    with pytest.raises(cuda_compile.CudaCompileError, match=r'#error "pool_tuner: no POOL_\* define given"'):
        fake_compile(wrong, "sm_90")
    assert fake_compile(right, "sm_90") == b"cubin:" + right.encode()


@pytest.mark.skipif(NVCC is None, reason=f"compiles with nvcc: {NO_NVCC}")
def test_nvcc_fails_and_compiles_the_same_gem_programs(user_cache):
    right, wrong = _gem_sources()
    with pytest.raises(cuda_compile.CudaCompileError, match=r'#error "pool_tuner: no POOL_\* define given"'):
        cuda_compile.cubin(wrong, "sm_90", NVCC)
    assert cuda_compile.cubin(right, "sm_90", NVCC)[1]


def test_render_has_no_default_operator_header():
    """Every program names its op's operator header: ``Variant.program`` passes the problem's."""
    with pytest.raises(TypeError, match="operator_header"):
        kernel_source.render("forward/thread_per_output.c", {"POOL_GEM": 1})
    for (op, direction), table in REGISTRY.items():
        for variant in table.values():
            assert variant.template in kernel_source.program_files(variant.template, OPS[op].operator_header)


def test_a_launch_short_of_the_kernels_parameters_is_refused(fake_gpu):
    """avgmax's forward writes its values and its indices: given x, one output and the plane count,
    the driver reads a fourth argument that was never given."""
    device, driver = fake_gpu
    problem = Problem.create("adaptive_avgmax_pool2d", (2, 3, 10, 9), (4, 7))
    variant = REGISTRY[(problem.op, "forward")]["pyramid_stream"]
    params = variant.default_for(problem)
    kernel = device.build(None, variant.program(params, problem), variant.kernel_name)
    assert len(driver.parameters[kernel.function]) == 4
    x = device.to_device(np.zeros(problem.input_shape, np.float32))
    out = device.empty((problem.planes * 28 * 2,), np.float32)
    with pytest.raises(cuda_driver.DriverError, match=f"cuLaunchKernel.*\\({INVALID_VALUE}\\)"):
        device.launch(None, kernel, variant.groups(params, problem), variant.block(params), [x, out, *problem.scalars])
    assert not driver.launches


@pytest.mark.parametrize("op,direction,variant,layout,shape,size", variant_cases(with_shapes=False))
def test_every_launch_of_the_matrix_has_its_kernels_parameters(fake_gpu, op, direction, variant, layout, shape, size,
                                                                rng):
    """The matrix's calls on the fake GPU (nothing is computed: only the launches are checked)."""
    device, driver = fake_gpu
    problem = problem_of(op, direction, shape, size, layout=layout)
    ndim = OPS[op].ndim
    x, values, indices = case_input(rng, op, shape, size, "float32")
    for config in configurations(device, variant, problem, ("default",)):
        if direction == "forward":
            call_forward(op, to_device(device, x, ndim, problem.channels_last), size, variant, config)
        else:
            grads = [to_device(device, np.zeros(v.shape, np.float32), ndim, problem.channels_last) for v in values]
            device_indices = [to_device(device, i, ndim, problem.channels_last) for i in indices]
            call_backward(op, grads, device_indices, shape, variant, config)
    assert driver.launches
    for launch in driver.launches:
        assert len(launch["arguments"]) == len(driver.parameters[launch["function"]])


def test_the_harness_reads_back_what_it_writes_on_the_fake_gpu(fake_gpu, rng):
    """The fake driver's memory holds the bytes copies move: the harness's reads of CUDA arrays
    (through their ``__cuda_array_interface__``) give back what it wrote."""
    check_round_trip(fake_gpu[0], rng)


@pytest.mark.parametrize("ndim", [1, 2, 3])
@pytest.mark.parametrize("channels_last", [False, True], ids=["channels-first", "channels-last"])
def test_gem_backward_launches_have_their_kernels_parameters(fake_gpu, ndim, channels_last, rng):
    """GeM's backward on the fake GPU (its own kernels, no variants): its forward and its
    input-gradient kernel launched with the parameters they declare."""
    device, driver = fake_gpu
    shape, size = REPRESENTATIVE[ndim]
    x = to_device(device, np.abs(random_input(rng, shape)), ndim, channels_last)
    grad = to_device(device, random_input(rng, shape[:-ndim] + size), ndim, channels_last)
    getattr(pt, f"adaptive_gem_pool{ndim}d_backward")(grad, x, size, p=2.5, eps=1e-3)
    assert len(driver.launches) >= 2
    for launch in driver.launches:
        assert len(launch["arguments"]) == len(driver.parameters[launch["function"]])
