"""The plane count is a run-time kernel argument (kernels/prelude.h, ``Problem.scalars``): every
batch size of a per-sample shape runs on the kernel built for the first, with correct results, and
nothing a program is built from depends on the batch size except the index width."""

import math

import numpy as np
import pytest

import pool_tuner as pt
from pool_tuner import backends, dispatch, reference
from pool_tuner.backends import opencl
from pool_tuner.problem import LAYOUT_NAMES, Problem
from pool_tuner.variants import REGISTRY, variants_for

from conftest import random_input

torch = pytest.importorskip("torch")

#: Batch sizes of one per-sample shape: one plane group or several, whole and partial last groups.
BATCHES = (1, 2, 5, 7)
#: (op, per-sample shape (C, *spatial), output size): non-divisible and overlapping windows.
SAMPLES = [("adaptive_avg_pool2d", (3, 10, 9), (4, 7)), ("adaptive_max_pool2d", (3, 10, 9), (4, 7))]
FLOAT32_TOL = dict(rtol=1e-5, atol=1e-6)


def _channels_last(x, ndim):
    """``x`` with its channel axis last in memory, same logical shape."""
    c = x.ndim - ndim - 1
    return np.moveaxis(np.ascontiguousarray(np.moveaxis(x, c, -1)), -1, c)


@pytest.fixture
def builds(monkeypatch, user_cache):
    """Sources handed to the OpenCL program cache (every build the dispatcher asks for)."""
    sources = []
    build = opencl._build

    def counting(context, cl_device, source, kernel_name, options):
        sources.append(source)
        return build(context, cl_device, source, kernel_name, options)

    monkeypatch.setattr(opencl, "_build", counting)
    return sources


def _check_forward(op, name, x, size, channels_last):
    """One forward call of variant ``name`` against the float64 reference and PyTorch."""
    kind, ndim = pt.problem.OPS[op]
    exact = torch.from_numpy(x).double()
    fn = getattr(torch.nn.functional, op)
    given = _channels_last(x, ndim) if channels_last else x
    if kind == "avg":
        got = getattr(pt, op)(given, size, variant=name)
        np.testing.assert_allclose(got, reference.forward(op, x.astype(np.float64), size), **FLOAT32_TOL)
        np.testing.assert_allclose(got, fn(exact, size).numpy(), **FLOAT32_TOL)
        return
    values, indices = getattr(pt, op)(given, size, variant=name, return_indices=True)
    want_values, want_indices = reference.forward(op, x.astype(np.float64), size)
    torch_values, torch_indices = fn(exact, size, return_indices=True)
    np.testing.assert_allclose(values, want_values, **FLOAT32_TOL)
    np.testing.assert_allclose(values, torch_values.numpy(), **FLOAT32_TOL)
    np.testing.assert_array_equal(indices, want_indices)
    np.testing.assert_array_equal(indices, torch_indices.numpy())


def _check_backward(op, name, x, grad, size, channels_last):
    """One backward call of variant ``name`` against the float64 reference and PyTorch's autograd."""
    kind, ndim = pt.problem.OPS[op]
    exact = torch.from_numpy(x).double().requires_grad_(True)
    fn = getattr(torch.nn.functional, op)
    given = _channels_last(grad, ndim) if channels_last else grad
    if kind == "avg":
        got = getattr(pt, f"{op}_backward")(given, x.shape, variant=name)
        expected = reference.backward(op, grad.astype(np.float64), x.shape)
        fn(exact, size).backward(torch.from_numpy(grad).double())
    else:
        _, indices = reference.forward(op, x.astype(np.float64), size)
        given_indices = _channels_last(indices, ndim) if channels_last else indices
        got = getattr(pt, f"{op}_backward")(given, given_indices, x.shape, variant=name)
        expected = reference.backward(op, grad.astype(np.float64), x.shape, indices)
        fn(exact, size, return_indices=True)[0].backward(torch.from_numpy(grad).double())
    np.testing.assert_allclose(got, expected, **FLOAT32_TOL)
    np.testing.assert_allclose(got, exact.grad.numpy(), **FLOAT32_TOL)


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels-last"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("op,sample,size", SAMPLES, ids=[op for op, _, _ in SAMPLES])
def test_every_batch_size_runs_on_one_build_and_matches_the_references(builds, rng, op, sample, size, direction,
                                                                       channels_last):
    _, ndim = pt.problem.OPS[op]
    layout = LAYOUT_NAMES[ndim][int(channels_last)]
    device = backends.default_device()
    first = Problem.create(op, (1, *sample), size, layout=layout, direction=direction)
    names = [name for name, variant in variants_for(op, direction).items() if variant.is_legal({}, first, device.info.limits)]
    assert names
    for name in names:
        built = len(builds)
        for batch in BATCHES:
            x = random_input(rng, (batch, *sample))
            if direction == "forward":
                _check_forward(op, name, x, size, channels_last)
            else:
                grad = random_input(rng, (batch, sample[0], *size))
                _check_backward(op, name, x, grad, size, channels_last)
        assert len(builds) == built + 1, f"{name}: {len(builds) - built} builds for batch sizes {BATCHES}"


def test_a_new_batch_size_reuses_the_built_kernel_and_recomputes_the_grid(builds):
    device = backends.default_device()
    context = device.queue.context
    launches = []
    for batch in (2, 9, 2):
        problem = Problem.create("adaptive_avg_pool2d", (batch, 3, 10, 9), (4, 7))
        launches.append(dispatch.prepare(device, context, problem, dispatch.choose(problem, device)))
    assert len(builds) == 1 and launches[0].kernel is launches[1].kernel
    assert launches[2] is launches[0]  # the launch itself is memoised per problem
    choice = dispatch.choose(Problem.create("adaptive_avg_pool2d", (9, 3, 10, 9), (4, 7)), device)
    assert launches[1].groups == choice.variant.groups(choice.config, Problem.create(
        "adaptive_avg_pool2d", (9, 3, 10, 9), (4, 7))) > launches[0].groups
    assert [launch.scalars for launch in launches] == [(2 * 3,), (9 * 3,), (2 * 3,)]
    assert all(isinstance(s, np.int64) for launch in launches for s in launch.scalars)


@pytest.mark.parametrize("key", sorted(REGISTRY), ids=lambda k: "-".join(k))
def test_programs_depend_on_the_per_sample_shape_only(key):
    """Equal ``kernel_key``s give equal programs (so sharing a build is right), and the batch size
    changes neither -- also the bounds-check define, whose grid must then end exactly at every
    batch size where it is off."""
    op, direction = key
    _, ndim = pt.problem.OPS[op]
    device = backends.default_device()
    spatial, size = {1: ((13,), (5,)), 2: ((10, 9), (4, 7)), 3: ((5, 6, 7), (3, 4, 2))}[ndim]
    for layout in LAYOUT_NAMES[ndim]:
        for channels in (1, 3, 64):
            problems = [Problem.create(op, (channels, *spatial), size, layout=layout, direction=direction)]
            problems += [Problem.create(op, (batch, channels, *spatial), size, layout=layout, direction=direction)
                         for batch in (1, 2, 3, 8, 11)]
            assert len({p.kernel_key for p in problems}) == 1
            for variant in variants_for(op, direction).values():
                for params in variant.legal_configurations(problems[0], device.info.limits):
                    defines = [variant.defines(params, p) for p in problems]
                    assert all(d == defines[0] for d in defines), f"{variant.name} {params}"
                    assert "N_PLANES" not in defines[0]
                    if defines[0].get("PARTIAL_LAST_GROUP") == 0:
                        per_group = params["block_size_x"] * params.get("outputs_per_thread",
                                                                        params.get("inputs_per_thread", 1))
                        for p in problems:
                            units = p.planes * _units_per_plane(variant, p)
                            assert units % per_group == 0, f"{variant.name} {params} {p.input_shape}"


def _units_per_plane(variant, problem) -> int:
    """Work-items' units of one plane in the variants with a bounds-check define."""
    if variant.name == "thread_per_output":  # a work-item per output
        return math.prod(problem.out_spatial)
    if variant.name in ("gem_planes", "gem_plane_windows"):  # a work-item per plane
        return 1
    if variant.name == "thread_per_input":
        return math.prod(problem.in_spatial)
    t, h, _ = problem.out_spatial if variant.direction == "forward" else problem.in_spatial
    return t * h


def test_the_index_width_is_part_of_the_build_key():
    small = Problem.create("adaptive_avg_pool2d", (1, 3, 1000, 1000), (7, 7))
    large = Problem.create("adaptive_avg_pool2d", (1000, 3, 1000, 1000), (7, 7))
    assert not small.index_64 and large.index_64
    assert small.kernel_key != large.kernel_key
