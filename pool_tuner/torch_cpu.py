"""CPU tensors in ``pool_tuner.torch``: one memoised plan per call signature, run on the tensors'
own memory.

The first call of a signature -- op and direction, each tensor's shape, strides and dtype, the
output size (or input shape) and pool_tuner's options -- is validated, dispatched and built by
``plans.make_plan``; every later call is a dictionary lookup, ``torch.empty_strided`` for each
result and one launch over the tensors' memory (``Device.host_launch``: no copies on devices that
share host memory, PoCL's CPU device among them).  A device that does not share host memory gets
numpy views of the tensors through ``ops``, which copies them to the device and back.

**PyTorch's own kernel as a candidate.**  Every launch costs a fixed time (the device's
launch-and-wait) that PyTorch's CPU kernels, plain function calls, do not pay: below it no
pool_tuner kernel can win.  So a small forward problem (``RACE_BYTES``) called eagerly on CPU
tensors with no forced variant or configuration races the two on its first calls (``Race``: a
block of each, every call timed as the caller made it), and the layer keeps the faster one --
pool_tuner's only by a margin, for the cost its launches put on the PyTorch operations around them
-- for its forward and (through PyTorch's autograd) its backward pass.  ``pool_tuner.explain(...,
caller="torch")`` shows the measurement.  Both compute PyTorch's semantics, but they may differ
in the last bit of an average, and a close race can go either way from one process to the next:
``POOL_TUNER_PYTORCH_CANDIDATE=0`` (read at import) always runs pool_tuner's kernel.
"""

from __future__ import annotations

import math
import os
import threading

import numpy as np
import torch

from . import backends, dispatch, ops, plans, tuner
from .operations import SINGLE_LEVEL

#: Set to "0" to never let PyTorch's own CPU kernel run a layer (see the module docstring).
CANDIDATE_ENV = "POOL_TUNER_PYTORCH_CANDIDATE"
pytorch_candidate = os.environ.get(CANDIDATE_ENV, "1") != "0"
#: Forward problems moving at most this many bytes race PyTorch's kernel on their first call.
RACE_BYTES = 1 << 22
#: Timed calls of each candidate in the race.
RACE_CALLS = 5
#: How much faster than PyTorch's kernel pool_tuner's must be in the race (see ``Race``).
RACE_MARGIN = 1.25

_PLANS = plans.PlanTable("torch_cpu.plans")

#: op -> PyTorch's functional form of it (its forward kernel; its backward through autograd).
PYTORCH_FORMS = {op: getattr(torch.nn.functional, op) for op in SINGLE_LEVEL}


def plan(op: str, direction: str, tensors: list, size, options: tuple, key=None, race: bool = False) -> plans.Plan:
    """The plan of a call signature, made and memoised on its first use; ``options`` are
    pool_tuner's keyword options as ``(name, value)`` pairs.  ``race``: the eager path's plans,
    which may race PyTorch's kernel (``start_race``); the custom op's always run pool_tuner's."""
    if key is None:
        key = signature(op, direction, tensors, size, options)
    found = _PLANS.get(key)
    if found is None:
        given = dict(options)
        device = backends.resolve_device(given.get("device"))
        names = ("input",) if direction == "forward" else ("grad_out",)
        found = plans.make_plan(op, direction, [plans.tensor_spec(t) for t in tensors], size, device, given.get("variant"),
                                given.get("config"), on_miss=tuner.tune_on_miss, names=names, build=False)
        if race:
            start_race(found)
        if found.race is None:
            found.launch  # noqa: B018 -- no race: built now, as every plan is; a race builds at pool_tuner's turn
        _PLANS.put(key, found)
    return found


def plan_of(key) -> plans.Plan | None:
    """The plan memoised for signature ``key``, or None."""
    return _PLANS.get(key)


def signature(op: str, direction: str, tensors: list, size, options: tuple):
    """The memo key of a call (see ``plan``); sizes keep their elements' types, so that a bad
    argument never meets a good call's plan."""
    return (op, direction, ops._exact(size), options, backends.env_device_setting(),
            *[(t.shape, t.stride(), t.dtype) for t in tensors])


def run(found: plans.Plan, tensors: list) -> list:
    """Run a plan on CPU ``tensors`` (``[x]``, ``[grad_out]`` or ``[grad_out, indices]``);
    returns its results as tensors in the problem's layout."""
    problem = found.problem
    if not found.device.info.shares_host_memory:
        arrays = [ops_array(t) for t in tensors]
        names = ("x",) if problem.direction == "forward" else ("grad_out", "indices")
        return [to_tensor(a, t) for a, t in zip(ops._run(found, arrays, names), _result_likes(found, tensors[0]))]
    tensors = [_in_memory_order(t, found) if reorder else t for t, reorder in zip(tensors, found.reorder)]
    dtype = tensors[0].dtype
    results = [empty_result(r, problem, torch.int64 if r.dtype == "int64" else dtype) for r in found.results]
    if ops.poison_outputs:
        for r in results:
            r.fill_(ops.INDEX_POISON if r.dtype == torch.int64 else math.nan)
    if found.launch is not None:
        found.run_on_host([t.data_ptr() for t in tensors] + [r.data_ptr() for r in results])
    elif found.zero_fill:
        results[0].zero_()
    return results


#: The numpy dtype that holds a result of each torch dtype (bfloat16: its bits).
NUMPY_STORAGE = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
                 torch.bfloat16: np.int16, torch.int64: np.int64}


def empty_result(result: plans.Result, problem, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised result tensor, its memory from numpy's allocator.

    The launch needs a buffer over the result's memory, whose first use costs about as much as a
    small kernel; buffers are kept per address (``backends.opencl.HostBuffers``).  numpy's
    allocator hands a freed block of the same size back at the same address, where PyTorch's CPU
    allocator gives blocks this size fresh mappings at ever new addresses: with numpy's memory a
    layer called again and again reuses its kept buffer."""
    storage = torch.from_numpy(np.empty(result.memory_shape, NUMPY_STORAGE[dtype]))
    if dtype == torch.bfloat16:
        storage = storage.view(torch.bfloat16)
    if problem.channels_last and not result.flat:
        return storage.movedim(-1, len(result.shape) - problem.ndim - 1)
    return storage


def _in_memory_order(t: torch.Tensor, found: plans.Plan) -> torch.Tensor:
    """An input that is in neither layout (or indices in another layout than ``grad_out``),
    copied into the problem's memory order."""
    strides = plans.element_strides(found.problem, tuple(t.shape))
    return torch.empty_strided(t.shape, strides, dtype=t.dtype).copy_(t)


def _result_likes(found: plans.Plan, first: torch.Tensor) -> list:
    return [torch.int64 if r.dtype == "int64" else first.dtype for r in found.results]


def ops_array(t: torch.Tensor) -> np.ndarray:
    """A numpy view of CPU tensor ``t`` (bfloat16 as ``ml_dtypes.bfloat16``)."""
    t = t.detach().resolve_conj().resolve_neg()  # no-ops for ordinary tensors
    if t.dtype == torch.bfloat16:
        import ml_dtypes  # only needed for bfloat16 tensors

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def to_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor sharing a numpy result's memory."""
    if dtype == torch.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


# ------------------------------------------------------------------ PyTorch's kernel as a candidate


def start_race(found: plans.Plan) -> None:
    """Set up the race of a new forward plan against PyTorch's kernel where it is due (see the
    module docstring); otherwise pool_tuner's kernel runs the plan from its first call."""
    problem = found.problem
    found.use_pytorch = False
    if (pytorch_candidate and problem.direction == "forward" and found.choice.source != "forced"
            and not problem.is_empty and problem.bytes_moved() <= RACE_BYTES):
        found.race = Race(found)


class Race:
    """PyTorch's kernel against pool_tuner's on a plan's first calls, each call timed as the
    caller made it: first ``RACE_CALLS + 1`` calls of PyTorch's, then as many of pool_tuner's, the
    first of each left out (first-touch costs); the faster by its fastest call then runs every
    later call (``Plan.use_pytorch``) and the race is noted for ``explain``.  So the race costs the
    caller nothing but the slower candidate's calls among the first ones.  The fastest call, not
    the median: what ran just before a call (another library's threads still spinning, say) can
    slow any few of them, and the race is about the kernels.

    In blocks rather than taking turns: a launch leaves the device's worker threads competing for
    the cores with PyTorch's own for a while, so a PyTorch call right after one of pool_tuner's
    would be charged for it.  That cost falls on the PyTorch operations around a pool_tuner
    kernel, which the race cannot see: pool_tuner's kernel must win by ``RACE_MARGIN``."""

    __slots__ = ("plan", "calls", "times", "lock")

    def __init__(self, found: plans.Plan):
        self.plan = found
        self.calls = 0
        self.times = {True: [], False: []}
        self.lock = threading.Lock()

    def next_is_pytorch(self) -> bool:
        return self.calls <= RACE_CALLS

    def record(self, used_pytorch: bool, seconds: float) -> None:
        with self.lock:
            self.calls += 1
            if self.plan.race is not self:  # decided meanwhile by another thread
                return
            if self.calls not in (1, RACE_CALLS + 2):
                self.times[used_pytorch].append(seconds * 1e3)
            if min(len(t) for t in self.times.values()) >= RACE_CALLS:
                self._decide()

    def _decide(self) -> None:
        pytorch_ms, pool_tuner_ms = (min(self.times[side]) for side in (True, False))
        found = self.plan
        found.use_pytorch = pool_tuner_ms * RACE_MARGIN > pytorch_ms
        found.race = None
        dispatch.note_measured_candidate(found.problem, found.device, {
            "candidate": "pytorch",
            "winner": "pytorch" if found.use_pytorch else "pool_tuner",
            "pytorch_ms": pytorch_ms,
            "pool_tuner_ms": pool_tuner_ms,
            "rule": f"forward problems of at most {RACE_BYTES} bytes called eagerly on CPU tensors run PyTorch's "
                    f"kernel on their first {RACE_CALLS + 1} calls, then pool_tuner's on as many; pool_tuner's runs "
                    f"from then on if its fastest call is {RACE_MARGIN}x faster, else PyTorch's",
        })
