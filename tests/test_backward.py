"""Every backward variant of avg and max pooling, 1d/2d/3d, on a matrix of shapes, against the
float64 reference and PyTorch autograd; determinism (runs and variants bit-identical); bad input."""

import numpy as np
import pyopencl.array as cl_array
import pytest

import pool_tuner as pt
from pool_tuner import backends, dispatch, reference
from pool_tuner.backends.opencl import OpenCLDevice
from pool_tuner.ops import memory_layout
from pool_tuner.shapes import resolve_output_size

from conftest import legal_variants, random_input

torch = pytest.importorskip("torch")

FLOAT32_TOL = dict(rtol=1e-5, atol=1e-6)

# (input shape, output size) per rank: divisible, non-divisible, upsampling O > I, O = 1, O = I,
# size-1 axes, primes, None entries, batch-less, empty batch, output size 0.
SHAPES = {
    1: [
        ((2, 3, 12), 4),            # divisible
        ((2, 5, 13), 5),            # non-divisible (test_matrix's 1d shape)
        ((1, 2, 5), 9),             # upsampling
        ((2, 3, 17), 1),            # global
        ((2, 3, 7), 7),             # O = I
        ((2, 3, 1), 3),             # size-1 axis, upsampled
        ((4, 13), 5),               # batch-less, primes
        ((1, 2, 9), (None,)),       # None entry
        ((0, 3, 8), 3),             # empty batch
        ((2, 3, 8), 0),             # empty output
    ],
    2: [
        ((2, 3, 8, 8), (4, 4)),
        ((2, 5, 10, 9), (4, 7)),
        ((1, 2, 5, 5), (7, 7)),
        ((2, 4, 7, 7), 1),
        ((2, 3, 6, 5), (6, 5)),
        ((3, 2, 1, 9), (1, 4)),
        ((1, 2, 13, 17), (5, 3)),
        ((1, 2, 10, 9), (None, 7)),
        ((3, 11, 7), (3, 2)),
        ((0, 3, 8, 8), (3, 3)),
        ((2, 3, 8, 8), 0),
        ((2, 3, 8, 8), (0, 4)),
    ],
    3: [
        ((2, 3, 8, 6, 4), (4, 3, 2)),
        ((2, 3, 5, 6, 7), (3, 4, 2)),
        ((1, 1, 3, 4, 5), (4, 5, 6)),
        ((2, 3, 5, 4, 3), 1),
        ((2, 4, 5, 3), (None, 5, 2)),
        ((1, 2, 1, 7, 1), (1, 3, 2)),
        ((0, 2, 4, 4, 4), 2),
        ((1, 2, 4, 4, 4), 0),
    ],
}
CASES = [
    pytest.param(kind, ndim, shape, size, variant, id=f"{kind}{ndim}d-{shape}->{size}-{variant}")
    for kind in ("avg", "max")
    for ndim, shapes in SHAPES.items()
    for shape, size in shapes
    # every variant that can run the problem (backward thread_per_row: average pooling, no input in
    # more than two windows along W)
    for variant in legal_variants(f"adaptive_{kind}_pool{ndim}d", "backward", shape, size)
]


def out_shape_of(shape, size, ndim):
    return shape[:-ndim] + resolve_output_size(size, shape[-ndim:])


def our_forward_indices(op, x, size):
    """Our forward's indices -- checked against the reference and PyTorch before they are used."""
    ndim = int(op[-2])
    values, indices = getattr(pt, op)(x, size, return_indices=True)
    ref_values, ref_indices = reference.forward(op, x, size)
    np.testing.assert_array_equal(values, ref_values)
    np.testing.assert_array_equal(indices, ref_indices)
    if x.size and indices.size:
        t_values, t_indices = getattr(torch.nn.functional, op)(
            torch.from_numpy(x), indices.shape[-ndim:], return_indices=True)
        np.testing.assert_array_equal(values, t_values.numpy())
        np.testing.assert_array_equal(indices, t_indices.numpy())
    return indices


def torch_grad(op, x, size, grad_out):
    """PyTorch autograd's input gradient, in float64."""
    ndim = int(op[-2])
    x64 = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    fn = getattr(torch.nn.functional, op)
    y = fn(x64, grad_out.shape[-ndim:])  # (torch's 1d ops take no None entries)
    y.backward(torch.from_numpy(grad_out.astype(np.float64)))
    return x64.grad.numpy()


def run_backward(op, grad_out, shape, indices=None, **kwargs):
    if op.startswith("adaptive_max"):
        return getattr(pt, f"{op}_backward")(grad_out, indices, shape, **kwargs)
    return getattr(pt, f"{op}_backward")(grad_out, shape, **kwargs)


@pytest.mark.parametrize("kind,ndim,shape,size,variant", CASES)
def test_backward_matches_reference_and_autograd(kind, ndim, shape, size, variant, rng):
    op = f"adaptive_{kind}_pool{ndim}d"
    x = random_input(rng, shape)
    grad_out = random_input(rng, out_shape_of(shape, size, ndim))
    indices = our_forward_indices(op, x, size) if kind == "max" else None
    grad_in = run_backward(op, grad_out, shape, indices, variant=variant)
    assert isinstance(grad_in, np.ndarray)
    assert grad_in.shape == shape
    assert grad_in.dtype == np.float32
    assert grad_in.flags.c_contiguous
    assert not np.isnan(grad_in).any(), "some input gradients were never written (poisoned NaN left)"
    if grad_out.size == 0:
        np.testing.assert_array_equal(grad_in, np.zeros(shape, np.float32))  # nothing flows back
    expected = reference.backward(op, grad_out, shape, indices)
    np.testing.assert_allclose(grad_in, expected, **FLOAT32_TOL)
    if x.size and grad_out.size:  # (PyTorch refuses some empty cases; the reference covers them)
        np.testing.assert_allclose(grad_in, torch_grad(op, x, size, grad_out), **FLOAT32_TOL)


def test_design_worked_example_backward():
    grad_in = pt.adaptive_avg_pool1d_backward(np.array([[[1, 2, 3, 4]]], np.float32), (1, 1, 14))
    expected = [.25, .25, .25, .75, .5, .5, .5, .75, .75, .75, 1.75, 1, 1, 1]
    np.testing.assert_array_equal(grad_in.ravel(), np.array(expected, np.float32))


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_output_size_zero_gives_zero_gradient(ndim):
    """Nothing flows back from an empty output.  (PyTorch's forward accepts output size 0, but its
    backward refuses an empty grad_output, so the expectation is written by hand.)"""
    shape = (2, 3) + (5,) * ndim
    grad_out = np.ones((2, 3) + (0,) * ndim, np.float32)
    for op, args in ((f"adaptive_avg_pool{ndim}d", ()),
                     (f"adaptive_max_pool{ndim}d", (np.zeros(grad_out.shape, np.int64),))):
        grad_in = getattr(pt, f"{op}_backward")(grad_out, *args, shape)
        assert grad_in.shape == shape and grad_in.dtype == np.float32
        np.testing.assert_array_equal(grad_in, np.zeros(shape, np.float32))


# ---------------------------------------------------------------- determinism

#: Non-divisible shapes (overlapping windows: inputs receive several contributions).
NON_DIVISIBLE = [((2, 5, 13), 5), ((2, 5, 10, 9), (4, 7)), ((1, 2, 5, 5), (7, 7)), ((2, 3, 5, 6, 7), (3, 4, 2))]
#: Besides every variant's default: configurations that change how work is split.
EXTRA_CONFIGS = {
    "thread_per_input": [{"block_size_x": 32, "inputs_per_thread": 8}],
    "plane_scatter": [{"block_size_x": 1}],
    "thread_per_row": [{"block_size_x": 1}, {"block_size_x": 256}],
    "smem_tiled": [{"block_size_x": 4, "block_size_y": 2, "tile_x": 2, "tile_y": 4},
                   {"block_size_x": 16, "block_size_y": 1, "tile_x": 1, "tile_y": 1}],
}


@pytest.mark.parametrize("kind", ["avg", "max"])
@pytest.mark.parametrize("shape,size", NON_DIVISIBLE, ids=[f"{s}->{o}" for s, o in NON_DIVISIBLE])
def test_backward_is_bit_identical_across_runs_and_variants(kind, shape, size, rng):
    ndim = len(shape) - 2
    op = f"adaptive_{kind}_pool{ndim}d"
    x = random_input(rng, shape)
    grad_out = random_input(rng, out_shape_of(shape, size, ndim))
    indices = our_forward_indices(op, x, size) if kind == "max" else None
    results = {}
    for variant in legal_variants(op, "backward", shape, size):
        first = run_backward(op, grad_out, shape, indices, variant=variant)
        again = run_backward(op, grad_out, shape, indices, variant=variant)
        assert np.array_equal(first, again), f"{variant}: two runs differ"
        results[variant] = first
        if ndim >= 2:  # the extra configurations on the 2d/3d shapes only (each is a compile)
            for config in EXTRA_CONFIGS.get(variant, []):
                results[f"{variant} {config}"] = run_backward(op, grad_out, shape, indices, variant=variant,
                                                              config=config)
    baseline_name, baseline = next(iter(results.items()))
    np.testing.assert_allclose(baseline, reference.backward(op, grad_out, shape, indices), **FLOAT32_TOL)
    for name, result in results.items():
        assert np.array_equal(result, baseline), f"{name} differs from {baseline_name}"


# ---------------------------------------------------------------- bad input

X_SHAPE = (2, 5, 10, 9)
G = np.ones((2, 5, 4, 7), np.float32)
IDX = np.zeros((2, 5, 4, 7), np.int64)  # position 0 is inside the windows of row 0, column 0 only


def good_indices():
    x = np.random.default_rng(0).uniform(-1, 1, X_SHAPE).astype(np.float32)
    return reference.forward("adaptive_max_pool2d", x, (4, 7))[1]


def forbid_kernels(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a kernel was built or launched for bad input")

    monkeypatch.setattr(dispatch, "prepare", forbidden)
    monkeypatch.setattr(OpenCLDevice, "launch", staticmethod(forbidden))


@pytest.fixture
def no_kernel_may_run(monkeypatch):
    forbid_kernels(monkeypatch)


def _outside_window():
    idx = good_indices()
    idx[0, 0, 0, 0] = 8  # (h=0, w=8) is in the plane but not in the window of output (0, 0)
    return idx


def _out_of_range(value):
    idx = good_indices()
    idx[1, 4, 3, 6] = value
    return idx


avg_bw, max_bw = pt.adaptive_avg_pool2d_backward, pt.adaptive_max_pool2d_backward


@pytest.mark.usefixtures("no_kernel_may_run")
@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: avg_bw(np.ones((2, 4, 4, 7), np.float32), X_SHAPE), ValueError, r"grad_out must have shape \(2, 5\)"),
        (lambda: avg_bw(np.ones((2, 5, 4), np.float32), X_SHAPE), ValueError, r"input_shape \(2, 5, 10, 9\) has 4 dimensions and grad_out \(2, 5, 4\) has 3"),
        (lambda: avg_bw(np.ones((3, 5, 4, 7), np.float32), X_SHAPE), ValueError, "grad_out must have shape"),
        (lambda: max_bw(np.ones((2, 4, 4, 7), np.float32), IDX, X_SHAPE), ValueError, "grad_out must have shape"),
        (lambda: avg_bw(G.astype(np.int32), X_SHAPE), TypeError, "grad_out.dtype"),
        (lambda: avg_bw(G.tolist(), X_SHAPE), TypeError, "grad_out must be a numpy.ndarray"),
        (lambda: avg_bw(G, (10, 9)), ValueError, "input_shape must be 3-d or 4-d"),
        (lambda: avg_bw(G, (1, 2, 3, 10, 9)), ValueError, "input_shape must be 3-d or 4-d"),
        (lambda: avg_bw(G, (2, 3, -10, 9)), ValueError, r"input_shape.*must be >= 0"),
        (lambda: avg_bw(G, (2, 3, 0, 9)), ValueError, "input_shape has a pooled dimension of size 0"),
        (lambda: avg_bw(G, 10), TypeError, "input_shape must be a tuple of ints"),
        (lambda: avg_bw(G, np.array(X_SHAPE)), TypeError, "input_shape must be a tuple of ints"),
        (lambda: avg_bw(G, X_SHAPE, variant="thread_per_output"), ValueError, "variant must be one of"),
        (lambda: max_bw(G, None, X_SHAPE), TypeError, "indices must be the int64 indices"),
        (lambda: max_bw(G, IDX.astype(np.int32), X_SHAPE), TypeError, "indices must have dtype int64"),
        (lambda: max_bw(G, IDX.astype(np.float32), X_SHAPE), TypeError, "indices must have dtype int64"),
        (lambda: max_bw(G, IDX.tolist(), X_SHAPE), TypeError, "indices must be the same kind of array"),
        (lambda: max_bw(G, IDX[:, :, :3], X_SHAPE), ValueError, "indices must have the shape of grad_out"),
        (lambda: max_bw(G, IDX[0], X_SHAPE), ValueError, "indices must have the shape of grad_out"),
        (lambda: max_bw(G, _out_of_range(-1), X_SHAPE), ValueError, r"indices must lie in \[0, 90\)"),
        (lambda: max_bw(G, _out_of_range(90), X_SHAPE), ValueError, r"indices must lie in \[0, 90\)"),
        (lambda: max_bw(G, _outside_window(), X_SHAPE), ValueError, "indices must each lie inside their output's pooling window"),
        (lambda: max_bw(G, IDX, X_SHAPE), ValueError, "indices must each lie inside"),
    ],
)
def test_bad_backward_argument_is_named(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.usefixtures("no_kernel_may_run")
def test_device_grad_out_with_numpy_indices_is_refused():
    queue = backends.default_device().queue
    with pytest.raises(TypeError, match="indices must be the same kind of array as grad_out"):
        max_bw(cl_array.to_device(queue, G), good_indices(), X_SHAPE)
    with pytest.raises(TypeError, match="indices must be the same kind of array as grad_out"):
        max_bw(G, cl_array.to_device(queue, good_indices()), X_SHAPE)


@pytest.mark.usefixtures("no_kernel_may_run")
def test_device_indices_in_another_layout_are_refused():
    queue = backends.default_device().queue
    idx = good_indices()
    idx_cl_memory = cl_array.to_device(queue, np.ascontiguousarray(idx.transpose(0, 2, 3, 1)))
    idx_cl = cl_array.Array(queue, idx.shape, np.int64, data=idx_cl_memory.data,
                            strides=np.ascontiguousarray(idx.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2).strides)
    with pytest.raises(ValueError, match="indices must have the memory layout of grad_out"):
        max_bw(cl_array.to_device(queue, G), idx_cl, X_SHAPE)


def test_good_indices_pass_the_checks():
    """The bad-input cases above differ from this call in one argument only."""
    idx = good_indices()
    grad_in = max_bw(G, idx, X_SHAPE)
    np.testing.assert_array_equal(grad_in, reference.backward("adaptive_max_pool2d", G, X_SHAPE, idx))


def test_validation_is_not_skipped_after_a_good_call(monkeypatch):
    """The validated problems are memoised; an argument that merely compares equal to a valid one
    (8.0 == 8, True == 1) must still be refused on later calls, before any kernel runs."""
    x = np.ones((2, 3, 8, 8), np.float32)
    grad_out = np.ones((2, 3, 2, 2), np.float32)
    avg_bw(grad_out, (2, 3, 8, 8))  # good calls first: their problems are memoised
    pt.adaptive_avg_pool2d(x, 1)
    pt.adaptive_avg_pool2d(x, (2, 2))
    forbid_kernels(monkeypatch)
    with pytest.raises(TypeError, match="input_shape.*must be an int"):
        avg_bw(grad_out, (2, 3, 8.0, 8))
    with pytest.raises(TypeError, match="output_size must be an int"):
        pt.adaptive_avg_pool2d(x, True)
    with pytest.raises(TypeError, match=r"output_size\[0\] must be an int"):
        pt.adaptive_avg_pool2d(x, (2.0, 2))


def test_numpy_indices_in_any_layout_for_channels_last_grad_out(rng):
    """numpy arguments are laid out by the library: channels-last grad_out with contiguous (or
    strided) indices gives the same gradient, channels-last like grad_out."""
    x = random_input(rng, X_SHAPE)
    indices = our_forward_indices("adaptive_max_pool2d", x, (4, 7))
    grad_out = random_input(rng, G.shape)
    grad_out_cl = np.ascontiguousarray(grad_out.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    expected = reference.backward("adaptive_max_pool2d", grad_out, X_SHAPE, indices)
    strided = np.repeat(indices, 2, axis=-1)[..., ::2]
    for idx in (indices, strided, np.ascontiguousarray(indices.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)):
        grad_in = max_bw(grad_out_cl, idx, X_SHAPE)
        assert memory_layout(grad_in, 2) == "NHWC"
        np.testing.assert_allclose(grad_in, expected, **FLOAT32_TOL)
