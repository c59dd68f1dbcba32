"""pool_tuner.torch returns what PyTorch returns down to the memory layout: results, indices and
input gradients have PyTorch's strides, since users ``.view()`` them (a channels-last result
makes ``y.view(n, -1)`` raise where PyTorch's contiguous one does not).

PyTorch's rule, which these tests hold pool_tuner to by comparing with PyTorch itself:
channels-last where a batched 1d or 2d pooling's input has its channel axis innermost in memory
(``torch.channels_last``), contiguous for every other input -- batch-less ones, and 3d pooling's
``channels_last_3d`` -- whatever layout pool_tuner's kernel read the input in; an average to
all-ones, which PyTorch computes as a mean, gives a contiguous gradient.  The inputs are
channel-innermost, where the layouts can differ, of every rank, batched and batch-less."""

import numpy as np
import pytest

from conftest import random_input

torch = pytest.importorskip("torch")
pytest.importorskip("ml_dtypes")

import torch.nn.functional as F  # noqa: E402

import pool_tuner.torch as ptt  # noqa: E402
from pool_tuner import torch_cpu  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)
NDIMS = (1, 2, 3)
#: Per rank, the pooled input sizes: pooled to 3 (overlapping windows) or to 1 (global pooling).
SPATIAL = {1: (7,), 2: (7, 6), 3: (5, 6, 4)}


def channels_innermost(rng, ndim: int, batched: bool) -> torch.Tensor:
    """Fresh random values, shape ``([2,] 5, *spatial)``, the channel axis innermost in memory."""
    shape = ((2,) if batched else ()) + (5,) + SPATIAL[ndim]
    c = len(shape) - ndim - 1
    memory = shape[:c] + shape[c + 1:] + (shape[c],)
    x = torch.from_numpy(random_input(rng, memory)).movedim(-1, c)
    assert not x.is_contiguous()
    return x


def random_like(rng, t: torch.Tensor) -> torch.Tensor:
    """A contiguous gradient for ``t``, fresh random values."""
    return torch.from_numpy(random_input(rng, tuple(t.shape)))


def assert_same_layout(got: torch.Tensor, expected: torch.Tensor):
    """Equal shapes and equal strides on every axis longer than 1: the memory layout, which is
    what ``.view()`` depends on (PyTorch's own strides of axes of size 1 vary with the path its
    kernel takes: a mean for global average pooling, ``as_strided`` after it)."""
    assert got.shape == expected.shape
    longer = [axis for axis, n in enumerate(got.shape) if n != 1]
    assert [got.stride(axis) for axis in longer] == [expected.stride(axis) for axis in longer], (
        f"strides {got.stride()}, PyTorch's {expected.stride()}")


def flattens(t: torch.Tensor, batched: bool) -> bool:
    """Whether ``t.view(n, -1)`` (batch-less: ``t.view(-1)``) works: what a head after pooling does."""
    try:
        t.view(t.shape[0], -1) if batched else t.view(-1)
    except RuntimeError:
        return False
    return True


def pytorch_pool(kind: str, ndim: int):
    return getattr(F, f"adaptive_{kind}_pool{ndim}d")


def gradient(y, x, grad, create_graph=False):
    (found,) = torch.autograd.grad(y, x, grad, create_graph=create_graph)
    return found


@pytest.mark.parametrize("size", [3, 1])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "batchless"])
@pytest.mark.parametrize("ndim", NDIMS)
@pytest.mark.parametrize("kind", ["avg", "max"])
def test_results_indices_and_gradients_are_laid_out_as_pytorchs(kind, ndim, batched, size, rng):
    """Forward without a gradient (the eager plan), with one (the custom op and its autograd), and
    the gradient of a gradient's graph (``create_graph=True``): PyTorch's layout and values."""
    x = channels_innermost(rng, ndim, batched)
    extra = {"return_indices": True} if kind == "max" else {}
    expected = pytorch_pool(kind, ndim)(x, size, **extra)
    got = getattr(ptt, f"adaptive_{kind}_pool{ndim}d")(x, size, **extra)
    for g, e in zip(*((got, expected) if kind == "max" else ((got,), (expected,)))):
        assert_same_layout(g, e)
        torch.testing.assert_close(g, e, **TOL)
    values = got[0] if kind == "max" else got
    assert flattens(values, batched) == flattens(expected[0] if kind == "max" else expected, batched)
    for create_graph in (False, True):
        x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        ours = getattr(ptt, f"adaptive_{kind}_pool{ndim}d")(x_ours, size)
        theirs = pytorch_pool(kind, ndim)(x_theirs, size)
        assert_same_layout(ours, theirs)
        grad = random_like(rng, ours)
        got_grad, expected_grad = gradient(ours, x_ours, grad, create_graph), gradient(theirs, x_theirs, grad)
        assert_same_layout(got_grad, expected_grad)
        torch.testing.assert_close(got_grad, expected_grad, **TOL)



def _rig_race(monkeypatch, winner: str):
    """Every race ends with ``winner`` running the layer (both sides still timed)."""
    real = torch_cpu.race_pytorch

    def rigged(found, x, output_size, form=None):
        real(found, x, output_size, form)
        return winner == "pytorch"

    monkeypatch.setattr(torch_cpu, "race_pytorch", rigged)


#: (kind, ndim, batched): channels_last_3d, a batch-less 2d input, batched 1d and 2d channels-last.
RACED = [("avg", 3, True), ("max", 2, False), ("avg", 1, True), ("max", 2, True)]


@pytest.mark.usefixtures("candidate_on")
@pytest.mark.parametrize("winner", ["pytorch", "pool_tuner"])
@pytest.mark.parametrize("kind,ndim,batched", RACED)
def test_the_layout_is_pytorchs_whichever_side_won_the_race(monkeypatch, winner, kind, ndim, batched, rng):
    """A small eager layer on a CPU tensor runs PyTorch's kernel or pool_tuner's, as its first
    call's race decided: what it returns has PyTorch's strides either way."""
    _rig_race(monkeypatch, winner)
    x = channels_innermost(rng, ndim, batched)
    extra = {"return_indices": True} if kind == "max" else {}
    got = getattr(ptt, f"adaptive_{kind}_pool{ndim}d")(x, 3, **extra)
    expected = pytorch_pool(kind, ndim)(x, 3, **extra)
    for g, e in zip(*((got, expected) if kind == "max" else ((got,), (expected,)))):
        assert_same_layout(g, e)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, theirs = getattr(ptt, f"adaptive_{kind}_pool{ndim}d")(x_ours, 3), pytorch_pool(kind, ndim)(x_theirs, 3)
    grad = random_like(rng, ours)
    assert_same_layout(gradient(ours, x_ours, grad), gradient(theirs, x_theirs, grad))



@pytest.mark.parametrize("size", [3, 1])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "batchless"])
@pytest.mark.parametrize("ndim", NDIMS)
@pytest.mark.parametrize("kind", ["avg", "max"])
def test_the_fake_implementations_promise_the_real_layout(kind, ndim, batched, size, rng):
    """The custom ops' fake implementations (what torch.compile and torch.export lay their graphs
    out by) give the real results' and gradient's layout (opcheck's and Inductor's stride checks
    likewise leave axes of size 1 out): forward and backward on meta tensors."""
    op = getattr(torch.ops.pool_tuner, f"adaptive_{kind}_pool{ndim}d")
    x = channels_innermost(rng, ndim, batched)
    grad = None
    found = []
    for t in (x.clone(), x.to("meta")):
        t.requires_grad_()
        out = op(t, [size] * ndim, "")
        values, indices = out if kind == "max" else (out, None)
        grad = random_like(rng, values) if grad is None else grad.to("meta")
        found.append([r for r in (values, indices, gradient(values, t, grad)) if r is not None])
    for real, fake in zip(*found):
        assert_same_layout(fake, real)


@pytest.fixture
def fresh_dynamo():
    """Dynamo forgets other tests' compiled code before and after."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("kind,ndim", [("avg", 3), ("max", 2)])
def test_compiled_results_and_gradients_are_laid_out_as_eager_and_pytorchs(kind, ndim, rng):
    """torch.compile(fullgraph=True) of a batched channels_last_3d and a batched channels-last
    input: the compiled graph's result, indices and gradient have eager's strides, which are
    PyTorch's."""
    x = channels_innermost(rng, ndim, batched=True)
    extra = {"return_indices": True} if kind == "max" else {}

    def pool(t):
        return getattr(ptt, f"adaptive_{kind}_pool{ndim}d")(t, 3, **extra)

    compiled = torch.compile(pool, fullgraph=True, backend="aot_eager")
    grad = None
    found = []
    for fn in (compiled, pool, lambda t: pytorch_pool(kind, ndim)(t, 3, **extra)):
        t = x.clone().requires_grad_()
        out = fn(t)
        values = out[0] if kind == "max" else out
        grad = random_like(rng, values) if grad is None else grad
        found.append((*(out if kind == "max" else (out,)), gradient(values, t, grad)))
    for got_compiled, got_eager, expected in zip(*found):
        assert got_compiled.stride() == got_eager.stride() == expected.stride()
        torch.testing.assert_close(got_compiled, expected, **TOL)


@pytest.mark.parametrize("size", [3, 1])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "batchless"])
@pytest.mark.parametrize("ndim", NDIMS)
def test_gem_is_laid_out_as_pytorchs_average_pooling(ndim, batched, size, rng):
    """GeM, an average of powers, has the layout of PyTorch's average pooling of the same input:
    its result, its gradient (the kernel's, without a gradient's graph; the composition's, with
    one), and what its custom op's fake implementations promise; values as PyTorch's composition's.
    The gradient's layout is the average's at a size other than 1 also at size 1, where PyTorch
    computes the average as a mean, whose gradient is contiguous (PyTorch's GeM composition keeps
    a batched channels-last input's channels-last there too, and a copy would double GeM's
    backward's memory)."""
    x = channels_innermost(rng, ndim, batched).abs()
    gem, average = getattr(ptt, f"adaptive_gem_pool{ndim}d"), pytorch_pool("avg", ndim)
    got, expected = gem(x, size, 3.0), average(x, size)
    assert_same_layout(got, expected)
    assert flattens(got, batched) == flattens(expected, batched)
    torch.testing.assert_close(got.double(), ptt._gem_composition(x.double(), [size] * ndim, 3.0, 1e-6), **TOL)
    x_theirs = x.clone().requires_grad_()
    averaged = average(x_theirs, 3)
    expected_grad = gradient(averaged, x_theirs, random_like(rng, averaged))
    for create_graph in (False, True):
        x_ours, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
        ours = gem(x_ours, size, 3.0)
        grad = random_like(rng, ours)
        got_grad = gradient(ours, x_ours, grad, create_graph)
        assert_same_layout(got_grad, expected_grad)
        composed = gradient(ptt._gem_composition(x64, [size] * ndim, 3.0, 1e-6), x64, grad.double())
        torch.testing.assert_close(got_grad.double(), composed, rtol=1e-4, atol=1e-5)
    x_meta = x.to("meta").requires_grad_()
    op = getattr(torch.ops.pool_tuner, f"adaptive_gem_pool{ndim}d")
    fake = op(x_meta, [size] * ndim, torch.tensor([3.0], device="meta"), 1e-6, "")
    assert_same_layout(fake, got)
    assert_same_layout(gradient(fake, x_meta, grad.to("meta")), got_grad)


@pytest.mark.parametrize("sizes", [[2, 3], [1]], ids=["2,3", "1"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "batchless"])
@pytest.mark.parametrize("ndim", NDIMS)
@pytest.mark.parametrize("kind", ["avg", "max"])
def test_pyramid_levels_are_laid_out_as_single_poolings(kind, ndim, batched, sizes, rng):
    """Each level of a pyramid (one read of the input, flat buffers viewed level by level) has
    the layout and values of PyTorch's adaptive pooling to its size, indices too; the gradient of
    all levels, PyTorch's of the levels pooled one by one; the custom ops' fakes promise the same."""
    x = channels_innermost(rng, ndim, batched)
    pyramid = getattr(ptt, f"adaptive_{kind}_pool_pyramid")
    extra = {"return_indices": True} if kind == "max" else {}
    got = pyramid(x, sizes, ndim=ndim, **extra)
    for position, size in enumerate(sizes):
        expected = pytorch_pool(kind, ndim)(x, size, **extra)
        for g, e in zip(*(([got[0][position], got[1][position]], expected) if kind == "max"
                          else ([got[position]], [expected]))):
            assert_same_layout(g, e)
            torch.testing.assert_close(g, e, **TOL)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    levels = pyramid(x_ours, sizes, ndim=ndim)
    grads = [random_like(rng, level) for level in levels]
    got_grad = gradient(levels, x_ours, grads)
    expected_grad = gradient([pytorch_pool(kind, ndim)(x_theirs, size) for size in sizes], x_theirs, grads)
    assert_same_layout(got_grad, expected_grad)
    torch.testing.assert_close(got_grad, expected_grad, **TOL)
    op = ptt._LEVEL_OPS[f"adaptive_{kind}_pool_pyramid{ndim}d", False]
    found = []
    for t in (x.clone(), x.to("meta")):
        t.requires_grad_()
        flat = op(t, [n for size in sizes for n in [size] * ndim], "")
        flat = flat[0] if kind == "max" else flat
        found.append(gradient(flat, t, torch.ones_like(flat)))
    assert_same_layout(found[1], found[0])


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "batchless"])
def test_fused_avg_and_max_levels_are_laid_out_as_single_poolings(batched, rng):
    """An avg and a max pooling of one tensor fused into one read (``fused_adaptive_pools``, what
    ``replace_pooling(fuse=True)`` runs; the avg+max op): each as PyTorch's, and the gradient."""
    x = channels_innermost(rng, 2, batched)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = ptt.fused_adaptive_pools(x_ours, (("avg", 3), ("max", 3)), 2)
    expected = (F.adaptive_avg_pool2d(x_theirs, 3), F.adaptive_max_pool2d(x_theirs, 3))
    for g, e in zip(got, expected):
        assert_same_layout(g, e)
        torch.testing.assert_close(g, e, **TOL)
    grads = [random_like(rng, level) for level in got]
    assert_same_layout(gradient(got, x_ours, grads), gradient(expected, x_theirs, grads))


def _timms_global_pool(x, mode: str, input_fmt: str):
    """timm's fast pooling layers' computation (``x.mean``/``x.amax`` over the spatial dims)."""
    dims, channel = ((2, 3), 1) if input_fmt == "NCHW" else ((1, 2), 3)
    avg, mx = x.mean(dims, keepdim=True), x.amax(dims, keepdim=True)
    return 0.5 * avg + 0.5 * mx if mode == "avg+max" else torch.cat((avg, mx), channel)


@pytest.mark.usefixtures("candidate_on")
@pytest.mark.parametrize("winner", ["pytorch", "pool_tuner"])
@pytest.mark.parametrize("mode", ["avg+max", "cat"])
@pytest.mark.parametrize("input_fmt", ["NCHW", "NHWC"])
def test_global_pool2d_is_laid_out_as_timms_whichever_side_won_the_race(monkeypatch, winner, mode, input_fmt, rng):
    """timm's fast avg+max layers (``GlobalPool2d``) on a channels-last feature map (NCHW in
    channels-last memory, or the NHWC tensor of that memory): the result and the gradient have the
    layout of timm's computation, which runs where it won the race, also where pool_tuner's
    kernels ran (a channels-last input's amax gradient is channels-last, the mean's contiguous:
    their sum has the layout of the one autograd adds first)."""
    _rig_race(monkeypatch, winner)
    x = channels_innermost(rng, 2, batched=True)
    x = x if input_fmt == "NCHW" else x.movedim(1, -1)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, expected = ptt.global_pool2d(x_ours, mode, input_fmt=input_fmt), _timms_global_pool(x_theirs, mode, input_fmt)
    assert_same_layout(got, expected)
    torch.testing.assert_close(got, expected, **TOL)
    grad = random_like(rng, got)
    got_grad, expected_grad = gradient(got, x_ours, grad), gradient(expected, x_theirs, grad)
    assert_same_layout(got_grad, expected_grad)
    torch.testing.assert_close(got_grad, expected_grad, **TOL)


@pytest.mark.parametrize("kind", ["avg", "max"])
@pytest.mark.parametrize("ndim,batched,size", [(1, True, (None,)), (2, True, (4, None)), (2, False, (None, 3)),
                                               (3, True, (2, None, 3))])
def test_a_jit_trace_keeping_axes_lays_results_out_as_pytorch(kind, ndim, batched, size, rng):
    """torch.jit.trace of a layer whose output size keeps axes (``None``), which folds them into the
    batch and pools the others: its results have PyTorch's layout, on the traced input and on one
    of another size along a kept axis."""
    import warnings

    extra = {"return_indices": True} if kind == "max" else {}
    layer = getattr(ptt, f"Adaptive{kind.capitalize()}Pool{ndim}d")(size, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's
        traced = torch.jit.trace(layer, (channels_innermost(rng, ndim, batched),), check_trace=False)
    for longer in (0, 2):
        x = channels_innermost(rng, ndim, batched)
        x = torch.cat([x] + [x.narrow(-1, 0, 1)] * longer, -1) if longer else x
        x = x.movedim(x.dim() - ndim - 1, -1).contiguous().movedim(-1, x.dim() - ndim - 1)
        resolved = tuple(x.shape[x.dim() - ndim + axis] if n is None else n for axis, n in enumerate(size))
        got, expected = traced(x), pytorch_pool(kind, ndim)(x, resolved, **extra)
        for g, e in zip(*((got, expected) if kind == "max" else ((got,), (expected,)))):
            assert_same_layout(g, e)
            torch.testing.assert_close(g, e, **TOL)
