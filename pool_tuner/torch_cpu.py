"""CPU tensors in ``pool_tuner.torch``: one memoised plan per call signature, run on the tensors'
own memory.

The first call of a signature -- op and direction, each tensor's shape, strides and dtype, the
output size (or input shape) and pool_tuner's options -- is validated, dispatched and built by
``plans.make_plan``; every later call is a dictionary lookup, ``torch.empty_strided`` for each
result and one launch over the tensors' memory (``Device.prepare``: no copies on devices that
share host memory, PoCL's CPU device among them).  A device that does not share host memory gets
numpy views of the tensors through ``ops``, which copies them to the device and back.

**PyTorch's own kernel as a candidate.**  Every launch costs a fixed time (the device's
launch-and-wait) that PyTorch's CPU kernels, plain function calls, do not pay: below it no
pool_tuner kernel can win.  So a small forward problem (``RACE_BYTES``) called eagerly on CPU
tensors with no forced variant or configuration races the two on its first call (``race_pytorch``: a
block of calls of each on the caller's input, the fastest call of each compared; pool_tuner's
kernel is neither built nor timed where PyTorch's is faster than the device's launch floor,
``launch_floor_ms``, by the margin below), and the layer
keeps the faster one -- pool_tuner's only by a margin, for the cost its launches put on the
PyTorch operations around them -- for its forward and (through PyTorch's autograd) its backward
pass.  ``pool_tuner.explain(..., caller="torch")`` shows the measurement.  ``pool_tuner.torch``'s
avg+max and global layers race the same way (``PYTORCH_FORMS``: a multi-level op's PyTorch
computation is each level's functional form).

**One answer per input.**  Both candidates compute PyTorch's semantics, but an average may differ
in its last bit between them.  So the race is decided before the signature's first result is
returned (under a lock, so threads meeting a new signature together wait for one decision) and
kept with the signature's plan, bounded as plans are by the one memo limit (``pool_tuner.memo``);
which side won is also kept apart, one flag per signature the process met, so a signature that
the limit dropped gets the same kernel when it comes back, not a new race: every call of a
signature returns the same bits for the life of the process.  Deciding first costs the first call a
dozen small calls (and the first race on a device in a process the launch floor's measurement:
one small kernel built and 21 calls of it), against the alternative of returning one candidate's
bits while timing the other, which would have to keep the first candidate even where the other
wins.  A close race can still go either way from one process to the next: under
``torch.use_deterministic_algorithms(True)`` nothing is timed and pool_tuner's dispatched kernel
runs (the same bits in every process with the same tuning records), and
``POOL_TUNER_PYTORCH_CANDIDATE=0`` (read at import) does that always.
"""

from __future__ import annotations

import functools
import os
import threading
import time

import numpy as np
import torch

from . import backends, dispatch, memo, ops, plans, switches, tuner
from .operations import DIRECTIONS, OPERATIONS, SINGLE_LEVEL

#: Set to 0 to never let PyTorch's own CPU kernel run a layer (see the module docstring; a switch:
#: ``switches``).
CANDIDATE_ENV = "POOL_TUNER_PYTORCH_CANDIDATE"
pytorch_candidate = switches.switch(CANDIDATE_ENV, True, "racing PyTorch's own kernel")
#: Forward problems moving at most this many bytes race PyTorch's kernel on their first call: not
#: only those where a launch's fixed cost decides, but the layers a CPU's caches hold, where
#: PyTorch's vectorised loops can be faster than any kernel on the device (a model's
#: squeeze-excitation poolings at batch 16); the race's dozen calls of such a layer cost its
#: first call milliseconds.
RACE_BYTES = 1 << 25
#: Timed calls of each candidate in the race (each after one untimed call: first-touch costs).
RACE_CALLS = 5
#: How much faster than PyTorch's kernel pool_tuner's must be in the race (``race_pytorch``).
RACE_MARGIN = 1.25
#: Timed calls of the smallest problem that measure a device's launch floor (``launch_floor_ms``):
#: more than a race's, since the floor is a minimum that every later race leans on.
FLOOR_CALLS = 20

_PLANS = plans.PlanTable("torch_cpu.plans")


#: What ``WINNERS`` holds for a signature that PyTorch's kernel runs.
PYTORCH = object()


class Winners:
    """The races' winners by the eager forward's signature: ``PYTORCH`` where PyTorch's kernel
    runs it, else the signature's plan (pool_tuner's kernel; also where no race is run), each
    decided once, by the first thread to meet the signature while the others wait for it.  A
    ``memo`` table, each winner filed under its plan's problem: bounded by the one memo limit,
    leaving with the signature's plan and built kernel, and emptied when dispatch forgets its
    decisions (which may change pool_tuner's kernel).  ``get`` is the table's ``peek``, a plain
    dictionary lookup, so that a warm eager call that PyTorch's kernel runs asks it once and
    needs nothing else; a call that runs the plan then marks the entry used (``mark_used``), which
    keeps the problem of a plan in use -- and its built kernel -- recent.  A PyTorch-run entry is not
    marked: its plan and kernel are not used, and evicting it costs its next call a new plan, never
    another race.

    Which side won is kept apart from the table (``_pytorch_won``, a flag per signature the
    process met, emptied only by ``forget``): a signature evicted by the memo limit and met again
    gets the same kernel, not a new race that could pick the other one -- one answer per input
    for the life of the process."""

    def __init__(self):
        self._table = memo.table("torch_cpu.winners")
        dispatch.register_dependent_memo(self._table)
        self._pytorch_won: dict = {}
        dispatch.register_dependent_memo(self._pytorch_won)
        #: ``get(key)``: the winner for ``key``, or None (``TypeError`` for an unhashable key).
        self.get = self._table.peek
        #: ``mark_used(key)``: mark ``key``'s entry as used (the memo's recency).
        self.mark_used = self._table.get
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):  # a forked child starts with the lock free
            os.register_at_fork(after_in_child=self._after_fork_in_child)

    def decide(self, key, found: plans.Plan, race):
        """The winner for ``key``: ``PYTORCH`` if ``race()`` says PyTorch's kernel wins, else the
        signature's plan ``found``, filed under its problem if there is none yet; the race runs
        once per signature in the process."""
        with self._lock:
            decided = self._table.get(key)
            if decided is None:
                won = self._pytorch_won.get(key)
                if won is None:
                    won = self._pytorch_won[key] = bool(race())
                decided = self._table.put(found.problem, key, PYTORCH if won else found)
            return decided

    def __len__(self) -> int:
        return len(self._table)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()


WINNERS = Winners()


#: op -> PyTorch's computation of it: a single-level op's functional form (its forward kernel;
#: its backward through autograd), a multi-level op's levels each by theirs.
PYTORCH_FORMS = {op: getattr(torch.nn.functional, op) for op in SINGLE_LEVEL}
#: op -> (PyTorch's ATen function of it, whether it returns ``(values, indices)``): what the
#: functional form calls, without the Python around it, for an output size that is one int (the
#: form resolves ``None`` entries first).  A layer that PyTorch's kernel runs pays no more.
PYTORCH_KERNELS = {op: (getattr(torch._C._nn, op, None) or getattr(torch, op), OPERATIONS[op].selects)
                   for op in SINGLE_LEVEL}


def _levels_form(operation):
    """PyTorch's computation of a multi-level op: each level's functional form at the level's
    size (a level is exactly that single-level op, ``Operation.level_ops``), as a list; for
    avg+max's one int output size, each level's ATen function, without the forms' Python."""
    if operation.pyramid:
        def levels(x, output_sizes):
            return [PYTORCH_FORMS[level.name](x, size)
                    for level, size in zip(operation.level_ops(len(output_sizes)), output_sizes)]
        return levels
    level_ops = operation.level_ops(1)
    forms = [PYTORCH_FORMS[level.name] for level in level_ops]
    kernels = [PYTORCH_KERNELS[level.name] for level in level_ops]

    def levels(x, output_size):
        if type(output_size) is int:
            return [kernel(x, output_size)[0] if selects else kernel(x, output_size) for kernel, selects in kernels]
        return [form(x, output_size) for form in forms]
    return levels


PYTORCH_FORMS.update({op: _levels_form(operation) for op, operation in OPERATIONS.items() if operation.multi_level})


def plan(op: str, direction: str, tensors: list, size, options: str, key,
         racing: bool = False) -> plans.Plan:
    """The plan of the call whose signature is ``key`` (``plans.signature``), made and memoised on
    its first use; ``options`` are pool_tuner's keyword options as ``pool_tuner.torch``'s schema
    string (``plans.options_text``).  Its kernel is built before the plan is kept (a
    configuration that cannot launch fails here), except for an eager forward (``racing``) that
    races PyTorch's kernel (``races``): that one is built at its first launch -- the race's,
    where pool_tuner's side is timed, or never, where PyTorch's kernel wins below the launch
    floor (``race_pytorch``)."""
    found = _PLANS.get(key)
    if found is None:
        given = dict(plans.options_of(options))
        device = backends.resolve_device(given.get("device"))
        found = plans.make_plan(op, direction, [plans.tensor_spec(t) for t in tensors], size, device, given.get("variant"),
                                given.get("config"), on_miss=tuner.tune_on_miss,
                                names=(DIRECTIONS[direction].torch_argument,), build=False)
        if not (racing and races(found)):
            found.build()
        _PLANS.put(key, found)
    return found


def winner(op: str, x: torch.Tensor, size, options: str, key, form=None, plan_key=None):
    """What runs the eager forward of signature ``key``: ``PYTORCH`` or the signature's plan, as
    the race decided (``WINNERS``), raced now on input ``x`` if it was not (``race_pytorch``),
    before the signature's first result; a race that PyTorch's kernel wins below the launch
    floor builds no kernel of the signature's (``plan``).  ``form``: as ``race_pytorch``'s, the
    race kept under ``(key, form)``; ``plan_key``: the key the plan is kept under, where not
    ``key`` (the one the front end that runs it looks it up by)."""
    found = plan(op, "forward", [x], size, options, key if plan_key is None else plan_key, racing=True)
    return WINNERS.decide(key if form is None else (key, form), found,
                          lambda: races(found) and race_pytorch(found, x, size, form))


def plan_of(key) -> plans.Plan | None:
    """The plan memoised for signature ``key``, or None."""
    return _PLANS.get(key)


def run(found: plans.Plan, tensors: list, scalars: tuple | None = None) -> list:
    """Run a plan on CPU ``tensors`` (``[x]``, ``[grad_out]`` or ``[grad_out, indices]``);
    returns its results as tensors in the problem's layout.  ``scalars``: the call's run-time
    kernel arguments, where not the plan's (``Problem.with_arguments``: GeM's p and eps)."""
    problem = found.problem
    if not found.device.info.shares_host_memory:
        arrays = [ops_array(t) for t in tensors]
        names = (problem.flow.argument, "indices")  # as many as there are arrays
        return [to_tensor(a, t) for a, t in zip(ops._run(found, arrays, names, scalars),
                                                _result_likes(found, tensors[0]))]
    if True in found.reorder:  # rare: most calls' inputs are in a layout the kernels read as they are
        tensors = [_in_memory_order(t, found) if reorder else t for t, reorder in zip(tensors, found.reorder)]
    return found.run(tensors, functools.partial(empty_result, problem, tensors[0].dtype), _data_ptr,
                     scalars=scalars)


#: A tensor's address (``plans.Plan.run``).
_data_ptr = torch.Tensor.data_ptr


#: The numpy dtype that holds a result of each torch dtype (bfloat16: its bits).
NUMPY_STORAGE = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
                 torch.bfloat16: np.int16, torch.int64: np.int64}


def empty_result(problem, dtype: torch.dtype, result: plans.Result, fill) -> torch.Tensor:
    """A result tensor (``plans.Plan.run``'s allocator), its memory from numpy's allocator: of
    ``dtype`` (the input's) or int64 for indices, uninitialised unless ``fill`` is given.

    The launch needs a buffer over the result's memory, whose first use costs about as much as a
    small kernel; buffers are kept per address (``backends.opencl.HostBuffers``).  numpy's
    allocator hands a freed block of the same size back at the same address, where PyTorch's CPU
    allocator gives blocks this size fresh mappings at ever new addresses: with numpy's memory a
    layer called again and again reuses its kept buffer."""
    if result.dtype == "int64":
        dtype = torch.int64
    storage = torch.from_numpy(np.empty(result.memory_shape, NUMPY_STORAGE[dtype]))
    if dtype == torch.bfloat16:
        storage = storage.view(torch.bfloat16)
    if fill is not None:
        storage.fill_(fill)
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


def races(found: plans.Plan) -> bool:
    """Whether a new eager plan races PyTorch's kernel (see the module docstring)."""
    problem = found.problem
    return (pytorch_candidate and problem.flow.reads_input and found.choice.source != "forced"
            and not problem.is_empty and problem.bytes_moved() <= RACE_BYTES)


def race_pytorch(found: plans.Plan, x: torch.Tensor, output_size, form=None) -> bool:
    """Race PyTorch's kernel against pool_tuner's on input ``x``; returns whether PyTorch's runs
    the plan, and notes the race for ``explain``.  ``form(x, output_size)``: PyTorch's computation
    that runs where it wins, by default the op's ``PYTORCH_FORMS``.

    In blocks rather than taking turns: a launch leaves the device's worker threads competing for
    the cores with PyTorch's own for a while, so a PyTorch call right after one of pool_tuner's
    would be charged for it.  That cost falls on the PyTorch operations around a pool_tuner
    kernel, which the race cannot see: pool_tuner's kernel must win by ``RACE_MARGIN``.  The
    fastest call, not the median: what ran just before a call (another library's threads still
    spinning, say) can slow any few of them, and the race is about the kernels.

    PyTorch's side is timed first; where it is already faster than the device's launch floor
    (``launch_floor_ms``) by ``RACE_MARGIN``, pool_tuner's kernel could win only by running
    faster than the floor's one-element call, and its side is neither built nor timed -- most of
    a new shape's first call, in a model whose layers PyTorch's kernels run.  A timed race whose
    pool_tuner call was faster than the floor lowers the floor to it."""
    form = form or PYTORCH_FORMS[found.problem.op]
    with torch.no_grad():
        pytorch_ms = _fastest_call_ms(lambda: form(x, output_size))
        floor_ms = launch_floor_ms(found.device)
        below_floor = floor_ms * RACE_MARGIN > pytorch_ms
        pool_tuner_ms = None if below_floor else _fastest_call_ms(lambda: run(found, [x]))
    if not below_floor and pool_tuner_ms < floor_ms:  # the floor was measured high: a kernel ran faster
        _FLOORS[found.device.info.id] = pool_tuner_ms
    use_pytorch = below_floor or pool_tuner_ms * RACE_MARGIN > pytorch_ms
    dispatch.note_measured_candidate(found.problem, found.device, {
        "candidate": "pytorch",
        "winner": "pytorch" if use_pytorch else "pool_tuner",
        "pytorch_ms": pytorch_ms,
        "pool_tuner_ms": pool_tuner_ms,
        "floor_ms": floor_ms,
        "rule": f"forward problems of at most {RACE_BYTES} bytes called eagerly on CPU tensors time PyTorch's kernel "
                f"on {RACE_CALLS + 1} calls, then pool_tuner's on as many, on their first call (the first of each "
                f"left out); pool_tuner's runs every call if its fastest call is {RACE_MARGIN}x faster, else "
                f"PyTorch's; pool_tuner's is not built or timed (pool_tuner_ms None) where PyTorch's fastest call is "
                f"{RACE_MARGIN}x faster than the device's launch floor (floor_ms: the fastest of {FLOOR_CALLS} calls of "
                f"a one-element problem); under torch.use_deterministic_algorithms(True) pool_tuner's, untimed",
    })
    return use_pytorch


#: device id -> its launch floor in milliseconds (``launch_floor_ms``); a forked child starts it
#: empty.
_FLOORS: dict = {}
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_FLOORS.clear)


def launch_floor_ms(device) -> float:
    """About the least any call of pool_tuner's on ``device`` costs, in milliseconds: the fastest
    of ``FLOOR_CALLS`` calls of the smallest problem there is (one float pooled to one, by the
    kernel dispatch chooses for it on the device) through the path every call takes (``run``:
    results allocated, the prepared launch and its wait).  A measured estimate, not a proof: a
    reading taken while the machine was busy errs high, which hands a race PyTorch's kernel
    could have lost to it, and every timed race that saw a faster pool_tuner call lowers it.
    Measured once per device in a process -- by the first race on it, under the races' lock --
    and again in a forked child, where the host fallback runs the kernels
    (``plans.Plan.prepared_launch``; the one-element plan is built at its first launch, which
    the fallback never makes).  The input is made without PyTorch's random generator or default
    device, which are the caller's."""
    found = _FLOORS.get(device.info.id)
    if found is None:
        x = torch.full((1, 1, 1), 0.5, dtype=torch.float32, device="cpu")
        smallest = plans.make_plan("adaptive_avg_pool1d", "forward", [plans.tensor_spec(x)], (1,), device,
                                   build=False)
        found = _FLOORS[device.info.id] = _fastest_call_ms(lambda: run(smallest, [x]), FLOOR_CALLS)
    return found


def _fastest_call_ms(call, calls: int = RACE_CALLS) -> float:
    """The fastest of ``calls`` timed calls of ``call`` after one untimed (first-touch costs), in
    milliseconds."""
    call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3
