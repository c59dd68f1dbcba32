"""The lean call path (pool_tuner.plans): a signature is validated, dispatched and built once;
later calls only launch, on the caller's own memory."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import pool_tuner as pt
import pool_tuner.torch as ptt
from pool_tuner import backends, dispatch, plans, reference, torch_cpu
from pool_tuner.backends import default_device
from pool_tuner.backends import opencl
from pool_tuner.operations import OPERATIONS

from conftest import random_input, tiered

FLOAT32_TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture
def fresh_plans():
    dispatch.forget()
    yield
    dispatch.forget()


def _count(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.usefixtures("fresh_plans")
def test_repeated_numpy_calls_plan_and_build_once(monkeypatch, rng):
    made, prepared = _count(monkeypatch, plans, "make_plan"), _count(monkeypatch, dispatch, "prepare")
    x = random_input(rng, (2, 5, 10, 9))
    for _ in range(3):
        x = random_input(rng, (2, 5, 10, 9))  # new data, same signature
        np.testing.assert_allclose(pt.adaptive_avg_pool2d(x, (4, 7)), reference.adaptive_avg_pool(x, (4, 7), 2),
                                   **FLOAT32_TOL)
    assert len(made) == 1 and len(prepared) == 1
    pt.adaptive_avg_pool2d(random_input(rng, (2, 5, 10, 9)), (4, 6))  # another signature
    assert len(made) == 2


@pytest.mark.usefixtures("fresh_plans")
def test_warm_numpy_and_tensor_calls_make_no_pyopencl_arrays(monkeypatch, rng):
    import pyopencl.array as cl_array

    x = random_input(rng, (1, 8, 5, 5))
    t = torch.from_numpy(random_input(rng, (1, 8, 5, 5)))
    module = ptt.AdaptiveMaxPool2d(2)
    pt.adaptive_avg_pool2d(x, 2), module(t)

    def forbidden(*args, **kwargs):
        raise AssertionError("a pyopencl Array was made on a warm call")

    monkeypatch.setattr(cl_array.Array, "__init__", forbidden)
    y = pt.adaptive_avg_pool2d(x, 2)
    np.testing.assert_allclose(y, reference.adaptive_avg_pool(x, 2, 2), **FLOAT32_TOL)
    out = module(t)
    assert torch.equal(out, torch.nn.functional.adaptive_max_pool2d(t, 2))


@pytest.mark.usefixtures("fresh_plans")
def test_signatures_tell_apart_what_changes_the_call(rng):
    x = random_input(rng, (2, 3, 10, 9))
    before = len(pt.ops._PLANS)
    pt.adaptive_avg_pool2d(x, (4, 7))
    pt.adaptive_avg_pool2d(np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2), (4, 7))
    pt.adaptive_avg_pool2d(x.astype(np.float16), (4, 7))
    pt.adaptive_avg_pool2d(x, [4, 7])
    pt.adaptive_avg_pool2d(x, (4, 7), variant="thread_per_output")
    assert len(pt.ops._PLANS) - before == 5
    with pytest.raises(TypeError, match=r"output_size\[0\] must be an int"):
        pt.adaptive_avg_pool2d(x, (4.0, 7))  # equal to (4, 7), but never its plan


@pytest.mark.usefixtures("fresh_plans")
def test_plans_are_bounded_by_the_memo_limit_and_forgotten_with_decisions(monkeypatch, rng):
    from pool_tuner import memo

    previous = memo.limit()
    memo.set_limit(4)
    try:
        for rows in range(5, 13):
            x = random_input(rng, (1, 3, rows, 9))
            np.testing.assert_allclose(pt.adaptive_avg_pool2d(x, (4, 7)), reference.adaptive_avg_pool(x, (4, 7), 2),
                                       **FLOAT32_TOL)
            assert len(pt.ops._PLANS) <= 4
    finally:
        memo.set_limit(previous)
    assert len(pt.ops._PLANS) > 0
    dispatch.forget()  # plans hold decisions: forgotten with them
    assert len(pt.ops._PLANS) == 0


@pytest.mark.usefixtures("fresh_plans")
@pytest.mark.parametrize("aliases", [True, False], ids=["aliasing", "mapped"])
def test_host_launch_is_exact_with_and_without_aliasing(monkeypatch, rng, aliases):
    """Where host memory does not alias (or the probe says so), buffers are made per call and
    results mapped: both paths give the same exact results."""
    device = default_device()
    if not device.info.shares_host_memory:
        pytest.skip("the default device does not share host memory")
    monkeypatch.setattr(device, "host_memory_aliases", aliases)
    kept = _count(monkeypatch, opencl.HostBuffers, "get")
    for shape, size in (((2, 5, 10, 9), (4, 7)), ((3, 7, 6), (4,))):
        x = random_input(rng, shape)
        ndim = len(shape) - 2 if len(shape) == 4 else 1
        fn = pt.adaptive_max_pool2d if ndim == 2 else pt.adaptive_max_pool1d
        values, indices = fn(x, size, return_indices=True)
        expected_values, expected_indices = reference.forward(fn.__name__, x, size)
        np.testing.assert_array_equal(values, expected_values)
        np.testing.assert_array_equal(indices, expected_indices)
    assert bool(kept) == aliases


def test_pocl_host_memory_aliases():
    """The probe behind the kept buffers answers yes on PoCL's CPU device (else every call pays
    fresh buffers and a map)."""
    device = default_device()
    if not (isinstance(device, opencl.OpenCLDevice) and device.is_pocl):
        pytest.skip("the default device is not PoCL's")
    assert device.host_memory_aliases


@pytest.mark.usefixtures("fresh_plans")
def test_kept_buffers_see_the_new_contents_of_reused_memory(rng):
    """A buffer kept for an address is used again for whatever array lives there now."""
    storage = np.empty(2 * 3 * 10 * 9, np.float32)
    x = storage.reshape(2, 3, 10, 9)
    for _ in range(3):
        x[...] = random_input(rng, x.shape)
        np.testing.assert_allclose(pt.adaptive_avg_pool2d(x, (4, 7)), reference.adaptive_avg_pool(x, (4, 7), 2),
                                   **FLOAT32_TOL)


# ------------------------------------------------------------------ PyTorch's kernel as a candidate


def _race_winner(monkeypatch, winner):
    """Make every race end with ``winner`` running the layer."""
    real = torch_cpu.race_pytorch

    def rigged(found, x, output_size, form=None):
        real(found, x, output_size, form)
        return winner == "pytorch"

    monkeypatch.setattr(torch_cpu, "race_pytorch", rigged)


#: More calls than a race times: the calls of a layer in a test that would see a race's turns.
MANY_CALLS = 3 * (torch_cpu.RACE_CALLS + 1)


@pytest.mark.usefixtures("candidate_on")
def test_the_races_decisions_are_bounded_by_the_memo_limit_and_leave_with_their_plans(rng):
    """One decision per eager signature, bounded as the plans are (on 0511fb1 ``WINNERS`` grew by
    one entry per signature without end), and a signature still gives one answer per call while
    its decision is held."""
    from pool_tuner import memo

    previous = memo.limit()
    memo.set_limit(3)
    try:
        for rows in range(4, 12):
            t = torch.from_numpy(random_input(rng, (1, 3, rows, 5)))
            first = ptt.adaptive_avg_pool2d(t, 2)
            assert torch.equal(first, ptt.adaptive_avg_pool2d(t, 2))
            assert len(torch_cpu.WINNERS) <= 3
    finally:
        memo.set_limit(previous)
    assert len(torch_cpu.WINNERS) > 0
    dispatch.forget()
    assert len(torch_cpu.WINNERS) == 0


@pytest.mark.usefixtures("candidate_on")
def test_a_signature_evicted_by_the_memo_limit_keeps_its_race_s_winner_when_met_again(monkeypatch, rng):
    """Eviction bounds the plans and the table of winners, not the promise of one answer per input:
    a signature met again after the memo limit dropped it runs the kernel its race chose, with no
    new race (which could pick the other kernel, and other bits)."""
    from pool_tuner import memo

    raced = _count(monkeypatch, torch_cpu, "race_pytorch")
    t = torch.from_numpy(random_input(rng, (1, 8, 4, 4)))
    first = ptt.adaptive_avg_pool2d(t, 2)
    assert len(raced) == 1
    previous = memo.limit()
    memo.set_limit(2)
    try:
        for rows in range(5, 10):  # other signatures push the first out of the bounded tables
            ptt.adaptive_avg_pool2d(torch.from_numpy(random_input(rng, (1, 8, rows, 4))), 2)
        assert len(torch_cpu.WINNERS) <= 2
        raced.clear()
        again = ptt.adaptive_avg_pool2d(t, 2)
    finally:
        memo.set_limit(previous)
    assert raced == [], "the returning signature was raced again"
    assert torch.equal(first, again)


#: Output sizes that pool_tuner's validation takes and PyTorch's functional forms do not all take as
#: written: (op, input shape, the size as given, the size it means).
UNUSUAL_SIZES = [
    ("adaptive_avg_pool1d", (2, 3, 7), (None,), (7,)),
    ("adaptive_max_pool1d", (3, 9), (None,), (9,)),
    ("adaptive_avg_pool2d", (1, 2, 7, 6), np.int64(3), (3, 3)),
    ("adaptive_max_pool2d", (1, 2, 7, 6), (np.int32(2), None), (2, 6)),
    ("adaptive_avg_pool3d", (1, 2, 3, 5, 4), [np.int64(2), 3, None], (2, 3, 4)),
    ("adaptive_avgmax_pool2d", (1, 2, 7, 6), np.int64(2), (2, 2)),
]


@pytest.mark.usefixtures("candidate_on")
@pytest.mark.parametrize("winner", ["pytorch", "pool_tuner"])
@pytest.mark.parametrize("op, shape, given, meant", UNUSUAL_SIZES, ids=[case[0] for case in UNUSUAL_SIZES])
def test_an_output_size_is_taken_alike_whichever_kernel_won_the_race(monkeypatch, rng, winner, op, shape, given,
                                                                      meant):
    """A call's output size means the same whoever runs it: ``None`` entries (which PyTorch's 1d
    forms refuse) and numpy integers (which its 2d forms refuse) were passed to PyTorch's kernel
    as written where it won the race, so the same call raised or not by the race's timing."""
    _race_winner(monkeypatch, winner)
    function = getattr(ptt, op)
    ndim = len(meant)
    for _ in range(2):  # the race's call, then a warm one
        x = random_input(rng, shape)
        got = function(torch.from_numpy(x), given)
        if op.startswith("adaptive_avgmax"):
            expected = 0.5 * (reference.adaptive_avg_pool(x, meant, ndim) + reference.adaptive_max_pool(x, meant, ndim)[0])
        elif "max" in op:
            expected = reference.adaptive_max_pool(x, meant, ndim)[0]
        else:
            expected = reference.adaptive_avg_pool(x, meant, ndim)
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6)


def _for_shape(calls: list, shape: tuple, problem_of) -> list:
    """The counted calls (``_count``) whose problem's input is of ``shape``."""
    return [args for args in calls if problem_of(args).input_shape == shape]


@pytest.mark.usefixtures("candidate_on")
def test_small_problems_race_pytorch_on_their_first_call_and_explain_says_who_won(monkeypatch, rng):
    """Where PyTorch's kernel is not faster than the device's launch floor (here: a margin of 0,
    which also hands the race to pool_tuner), both kernels are timed on the first call, the
    winner runs every later call, and ``explain`` gives both times."""
    monkeypatch.setattr(torch_cpu, "RACE_MARGIN", 0.0)
    shape = (1, 8, 4, 4)
    used = _count(monkeypatch, torch_cpu, "run")
    prepared = _count(monkeypatch, dispatch, "prepare")
    module = ptt.AdaptiveAvgPool2d(2)
    assert pt.explain("adaptive_avg_pool2d", shape, 2)["measured_candidate"] is None
    t = torch.from_numpy(random_input(rng, shape))
    torch.testing.assert_close(module(t), torch.nn.functional.adaptive_avg_pool2d(t, 2), rtol=1e-5, atol=1e-6)
    race = pt.explain("adaptive_avg_pool2d", shape, 2)["measured_candidate"]
    assert race["candidate"] == "pytorch" and race["pytorch_ms"] > 0 and race["pool_tuner_ms"] > 0
    assert race["floor_ms"] > 0 and race["winner"] == "pool_tuner"
    runs = lambda: _for_shape(used, shape, lambda args: args[0].problem)  # noqa: E731
    builds = lambda: _for_shape(prepared, shape, lambda args: args[2])  # noqa: E731
    assert len(runs()) == torch_cpu.RACE_CALLS + 1 + 1, "the race's calls, then the winner's"
    assert len(builds()) == 1
    for _ in range(MANY_CALLS):
        t = torch.from_numpy(random_input(rng, shape))
        torch.testing.assert_close(module(t), torch.nn.functional.adaptive_avg_pool2d(t, 2), rtol=1e-5, atol=1e-6)
    assert len(runs()) == torch_cpu.RACE_CALLS + 2 + MANY_CALLS and len(builds()) == 1


@pytest.mark.usefixtures("candidate_on")
def test_a_race_pytorch_wins_below_the_launch_floor_builds_no_kernel(monkeypatch, rng):
    """A first call whose PyTorch kernel is already faster than the device's launch floor by the
    race's margin neither builds nor times pool_tuner's kernel (a new shape's first call in a model
    costs about what PyTorch's does); ``explain`` says so.  The plan is still there: a call under
    ``torch.use_deterministic_algorithms(True)`` builds and runs pool_tuner's kernel."""
    shape = (1, 2, 3, 2)  # the smallest layers: a few floats, which PyTorch pools in microseconds
    used = _count(monkeypatch, torch_cpu, "run")
    prepared = _count(monkeypatch, dispatch, "prepare")
    module = ptt.AdaptiveAvgPool2d(2)
    for _ in range(MANY_CALLS):
        t = torch.from_numpy(random_input(rng, shape))
        assert torch.equal(module(t), torch.nn.functional.adaptive_avg_pool2d(t, 2))
    race = pt.explain("adaptive_avg_pool2d", shape, 2)["measured_candidate"]
    assert race["pool_tuner_ms"] is None and race["winner"] == "pytorch"
    assert 0 < race["pytorch_ms"] < race["floor_ms"] * torch_cpu.RACE_MARGIN
    assert _for_shape(prepared, shape, lambda args: args[2]) == [], "pool_tuner's kernel was built"
    assert _for_shape(used, shape, lambda args: args[0].problem) == [], "pool_tuner's kernel ran"
    t = torch.from_numpy(random_input(rng, shape))
    torch.use_deterministic_algorithms(True)
    try:
        result = module(t)
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(_for_shape(prepared, shape, lambda args: args[2])) == 1
    np.testing.assert_allclose(result.numpy(), reference.adaptive_avg_pool(t.numpy(), (2, 2), 2),
                               **FLOAT32_TOL)


#: What a fresh process runs before its first race, and checks after it (see below).
_CALLERS_STATE = {
    "random generator": ("torch.manual_seed(0); expected = torch.rand(3); torch.manual_seed(0)",
                         "assert torch.equal(torch.rand(3), expected), 'the race drew from the global generator'"),
    "default device": ("torch.set_default_device('meta')",
                       "assert pooled.is_cpu; torch.set_default_device(None)"),
}


@pytest.mark.parametrize("state", _CALLERS_STATE)
def test_a_process_s_first_race_leaves_the_callers_torch_state_alone(state):
    """A fresh process's first race, which also measures the launch floor, draws nothing from
    PyTorch's global random generator and makes its tensors on the CPU whatever the caller's
    default device: a drop-in layer does not move a seeded model's dropout or initialisation, and
    works under ``torch.set_default_device``."""
    import subprocess
    import sys

    before, after = _CALLERS_STATE[state]
    script = "\n".join([
        "import torch", "import pool_tuner.torch as ptt",
        "x = torch.arange(2 * 8 * 5 * 7, dtype=torch.float32, device='cpu').reshape(2, 8, 5, 7) / 7",
        before, "pooled = ptt.AdaptiveAvgPool2d(2)(x)", after,
        "torch.testing.assert_close(pooled, torch.nn.functional.adaptive_avg_pool2d(x, 2))"])
    env = dict(os.environ, POOL_TUNER_PYTORCH_CANDIDATE="1")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.usefixtures("candidate_on")
def test_forced_and_large_problems_never_race(monkeypatch, rng):
    used = _count(monkeypatch, torch_cpu, "run")
    t = torch.from_numpy(random_input(rng, (1, 8, 4, 4)))
    for _ in range(MANY_CALLS):
        ptt.adaptive_avg_pool2d(t, 2, variant="thread_per_output")
    assert len(used) == MANY_CALLS
    assert pt.explain("adaptive_avg_pool2d", (1, 8, 4, 4), 2)["measured_candidate"] is None
    big = torch.from_numpy(random_input(rng, (8, 64, 128, 130)))
    assert 8 * 64 * 128 * 130 * 4 > torch_cpu.RACE_BYTES
    used.clear()
    for _ in range(MANY_CALLS):
        ptt.adaptive_avg_pool2d(big, 3)
    assert len(used) == MANY_CALLS
    assert pt.explain("adaptive_avg_pool2d", (8, 64, 128, 130), 3)["measured_candidate"] is None


@pytest.mark.usefixtures("candidate_on")
@pytest.mark.parametrize("winner", ["pytorch", "pool_tuner"])
def test_either_winner_trains_like_pytorch(monkeypatch, rng, winner):
    """Whichever kernel runs the layer -- during the race and after it -- the forward and the
    backward pass give PyTorch's results."""
    _race_winner(monkeypatch, winner)
    module, stock = ptt.AdaptiveMaxPool2d((3, 2)), torch.nn.AdaptiveMaxPool2d((3, 2))
    for _ in range(MANY_CALLS + 2):
        x = torch.from_numpy(random_input(rng, (2, 4, 7, 5))).requires_grad_()
        reference_x = x.detach().clone().requires_grad_()
        values, expected = module(x), stock(reference_x)
        assert torch.equal(values, expected)
        grad = torch.from_numpy(random_input(rng, tuple(values.shape)))
        values.backward(grad), expected.backward(grad)
        assert torch.equal(x.grad, reference_x.grad)
    assert pt.explain("adaptive_max_pool2d", (2, 4, 7, 5), (3, 2))["measured_candidate"] is not None
    used = _count(monkeypatch, torch_cpu, "run")
    with torch.no_grad():
        module(x)
    assert bool(used) == (winner == "pool_tuner")


@pytest.mark.usefixtures("fresh_plans")
def test_repeated_tensor_calls_reuse_their_kept_buffers(monkeypatch, rng):
    """Results come from numpy's allocator, which hands a freed block back at the same address, so a
    layer called again and again makes no new buffers (each costs PoCL a first use)."""
    device = default_device()
    if not getattr(device, "host_memory_aliases", False):
        pytest.skip("the default device keeps no host buffers")
    made = _count(monkeypatch, opencl, "host_buffer")
    module = ptt.AdaptiveAvgPool2d(1)
    x = torch.from_numpy(random_input(rng, (8, 320, 7, 7)))  # results beyond small-object allocators
    with torch.no_grad():
        for _ in range(3):
            module(x)
        before = len(made)
        for _ in range(20):
            out = module(x)
            del out
    # The allocator may hand a block back elsewhere when another thread (PoCL's, the test runner's)
    # allocated in between: a few new buffers in 20 calls are that; a buffer per call is the bug.
    assert len(made) - before <= 3, f"{len(made) - before} new host buffers in 20 calls of one layer"
    torch.testing.assert_close(module(x), torch.nn.functional.adaptive_avg_pool2d(x, 1), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ one answer per input


@pytest.mark.usefixtures("candidate_on")
def test_a_signature_gives_the_same_bits_on_every_call(rng):
    """The race of PyTorch's kernel against pool_tuner's never shows in the results: 40 calls of
    one layer on one input, from the first (the race's) on, are bit-identical."""
    module = ptt.AdaptiveAvgPool2d((5, 6))
    x = torch.from_numpy(random_input(rng, (3, 16, 21, 17)))
    first = module(x)
    torch.testing.assert_close(first, torch.nn.functional.adaptive_avg_pool2d(x, (5, 6)), rtol=1e-5, atol=1e-6)
    differing = [call for call in range(1, 40) if not torch.equal(module(x), first)]
    assert differing == [], f"calls {differing} gave other bits than the first"
    assert pt.explain("adaptive_avg_pool2d", (3, 16, 21, 17), (5, 6))["measured_candidate"] is not None


@pytest.mark.usefixtures("candidate_on")
def test_deterministic_algorithms_run_pool_tuners_kernel_without_a_race(rng):
    """Under ``torch.use_deterministic_algorithms(True)`` nothing is timed: the layer runs
    pool_tuner's dispatched kernel, the same bits as the numpy API's in any process."""
    x = random_input(rng, (3, 16, 21, 17))
    module = ptt.AdaptiveAvgPool2d((5, 6))
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        results = [module(torch.from_numpy(x)) for _ in range(MANY_CALLS)]
    finally:
        torch.use_deterministic_algorithms(previous)
    expected = pt.adaptive_avg_pool2d(x, (5, 6))
    assert all(np.array_equal(r.numpy(), expected) for r in results)
    assert pt.explain("adaptive_avg_pool2d", (3, 16, 21, 17), (5, 6))["measured_candidate"] is None


@pytest.mark.usefixtures("candidate_on")
@pytest.mark.parametrize("op", ["adaptive_avg_pool1d", "adaptive_max_pool1d", "adaptive_avg_pool2d",
                                "adaptive_max_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool3d"])
@pytest.mark.parametrize("size", [3, (3, None, 2)], ids=["int", "sequence"])
def test_a_layer_pytorch_runs_gives_pytorchs_results_and_gradients(monkeypatch, rng, op, size):
    """Where PyTorch's kernel won the race, every op gives PyTorch's values, indices and gradients,
    for an int output size (PyTorch's ATen function called directly) as for a sequence."""
    _race_winner(monkeypatch, "pytorch")
    ndim, selects = OPERATIONS[op].ndim, OPERATIONS[op].selects
    size = size if isinstance(size, int) else size[:ndim]
    ours, stock = getattr(ptt, op), getattr(torch.nn.functional, op)
    for _ in range(3):
        x = torch.from_numpy(random_input(rng, (2, 3) + (7, 6, 5)[:ndim])).requires_grad_()
        reference_x = x.detach().clone().requires_grad_()
        got = ours(x, size, return_indices=True) if selects else ours(x, size)
        expected = stock(reference_x, size, return_indices=True) if selects else stock(reference_x, size)
        if selects:
            assert torch.equal(got[1], expected[1]) and torch.equal(ours(x, size), expected[0])
            got, expected = got[0], expected[0]
        assert torch.equal(got, expected)
        grad = torch.from_numpy(random_input(rng, tuple(got.shape)))
        got.backward(grad), expected.backward(grad)
        assert torch.equal(x.grad, reference_x.grad)


# ------------------------------------------------------------------ one signature for every front end


@pytest.mark.usefixtures("fresh_plans")
def test_every_front_end_keys_its_plans_by_the_one_signature(rng):
    """numpy arrays (ops), the custom op's path on CPU tensors (torch_cpu) and the eager path all
    memoise under ``plans.signature`` of the call as given."""
    from pool_tuner import ops

    x = random_input(rng, (2, 3, 10, 9))
    pt.adaptive_avg_pool2d(x, (4, 7))
    env = backends.env_device_setting()
    assert ops._PLANS.get(plans.signature("adaptive_avg_pool2d", "forward", (4, 7), (None, None), (None, env),
                                          (plans.describe(x),))) is not None
    t = torch.from_numpy(x)
    ptt.adaptive_max_pool2d(t, 3)  # eager, no gradient
    key = plans.signature("adaptive_max_pool2d", "forward", 3, "", env, (plans.describe_tensor(t),))
    assert plans.tensor_signature("adaptive_max_pool2d", "forward", 3, "", env, t) == key
    assert torch_cpu.plan_of(key) is not None
    options = ptt._encode_options(variant="thread_per_output")
    torch.ops.pool_tuner.adaptive_avg_pool2d(t, [4, 7], options)  # the custom op
    assert torch_cpu.plan_of(plans.signature("adaptive_avg_pool2d", "forward", (4, 7), options, env,
                                             (plans.describe_tensor(t),))) is not None
    assert plans.describe_tensor(t) == (torch.Tensor, t.shape, t.stride(), t.dtype)
    assert plans.describe(t) == (*plans.describe_tensor(t), t.device) != plans.describe(x)


@pytest.mark.usefixtures("fresh_plans")
def test_a_signature_called_eagerly_and_through_the_custom_op_has_one_plan(rng):
    """pool_tuner.torch's eager path and its custom op (which keys its size as a tuple) describe
    a tensor the same way."""
    t = torch.from_numpy(random_input(rng, (2, 3, 10, 9)))
    options = ptt._encode_options(variant="thread_per_output")
    before = len(torch_cpu._PLANS)
    ptt.adaptive_avg_pool2d(t, (4, 7), variant="thread_per_output")
    torch.ops.pool_tuner.adaptive_avg_pool2d(t, [4, 7], options)
    assert len(torch_cpu._PLANS) - before == 1


@pytest.mark.parametrize("output_size", [[[4, 7]], [(4,), 7], {4: 7}])
def test_an_unhashable_output_size_is_refused_naming_it_by_the_eager_path(rng, output_size):
    """The eager path keys its plans by the size as given: one that cannot be a key must still be
    refused by validation, naming ``output_size``, not fail inside the lookup."""
    t = torch.from_numpy(random_input(rng, (2, 3, 10, 9)))
    with pytest.raises((TypeError, ValueError), match="output_size"):
        ptt.adaptive_avg_pool2d(t, output_size)
    with pytest.raises((TypeError, ValueError), match="output_size"):
        ptt.AdaptiveMaxPool2d(output_size)(t)


def test_pool_tuner_torch_takes_a_device_object_as_pool_tuner_does(rng):
    """``device=`` as a device of ``pt.devices()``, as ``pool_tuner.adaptive_*`` take it, travels in
    the options as its id."""
    device = default_device()
    t = torch.from_numpy(random_input(rng, (2, 3, 10, 9)))
    assert torch.equal(ptt.adaptive_avg_pool2d(t, (4, 7), device=device),
                       ptt.adaptive_avg_pool2d(t, (4, 7), device=device.info.id))
    assert ptt.AdaptiveAvgPool2d(3, device=device)(t).shape == (2, 3, 3, 3)


@pytest.mark.usefixtures("fresh_plans")
def test_deterministic_calls_run_pool_tuner_s_kernel_and_a_later_plain_call_still_races(monkeypatch, rng):
    monkeypatch.setattr(torch_cpu, "pytorch_candidate", True)
    raced = _count(monkeypatch, torch_cpu, "race_pytorch")
    ran = _count(monkeypatch, torch_cpu, "run")
    t = torch.from_numpy(random_input(rng, (1, 8, 6, 6)))
    module = ptt.AdaptiveAvgPool2d(2)
    torch.use_deterministic_algorithms(True)
    try:
        module(t), module(t)
    finally:
        torch.use_deterministic_algorithms(False)
    assert not raced and len(ran) == 2, "pool_tuner's kernel, untimed"
    first = module(t)
    assert len(raced) == 1
    assert all(torch.equal(first, module(t)) for _ in range(3)) and len(raced) == 1


@pytest.mark.usefixtures("fresh_plans")
def test_a_layer_s_options_set_after_it_was_made_apply_to_its_next_call(rng):
    """The drop-in modules encode their options when they are set, not per call: setting one later
    (or copying the layer) must still reach the call."""
    import copy

    t = torch.from_numpy(random_input(rng, (1, 3, 10, 9)))
    layer = ptt.AdaptiveAvgPool2d((4, 7))
    layer(t)
    layer.variant = "thread_per_output"
    env = backends.env_device_setting()
    for module in (layer, copy.deepcopy(layer)):
        torch.testing.assert_close(module(t), torch.nn.functional.adaptive_avg_pool2d(t, (4, 7)))
        key = plans.tensor_signature("adaptive_avg_pool2d", "forward", (4, 7), '{"variant": "thread_per_output"}',
                                     env, t)
        assert torch_cpu.plan_of(key).choice.source == "forced"
    with pytest.raises(TypeError, match="JSON"):
        layer.config = {"block": object()}


@pytest.mark.parametrize("value, races", tiered([pytest.param(*case, id=f"{case[0]}-{case[1]}") for case in
                                                  [("off", False), ("yes", True), ("0", False), ("FALSE", False), ("1", True)]],
                                                 core=lambda values: values[0] in ("off", "yes")))
def test_the_pytorch_candidate_switch_takes_a_switchs_words(value, races):
    """POOL_TUNER_PYTORCH_CANDIDATE turned off only with exactly "0": "off" or "false" left the race
    on in silence.  Read in a fresh process, as at import."""
    code = ("import torch, pool_tuner as pt, pool_tuner.torch as ptt; x = torch.rand(2, 3, 10, 9); "
            "ptt.adaptive_avg_pool2d(x, (4, 7)); "
            "print(pt.explain('adaptive_avg_pool2d', (2, 3, 10, 9), (4, 7))['measured_candidate'] is not None)")
    env = {**os.environ, torch_cpu.CANDIDATE_ENV: value}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == str(races), proc.stderr
