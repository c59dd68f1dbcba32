"""The variant matrix's harness (tests/device_matrix.py) proven on the default device (PoCL): every
variant of every op and direction, through the public functions on device arrays, against the
float64 reference -- the check tests/test_cuda.py runs on a GPU, here on OpenCL, so that a GPU lease
never spends its minutes on a harness that was never run.  The core tier runs one variant of each
op and direction (every variant's kernel is test_matrix.py's on numpy arrays); the exhaustive tier
runs them all.  The dtype cases run the ops with several results or run-time arguments (pyramids,
avgmax, GeM) in the half-precision dtypes; the single-level ops' dtypes on numpy arrays are
test_matrix.py's."""

import pytest

from pool_tuner import backends
from pool_tuner.problem import OPS

from conftest import tiered
from device_matrix import REPRESENTATIVE, check_case, check_gem_backward, check_round_trip, gem_backward_cases, dtype_layout_cases, layout_for, variant_cases


def _newer_ops_in_half_precision():
    """The pyramids', avgmax's and GeM's cases in float16 and bfloat16, each variant in the layout
    its shape-matrix case runs in."""
    cases = []
    for case in dtype_layout_cases():
        op, _, dtype, layout, variant = case.values
        operation = OPS[op]
        if (dtype in ("float16", "bfloat16") and (operation.multi_level or operation.arguments)
                and layout == layout_for(variant, operation.ndim)):
            cases.append(case)
    return tiered(cases, group=lambda values: values[:3])  # core: one variant of each op, direction and dtype


@pytest.fixture(scope="module")
def device():
    return backends.default_device()


@pytest.mark.parametrize("op,direction,variant,layout,shape,size",
                         tiered(variant_cases(with_shapes=False), group=lambda values: values[:2]))
def test_every_variant_on_device_arrays(device, op, direction, variant, layout, shape, size, rng):
    check_case(device, op, direction, "float32", layout, variant, shape, size, rng)


@pytest.mark.parametrize("op,direction,dtype,layout,variant", _newer_ops_in_half_precision())
def test_newer_ops_in_half_precision_on_device_arrays(device, op, direction, dtype, layout, variant, rng):
    shape, size = REPRESENTATIVE[OPS[op].ndim]
    check_case(device, op, direction, dtype, layout, variant, shape, size, rng)


def test_the_harness_reads_back_what_it_writes(device, rng):
    check_round_trip(device, rng)


@pytest.mark.parametrize("ndim,dtype,layout", gem_backward_cases())
def test_gem_backward_on_device_arrays(device, ndim, dtype, layout, rng):
    """Channels-last included: on a device that shares host memory the backward once read the
    arrays' memory as if it were contiguous and returned a channels-first gradient."""
    check_gem_backward(device, ndim, dtype, layout, rng)
