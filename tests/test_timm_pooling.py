"""``replace_pooling`` on timm's pooling layers: every layer of ``timm.layers.adaptive_avgmax_pool``
in timm's models (``SelectAdaptivePool2d``'s ``avg``, ``max``, ``avgmax``, ``catavgmax`` and their
``fast`` forms, flattened or not, NCHW or NHWC) becomes a pool_tuner module, the model's outputs and
gradients stay timm's, and the swap report names what was swapped and what was not, and why.

The tests that build timm's models skip, saying why, where timm does not import (it needs a
torchvision built for the installed torch).  ``GlobalPool2d`` -- the replacement of timm's fast
layers -- is tested without timm against timm's formulas written out in PyTorch operations."""

import concurrent.futures
import copy
import subprocess
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import outputs_and_gradients  # noqa: E402

import pool_tuner as pt  # noqa: E402
import pool_tuner.torch as ptt  # noqa: E402
from pool_tuner import torch_cpu  # noqa: E402

F = torch.nn.functional
TIMM_POOLING = "timm.layers.adaptive_avgmax_pool"
#: timm's ``global_pool`` values, each a layer of timm's pooling module.
POOL_TYPES = ("avg", "max", "avgmax", "catavgmax", "fastavg", "fastmax", "fastavgmax", "fastcatavgmax")
#: float32 noise of summing in another order, grown through the layers after the pooling
MODEL_TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def timm():
    try:
        import timm
    except Exception as error:  # noqa: BLE001 -- a torchvision built for another torch raises RuntimeError
        pytest.skip(f"needs timm (pip install timm, with a torchvision matching torch): {type(error).__name__}: "
                    f"{error}")
    return timm


def tensor(rng, shape, dtype=torch.float32):
    x = rng.uniform(-2.0, 2.0, size=shape)
    x[np.abs(x) < 1e-3] = 0.5
    return torch.from_numpy(x).to(dtype)


def _timm_layers(model) -> list:
    """``(name, class name)`` of the layers of timm's pooling module left in ``model`` (its
    ``SelectAdaptivePool2d`` containers aside, whose ``pool`` is the layer)."""
    return [(name, type(m).__name__) for name, m in model.named_modules()
            if type(m).__module__ == TIMM_POOLING and type(m).__name__ != "SelectAdaptivePool2d"]


def _assert_same(stock, swapped, x, tol):
    ys, gs, ps = outputs_and_gradients(stock, x)
    yw, gw, pw = outputs_and_gradients(swapped, x)
    torch.testing.assert_close(yw, ys, **tol)
    torch.testing.assert_close(gw, gs, rtol=tol["rtol"], atol=tol["atol"] * max(gs.abs().max().item(), 1.0))
    assert set(pw) == set(ps), "the same parameters under the same names"
    for name, grad in ps.items():
        scale = max(grad.abs().max().item(), 1.0)
        torch.testing.assert_close(pw[name], grad, rtol=tol["rtol"], atol=tol["atol"] * scale, msg=name)


# ------------------------------------------------------------------------------ timm's models


@pytest.mark.parametrize("pool_type", POOL_TYPES)
@pytest.mark.parametrize("arch", ["resnet18", "efficientnet_b0"])
def test_every_timm_pooling_layer_is_swapped_and_the_model_is_timms(arch, pool_type, timm, rng):
    torch.manual_seed(0)
    stock = timm.create_model(arch, pretrained=False, global_pool=pool_type, num_classes=10)
    assert _timm_layers(stock) or pool_type in ("avg", "max"), "timm pools through its own layers"
    report = []
    swapped = ptt.replace_pooling(copy.deepcopy(stock), fuse=True, report=report)
    assert type(swapped) is type(stock)
    assert _timm_layers(swapped) == [], "every layer of timm's pooling module swapped"
    pool = swapped.global_pool.pool
    assert type(pool).__module__ == ptt.__name__, pool
    assert [entry["module"] for entry in report if entry["action"] == "swapped"] == ["global_pool.pool"]
    x = tensor(rng, (2, 3, 96, 96))  # 3x3 maps at the head
    for training in (False, True):
        stock.train(training), swapped.train(training)
        _assert_same(stock, swapped, x, MODEL_TOL)


@pytest.mark.parametrize("input_fmt", ["NCHW", "NHWC"])
@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("pool_type", POOL_TYPES)
def test_select_adaptive_pool2d_every_form(pool_type, flatten, input_fmt, timm, rng):
    """timm's head layer alone, in every form it takes: the same result and input gradient, ties
    included (integer-valued inputs: ``amax`` in the fast forms splits a gradient among tied maxima,
    ``adaptive_max_pool2d`` gives it to the first)."""
    stock = timm.layers.SelectAdaptivePool2d(pool_type=pool_type, flatten=flatten, input_fmt=input_fmt)
    swapped = ptt.replace_pooling(copy.deepcopy(stock), fuse=True)
    assert _timm_layers(swapped) == []
    shape = (2, 5, 6, 7) if input_fmt == "NCHW" else (2, 6, 7, 5)
    for x in (tensor(rng, shape), torch.from_numpy(rng.integers(-2, 3, shape).astype(np.float32))):
        ys, gs, _ = outputs_and_gradients(stock, x)
        yw, gw, _ = outputs_and_gradients(swapped, x)
        assert yw.shape == ys.shape
        torch.testing.assert_close(yw, ys, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(gw, gs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("pool_type", ["avgmax", "catavgmax", "fastavgmax", "fastcatavgmax"])
def test_avg_and_max_of_one_tensor_are_swapped_only_with_fuse(pool_type, timm):
    stock = timm.layers.SelectAdaptivePool2d(pool_type=pool_type)
    report = []
    kept = ptt.replace_pooling(copy.deepcopy(stock), report=report)
    assert type(kept.pool) is type(stock.pool)
    (entry,) = report
    assert entry["module"] == "pool" and entry["action"] == "kept" and "fuse=True" in entry["reason"]


def test_a_subclass_of_a_timm_layer_is_kept_and_says_why(timm, rng):
    """A subclass may compute something else: not swapped as timm's layer; with fuse=True the
    torch.fx pass still reads its forward and fuses the poolings it finds there."""
    class Mine(timm.layers.adaptive_avgmax_pool.AdaptiveCatAvgMaxPool2d):
        def forward(self, x):
            return super().forward(x) * 2

    stock = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), Mine())
    report = []
    kept = ptt.replace_pooling(copy.deepcopy(stock), report=report)
    assert type(kept[1]) is Mine
    (entry,) = report
    assert entry["module"] == "1" and entry["action"] == "kept" and "subclass" in entry["reason"]
    assert "AdaptiveCatAvgMaxPool2d" in entry["reason"]
    report = []
    fused = ptt.replace_pooling(copy.deepcopy(stock), fuse=True, report=report)
    assert [(e["module"], e["action"]) for e in report] == [("1", "kept"), ("1", "fused")]
    assert isinstance(fused[1], torch.fx.GraphModule)
    _assert_same(stock, fused, tensor(rng, (2, 3, 5, 6)), dict(rtol=1e-6, atol=1e-6))


def test_explain_pooling_tells_without_swapping(timm):
    model = timm.create_model("resnet18", pretrained=False, global_pool="catavgmax", num_classes=10)
    entries = ptt.explain_pooling(model, fuse=True)
    assert type(model.global_pool.pool).__module__ == TIMM_POOLING, "the model is left as it was"
    (entry,) = entries
    assert entry["module"] == "global_pool.pool" and entry["action"] == "swapped"
    assert entry["type"] == f"{TIMM_POOLING}.AdaptiveCatAvgMaxPool2d"
    assert "AdaptiveAvgMaxPool2d" in entry["replacement"] and "'cat'" in entry["replacement"]
    assert "one read" in entry["reason"]


# ------------------------------------------------------------------------------ without timm


def test_replace_pooling_never_imports_timm():
    code = ("import sys, torch, pool_tuner.torch as ptt\n"
            "m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.AdaptiveAvgPool2d(1))\n"
            "ptt.replace_pooling(m, fuse=True); ptt.explain_pooling(m, fuse=True)\n"
            "assert 'timm' not in sys.modules, 'timm imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def _timm_fast(x, mode, flatten, input_fmt):
    """timm's fast layers' forward (``FastAdaptive*Pool``), written out."""
    dims, channel = ((2, 3), 1) if input_fmt == "NCHW" else ((1, 2), 3)
    avg, mx = x.mean(dims, keepdim=not flatten), x.amax(dims, keepdim=not flatten)
    return {"avg": avg, "max": mx, "avg+max": 0.5 * avg + 0.5 * mx,
            "cat": torch.cat((avg, mx), 1 if flatten else channel)}[mode]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("input_fmt", ["NCHW", "NHWC"])
@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("mode", ["avg", "max", "avg+max", "cat"])
def test_global_pool2d_is_timms_fast_pooling(mode, flatten, input_fmt, dtype, rng):
    shape = (3, 4, 5, 7) if input_fmt == "NCHW" else (3, 5, 7, 4)
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-6)
    layer = ptt.GlobalPool2d(mode, flatten=flatten, input_fmt=input_fmt)
    # integer values: ties everywhere, so the max levels' gradients must split as amax's do
    for x in (tensor(rng, shape, dtype), torch.from_numpy(rng.integers(-3, 4, shape).astype(np.float32)).to(dtype)):
        x_stock, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, got = _timm_fast(x_stock, mode, flatten, input_fmt), layer(x_ours)
        assert got.shape == expected.shape and got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, **tol)
        grad = torch.from_numpy(rng.standard_normal(expected.shape)).to(dtype)
        expected.backward(grad), got.backward(grad)
        torch.testing.assert_close(x_ours.grad, x_stock.grad, rtol=0, atol=0)  # timm's own formulas


def test_global_pool2d_nhwc_input_that_is_channels_first_in_memory(rng):
    x = tensor(rng, (2, 4, 5, 6)).permute(0, 2, 3, 1)  # logically NHWC, stored NCHW
    torch.testing.assert_close(ptt.GlobalPool2d("cat", input_fmt="NHWC")(x), _timm_fast(x, "cat", False, "NHWC"))


@pytest.mark.parametrize("mode", ["avg", "max", "avg+max", "cat"])
def test_global_pool2d_compiles_and_exports(mode, rng):
    """torch.compile(fullgraph=True), backward included, and torch.export: as eager."""
    layer = ptt.GlobalPool2d(mode, flatten=True, input_fmt="NHWC")
    x = torch.from_numpy(rng.integers(-3, 4, (2, 5, 6, 4)).astype(np.float32))
    x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, got = layer(x_eager), torch.compile(layer, fullgraph=True)(x_compiled)
    torch.testing.assert_close(got, expected)
    grad = torch.from_numpy(rng.standard_normal(expected.shape).astype(np.float32))
    expected.backward(grad), got.backward(grad)
    torch.testing.assert_close(x_compiled.grad, x_eager.grad, rtol=0, atol=0)
    program = torch.export.export(layer, (x,))
    assert "pool_tuner" in program.graph_module.code
    torch.testing.assert_close(program.module()(x), expected.detach())


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "default"])
@pytest.mark.parametrize("mode", ["avg", "max", "avg+max", "cat"])
def test_global_pool2d_compiles_with_dynamic_spatial_sizes(mode, dynamic, rng):
    """torch.compile with symbolic sizes (dynamic=True, or by default once H x W changes between
    calls), backward included: timm's values and gradients at every size."""
    torch._dynamo.reset()
    layer = ptt.GlobalPool2d(mode, input_fmt="NHWC")
    compiled = torch.compile(layer, fullgraph=True, dynamic=dynamic)
    for shape in [(2, 8, 9, 3), (2, 5, 6, 3), (2, 7, 4, 3)]:
        x = torch.from_numpy(rng.integers(-3, 4, shape).astype(np.float32))
        x_stock, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected, got = _timm_fast(x_stock, mode, False, "NHWC"), compiled(x_compiled)
        torch.testing.assert_close(got, expected)
        grad = torch.from_numpy(rng.standard_normal(expected.shape).astype(np.float32))
        expected.backward(grad), got.backward(grad)
        torch.testing.assert_close(x_compiled.grad, x_stock.grad)
    torch._dynamo.reset()


def test_global_pool2d_exports_to_onnx_as_timms_reductions(rng):
    onnxruntime = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), ptt.GlobalPool2d("cat", flatten=True)).eval()
    x = tensor(rng, (2, 3, 7, 5))
    program = torch.onnx.export(model, (x,), verbose=False)
    assert {"ReduceMean", "ReduceMax", "Concat"} <= {node.op_type for node in program.model.graph}
    session = onnxruntime.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    torch.testing.assert_close(torch.from_numpy(got), model(x), rtol=1e-5, atol=1e-6)


GLOBAL_MODES = ("avg", "max", "avg+max", "cat")


class _GlobalPoolings(torch.nn.Module):
    """Every global pooling mode in both layouts, and avg+max pooling (its levels decomposed)."""

    def __init__(self):
        super().__init__()
        self.formats = [input_fmt for mode in GLOBAL_MODES for input_fmt in ("NCHW", "NHWC")]
        self.pools = torch.nn.ModuleList(ptt.GlobalPool2d(mode, input_fmt=input_fmt) for mode in GLOBAL_MODES
                                         for input_fmt in ("NCHW", "NHWC"))
        self.avgmax = ptt.AdaptiveAvgMaxPool2d((3, 4), "cat")

    def forward(self, x):
        return (*[pool(x if input_fmt == "NCHW" else x.permute(0, 2, 3, 1))
                  for pool, input_fmt in zip(self.pools, self.formats)], self.avgmax(x))


@pytest.mark.parametrize("exporter", ["pool_tuner.onnx.export", "torch.onnx.export"])
def test_global_pooling_exported_to_onnx_keeps_pytorchs_nan_and_infinities(exporter, rng):
    """A plane holding NaN, +inf, -inf or both infinities pools in onnxruntime as in PyTorch (timm's
    x.mean / x.amax): onnxruntime's ReduceMax skips NaNs, PyTorch's amax gives NaN."""
    onnxruntime = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from pool_tuner import onnx as pto

    x = tensor(rng, (2, 5, 7, 6))
    for channel, values in enumerate([(float("nan"),), (float("inf"),), (-float("inf"),), (float("inf"), -float("inf"))]):
        for position, value in enumerate(values):
            x[0, channel, 3, position] = value  # one window of avgmax's (3, 4) holds them all
    model = _GlobalPoolings().eval()
    expected = [_timm_fast(x if input_fmt == "NCHW" else x.permute(0, 2, 3, 1), mode, False, input_fmt)
                for mode in GLOBAL_MODES for input_fmt in ("NCHW", "NHWC")]
    expected.append(torch.cat((F.adaptive_avg_pool2d(x, (3, 4)), F.adaptive_max_pool2d(x, (3, 4))), 1))
    export = pto.export if exporter == "pool_tuner.onnx.export" else torch.onnx.export
    program = export(model, (x,), verbose=False)
    session = onnxruntime.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    results = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    for result, want in zip(results, expected, strict=True):
        want = want.numpy()
        assert np.isnan(want).any() and np.isinf(want).any()
        for special in (np.isnan, np.isposinf, np.isneginf):
            np.testing.assert_array_equal(special(result), special(want))
        np.testing.assert_allclose(result, want, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_global_pool2d_refuses_bad_arguments(rng):
    with pytest.raises(ValueError, match="mode"):
        ptt.GlobalPool2d("sum")
    with pytest.raises(ValueError, match="input_fmt"):
        ptt.GlobalPool2d("avg", input_fmt="NCL")
    with pytest.raises(ValueError, match="input"):
        ptt.GlobalPool2d("avg")(tensor(rng, (4, 5, 6)))
    with pytest.raises(TypeError, match="input"):
        ptt.GlobalPool2d("avg")(np.zeros((1, 2, 3, 3), np.float32))


def test_the_report_names_pytorch_layers_swapped_kept_and_modules_fused(rng):
    class MyPool(torch.nn.AdaptiveAvgPool2d):
        pass

    class Head(torch.nn.Module):  # timm's catavgmax head written as functional calls
        def forward(self, x):
            return torch.cat((F.adaptive_avg_pool2d(x, 1), F.adaptive_max_pool2d(x, 1)), 1)

    model = torch.nn.Sequential(torch.nn.AdaptiveMaxPool2d(4, return_indices=False), MyPool(2),
                                ptt.AdaptiveAvgPool2d(2), Head())
    entries = ptt.explain_pooling(model, fuse=True)
    assert [(e["module"], e["action"]) for e in entries] == [("3", "fused"), ("0", "swapped"), ("1", "kept")]
    fused, swapped, kept = entries
    assert "avg 1, max 1" in fused["reason"] and fused["type"].endswith("Head")
    assert swapped["replacement"] == "pool_tuner.torch.AdaptiveMaxPool2d(output_size=4)"
    assert swapped["type"] == "torch.nn.modules.pooling.AdaptiveMaxPool2d"
    assert "subclass of torch.nn.AdaptiveAvgPool2d" in kept["reason"] and kept["replacement"] is None
    x = tensor(rng, (2, 3, 9, 9))
    torch.testing.assert_close(ptt.replace_pooling(copy.deepcopy(model), fuse=True)(x), model(x))


# ------------------------------------------------------------------ PyTorch's computation as a candidate


def _rig_race(monkeypatch, winner):
    """Every race is still run and noted (pool_tuner's side timed where ``winner`` is pool_tuner,
    skipped below the launch floor where it is PyTorch), and ends with ``winner`` running the layer."""
    monkeypatch.setattr(torch_cpu, "RACE_MARGIN", 1e12 if winner == "pytorch" else 0.0)


def _timm_adaptive(x, size, mode):
    """timm's ``AdaptiveAvgMaxPool2d`` / ``AdaptiveCatAvgMaxPool2d`` forward, written out."""
    avg, mx = F.adaptive_avg_pool2d(x, size), F.adaptive_max_pool2d(x, size)
    return 0.5 * (avg + mx) if mode == "avg+max" else torch.cat((avg, mx), 1)


#: (layer, timm's computation of it, the op pool_tuner.explain names its race by, output size)
RACED_LAYERS = {
    "catavgmax": (lambda: ptt.AdaptiveAvgMaxPool2d(1, "cat"), lambda x: _timm_adaptive(x, 1, "cat"),
                  "adaptive_avgmax_pool2d", 1),
    "avgmax_2x3": (lambda: ptt.AdaptiveAvgMaxPool2d((2, 3), "avg+max"), lambda x: _timm_adaptive(x, (2, 3), "avg+max"),
                   "adaptive_avgmax_pool2d", (2, 3)),
    "fastcatavgmax": (lambda: ptt.GlobalPool2d("cat", flatten=True), lambda x: _timm_fast(x, "cat", True, "NCHW"),
                      "adaptive_avgmax_pool2d", 1),
    "fastavgmax": (lambda: ptt.GlobalPool2d("avg+max"), lambda x: _timm_fast(x, "avg+max", False, "NCHW"),
                   "adaptive_avgmax_pool2d", 1),
    "fastavg": (lambda: ptt.GlobalPool2d("avg", flatten=True), lambda x: _timm_fast(x, "avg", True, "NCHW"),
                "adaptive_avg_pool2d", 1),
    "fastmax": (lambda: ptt.GlobalPool2d("max"), lambda x: _timm_fast(x, "max", False, "NCHW"),
                "adaptive_max_pool2d", 1),
}
#: More calls than a race times.
MANY_CALLS = 3 * (torch_cpu.RACE_CALLS + 1)


@pytest.mark.usefixtures("candidate_on")
@pytest.mark.parametrize("name", RACED_LAYERS)
def test_avgmax_and_global_layers_race_pytorch_on_cpu_and_explain_says_who_won(name, rng):
    """A CPU layer's first call of a signature times timm's own computation against pool_tuner's
    one-read kernel and keeps the faster -- pool_tuner's untimed where timm's is faster than the
    device's launch floor by the margin: ``pool_tuner.explain`` names the race and its times."""
    make, timms, op, size = RACED_LAYERS[name]
    shape = (2, 16, 7, 7)
    assert pt.explain(op, shape, size)["measured_candidate"] is None
    layer, x = make(), tensor(rng, shape)
    torch.testing.assert_close(layer(x), timms(x), rtol=1e-5, atol=1e-6)
    race = pt.explain(op, shape, size)["measured_candidate"]
    assert race is not None, "the race is noted"
    assert race["candidate"] == "pytorch" and race["pytorch_ms"] > 0 and race["floor_ms"] > 0
    if race["pool_tuner_ms"] is None:
        assert race["pytorch_ms"] < race["floor_ms"] * torch_cpu.RACE_MARGIN and race["winner"] == "pytorch"
    else:
        assert race["winner"] == ("pytorch" if race["pool_tuner_ms"] * torch_cpu.RACE_MARGIN > race["pytorch_ms"]
                                  else "pool_tuner")


@pytest.mark.usefixtures("candidate_on")
@pytest.mark.parametrize("name", RACED_LAYERS)
def test_a_raced_layer_that_pool_tuner_wins_keeps_one_plan_per_signature(monkeypatch, name, rng):
    """The race's plan is the one the layer then runs: a new signature adds one plan, however the
    layer's output size is written (an int size used to file the race's plan under one key and
    the run's under another)."""
    make, timms, _, _ = RACED_LAYERS[name]
    _rig_race(monkeypatch, "pool_tuner")
    layer, x = make(), tensor(rng, (2, 16, 9, 8))
    before = len(torch_cpu._PLANS)
    for _ in range(3):
        torch.testing.assert_close(layer(x), timms(x), rtol=1e-5, atol=1e-6)
    assert len(torch_cpu._PLANS) - before == 1


@pytest.mark.usefixtures("candidate_on")
@pytest.mark.parametrize("winner", ["pytorch", "pool_tuner"])
@pytest.mark.parametrize("name", RACED_LAYERS)
def test_either_winner_gives_one_answer_per_input_and_timms_gradients(monkeypatch, name, winner, rng):
    """From the first call (the race's) on, a signature's results are the same bits; where timm's
    own computation won they are its bits and its gradients, exactly."""
    _rig_race(monkeypatch, winner)
    make, timms, op, size = RACED_LAYERS[name]
    layer, x = make(), tensor(rng, (3, 8, 5, 6))
    first = layer(x)
    assert pt.explain(op, tuple(x.shape), size)["measured_candidate"]["winner"] == winner
    differing = [call for call in range(MANY_CALLS) if not torch.equal(layer(x), first)]
    assert differing == [], f"calls {differing} gave other bits than the first"
    x_stock, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, got = timms(x_stock), layer(x_ours)
    if winner == "pytorch":
        assert torch.equal(got, expected)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    grad = torch.from_numpy(rng.standard_normal(tuple(expected.shape)).astype(np.float32))
    expected.backward(grad), got.backward(grad)
    torch.testing.assert_close(x_ours.grad, x_stock.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.usefixtures("candidate_on")
def test_global_pooling_races_timms_reductions_apart_from_the_adaptive_layers(monkeypatch, rng):
    """GlobalPool2d runs timm's x.mean/x.amax where PyTorch's side wins, so that is what its race
    times, decided apart from an AdaptiveAvgMaxPool2d's race (adaptive poolings) on the same input."""
    x = tensor(rng, (2, 32, 7, 7))
    _rig_race(monkeypatch, "pool_tuner")
    adaptive = ptt.AdaptiveAvgMaxPool2d(1, "cat")(x)
    _rig_race(monkeypatch, "pytorch")
    fast = ptt.GlobalPool2d("cat", flatten=True)(x)
    assert torch.equal(adaptive.flatten(1), torch.from_numpy(pt.adaptive_avgmax_pool2d(x.numpy(), 1, mode="cat")).flatten(1))
    assert torch.equal(fast, _timm_fast(x, "cat", True, "NCHW"))
    assert torch.equal(ptt.AdaptiveAvgMaxPool2d(1, "cat")(x), adaptive), "each kept its own decision"


@pytest.mark.usefixtures("candidate_on")
@pytest.mark.parametrize("name", ["catavgmax", "fastcatavgmax"])
def test_threads_meeting_a_new_signature_get_one_answer(name, rng):
    """Threads calling a layer on one new signature together wait for one race: every result,
    and every later call's, is the same bits."""
    make, _, op, size = RACED_LAYERS[name]
    layer, x = make(), tensor(rng, (2, 24, 6, 5))
    barrier = threading.Barrier(4)

    def call(_):
        barrier.wait()
        return layer(x)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(call, range(4)))
    results.append(layer(x))
    assert all(torch.equal(r, results[0]) for r in results)
    assert pt.explain(op, tuple(x.shape), size)["measured_candidate"] is not None


@pytest.mark.usefixtures("candidate_on")
def test_deterministic_algorithms_run_the_fused_kernel_without_a_race(rng):
    x = tensor(rng, (2, 8, 7, 5))
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        results = [ptt.AdaptiveAvgMaxPool2d(1, "cat")(x) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(previous)
    expected = pt.adaptive_avgmax_pool2d(x.numpy(), 1, mode="cat")
    assert all(np.array_equal(r.numpy(), expected) for r in results)
    assert pt.explain("adaptive_avgmax_pool2d", (2, 8, 7, 5), 1)["measured_candidate"] is None


@pytest.mark.parametrize("layer", [ptt.AdaptiveAvgMaxPool2d((2, 3), "cat"), ptt.AdaptiveAvgMaxPool2d(1, "avg+max"),
                                   ptt.GlobalPool2d("cat", flatten=True), ptt.GlobalPool2d("avg+max"),
                                   ptt.GlobalPool2d("max", input_fmt="NHWC"), ptt.PyramidPooling([1, 2, 3], "max")],
                         ids=repr)
def test_pool_tuner_onnx_export_exports_the_layers_in_standard_operators(layer, rng):
    """pool_tuner.onnx.export swaps avg+max, global and pyramid layers for their compositions
    (they failed to convert: their custom ops have no ONNX form); onnxruntime gives their results."""
    onnxruntime = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from pool_tuner import onnx as pto

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3), torch.nn.ReLU(), layer).eval()
    x = tensor(rng, (2, 3, 9, 11))
    program = pto.export(model, (x,))
    assert not [node.domain for node in program.model.graph if node.domain not in ("", "ai.onnx")]
    session = onnxruntime.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    expected = model(x)
    for result, want in zip(got, expected if isinstance(expected, list) else [expected]):
        np.testing.assert_allclose(result, want.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert model[2] is layer, "the model itself is untouched"


@pytest.mark.usefixtures("candidate_on")
@pytest.mark.parametrize("pool_type", ["avgmax", "catavgmax", "fastavgmax", "fastcatavgmax"])
def test_a_timm_model_whose_pooling_race_pytorch_won_is_timms_bit_for_bit(monkeypatch, pool_type, timm, rng):
    """Where timm's own computation won the race (as at batch 1 on a CPU), the swapped model's
    outputs and gradients are the stock model's, bit for bit."""
    _rig_race(monkeypatch, "pytorch")
    torch.manual_seed(0)
    stock = timm.create_model("resnet18", pretrained=False, global_pool=pool_type, num_classes=10).eval()
    swapped = ptt.replace_pooling(copy.deepcopy(stock), fuse=True)
    assert _timm_layers(swapped) == []
    x = tensor(rng, (1, 3, 224, 224))  # 7x7 maps at the head: sums in another order differ in their last bits
    ys, gs, _ = outputs_and_gradients(stock, x)
    yw, gw, _ = outputs_and_gradients(swapped, x)
    assert torch.equal(yw, ys) and torch.equal(gw, gs)
