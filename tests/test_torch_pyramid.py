"""pool_tuner.torch's multi-level pooling: the pyramid and avg+max functional forms and modules,
their custom ops (fake implementations, autograd, opcheck), torch.compile(fullgraph=True),
torch.export, ONNX export by decomposition, and ``replace_pooling(fuse=True)`` -- on hand-made
models always, on segmentation_models_pytorch's PSPNet and a timm model with
``global_pool="catavgmax"`` where those are installed: same outputs and gradients as stock."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import pool_tuner.torch as ptt  # noqa: E402
from conftest import EXHAUSTIVE, outputs_and_gradients, tiered  # noqa: E402

F = torch.nn.functional
TOL = dict(rtol=1e-5, atol=1e-6)
DTYPE_TOL = {torch.float32: TOL, torch.float64: dict(rtol=1e-12, atol=1e-12),
             torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}


def tensor(rng, shape, dtype=torch.float32):
    x = rng.uniform(-2.0, 2.0, size=shape)
    x[np.abs(x) < 1e-3] = 0.5
    return torch.from_numpy(x).to(dtype)


def _close(got, expected, dtype=torch.float32):
    torch.testing.assert_close(got.double(), expected.double(), **DTYPE_TOL[dtype])


#: (channels-last, dtype): every dtype contiguous and float32 channels-last in the core tier.
LEVEL_CASES = tiered([pytest.param(channels_last, dtype, id=f"{channels_last}-{dtype}")
                      for channels_last in (False, True) for dtype in DTYPE_TOL],
                     core=lambda values: not values[0] or values[1] == torch.float32)


@pytest.mark.parametrize("channels_last,dtype", LEVEL_CASES)
def test_pyramids_match_pytorch_level_by_level(dtype, channels_last, rng):
    x = tensor(rng, (2, 6, 13, 11), dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    sizes = [1, 2, (3, None), 6]
    for got, size in zip(ptt.adaptive_avg_pool_pyramid(x, sizes), sizes):
        expected = F.adaptive_avg_pool2d(x.double(), size)
        _close(got, expected, dtype)
        assert got.dtype == dtype
        if got.shape[-2:].numel() > 1:  # a 1x1 level is both contiguous and channels-last
            assert got.is_contiguous(memory_format=torch.channels_last) == channels_last
    values, indices = ptt.adaptive_max_pool_pyramid(x, sizes, return_indices=True)
    for got, got_indices, size in zip(values, indices, sizes):
        expected, expected_indices = F.adaptive_max_pool2d(x, size, return_indices=True)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert torch.equal(got_indices, expected_indices)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_half_precision_gradients_of_every_multi_level_op_match_pytorch(dtype, deterministic, rng):
    """The backward of each multi-level op in 16-bit floats (bfloat16's once raised "unknown dtype
    'bfloat16'": its flat gradient buffers were checked through numpy, which has no bfloat16);
    deterministic algorithms make avg+max run pool_tuner's kernel rather than PyTorch's."""
    x = tensor(rng, (2, 3, 9, 7), dtype)
    sizes = [1, 2, (3, 4)]
    cases = [(lambda t: ptt.adaptive_avg_pool_pyramid(t, sizes), lambda t: [F.adaptive_avg_pool2d(t, s) for s in sizes]),
             (lambda t: ptt.adaptive_max_pool_pyramid(t, sizes), lambda t: [F.adaptive_max_pool2d(t, s) for s in sizes]),
             (lambda t: [ptt.adaptive_avgmax_pool2d(t, 2)],
              lambda t: [0.5 * (F.adaptive_avg_pool2d(t, 2) + F.adaptive_max_pool2d(t, 2))])]
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        for ours, theirs in cases:
            weights = [tensor(rng, level.shape, torch.float64) for level in theirs(x.double())]
            grads = []
            for fn, t in ((ours, x.clone()), (theirs, x.double())):
                t.requires_grad_()
                sum((level.double() * w).sum() for level, w in zip(fn(t), weights)).backward()
                grads.append(t.grad)
            assert grads[0].dtype == dtype
            _close(grads[0], grads[1], dtype)
    finally:
        torch.use_deterministic_algorithms(previous)


@pytest.mark.parametrize("ndim,shape,sizes", [(1, (2, 3, 17), [1, 5, 20]), (3, (1, 2, 5, 6, 7), [1, 2, (3, 4, 5)])])
def test_pyramids_1d_3d(ndim, shape, sizes, rng):
    x = tensor(rng, shape)
    avg_fn, max_fn = getattr(F, f"adaptive_avg_pool{ndim}d"), getattr(F, f"adaptive_max_pool{ndim}d")
    for got, size in zip(ptt.adaptive_avg_pool_pyramid(x, sizes, ndim=ndim), sizes):
        _close(got, avg_fn(x, size))
    values, indices = ptt.adaptive_max_pool_pyramid(x, sizes, True, ndim=ndim)
    for got, got_indices, size in zip(values, indices, sizes):
        expected, expected_indices = max_fn(x, size, return_indices=True)
        assert torch.equal(got, expected) and torch.equal(got_indices, expected_indices)


@pytest.mark.parametrize("mode", ["avg+max", "cat"])
def test_avgmax_is_timms_definition(mode, rng):
    x = tensor(rng, (3, 8, 7, 7))
    avg, mx = F.adaptive_avg_pool2d(x, 1), F.adaptive_max_pool2d(x, 1)
    expected = 0.5 * (avg + mx) if mode == "avg+max" else torch.cat((avg, mx), 1)
    _close(ptt.adaptive_avgmax_pool2d(x, 1, mode), expected)
    _close(ptt.AdaptiveAvgMaxPool2d(1, mode)(x), expected)


def test_gradcheck_of_every_multi_level_op(rng):
    x = tensor(rng, (2, 3, 9, 7), torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: ptt.adaptive_avg_pool_pyramid(t, [1, 2, (3, 4), 5]), (x,))
    # max: tie-free inputs (random float64 values)
    assert torch.autograd.gradcheck(lambda t: ptt.adaptive_max_pool_pyramid(t, [1, (2, 3), 4]), (x,))
    assert torch.autograd.gradcheck(lambda t: ptt.adaptive_avgmax_pool2d(t, 2, "cat"), (x,))
    xc = x.detach().to(memory_format=torch.channels_last).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: ptt.adaptive_avg_pool_pyramid(t, [1, 3]), (xc,))


@pytest.mark.parametrize("channels_last", [False, pytest.param(True, marks=EXHAUSTIVE)])
def test_gradgradcheck_of_every_multi_level_op(channels_last, rng):
    """Double backward: the backward's own gradient (avg levels by the avg pyramid's forward, max
    levels by a gather at their indices), checked numerically in float64, both memory formats."""
    x = tensor(rng, (1, 2, 9, 7), torch.float64)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_()
    # max: tie-free inputs (random float64 values)
    for fn in (lambda t: ptt.adaptive_avg_pool_pyramid(t, [1, 2, (3, 4), 5]),
               lambda t: ptt.adaptive_max_pool_pyramid(t, [1, (2, 3), 4, 9]),
               lambda t: ptt.adaptive_avgmax_pool2d(t, (3, 2), "avg+max"),
               lambda t: ptt.adaptive_avgmax_pool2d(t, 2, "cat")):
        assert torch.autograd.gradgradcheck(fn, (x,))


@pytest.mark.parametrize("ndim,shape,sizes", [(1, (2, 3, 11), [1, 4, 13]), (3, (1, 2, 4, 5, 3), [1, (2, 3, 2)])])
def test_gradgradcheck_1d_3d(ndim, shape, sizes, rng):
    x = tensor(rng, shape, torch.float64).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda t: ptt.adaptive_avg_pool_pyramid(t, sizes, ndim=ndim), (x,))
    assert torch.autograd.gradgradcheck(lambda t: ptt.adaptive_max_pool_pyramid(t, sizes, ndim=ndim), (x,))


def test_gradients_match_pytorchs_separate_poolings(rng):
    x = tensor(rng, (2, 4, 21, 19))
    sizes = [1, 2, 3, 6]
    ours, stock = x.clone().requires_grad_(), x.clone().requires_grad_()
    weights = [tensor(rng, (2, 4, s, s)) for s in sizes]
    sum((y * w).sum() for y, w in zip(ptt.adaptive_avg_pool_pyramid(ours, sizes), weights)).backward()
    sum((F.adaptive_avg_pool2d(stock, s) * w).sum() for s, w in zip(sizes, weights)).backward()
    _close(ours.grad, stock.grad)
    first = ours.grad.clone()
    ours.grad = None
    sum((y * w).sum() for y, w in zip(ptt.adaptive_avg_pool_pyramid(ours, sizes), weights)).backward()
    assert torch.equal(ours.grad, first), "deterministic: bit-identical across runs"


def test_opcheck_of_the_custom_ops(rng):
    x = tensor(rng, (2, 3, 9, 7)).requires_grad_()
    xc = x.detach().to(memory_format=torch.channels_last).requires_grad_()
    for op, args in [(torch.ops.pool_tuner.adaptive_avg_pool_pyramid2d, (x, [1, 1, 2, 2, 3, 3], "")),
                     (torch.ops.pool_tuner.adaptive_max_pool_pyramid2d, (xc, [1, 1, 2, 3], "")),
                     (torch.ops.pool_tuner.adaptive_avgmax_pool2d, (x, [2, 2], ""))]:
        torch.library.opcheck(op, args)


def test_compile_fullgraph_and_export(rng):
    model = ptt.PyramidPooling([1, 2, 3, 6])
    compiled = torch.compile(model, fullgraph=True)
    x = tensor(rng, (2, 8, 20, 20)).requires_grad_()
    outputs = compiled(x)
    for got, size in zip(outputs, [1, 2, 3, 6]):
        _close(got, F.adaptive_avg_pool2d(x, size))
    sum(o.sum() for o in outputs).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    program = torch.export.export(ptt.AdaptiveAvgMaxPool2d(1, "cat"), (tensor(rng, (2, 8, 7, 7)),))
    assert "pool_tuner.adaptive_avgmax_pool2d" in str(program.graph_module.code)
    y = tensor(rng, (2, 8, 7, 7))
    _close(program.module()(y), torch.cat((F.adaptive_avg_pool2d(y, 1), F.adaptive_max_pool2d(y, 1)), 1))


def test_onnx_export_decomposes_every_level(rng):
    onnxruntime = pytest.importorskip("onnxruntime")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pyramid, self.head = ptt.PyramidPooling([1, 2, 3, (2, 5)]), ptt.AdaptiveAvgMaxPool2d(1, "cat")

        def forward(self, x):
            return (*self.pyramid(x), self.head(x))

    model = Model().eval()
    x = tensor(rng, (2, 3, 10, 9))
    program = torch.onnx.export(model, (x,), verbose=False)
    assert "pool_tuner" not in {node.domain for node in program.model.graph}
    session = onnxruntime.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    results = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    for result, expected in zip(results, model(x), strict=True):
        np.testing.assert_allclose(result, expected.numpy(), rtol=1e-5, atol=1e-6)


def test_modules_and_their_errors(rng):
    pool = ptt.PyramidPooling([1, 2], mode="max")
    assert repr(pool) == "pool_tuner.torch.PyramidPooling(output_sizes=[1, 2], mode='max')"
    assert repr(ptt.AdaptiveAvgMaxPool2d(3, "cat", device="opencl:pocl:0")) == (
        "pool_tuner.torch.AdaptiveAvgMaxPool2d(output_size=3, mode='cat', device='opencl:pocl:0')")
    with pytest.raises(ValueError, match="mode must be 'avg' or 'max'"):
        ptt.PyramidPooling([1], mode="sum")
    with pytest.raises(ValueError, match="output_sizes must be a non-empty"):
        ptt.PyramidPooling([])
    with pytest.raises(ValueError, match="mode must be one of"):
        ptt.AdaptiveAvgMaxPool2d(1, mode="max")
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):
        ptt.adaptive_avg_pool_pyramid(np.ones((2, 3, 4, 4)), [1])
    with pytest.raises(ValueError, match=r"output_sizes\[1\]"):
        ptt.adaptive_avg_pool_pyramid(tensor(rng, (2, 3, 4, 4)), [1, -1])
    with pytest.raises(RuntimeError, match="torch.jit.script"):
        torch.jit.script(pool)


# --------------------------------------------------------------------------------- replace_pooling(fuse=True)


class Pyramid(torch.nn.Module):
    """PSPNet's pyramid pooling module in miniature: sibling pools of one tensor, each followed by
    a 1x1 convolution, upsampled and concatenated."""

    def __init__(self, channels=4, sizes=(1, 2, 3, 6)):
        super().__init__()
        self.pools = torch.nn.ModuleList(torch.nn.AdaptiveAvgPool2d(s) for s in sizes)
        self.convs = torch.nn.ModuleList(torch.nn.Conv2d(channels, 2, 1) for _ in sizes)

    def forward(self, x):
        h, w = x.shape[2:]
        levels = [F.interpolate(conv(pool(x)), size=(h, w), mode="bilinear", align_corners=True)
                  for pool, conv in zip(self.pools, self.convs)]
        return torch.cat(levels + [x], 1)


class CatAvgMax(torch.nn.Module):
    """timm's catavgmax head in miniature: functional avg and max pooling of one tensor."""

    def forward(self, x):
        return torch.cat((F.adaptive_avg_pool2d(x, 1), F.adaptive_max_pool2d(x, 1)), 1).flatten(1)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.ppm = Pyramid()
        self.head = CatAvgMax()
        self.fc = torch.nn.Linear(2 * 12, 5)

    def forward(self, x):
        x = self.ppm(torch.relu(self.stem(x)))
        if x.sum() > 0:  # data-dependent control flow: the whole model does not trace
            x = x * 1.0
        return self.fc(self.head(x))


def _assert_same(stock, fused, x, tol):
    ys, gs, ps = outputs_and_gradients(stock, x)
    yf, gf, pf = outputs_and_gradients(fused, x)
    torch.testing.assert_close(yf, ys, **tol)
    torch.testing.assert_close(gf, gs, **tol)
    assert set(pf) == set(ps), "the same parameters under the same names"
    for name, grad in ps.items():
        if grad is None:
            assert pf[name] is None
        else:
            scale = max(grad.abs().max().item(), 1.0)
            torch.testing.assert_close(pf[name], grad, rtol=tol["rtol"], atol=tol["atol"] * scale)


def _fused_calls(model) -> int:
    return sum(node.target is ptt.fused_adaptive_pools for m in model.modules() if isinstance(m, torch.fx.GraphModule)
               for node in m.graph.nodes)


def test_replace_pooling_fuses_sibling_pools_of_one_tensor(rng):
    stock = Net()
    fused = ptt.replace_pooling(copy.deepcopy(stock), fuse=True)
    assert isinstance(fused, Net), "the model keeps its class: only the modules holding sibling pools are rewritten"
    assert isinstance(fused.ppm, torch.fx.GraphModule) and isinstance(fused.head, torch.fx.GraphModule)
    assert _fused_calls(fused) == 2
    _assert_same(stock, fused, tensor(rng, (2, 3, 13, 11)), TOL)


class ModeDependentHead(torch.nn.Module):
    """Sibling pools of one tensor, and a branch on ``self.training`` after them."""

    def __init__(self):
        super().__init__()
        self.pools = torch.nn.ModuleList(torch.nn.AdaptiveAvgPool2d(s) for s in (1, 2, 3))

    def forward(self, x):
        y = torch.cat([F.interpolate(pool(x), size=x.shape[-2:]) for pool in self.pools], 1)
        return y * 0.5 if self.training else y


@pytest.mark.parametrize("traced_in", ["train", "eval"])
def test_a_module_whose_forward_differs_by_mode_is_not_rewritten(rng, traced_in):
    """torch.fx runs ``if self.training:`` once, at the rewrite: the rewritten module kept that
    mode's branch for good (a model swapped in training mode scaled its outputs in eval too).  Such
    a module stays as it is, its pools swapped one by one, and the report says why."""
    stock = ModeDependentHead().train(traced_in == "train")
    report = []
    swapped = ptt.replace_pooling(copy.deepcopy(stock), fuse=True, report=report)
    assert type(swapped) is ModeDependentHead and _fused_calls(swapped) == 0
    assert all(type(pool) is ptt.AdaptiveAvgPool2d for pool in swapped.pools)
    assert any("training and eval" in entry["reason"] for entry in report)
    x = tensor(rng, (2, 3, 7, 9))
    for mode in (True, False):
        stock.train(mode)
        swapped.train(mode)
        torch.testing.assert_close(swapped(x), stock(x), **TOL)


@pytest.mark.parametrize("fuse", [False, True])
def test_a_swapped_layer_keeps_its_hooks(rng, fuse):
    """Hooks on a replaced layer run on its replacement, and their handles still remove them (they
    were dropped with the layer); a layer with hooks is not fused away, so that they still run."""
    stock = Pyramid()
    calls = []
    handles = [stock.pools[0].register_forward_pre_hook(lambda module, args: calls.append("pre")),
               stock.pools[0].register_forward_hook(lambda module, args, output: calls.append("forward")),
               stock.register_forward_hook(lambda module, args, output: calls.append("root"))]
    swapped = ptt.replace_pooling(stock, fuse=fuse)
    x = tensor(rng, (2, 4, 13, 11))
    swapped(x)
    assert calls == ["pre", "forward", "root"]
    if fuse:
        assert _fused_calls(swapped) == 1, "the pools without hooks are still fused"
    for handle in handles:
        handle.remove()
    swapped(x)
    assert calls == ["pre", "forward", "root"]


class HookedHead(torch.nn.Module):
    """Sibling pools of one tensor after a submodule that has a hook of its own."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 1), torch.nn.ReLU())
        self.pools = torch.nn.ModuleList(torch.nn.AdaptiveAvgPool2d(s) for s in (1, 2))

    def forward(self, x):
        x = self.inner(x)
        return torch.cat([pool(x).flatten(1) for pool in self.pools], 1)


def test_a_submodule_with_hooks_stays_a_module_of_the_rewritten_graph(rng):
    """torch.fx traces through a submodule that is not a leaf: its hooks ran once, on placeholders,
    during ``replace_pooling``, and never after.  A module with hooks is a leaf of the trace, so
    they run on every call, and their handle still removes them."""
    head, calls = HookedHead(), []
    handle = head.inner.register_forward_hook(lambda module, args, output: calls.append("inner"))
    stock = copy.deepcopy(head)
    fused = ptt.replace_pooling(head, fuse=True)
    assert calls == [] and _fused_calls(fused) == 1
    x = tensor(rng, (2, 4, 7, 9))
    torch.testing.assert_close(fused(x), stock(x), **TOL)
    assert calls == ["inner", "inner"], "the hook ran on the rewritten module's call, as on the stock copy's"
    handle.remove()
    fused(x)
    assert calls == ["inner", "inner"]


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("function", ["replace_pooling", "explain_pooling"])
def test_replace_and_explain_pooling_refuse_a_model_that_is_not_a_module(function, fuse):
    for model in ("not a model", None, torch.nn.AdaptiveAvgPool2d):
        with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got "):
            getattr(ptt, function)(model, fuse=fuse)


def test_replace_pooling_without_fuse_leaves_the_graph(rng):
    model = ptt.replace_pooling(Net())
    assert _fused_calls(model) == 0 and isinstance(model.ppm.pools[0], ptt.AdaptiveAvgPool2d)


def test_fused_adaptive_pools_orders_results_as_the_calls(rng):
    x = tensor(rng, (2, 3, 9, 9))
    levels = (("max", 2), ("avg", 1), ("avg", (3, None)), ("max", 4))
    results = ptt.fused_adaptive_pools(x, levels, 2)
    for got, (kind, size) in zip(results, levels):
        _close(got, getattr(F, f"adaptive_{kind}_pool2d")(x, size))


def test_pspnet_from_segmentation_models_pytorch(rng):
    smp = pytest.importorskip("segmentation_models_pytorch", reason="needs segmentation_models_pytorch")
    torch.manual_seed(0)
    stock = smp.PSPNet("resnet18", encoder_weights=None, classes=3)
    fused = ptt.replace_pooling(copy.deepcopy(stock), fuse=True)
    assert type(fused) is type(stock) and _fused_calls(fused) == 1
    for training in (True, False):
        stock.train(training), fused.train(training)
        # batch norm in training mode sums in another order after the pooled sums: float32 noise
        _assert_same(stock, fused, tensor(rng, (2, 3, 64, 64)), dict(rtol=1e-4, atol=1e-5))


def test_timm_catavgmax_head(rng):
    """timm's catavgmax layer becomes the fused avgmax module (tests/test_timm_pooling.py: every
    timm pooling layer), no torch.fx rewrite needed."""
    try:
        import timm
    except Exception as error:  # noqa: BLE001 -- a torchvision built for another torch raises RuntimeError
        pytest.skip(f"needs timm: {type(error).__name__}: {error}")
    torch.manual_seed(0)
    stock = timm.create_model("resnet18", pretrained=False, global_pool="catavgmax", num_classes=10)
    fused = ptt.replace_pooling(copy.deepcopy(stock), fuse=True)
    assert type(fused) is type(stock) and _fused_calls(fused) == 0
    assert isinstance(fused.global_pool.pool, ptt.AdaptiveAvgMaxPool2d) and fused.global_pool.pool.mode == "cat"
    _assert_same(stock, fused, tensor(rng, (2, 3, 64, 64)), dict(rtol=1e-4, atol=1e-5))
