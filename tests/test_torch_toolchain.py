"""pool_tuner.torch through PyTorch's toolchain: the custom ops under torch.library.opcheck,
torch.compile(fullgraph=True) forward and backward, torch.export, ONNX (pool_tuner.onnx and
onnxruntime), TorchScript's refusal, and the import/argument errors a PyTorch user sees.

Compilations are the cost here (each inductor compile takes tens of seconds on two cores): the
broad matrix runs on the "aot_eager" backend, and one test compiles with inductor."""

import copy
import io
import subprocess
import sys
import warnings

import numpy as np
import pytest

from conftest import random_input, tiered

torch = pytest.importorskip("torch")
pytest.importorskip("ml_dtypes")

import torch.nn.functional as F  # noqa: E402

import pool_tuner as pt  # noqa: E402
import pool_tuner.torch as ptt  # noqa: E402
from pool_tuner import decomposition  # noqa: E402
from pool_tuner import onnx as pto  # noqa: E402

KINDS = ("avg", "max")
KIND_NDIM = [(kind, ndim) for kind in KINDS for ndim in (1, 2, 3)]
FLOAT32_TOL = dict(rtol=1e-5, atol=1e-6)
TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: FLOAT32_TOL,
       torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}

#: Per rank, (input shape, output size, dtype, channels-last): every dtype, both layouts and the
#: odd shapes -- non-divisible, upsampling, batch-less, output 1 -- each at least once per op.
OPCHECK_CASES = {
    1: [((2, 3, 14), [4], torch.float32, False), ((2, 3, 5), [7], torch.float64, True),
        ((3, 9), [4], torch.float16, True), ((2, 3, 12), [1], torch.bfloat16, False)],
    2: [((2, 3, 10, 9), [5, 7], torch.float32, False), ((1, 2, 5, 5), [7, 7], torch.float64, True),
        ((3, 10, 9), [5, 4], torch.float16, True), ((2, 3, 7, 7), [1, 1], torch.bfloat16, False)],
    3: [((1, 2, 5, 7, 9), [3, 4, 5], torch.float32, False), ((1, 2, 3, 4, 5), [5, 6, 4], torch.float64, True),
        ((2, 5, 7, 9), [2, 3, 4], torch.float16, True), ((2, 2, 3, 5, 7), [1, 1, 1], torch.bfloat16, False)],
}


def tensor(rng, shape, dtype=torch.float32, channels_last=False, ndim=None):
    """Fresh random values; ``channels_last``: the channel axis (``ndim`` pooled axes after it)
    innermost in memory."""
    if not channels_last:
        return torch.from_numpy(random_input(rng, shape)).to(dtype)
    c = len(shape) - ndim - 1
    memory = shape[:c] + shape[c + 1:] + (shape[c],)
    x = torch.from_numpy(random_input(rng, memory)).to(dtype).movedim(-1, c)
    assert not x.is_contiguous() and ptt._is_channels_last(x, ndim)
    return x


def torch_pool(kind, ndim):
    return getattr(F, f"adaptive_{kind}_pool{ndim}d")

#: The ranks of the ONNX export tests: 2d in the core tier, 1d and 3d in the exhaustive one (each
#: export takes seconds; the decomposition is one code path for every rank).
ONNX_RANKS = tiered([pytest.param(ndim, id=str(ndim)) for ndim in (1, 2, 3)], core=lambda values: values[0] == 2)


def layer(kind, ndim, size, ours=True):
    return getattr(ptt if ours else torch.nn, f"Adaptive{kind.capitalize()}Pool{ndim}d")(size)


# ---------------------------------------------------------------------------------------------
# The custom ops


@pytest.mark.parametrize("kind,ndim", tiered([pytest.param(kind, ndim, id=f"{kind}-{ndim}") for kind, ndim in KIND_NDIM],
                                             core=lambda values: values in {("avg", 1), ("avg", 2), ("max", 2), ("max", 3)}))
def test_opcheck_forward_and_backward_ops(kind, ndim, rng):
    """torch.library.opcheck (schema, autograd registration, fake tensors against the real
    kernels' shapes/strides/dtypes, AOT dispatch with dynamic shapes) for both ops of a kind and
    rank, with results checked against PyTorch's."""
    forward, backward = ptt._OPS[kind, ndim, False], ptt._OPS[kind, ndim, True]
    for shape, size, dtype, channels_last in OPCHECK_CASES[ndim]:
        x = tensor(rng, shape, dtype, channels_last, ndim)
        torch.library.opcheck(forward, (x.requires_grad_(), size, ""))
        out = forward(x.detach(), size, "")
        values = out[0] if kind == "max" else out
        expected = torch_pool(kind, ndim)(x.detach(), size, *([True] if kind == "max" else []))
        torch.testing.assert_close(values, expected[0] if kind == "max" else expected, **TOL[dtype])
        if kind == "max":
            assert torch.equal(out[1], expected[1])
        pytorchs_channels_last = channels_last and x.dim() == ndim + 2 and ndim < 3  # batched 1d and 2d only
        assert ptt._is_channels_last(values, ndim) == pytorchs_channels_last
        grad_out = tensor(rng, tuple(values.shape), dtype, channels_last and not values.is_contiguous(), ndim)
        extra = (out[1],) if kind == "max" else ()
        torch.library.opcheck(backward, (grad_out.requires_grad_(), *extra, list(shape), ""))


def test_fake_implementation_keeps_channels_last(rng):
    x = tensor(rng, (2, 3, 10, 9), channels_last=True, ndim=2).to(device="meta")
    assert x.is_contiguous(memory_format=torch.channels_last)
    y, idx = torch.ops.pool_tuner.adaptive_max_pool2d(x, [5, 7], "")
    assert y.shape == idx.shape == (2, 3, 5, 7) and idx.dtype == torch.int64
    assert y.is_contiguous(memory_format=torch.channels_last) and idx.is_contiguous(memory_format=torch.channels_last)


# ---------------------------------------------------------------------------------------------
# torch.compile


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own models: forget earlier tests' compiled code (dynamo caches it
    per code object, up to a recompile limit that a whole file of models would exceed)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Net(torch.nn.Module):
    """conv -> pool_tuner module -> functional form (max with indices) -> linear: both forms."""

    def __init__(self, kind, ndim, size, channels=4):
        super().__init__()
        conv = getattr(torch.nn, f"Conv{ndim}d")
        self.conv, self.pool = conv(2, channels, 3), layer(kind, ndim, size)
        self.kind, self.ndim, self.size = kind, ndim, size
        self.head = torch.nn.LazyLinear(3)

    def forward(self, x):
        y = self.pool(torch.relu(self.conv(x)))
        fn = getattr(ptt, f"adaptive_{self.kind}_pool{self.ndim}d")
        z = fn(y, 2, True)[0] if self.kind == "max" else fn(y, 2)
        return self.head(torch.cat([y.flatten(1), z.flatten(1)], 1))


NET_INPUTS = {1: (2, 2, 19), 2: (2, 2, 13, 12), 3: (2, 2, 7, 8, 9)}
NET_SIZES = {1: 5, 2: (5, 4), 3: (3, 4, 3)}


def eager_and_compiled(model, x, **compile_options):
    """Outputs and (input, parameter) gradients of ``model`` and of its compiled copy."""
    compiled = torch.compile(model, fullgraph=True, **compile_options)
    results = []
    for net in (model, compiled):
        x_ = x.detach().clone().requires_grad_()
        y = net(x_)
        grads = torch.autograd.grad(y.square().sum(), [x_, *model.parameters()])
        results.append((y, grads))
    return results


@pytest.mark.parametrize("kind,ndim", KIND_NDIM)
def test_compile_fullgraph_forward_and_backward_matches_eager(kind, ndim, rng):
    """fullgraph=True: a graph break would raise.  The same compiled model then runs a new batch
    size (recompiled with a dynamic batch) and channels-last input."""
    torch.manual_seed(0)
    model = Net(kind, ndim, NET_SIZES[ndim])
    model(torch.zeros(NET_INPUTS[ndim]))  # materialise the lazy linear
    for shape in (NET_INPUTS[ndim], (3,) + NET_INPUTS[ndim][1:]):
        x = tensor(rng, shape)
        (y, grads), (y_c, grads_c) = eager_and_compiled(model, x, backend="aot_eager")
        torch.testing.assert_close(y_c, y, **FLOAT32_TOL)
        for g_c, g in zip(grads_c, grads):
            torch.testing.assert_close(g_c, g, **FLOAT32_TOL)
    reference = Net(kind, ndim, NET_SIZES[ndim])
    reference.load_state_dict(model.state_dict())
    reference.pool = layer(kind, ndim, NET_SIZES[ndim], ours=False)
    torch.testing.assert_close(y, reference(x), **FLOAT32_TOL)  # and eager is PyTorch's result


def test_compile_with_channels_last_input(rng):
    x = tensor(rng, (2, 3, 10, 9), channels_last=True, ndim=2).requires_grad_()
    compiled = torch.compile(lambda t: ptt.adaptive_avg_pool2d(t, (5, 7)) * 2, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, F.adaptive_avg_pool2d(x, (5, 7)) * 2, **FLOAT32_TOL)
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, torch.autograd.grad(F.adaptive_avg_pool2d(x, (5, 7)).sum() * 2, x)[0],
                               **FLOAT32_TOL)


def test_compile_fullgraph_of_the_functional_form_with_options(rng):
    """The options of a functional call are encoded into the op's schema string as a constant of
    the graph: fullgraph=True does not break on it, and the compiled call gives PyTorch's result."""
    variant = pt.variants("adaptive_avg_pool2d")[0]
    x = tensor(rng, (2, 3, 11, 13))
    compiled = torch.compile(lambda t: ptt.adaptive_avg_pool2d(t, (5, 7), variant=variant) * 2, fullgraph=True,
                             backend="aot_eager")
    torch.testing.assert_close(compiled(x), F.adaptive_avg_pool2d(x, (5, 7)) * 2, **FLOAT32_TOL)


def test_importing_the_torch_front_end_leaves_the_compiler_unimported():
    """``import pool_tuner.torch`` does not import ``torch._dynamo`` (which takes longer than the
    rest of the import): a user who never compiles never pays for it."""
    code = "import sys, pool_tuner.torch; print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_inductor_training_runs_pool_tuner_backward(rng):
    """The real compiler: a compiled training step follows eager PyTorch's, and the profiler shows
    that the backward kernels that ran are pool_tuner's ops, not ATen's adaptive pooling."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3), torch.nn.AdaptiveMaxPool2d((5, 7)), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d((3, 4)), torch.nn.Flatten(), torch.nn.Linear(4 * 3 * 4, 2),
    )
    model = ptt.replace_pooling(copy.deepcopy(reference))
    compiled = torch.compile(model, fullgraph=True)
    x, target = tensor(rng, (2, 2, 12, 11)), tensor(rng, (2, 2))
    losses = {}
    for name, net, params in (("eager", reference, reference), ("compiled", compiled, model)):
        optimizer = torch.optim.SGD(params.parameters(), lr=0.05)
        losses[name] = []
        # A fresh compile cache: a cached graph would hide a change to the ops' autograd formulas.
        with torch._inductor.utils.fresh_cache(), \
                torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            for _ in range(3):
                optimizer.zero_grad()
                loss = F.mse_loss(net(x), target)
                loss.backward()
                optimizer.step()
                losses[name].append(loss.item())
        ran = {event.key for event in profile.key_averages()}
        if name == "compiled":
            assert {"pool_tuner::adaptive_max_pool2d_backward", "pool_tuner::adaptive_avg_pool2d_backward",
                    "pool_tuner::adaptive_max_pool2d", "pool_tuner::adaptive_avg_pool2d"} <= ran
            assert not [key for key in ran if "aten::" in key and "adaptive" in key]
    np.testing.assert_allclose(losses["compiled"], losses["eager"], rtol=1e-5)
    for p, q in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA tensors need a CUDA GPU: torch.cuda.is_available() is False"
)


@needs_cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_tensors_go_through_the_same_ops(kind, rng):
    """opcheck on CUDA (channels-last: the CUDA backend works on contiguous copies, the results
    come back in the memory format the fake implementation promised) and a compiled call."""
    x = tensor(rng, (2, 3, 10, 9), channels_last=True, ndim=2).cuda()
    torch.library.opcheck(ptt._OPS[kind, 2, False], (x.requires_grad_(), [5, 7], ""))
    compiled = torch.compile(getattr(ptt, f"adaptive_{kind}_pool2d"), fullgraph=True, backend="aot_eager")
    y = compiled(x, (5, 7))
    expected = torch_pool(kind, 2)(x, (5, 7))
    assert y.is_cuda and y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, expected, **FLOAT32_TOL)
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, torch.autograd.grad(expected.sum(), x)[0], **FLOAT32_TOL)


# ---------------------------------------------------------------------------------------------
# torch.export


@pytest.mark.parametrize("kind,ndim", KIND_NDIM)
def test_export_runs_and_matches_eager(kind, ndim, rng):
    size = NET_SIZES[ndim]
    model = torch.nn.Sequential(getattr(ptt, f"Adaptive{kind.capitalize()}Pool{ndim}d")(size, variant="thread_per_output"))
    x = tensor(rng, NET_INPUTS[ndim])
    program = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch", max=64)},))
    code = program.graph_module.code
    assert f"torch.ops.pool_tuner.adaptive_{kind}_pool{ndim}d.default" in code
    assert '"variant": "thread_per_output"' in code  # the options travel in the graph
    for batch in (NET_INPUTS[ndim][0], 5):
        x = tensor(rng, (batch,) + NET_INPUTS[ndim][1:])
        torch.testing.assert_close(program.module()(x), torch_pool(kind, ndim)(x, size), **FLOAT32_TOL)


def test_exported_program_saves_and_loads(rng, tmp_path):
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), ptt.AdaptiveMaxPool2d((5, 7), return_indices=True))
    x = tensor(rng, (2, 2, 12, 11))
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(model, (x,)), path)
    values, indices = torch.export.load(path).module()(x)
    t_values, t_indices = F.adaptive_max_pool2d(model[0](x), (5, 7), True)
    assert torch.equal(values, t_values) and torch.equal(indices, t_indices)


# ---------------------------------------------------------------------------------------------
# ONNX: the decomposition (in PyTorch, no export), then through onnxruntime


@pytest.mark.parametrize("kind", KINDS)
def test_onnx_decomposition_is_exact(kind, rng):
    """Every path of pool_tuner.decomposition.decompose -- one fixed pooling, per-axis fixed pooling,
    pooling matrices / window slices, identity axes, upsampling, output 1, batch-less -- against
    PyTorch in float64."""
    cases = [((2, 3, 12), [4]), ((2, 3, 14), [4]), ((3, 5), [7]), ((2, 3, 8, 8), [4, 4]),
             ((2, 3, 7, 10), [3, 4]), ((2, 3, 10, 9), [5, 9]), ((3, 5, 5), [7, 1]), ((2, 3, 7, 7), [1, 1]),
             ((1, 2, 4, 6, 6), [2, 3, 3]), ((1, 2, 5, 7, 9), [3, 4, 5]), ((2, 3, 4, 5), [5, 6, 4])]
    for shape, size in cases:
        ndim = len(size)
        x = tensor(rng, shape, torch.float64)
        expected = torch_pool(kind, ndim)(x, size)
        torch.testing.assert_close(decomposition.decompose(kind, ndim, x, size, "test"), expected, rtol=1e-12, atol=1e-12)


def run_onnx(program, *inputs):
    onnxruntime = pytest.importorskip("onnxruntime")
    session = onnxruntime.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run(None, {name: x.numpy() for name, x in zip(names, inputs)})


class Branches(torch.nn.Module):
    def __init__(self, *layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x):
        return tuple(pool(x) for pool in self.layers)


#: Per rank: input shape and output sizes -- divisible, fixed-equivalent non-divisible, and
#: non-divisible (pooling matrix / window slices), upsampling included.
ONNX_CASES = {1: ((2, 3, 14), [7, 6, 5, 17]), 2: ((2, 3, 10, 9), [(5, 3), (4, 4), (3, 4), (12, 4)]),
              3: ((1, 2, 6, 7, 9), [(3, 7, 3), (3, 3, 4), (4, 5, 2), (7, 3, 2)])}


@pytest.mark.parametrize("ndim", ONNX_RANKS)
def test_onnx_export_of_torch_layers_runs_in_onnxruntime(ndim, rng):
    pytest.importorskip("onnxruntime")
    shape, sizes = ONNX_CASES[ndim]
    layers = [layer(kind, ndim, size, ours=False) for kind in KINDS for size in sizes]
    model = Branches(*layers).eval()
    # 2d: a dynamic batch dimension (the pooled ones stay static), run at two batch sizes
    dynamic = ({0: torch.export.Dim("batch", max=64)},) if ndim == 2 else None
    program = pto.export(model, (tensor(rng, shape),), dynamic_shapes=dynamic, verbose=False)
    ops = {node.op_type for node in program.model.graph}
    assert not [node.domain for node in program.model.graph if node.domain not in ("", "ai.onnx")]
    assert {"AveragePool", "MaxPool", "MatMul", "ReduceMax"} <= ops, ops
    for batch in (shape[0], 5) if dynamic else (shape[0],):
        x = tensor(rng, (batch,) + shape[1:])
        for result, expected in zip(run_onnx(program, x), model(x), strict=True):
            np.testing.assert_allclose(result, expected.numpy(), **FLOAT32_TOL)


@pytest.mark.parametrize("ndim", ONNX_RANKS)
def test_onnx_export_of_max_pooling_keeps_nans_in_onnxruntime(ndim, rng):
    """A max window holding NaN gives NaN in onnxruntime as in PyTorch, on every path of the
    decomposition (onnxruntime's MaxPool and ReduceMax skip NaNs)."""
    pytest.importorskip("onnxruntime")
    shape, sizes = ONNX_CASES[ndim]
    model = Branches(*[layer("max", ndim, size, ours=False) for size in sizes]).eval()
    x = tensor(rng, shape)
    x[torch.from_numpy(rng.random(shape) < 0.1)] = float("nan")
    program = pto.export(model, (x,), verbose=False)
    for result, expected in zip(run_onnx(program, x), model(x), strict=True):
        assert np.isnan(expected.numpy()).any()
        np.testing.assert_array_equal(result, expected.numpy())  # NaN where PyTorch has NaN, values exact


#: What each channel of ``with_special_values``' input holds in one window: PyTorch's average of
#: that window is NaN, +inf, -inf, NaN, finite; its max NaN, +inf, finite (or -inf), +inf, finite.
SPECIAL_VALUES = ((float("nan"),), (float("inf"),), (-float("inf"),), (float("inf"), -float("inf")), ())

#: Per rank: input shape (5 channels, one per entry of SPECIAL_VALUES; 1d batch-less) and output
#: sizes -- non-uniform windows on every axis (pooling matrices / window slices), fixed windows on
#: every axis (one AveragePool / MaxPool), and both mixed; upsampling in 1d.
SPECIAL_CASES = {1: ((5, 14), [5, 7, 17]), 2: ((2, 5, 10, 9), [(4, 7), (5, 3), (5, 7)]),
                 3: ((1, 5, 6, 7, 9), [(4, 5, 2), (3, 7, 3), (3, 5, 3)])}


def with_special_values(x, ndim):
    """``x`` with channel ``c`` of its first sample holding ``SPECIAL_VALUES[c]`` at the first
    positions along the last axis (one window of every case holds them all), row 3 of the others;
    the rest finite."""
    x = x.clone()
    sample = x[0] if x.dim() == ndim + 2 else x
    for channel, values in enumerate(SPECIAL_VALUES):
        for position, value in enumerate(values):
            sample[(channel,) + (3,) * (ndim - 1) + (position,)] = value
    return x


def assert_same_with_special_values(results, expected):
    """onnxruntime's results are PyTorch's: NaN, +inf and -inf exactly where PyTorch has them, the
    finite values close."""
    for result, want in zip(results, expected, strict=True):
        want = want.detach().numpy()
        assert np.isnan(want).any() and np.isinf(want).any()  # the input's special values reached it
        np.testing.assert_array_equal(np.isnan(result), np.isnan(want))
        np.testing.assert_array_equal(np.isposinf(result), np.isposinf(want))
        np.testing.assert_array_equal(np.isneginf(result), np.isneginf(want))
        np.testing.assert_allclose(result, want, equal_nan=True, **FLOAT32_TOL)


@pytest.mark.parametrize("ndim", ONNX_RANKS)
def test_onnx_export_keeps_pytorchs_nan_and_infinities_in_onnxruntime(ndim, rng):
    """A window holding NaN, +inf, -inf or both infinities gives in onnxruntime what it gives in
    PyTorch, and the other windows stay finite, on every path of the decomposition (a pooling
    matrix's zeros times NaN or inf are NaN: one special value spread along a whole row)."""
    pytest.importorskip("onnxruntime")
    shape, sizes = SPECIAL_CASES[ndim]
    ours, pytorchs = (Branches(*[layer(kind, ndim, size, mine) for kind in KINDS for size in sizes]).eval()
                      for mine in (True, False))
    x = with_special_values(tensor(rng, shape), ndim)
    assert_same_with_special_values(run_onnx(pto.export(ours, (x,), verbose=False), x), pytorchs(x))
    assert_same_with_special_values(run_onnx(pto.export(pytorchs, (x,), verbose=False), x), pytorchs(x))


def test_plain_torch_onnx_exports_keep_pytorchs_nan_and_infinities(rng):
    """pool_tuner's layers and functional forms under torch.onnx.export, both exporters, keep NaN and
    infinities as PyTorch does."""
    onnxruntime = pytest.importorskip("onnxruntime")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.avg, self.max = ptt.AdaptiveAvgPool2d((4, 7)), ptt.AdaptiveMaxPool2d((4, 7))

        def forward(self, x):
            return self.avg(x), self.max(x), ptt.adaptive_avg_pool1d(x.flatten(2), 7)

    model = Model().eval()
    x = with_special_values(tensor(rng, (2, 5, 10, 9)), 2)
    expected = F.adaptive_avg_pool2d(x, (4, 7)), F.adaptive_max_pool2d(x, (4, 7)), F.adaptive_avg_pool1d(x.flatten(2), 7)
    assert_same_with_special_values(run_onnx(torch.onnx.export(model, (x,), verbose=False), x), expected)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation and tracer warnings
        torch.onnx.export(model, (x,), buffer, dynamo=False)
    session = onnxruntime.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
    assert_same_with_special_values(session.run(None, {session.get_inputs()[0].name: x.numpy()}), expected)


def test_plain_torch_onnx_export_of_pool_tuner_layers_and_functions(rng):
    """No helper: pool_tuner's modules and functional forms decompose themselves under
    torch.onnx.export."""
    pytest.importorskip("onnxruntime")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.avg, self.max = ptt.AdaptiveAvgPool2d((3, 4)), ptt.AdaptiveMaxPool3d((2, None, 3))

        def forward(self, x):
            return self.avg(x), self.max(x.unsqueeze(1)), ptt.adaptive_max_pool1d(x.flatten(2), 7)

    model = Model().eval()
    x = tensor(rng, (2, 3, 10, 9))
    program = torch.onnx.export(model, (x,), verbose=False)
    assert "pool_tuner" not in {node.domain for node in program.model.graph}
    for result, expected in zip(run_onnx(program, x), model(x), strict=True):
        np.testing.assert_allclose(result, expected.numpy(), **FLOAT32_TOL)


def test_torchscript_onnx_exporter_decomposes_pool_tuner_layers(rng):
    """torch.onnx.export(dynamo=False), PyTorch's TorchScript exporter, traces sizes as tensors:
    pool_tuner's layers decompose at the sizes of the example input, as PyTorch's own layers do."""
    onnxruntime = pytest.importorskip("onnxruntime")

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.avg, self.max = ptt.AdaptiveAvgPool2d((4, None)), ptt.AdaptiveMaxPool3d((2, None, 3))
            self.gem, self.cat = ptt.AdaptiveGeMPool2d(1), ptt.AdaptiveAvgMaxPool2d(2, "cat")

        def forward(self, x):
            return (self.avg(x), self.max(x.unsqueeze(1)), ptt.adaptive_max_pool1d(x.flatten(2), 7), self.gem(x.abs()),
                    self.cat(x))

    model = Model().eval()
    x = tensor(rng, (2, 3, 10, 9))
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation and tracer warnings
        torch.onnx.export(model, (x,), buffer, dynamo=False)
    session = onnxruntime.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
    results = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    for result, expected in zip(results, model(x), strict=True):
        np.testing.assert_allclose(result, expected.detach().numpy(), **FLOAT32_TOL)


@pytest.mark.parametrize("shape", [(1, 3, 12, 12), (1, 3, 4, 16), (1, 3, 1, 64), (1, 3, 8, 1), (2, 3, 8, 8)])
def test_a_torchscript_export_refuses_other_pooled_sizes_at_run_time(shape, rng):
    """The TorchScript exporter fixes the windows at the example's pooled sizes (8x8); a model
    exported with dynamic_axes naming a pooled axis ran on 12x12 and gave 3x3 windows of the wrong
    sizes. Other pooled sizes are now refused by onnxruntime; other batch sizes run."""
    onnxruntime = pytest.importorskip("onnxruntime")
    model = torch.nn.Sequential(ptt.AdaptiveAvgPool2d((2, 3)), torch.nn.Flatten()).eval()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation and tracer warnings
        torch.onnx.export(model, (tensor(rng, (1, 3, 8, 8)),), buffer, dynamo=False, input_names=["x"],
                          dynamic_axes={"x": {0: "n", 2: "h", 3: "w"}})
    session = onnxruntime.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
    x = tensor(rng, shape)
    if shape[2:] == (8, 8):
        np.testing.assert_allclose(session.run(None, {"x": x.numpy()})[0], model(x).numpy(), **FLOAT32_TOL)
    else:
        with pytest.raises(Exception, match="Expand|Reshape|broadcast|reshape"):
            session.run(None, {"x": x.numpy()})


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ndim,shape,size", [(1, (2, 3, 10), 0), (2, (2, 3, 10, 9), (0, 2)), (3, (3, 5, 6, 7), (2, 0, 9)),
                                             (2, (2, 3, 10, 9), (0, 0)), (3, (2, 3, 5, 6, 7), (0, 3, 0))])
def test_onnx_export_of_an_output_size_zero_is_an_empty_result(kind, ndim, shape, size, rng):
    """PyTorch pools to an output size of 0 as an empty result; so does the exported model."""
    pytest.importorskip("onnxruntime")
    model = torch.nn.Sequential(torch.nn.Identity(), layer(kind, ndim, size, ours=False)).eval()
    x = tensor(rng, shape)
    (result,) = run_onnx(pto.export(model, (x,), verbose=False), x)
    assert result.shape == tuple(model(x).shape) and result.size == 0


def test_onnx_export_errors_name_the_layer():
    class Unknown(torch.nn.AdaptiveAvgPool2d):
        pass

    x = torch.ones(2, 3, 10, 9)
    model = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d((5, 7))))
    with pytest.raises(ValueError, match=r"layer '1\.0'.*pooled input size 1 is dynamic"):
        pto.export(model, (x,), dynamic_shapes=({3: torch.export.Dim("width", min=4, max=64)},))
    model[1][0] = torch.nn.AdaptiveMaxPool2d(3, return_indices=True)
    with pytest.raises(ValueError, match=r"layer '1\.0' \(AdaptiveMaxPool2d\) has return_indices=True"):
        pto.export(model, (x,))
    model[1][0] = Unknown(3)
    with pytest.raises(TypeError, match=r"layer '1\.0' is a .*Unknown, a subclass .* does not know"):
        pto.export(model, (x,))


def test_onnx_export_without_onnxscript_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxscript", None)
    with pytest.raises(ImportError, match=r'needs onnxscript.*pip install "pool-tuner\[onnx\]"'):
        pto.export(ptt.AdaptiveAvgPool1d(3), (torch.ones(1, 2, 9),))


# ---------------------------------------------------------------------------------------------
# TorchScript, imports and argument errors


def test_torchscript_is_refused_with_what_to_use_instead():
    model = ptt.replace_pooling(torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.AdaptiveAvgPool2d(2)))
    with pytest.raises(RuntimeError, match=r"torch\.jit\.script.*use torch\.compile.*torch\.export\.export"):
        torch.jit.script(model)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ndim,shape,size", [(1, (2, 3, 10), (None,)), (2, (2, 3, 10, 9), (4, None)),
                                             (2, (3, 10, 9), (None, None)), (3, (2, 3, 5, 6, 7), (2, None, 3)),
                                             (3, (3, 5, 6, 7), (None, 4, None))])
def test_jit_trace_of_an_output_size_with_none_follows_the_input_size(kind, ndim, shape, size, rng):
    """torch.jit.trace resolves None against the traced input's sizes, which are tensors there:
    the trace runs, gives PyTorch's values, indices and strides and, like PyTorch's own layer's
    trace, follows the input's size along the kept axes; gradients flow through it."""
    kwargs = {"return_indices": True} if kind == "max" else {}
    traced = torch.jit.trace(getattr(ptt, f"Adaptive{kind.capitalize()}Pool{ndim}d")(size, **kwargs),
                             (tensor(rng, shape),), check_trace=False)
    for x in (tensor(rng, shape), tensor(rng, shape[:-1] + (shape[-1] + 3,))):
        x_stock, x_traced = x.clone().requires_grad_(), x.clone().requires_grad_()
        resolved = tuple(x.shape[x.dim() - ndim + axis] if s is None else s for axis, s in enumerate(size))
        expected, got = torch_pool(kind, ndim)(x_stock, resolved, **kwargs), traced(x_traced)
        for e, g in zip(*((expected, got) if kind == "max" else ((expected,), (got,)))):
            torch.testing.assert_close(g, e, **(FLOAT32_TOL if kind == "avg" else dict(rtol=0, atol=0)))
            assert g.stride() == e.stride()
        values = (expected[0], got[0]) if kind == "max" else (expected, got)
        grad = torch.from_numpy(rng.standard_normal(values[0].shape).astype(np.float32))
        values[0].backward(grad), values[1].backward(grad)
        torch.testing.assert_close(x_traced.grad, x_stock.grad, **FLOAT32_TOL)


def test_import_without_torch_says_what_to_install():
    code = ("import sys; sys.modules['torch'] = None\n"
            "try:\n    import pool_tuner.torch\nexcept ImportError as e:\n"
            "    assert type(e) is ImportError, type(e); print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert 'pip install "pool-tuner[torch]"' in out


@pytest.mark.parametrize("kind,ndim", KIND_NDIM)
def test_wrong_rank_names_the_input_argument(kind, ndim):
    for call in (lambda x: layer(kind, ndim, 2)(x), lambda x: getattr(ptt, f"adaptive_{kind}_pool{ndim}d")(x, 2)):
        with pytest.raises(ValueError, match=rf"^input must be {ndim + 1}-d or {ndim + 2}-d .* got shape"):
            call(torch.ones((1,) * (ndim + 3)))
        with pytest.raises(ValueError, match=r"^input has a pooled dimension of size 0"):
            call(torch.ones((1, 2) + (0,) * ndim))
