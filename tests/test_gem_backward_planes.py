"""GeM's backward over small channels-first planes on a CPU device: the plane form of the
input-gradient pass (kernels/operators/gem_plane_gradient.c, a work-item per plane), chosen by
``gem.input_gradient_form`` and named by ``explain``.  Its gradient of x has the bits of the
element form (gem_input_gradient.c, which channels-last memory runs), over NaN, negative, zero,
below-eps and eps inputs; both gradients against the float64 reference and PyTorch's composition;
dL/dp the same bits for any slab size."""

import numpy as np
import pytest

import pool_tuner as pt
from pool_tuner import gem, reference
from pool_tuner.problem import LAYOUT_NAMES, Problem

from conftest import EXHAUSTIVE, gem_p_term_magnitude

TOL = {"float64": 1e-12, "float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}
FUNCTIONS = {1: (pt.adaptive_gem_pool1d, pt.adaptive_gem_pool1d_backward),
             2: (pt.adaptive_gem_pool2d, pt.adaptive_gem_pool2d_backward),
             3: (pt.adaptive_gem_pool3d, pt.adaptive_gem_pool3d_backward)}
# (shape, output size): planes in whole vector steps (64 inputs into 16 outputs: the limits), a last
# step that ends at the plane's end (49, 25, 13 inputs), fewer than eight inputs, a plane count that
# does not fill the last work-group, global pooling, 1d and 3d
PLANE_CASES = [((3, 70, 7, 7), 2), ((2, 64, 7, 7), 3), ((2, 33, 5, 5), (2, 3)), ((2, 16, 8, 8), (4, 4)),
               ((2, 9, 2, 3), 2), ((2, 16, 7, 7), 1), ((3, 5, 13), 3), ((2, 7, 3, 4, 4), (1, 2, 2))]
P_VALUES = [3.0, 2.2]


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return np.dtype(name)


def _channels_last(x):
    return np.moveaxis(np.ascontiguousarray(np.moveaxis(x, 1, -1)), -1, 1)


def _problem(shape, size, dtype, layout=None):
    return Problem.create(FUNCTIONS[len(shape) - 2][0].__name__, shape, size, dtype, layout, direction="backward")


def _edge_input(rng, shape, dtype):
    """Features in [0, 2) with zeros, negatives, values just below eps, eps itself and NaNs."""
    x = rng.random(shape) * 2
    pick = rng.random(shape)
    x[pick < 0.08] = 0.0
    x[(pick >= 0.08) & (pick < 0.12)] = -rng.random()
    x[(pick >= 0.12) & (pick < 0.14)] = 5e-7
    x[(pick >= 0.14) & (pick < 0.16)] = 1e-6
    x[(pick >= 0.16) & (pick < 0.17)] = np.nan
    x.flat[5] = np.nan
    return x.astype(_dtype(dtype))


def _finite_input(rng, shape, dtype):
    x = rng.random(shape) * 2
    x[rng.random(shape) < 0.1] = 0.0
    return x.astype(_dtype(dtype))


def _bits(array):
    return array.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[array.itemsize])


@pytest.mark.parametrize("shape,size", PLANE_CASES)
def test_small_channels_first_planes_run_the_plane_form_and_explain_says_so(shape, size):
    ndim = len(shape) - 2
    forward = FUNCTIONS[ndim][0]
    info = pt.explain(forward.__name__, shape, size, direction="backward")
    assert (info["variant"], info["params"], info["source"]) == (gem.PLANE_FORM.kernel, gem.PLANE_FORM.config, "own")
    channels_last = pt.explain(forward.__name__, shape, size, layout=LAYOUT_NAMES[ndim][1], direction="backward")
    assert (channels_last["variant"], channels_last["params"]) == (gem.INPUT_GRADIENT_KERNEL, gem.INPUT_GRADIENT_CONFIG)


@pytest.mark.parametrize("shape,size", [((2, 3, 9, 8), 2), ((2, 3, 7, 7), (5, 4)), ((2, 3, 12, 12), 4)])
def test_planes_past_the_limits_run_the_element_form(shape, size):
    """More than 64 inputs, or more than 16 outputs, per plane: the element form."""
    info = pt.explain("adaptive_gem_pool2d", shape, size, direction="backward")
    assert (info["variant"], info["params"]) == (gem.INPUT_GRADIENT_KERNEL, gem.INPUT_GRADIENT_CONFIG)


@pytest.mark.parametrize("dtype", ["float32", *(pytest.param(d, marks=EXHAUSTIVE) for d in ("float16", "bfloat16")),
                                   "float64"])
@pytest.mark.parametrize("shape,size", PLANE_CASES)
def test_the_plane_form_has_the_element_forms_bits_for_x(rng, shape, size, dtype):
    """The gradient of x, NaN, negative, zero, below-eps and eps inputs included, to the bit: each
    input's share summed in ascending output order as the element form sums it (channels-last
    memory runs the element form); dL/dp close to the element form's (its terms grouped by plane)."""
    ndim = len(shape) - 2
    forward, backward = FUNCTIONS[ndim]
    for p in P_VALUES:
        x = _edge_input(rng, shape, dtype)
        y = forward(x, size, p=p)
        g = rng.standard_normal(y.shape).astype(x.dtype)
        planes, planes_p = backward(g, x, size, p=p, output=y)
        elements, elements_p = backward(g, _channels_last(x), size, p=p, output=y)
        assert planes.dtype == x.dtype and planes.shape == x.shape
        assert np.array_equal(_bits(planes), _bits(np.ascontiguousarray(elements))), p
        assert np.isnan(planes_p) and np.isnan(elements_p)  # NaN inputs make NaN outputs, which make dL/dp NaN
        finite = _finite_input(rng, shape, dtype)
        y = forward(finite, size, p=p)
        planes, planes_p = backward(g, finite, size, p=p, output=y)
        elements, elements_p = backward(g, _channels_last(finite), size, p=p, output=y)
        assert np.array_equal(_bits(planes), _bits(np.ascontiguousarray(elements))), p
        y64 = reference.adaptive_gem_pool(finite.astype(np.float64), size, ndim, p)
        magnitude = gem_p_term_magnitude(g, y64, p)
        assert abs(planes_p - elements_p) <= TOL[dtype] * magnitude, p


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("shape,size", PLANE_CASES)
def test_the_plane_form_matches_the_reference(rng, shape, size, dtype):
    ndim = len(shape) - 2
    forward, backward = FUNCTIONS[ndim]
    for p in P_VALUES:
        x = _finite_input(rng, shape, dtype)
        x.flat[::11] = -1.0  # below eps: no gradient
        y = forward(x, size, p=p)
        g = rng.standard_normal(y.shape).astype(x.dtype)
        grad_x, grad_p = backward(g, x, size, p=p)
        expected_x, expected_p = reference.adaptive_gem_pool_backward(g.astype(np.float64), x.astype(np.float64),
                                                                      size, ndim, p)
        scale = np.abs(expected_x).max()
        np.testing.assert_allclose(grad_x.astype(np.float64), expected_x, rtol=TOL[dtype] * 10,
                                   atol=TOL[dtype] * 10 * scale)
        assert (grad_x.astype(np.float64).flat[::11] == 0).all()
        # dL/dp sums terms of both signs: its error is relative to their magnitude, not to the sum
        y64 = reference.adaptive_gem_pool(x.astype(np.float64), size, ndim, p)
        magnitude = gem_p_term_magnitude(g, y64, p)
        assert abs(grad_p - expected_p) <= TOL[dtype] * 10 * magnitude, p


@pytest.mark.parametrize("dtype,p", [("float32", 3.0), ("float16", 2.2)])
@pytest.mark.parametrize("shape,size", [((8, 100, 7, 7), 2), ((8, 64, 2, 3), 2)])
def test_the_plane_form_in_slabs_has_the_bits_of_one_pass(rng, monkeypatch, shape, size, p, dtype):
    """The host backward's smallest slabs and one pass over the whole: the same gradient and dL/dp
    to the bit (one term per plane, added by the host in plane order whatever the slabs)."""
    x = _finite_input(rng, shape, dtype)
    y = pt.adaptive_gem_pool2d(x, size, p=p)
    g = rng.standard_normal(y.shape).astype(x.dtype)
    problem = _problem(shape, size, dtype)
    assert pt.explain("adaptive_gem_pool2d", shape, size, dtype, direction="backward")["variant"] == \
        gem.PLANE_FORM.kernel
    monkeypatch.setattr(gem, "MIN_SLAB_INPUTS", 1 << 40)
    assert len(gem.slabs(problem)) == 1
    whole = pt.adaptive_gem_pool2d_backward(g, x, size, p=p, output=y)
    monkeypatch.setattr(gem, "SLAB_SHARE_OF_INPUT", 0.0)
    monkeypatch.setattr(gem, "MIN_SLAB_INPUTS", 1)
    assert len(gem.slabs(problem)) > 1
    sliced = pt.adaptive_gem_pool2d_backward(g, x, size, p=p, output=y)
    assert np.array_equal(_bits(sliced[0]), _bits(whole[0])) and sliced[1] == whole[1]
    expected_x, expected_p = reference.adaptive_gem_pool_backward(g.astype(np.float64), x.astype(np.float64), size,
                                                                  2, p)
    y64 = reference.adaptive_gem_pool(x.astype(np.float64), size, 2, p)
    magnitude = gem_p_term_magnitude(g, y64, p)
    assert abs(sliced[1] - expected_p) <= TOL[dtype] * 10 * magnitude


@pytest.mark.parametrize("dtype,size", [("float32", 2), ("float16", 3)])
def test_torch_backward_with_a_learnt_p_matches_the_composition(rng, dtype, size):
    """Through pool_tuner.torch with p an nn.Parameter (issue 37's case, smaller): the gradients of x
    and p against PyTorch's composition in float64."""
    torch = pytest.importorskip("torch")
    import pool_tuner.torch as ptt

    tdtype = getattr(torch, dtype)
    x = torch.from_numpy(_finite_input(rng, (4, 96, 7, 7), "float64")).to(tdtype).requires_grad_()
    p = torch.nn.Parameter(torch.tensor([2.6]))
    y = ptt.adaptive_gem_pool2d(x, size, p, 1e-6)
    g = torch.from_numpy(rng.standard_normal(tuple(y.shape))).to(tdtype)
    y.backward(g)
    x64, p64 = x.detach().double().requires_grad_(), p.detach().double().requires_grad_()
    ptt._gem_composition(x64, [size, size], p64, 1e-6).backward(g.double())
    scale = x64.grad.abs().max().item()
    tol = TOL[dtype]
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=tol * 10, atol=tol * 10 * scale)
    torch.testing.assert_close(p.grad.double(), p64.grad, rtol=tol * 100, atol=tol * 100)
