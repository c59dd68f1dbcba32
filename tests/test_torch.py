"""pool_tuner.torch: modules, functional forms and autograd against PyTorch's own layers."""

import copy
import subprocess
import sys

import numpy as np
import pytest

from conftest import random_input

torch = pytest.importorskip("torch")
ml_dtypes = pytest.importorskip("ml_dtypes")

import torch.nn.functional as F  # noqa: E402

import pool_tuner.torch as ptt  # noqa: E402

FLOAT32_TOL = dict(rtol=1e-5, atol=1e-6)
#: float16/bfloat16 results: float32 accumulation, one rounding to the storage type (a few ulps
#: where the two libraries round differently).
LOW_PRECISION_TOL = {torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}

KINDS = ("avg", "max")
# (input shape, output size) per rank: divisible, non-divisible (overlapping windows),
# upsampling O > I, global O = 1, and batch-less input with a None entry (1d: batch-less global).
# Later tests reuse these shapes (and GRADCHECK's) so that their kernels are already compiled:
# each new shape, dtype or layout costs a kernel build per direction.
CASES = {
    1: [((2, 3, 12), 4), ((2, 3, 14), 4), ((2, 3, 5), 7), ((3, 9), (None,))],
    2: [((2, 3, 8, 8), (4, 4)), ((2, 3, 10, 9), (5, 7)), ((1, 2, 5, 5), (7, 7)), ((2, 3, 7, 7), 1),
        ((3, 10, 9), (None, 4))],
    3: [((1, 2, 4, 6, 6), (2, 3, 3)), ((1, 2, 5, 7, 9), (3, 4, 5)), ((1, 2, 3, 4, 5), (5, 6, 4)),
        ((2, 2, 3, 5, 7), 1), ((2, 5, 7, 9), (2, None, 4))],
}
MATRIX = [(ndim, shape, size) for ndim, cases in CASES.items() for shape, size in cases]
#: One non-divisible case per rank, for the dtype, layout and functional tests.
MAIN = {ndim: CASES[ndim][1] for ndim in CASES}
KIND_NDIM = [(kind, ndim) for kind in KINDS for ndim in (1, 2, 3)]
#: Small float64 problems with overlapping windows, for gradcheck and gradgradcheck.
GRADCHECK = {1: ((2, 2, 7), 3), 2: ((1, 2, 5, 4), (3, 3)), 3: ((1, 1, 3, 4, 5), (2, 3, 3))}


def case_id(case):
    ndim, shape, size = case
    return f"{ndim}d-{'x'.join(map(str, shape))}-to-{size}".replace(" ", "")


def ours(kind, ndim):
    return getattr(ptt, f"Adaptive{kind.capitalize()}Pool{ndim}d")


def theirs(kind, ndim):
    return getattr(torch.nn, f"Adaptive{kind.capitalize()}Pool{ndim}d")


def torch_size(size, shape, ndim):
    """PyTorch's 1d layers take no None entries: resolve them for the torch side."""
    if ndim == 1 and isinstance(size, tuple):
        return tuple(shape[-1] if s is None else s for s in size)
    return size


def make_pair(kind, ndim, shape, size):
    """(our module, torch's module) -- max pooling returns indices."""
    extra = (True,) if kind == "max" else ()
    return ours(kind, ndim)(size, *extra), theirs(kind, ndim)(torch_size(size, shape, ndim), *extra)


def tensor(rng, shape, dtype=torch.float32, requires_grad=True):
    x = torch.from_numpy(random_input(rng, shape)).to(dtype)
    return x.requires_grad_(requires_grad)


def tie_free(shape, dtype=torch.float64, seed=0):
    """Distinct values at least 1/numel apart: finite-difference steps never change an argmax."""
    n = int(np.prod(shape))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return (perm.to(dtype) * (4.0 / n) - 2.0).reshape(shape).requires_grad_()


def run(module, x, grad_seed=0):
    """Output (values, indices or None) and the input gradient for a fixed random grad_out."""
    out = module(x)
    values, indices = out if isinstance(out, tuple) else (out, None)
    g = torch.randn(values.shape, generator=torch.Generator().manual_seed(grad_seed)).to(values.device, values.dtype)
    (grad,) = torch.autograd.grad(values, x, g)
    return values, indices, grad


def assert_close(actual, expected, tol=FLOAT32_TOL):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape and actual.device == expected.device
    torch.testing.assert_close(actual, expected, **tol)


def assert_same_as_torch(kind, ours_result, torch_result, tol=FLOAT32_TOL):
    (values, indices, grad), (t_values, t_indices, t_grad) = ours_result, torch_result
    assert not torch.isnan(values.float()).any(), "an output was never written (poisoned NaN left)"
    if kind == "max":
        assert torch.equal(values, t_values) and values.dtype == t_values.dtype
        assert indices.dtype == torch.int64 and torch.equal(indices, t_indices)
    else:
        assert_close(values, t_values, tol)
    assert_close(grad, t_grad, tol)  # max: overlapping windows sum in another order


# ---------------------------------------------------------------------------------------------
# The six modules against PyTorch's


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", MATRIX, ids=case_id)
def test_module_matches_torch_values_indices_and_gradients(kind, case, rng):
    ndim, shape, size = case
    mine, reference = make_pair(kind, ndim, shape, size)
    x = tensor(rng, shape)
    assert_same_as_torch(kind, run(mine, x), run(reference, x))


@pytest.mark.parametrize("kind,ndim", KIND_NDIM)
def test_gradcheck_float64(kind, ndim):
    shape, size = GRADCHECK[ndim]
    module = ours(kind, ndim)(size)
    x = tie_free(shape)
    assert torch.autograd.gradcheck(module, (x,))
    # Max pooling's double backward is linear too (a gather by index); with tie-free inputs the
    # indices do not move under finite differences, so it is checked like avg's.
    assert torch.autograd.gradgradcheck(module, (x,))


def test_double_backward_of_avg_is_the_forward(rng):
    """d/d(grad_out) of <avg_backward(grad_out), v> is avg_pool(v)."""
    shape, size = GRADCHECK[2]
    x = tensor(rng, shape, torch.float64)
    y = ptt.adaptive_avg_pool2d(x, size)
    g = torch.randn_like(y).requires_grad_()
    (grad_in,) = torch.autograd.grad(y, x, g, create_graph=True)
    v = torch.randn_like(grad_in)
    (grad_g,) = torch.autograd.grad(grad_in, g, v)
    torch.testing.assert_close(grad_g, F.adaptive_avg_pool2d(v, size), rtol=1e-12, atol=1e-12)


def test_double_backward_of_max_is_a_gather():
    shape, size = GRADCHECK[2]
    x = tie_free(shape, seed=1)
    y, idx = ptt.adaptive_max_pool2d(x, size, return_indices=True)
    g = torch.randn_like(y).requires_grad_()
    (grad_in,) = torch.autograd.grad(y, x, g, create_graph=True)
    v = torch.randn_like(grad_in)
    (grad_g,) = torch.autograd.grad(grad_in, g, v)
    expected = torch.gather(v.flatten(2), 2, idx.flatten(2)).reshape(idx.shape)
    assert torch.equal(grad_g, expected)


# ---------------------------------------------------------------------------------------------
# Memory layouts and dtypes


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ndim", [2, 3])
def test_channels_last_results_in_pytorchs_memory_format(kind, ndim, rng):
    """Read in place either way; the results' memory format is PyTorch's: channels-last of a
    ``channels_last`` input, contiguous of a ``channels_last_3d`` one."""
    shape, size = MAIN[ndim]
    memory_format = torch.channels_last if ndim == 2 else torch.channels_last_3d
    x = tensor(rng, shape, requires_grad=False).to(memory_format=memory_format).requires_grad_()
    mine, reference = make_pair(kind, ndim, shape, size)
    result = run(mine, x)
    results_format = memory_format if ndim == 2 else torch.contiguous_format
    assert result[0].is_contiguous(memory_format=results_format)
    if kind == "max":
        assert result[1].is_contiguous(memory_format=results_format)
    assert_same_as_torch(kind, result, run(reference, x))


@pytest.mark.parametrize("kind", KINDS)
def test_channels_last_1d_keeps_its_strides(kind, rng):
    """A (N, C, L) view of (N, L, C) memory is pooled in place and comes out the same way."""
    (n, c, length), size = MAIN[1]
    x = tensor(rng, (n, length, c), requires_grad=False).transpose(1, 2).requires_grad_()
    mine, reference = make_pair(kind, 1, x.shape, size)
    result = run(mine, x)
    assert result[0].stride()[1] == 1
    assert_same_as_torch(kind, result, run(reference, x))


@pytest.mark.parametrize("kind", KINDS)
def test_non_contiguous_input_and_expanded_grad(kind, rng):
    shape, size = MAIN[2]
    wide = tensor(rng, shape[:-1] + (2 * shape[-1],), requires_grad=False)
    x = wide[..., ::2].requires_grad_()  # strided, neither layout: copied by pool_tuner
    assert not x.is_contiguous()
    mine, reference = make_pair(kind, 2, shape, size)
    assert_same_as_torch(kind, run(mine, x), run(reference, x))
    # y.sum() sends back an expanded (stride-0) gradient
    y = mine(x)[0]
    (grad,) = torch.autograd.grad(y.sum(), x)
    (t_grad,) = torch.autograd.grad(reference(x)[0].sum(), x)
    assert_close(grad, t_grad)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ndim,dtype", [(1, torch.float16), (2, torch.float16), (2, torch.bfloat16), (3, torch.bfloat16)],
                         ids=["1d-float16", "2d-float16", "2d-bfloat16", "3d-bfloat16"])
def test_half_precision_tensors(kind, ndim, dtype, rng):
    shape, size = MAIN[ndim]
    x = tensor(rng, shape, dtype)
    mine, reference = make_pair(kind, ndim, shape, size)
    result = run(mine, x)
    assert result[0].dtype == dtype and result[2].dtype == dtype
    assert_same_as_torch(kind, result, run(reference, x), LOW_PRECISION_TOL[dtype])


def test_cpu_tensors_are_pooled_in_their_own_memory(rng, monkeypatch):
    """The kernel reads the tensor's memory itself (PoCL shares host memory): no copy."""
    from pool_tuner.backends.opencl import HostLaunch

    launched = []
    real_call = HostLaunch.__call__

    def record(self, stream, *addresses, scalars=None):
        launched.append(addresses[0])
        real_call(self, stream, *addresses, scalars=scalars)

    monkeypatch.setattr(HostLaunch, "__call__", record)
    base = tensor(rng, (2, 3, 10, 9), requires_grad=True)
    for t in (base, base.detach().to(memory_format=torch.channels_last), base.detach().bfloat16(),
              base.detach().half()[1:]):
        launched.clear()
        ptt.adaptive_avg_pool2d(t, (4, 7))
        assert launched == [t.data_ptr()]


def test_cpu_tensors_cross_to_numpy_without_copies(rng):
    """Where the device does not share host memory, tensors reach ``ops`` as numpy views."""
    from pool_tuner import torch_cpu

    base = tensor(rng, (2, 3, 10, 9), requires_grad=True)
    for t in (base, base.detach().to(memory_format=torch.channels_last), base.detach().bfloat16(),
              base.detach().half()[1:]):
        array = torch_cpu.ops_array(t)
        assert array.__array_interface__["data"][0] == t.data_ptr()
        assert array.strides == tuple(s * t.element_size() for s in t.stride())
    assert torch_cpu.ops_array(base.detach().bfloat16()).dtype == ml_dtypes.bfloat16


# ---------------------------------------------------------------------------------------------
# Autograd behaviour


@pytest.mark.parametrize("kind", KINDS)
def test_no_graph_without_requires_grad(kind, rng):
    shape, size = MAIN[2]
    module = ours(kind, 2)(size, return_indices=True) if kind == "max" else ours(kind, 2)(size)
    x = tensor(rng, shape, requires_grad=False)
    out = module(x)
    for t in out if isinstance(out, tuple) else (out,):
        assert isinstance(t, torch.Tensor) and t.grad_fn is None and not t.requires_grad
    with torch.no_grad():
        y = module(x.clone().requires_grad_())
    y = y[0] if isinstance(y, tuple) else y
    assert y.grad_fn is None and not y.requires_grad


def test_deterministic_algorithms_mode(rng):
    """Forward and backward (and double backward) run under use_deterministic_algorithms(True),
    and repeated gradients are bit-identical."""
    shape, size = MAIN[2]
    x = tensor(rng, shape)
    g = torch.randn(shape[:-2] + size)
    expected = {kind: torch.autograd.grad(getattr(F, f"adaptive_{kind}_pool2d")(x, size), x, g)[0] for kind in KINDS}
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for kind in KINDS:
            fn = getattr(ptt, f"adaptive_{kind}_pool2d")
            grads = []
            for _ in range(2):
                (grad,) = torch.autograd.grad(fn(x, size), x, g.requires_grad_(), create_graph=True)
                grads.append(grad)
                torch.autograd.grad(grad.sum(), g)  # double backward too
            assert torch.equal(grads[0], grads[1])
            assert_close(grads[0], expected[kind])
    finally:
        torch.use_deterministic_algorithms(previous)


def test_empty_batch(rng):
    x = torch.zeros((0, 3, 10, 9), requires_grad=True)
    y, idx = ptt.adaptive_max_pool2d(x, (5, 7), return_indices=True)
    assert y.shape == idx.shape == (0, 3, 5, 7) and idx.dtype == torch.int64
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert ptt.adaptive_avg_pool2d(x, (5, 7)).shape == (0, 3, 5, 7)


@pytest.mark.parametrize("kind", KINDS)
def test_sgd_training_follows_torch(kind):
    """A pooling layer inside nn.Sequential trains exactly as PyTorch's does."""
    (n, c, h, w), size = MAIN[2]  # the pooling layer sees this shape
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, c, 3), torch.nn.ReLU(), theirs(kind, 2)(size), torch.nn.Flatten(),
        torch.nn.Linear(c * size[0] * size[1], 3),
    )
    mine = copy.deepcopy(model)
    mine[2] = ours(kind, 2)(size)
    data = torch.randn(n, 3, h + 2, w + 2, generator=torch.Generator().manual_seed(1))
    target = torch.randn(n, 3, generator=torch.Generator().manual_seed(2))
    losses = []
    for net in (model, mine):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
        trajectory = []
        for _ in range(5):
            optimizer.zero_grad()
            loss = F.mse_loss(net(data), target)
            loss.backward()
            optimizer.step()
            trajectory.append(loss.item())
        losses.append(trajectory)
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    assert losses[0][-1] < losses[0][0]
    for p, q in zip(model.parameters(), mine.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_torch_func_transforms_are_refused_clearly_and_torch_compile_runs(kind, rng):
    """torch.func transforms cannot differentiate torch.library custom ops (PyTorch 2.13): a
    clear error says to use torch.autograd; torch.compile with the "eager" backend (no C++
    compile; tests/test_torch_toolchain.py compiles with fullgraph) gives the eager results."""
    shape, size = MAIN[2]
    x = tensor(rng, shape, requires_grad=False)
    ours_fn, torch_fn = getattr(ptt, f"adaptive_{kind}_pool2d"), getattr(F, f"adaptive_{kind}_pool2d")
    for transform in (torch.func.grad, torch.vmap):
        with pytest.raises(RuntimeError, match="torch.func transforms.*torch.autograd.grad"):
            transform(lambda t: ours_fn(t, size).square().sum())(x)
    compiled = torch.compile(lambda t: torch.relu(ours_fn(t, size)) * 2, backend="eager")
    y = compiled(x.requires_grad_())
    assert_close(y, torch.relu(torch_fn(x, size)) * 2)
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert_close(grad, torch.autograd.grad((torch.relu(torch_fn(x, size)) * 2).sum(), x)[0])


# ---------------------------------------------------------------------------------------------
# API surface


@pytest.mark.parametrize("kind,ndim", KIND_NDIM)
def test_repr_and_attributes_match_torch(kind, ndim):
    for size in (3, (5,) * ndim, (None,) + (4,) * (ndim - 1)):
        extra = {"return_indices": True} if kind == "max" else {}
        mine, reference = ours(kind, ndim)(size, **extra), theirs(kind, ndim)(size, **extra)
        # PyTorch's repr, with the class named as pool_tuner's: a printed model shows the swap
        assert repr(mine) == "pool_tuner.torch." + repr(reference)
        assert isinstance(mine, theirs(kind, ndim))
        assert mine.output_size == reference.output_size
        assert repr(copy.deepcopy(mine)) == repr(mine)
    assert repr(torch.nn.Sequential(ours(kind, ndim)(3))) == repr(torch.nn.Sequential(theirs(kind, ndim)(3))).replace(
        "(0): Adaptive", "(0): pool_tuner.torch.Adaptive")
    assert repr(ours(kind, ndim)(3, variant="thread_per_output")) == (
        f"pool_tuner.torch.Adaptive{kind.capitalize()}Pool{ndim}d(output_size=3, variant='thread_per_output')"
    )


@pytest.mark.parametrize("kind,ndim", KIND_NDIM)
def test_functional_forms_match_torch(kind, ndim, rng):
    shape, size = MAIN[ndim]
    x = tensor(rng, shape, requires_grad=False)
    ours_fn, torch_fn = getattr(ptt, f"adaptive_{kind}_pool{ndim}d"), getattr(F, f"adaptive_{kind}_pool{ndim}d")
    if kind == "avg":
        assert_close(ours_fn(x, size), torch_fn(x, size))
        return
    values = ours_fn(x, size)
    assert isinstance(values, torch.Tensor) and torch.equal(values, torch_fn(x, size))
    values, indices = ours_fn(x, size, True)
    t_values, t_indices = torch_fn(x, size, True)
    assert torch.equal(values, t_values) and torch.equal(indices, t_indices)


def test_functional_passes_pool_tuner_options_through(rng):
    import pool_tuner as pt

    shape, size = MAIN[2]
    x = tensor(rng, shape)
    device = pt.explain("adaptive_avg_pool2d", shape, size)["device"].split()[0]
    y = ptt.adaptive_avg_pool2d(x, size, device=device, variant="thread_per_output", config={"block_size_x": 64})
    assert_close(y, F.adaptive_avg_pool2d(x, size))
    (grad,) = torch.autograd.grad(y.sum(), x)  # the backward kernel is dispatched, not forced
    assert_close(grad, torch.autograd.grad(F.adaptive_avg_pool2d(x, size).sum(), x)[0])
    with pytest.raises(ValueError, match="variant"):
        ptt.adaptive_avg_pool2d(x, size, variant="no_such_variant")
    module = ptt.AdaptiveAvgPool2d(size, variant="thread_per_output")
    assert_close(module(x), y)


@pytest.mark.parametrize("grad_channels_last", [False, True])
@pytest.mark.parametrize("input_channels_last", [False, True])
@pytest.mark.parametrize("kind", ["avg", "max"])
def test_the_input_s_gradient_has_the_input_s_memory_format(rng, kind, input_channels_last, grad_channels_last):
    """As PyTorch's pooling backwards: the gradient in the input's memory format whatever
    ``grad_out``'s (it followed ``grad_out``'s: a channels-last layer given a contiguous gradient,
    as a flatten gives, returned a contiguous one).  Values as PyTorch's."""
    layout = lambda t, channels_last: t.to(memory_format=torch.channels_last) if channels_last else t  # noqa: E731
    x = layout(tensor(rng, (2, 8, 9, 7), requires_grad=False), input_channels_last).requires_grad_()
    y = getattr(ptt, f"adaptive_{kind}_pool2d")(x, (3, 4))
    g = layout(torch.from_numpy(random_input(rng, tuple(y.shape))), grad_channels_last)
    (grad,) = torch.autograd.grad(y, x, g)
    x_ = x.detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad(getattr(F, f"adaptive_{kind}_pool2d")(x_, (3, 4)), x_, g)
    assert grad.is_contiguous(memory_format=torch.channels_last) == input_channels_last
    assert grad.is_contiguous(memory_format=torch.channels_last) == expected.is_contiguous(
        memory_format=torch.channels_last)
    assert_close(grad, expected)


@pytest.mark.parametrize("kind", ["avg", "max"])
def test_a_1x1_result_s_gradient_of_either_layout_is_pytorch_s(rng, kind):
    """A channels-last input pooled to 1x1 with a contiguous gradient, whose strides differ from
    the result's only on axes of size 1 (the same memory): read as it is, the values PyTorch's."""
    x = tensor(rng, (2, 8, 5, 5), requires_grad=False).to(memory_format=torch.channels_last).requires_grad_()
    y = getattr(ptt, f"adaptive_{kind}_pool2d")(x, 1)
    g = torch.from_numpy(random_input(rng, tuple(y.shape)))
    (grad,) = torch.autograd.grad(y, x, g)
    x_ = x.detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad(getattr(F, f"adaptive_{kind}_pool2d")(x_, 1), x_, g)
    assert_close(grad, expected)


def test_replace_pooling_swaps_every_torch_layer(rng):
    model = torch.nn.Sequential(
        torch.nn.Sequential(torch.nn.AdaptiveMaxPool2d((5, 7)), torch.nn.Identity()),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
    )
    x = tensor(rng, MAIN[2][0], requires_grad=False)
    expected = model(x)
    swapped = ptt.replace_pooling(model)
    assert swapped is model
    assert type(model[0][0]) is ptt.AdaptiveMaxPool2d and type(model[1]) is ptt.AdaptiveAvgPool2d
    assert "pool_tuner.torch.AdaptiveMaxPool2d(output_size=(5, 7))" in repr(model)
    assert "pool_tuner.torch.AdaptiveAvgPool2d(output_size=1)" in repr(model)
    assert_close(model(x), expected)
    assert type(ptt.replace_pooling(torch.nn.AdaptiveAvgPool1d(3))) is ptt.AdaptiveAvgPool1d


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(TypeError, match="input must have dtype"):
        ptt.adaptive_avg_pool2d(torch.ones((1, 2, 4, 4), dtype=torch.int64), 2)
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):
        ptt.adaptive_max_pool2d(np.ones((1, 2, 4, 4), np.float32), 2)
    with pytest.raises(ValueError, match="meta"):
        ptt.AdaptiveAvgPool2d(2)(torch.empty((1, 2, 4, 4), device="meta"))
    with pytest.raises(ValueError, match="output_size"):
        ptt.adaptive_avg_pool2d(torch.ones((1, 2, 4, 4)), (2, -1))


def test_importing_pool_tuner_does_not_import_torch():
    code = "import sys, pool_tuner; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------
# CUDA tensors (pool_tuner's CUDA backend, by pointer)

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA tensors need a CUDA GPU: torch.cuda.is_available() is False"
)


@needs_cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_tensors_match_torch(kind, rng):
    shape, size = MAIN[2]
    x = tensor(rng, shape, requires_grad=False).cuda().requires_grad_()
    mine, reference = make_pair(kind, 2, shape, size)
    result = run(mine, x)
    assert result[0].is_cuda and result[2].is_cuda
    assert_same_as_torch(kind, result, run(reference, x))


@needs_cuda
def test_cuda_channels_last_bfloat16_and_determinism(rng):
    shape, size = MAIN[2]
    x = tensor(rng, shape, torch.bfloat16, requires_grad=False).cuda().to(memory_format=torch.channels_last)
    x.requires_grad_()
    y = ptt.adaptive_avg_pool2d(x, size)
    assert y.is_cuda and y.dtype == torch.bfloat16 and y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, F.adaptive_avg_pool2d(x, size), **LOW_PRECISION_TOL[torch.bfloat16])
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # PyTorch's own CUDA backward would refuse here
    try:
        grads = [torch.autograd.grad(ptt.adaptive_avg_pool2d(x, size).float().sum(), x)[0] for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(previous)
    assert torch.equal(grads[0], grads[1])
