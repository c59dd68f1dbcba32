"""The benchmark suite: pool_tuner against PyTorch and the bandwidth floor.

For each shape and direction, in one run on one device: pool_tuner's dispatched kernel, pool_tuner
forced to the default rules' choice, and PyTorch (on the device's ``torch_device``: the same GPU for a
CUDA device, the CPU for OpenCL devices), each timed as users call it -- a loop of calls back to
back on device-resident data (``time_loop``), then waiting for the device once.  On a CUDA device
users call ``pool_tuner.torch`` on CUDA tensors, so that is what is timed, with PyTorch's caching
allocator on both sides, every loop between CUDA events, and the two kernels alone as well
(``_measure_cuda``).  The candidates'
loops are interleaved, a fresh random order every round, ``repeat`` rounds, medians.  The shapes are
the presets' (which ``pool-tuner tune --preset all`` tunes) and ``presets.UNTUNED``, shapes no
preset tunes, where dispatch has only a nearest tuned shape or the default to go on.  Devices are
used only through the contract of ``backends.base``.  The device's memory streams are measured in
the same run, before and after the suite (``memory_bandwidth``; each keeps the faster): a shape's
floor is its bytes moved (read + written) over the fastest copy, its stream floor also counts its
reads and writes alone.

PyTorch is required (``pip install "pool-tuner[bench]"``): its times are half of every comparison.
Results: a JSON file and a PNG plot (matplotlib, optional).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import time
from pathlib import Path

import numpy as np

from . import backends, dispatch, kernel_source, presets
from .operations import DIRECTIONS, find
from .problem import OPS, Problem
from .variants import is_global

#: Size of each buffer that ``memory_bandwidth`` streams through: far past the caches.
STREAM_BYTES = 256 * 2**20
#: Wall time each timed loop of calls aims at: the calls per loop are chosen from a candidate's
#: warm-up so that one loop lasts about this long (at least MIN_CALLS, at most MAX_CALLS calls).
#: A loop of many calls is timed as a user's loop runs -- calls queued back to back, the device
#: waited for once -- and whatever one call leaves behind for the next (PyTorch's OpenMP threads
#: keep spinning after a call; a GPU keeps running queued kernels) is inside the loop, as it is
#: in the user's.
LOOP_S = 0.05
MIN_CALLS = 3
MAX_CALLS = 1000


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way of computing a benchmark case: ``call`` starts one complete call (it may return before
    the device has finished, as a library call on device arrays does), ``wait`` waits until every
    call started has finished."""

    call: object
    wait: object


def time_loop(candidate: Candidate, calls: int) -> float:
    """Milliseconds per call of ``calls`` calls of ``candidate`` back to back, then one wait."""
    start = time.perf_counter()
    for _ in range(calls):
        candidate.call()
    candidate.wait()
    return (time.perf_counter() - start) * 1e3 / calls


def calls_per_loop(candidate: Candidate) -> int:
    """How many calls make a loop of about ``LOOP_S`` for ``candidate`` (from three warm calls)."""
    per_call_s = time_loop(candidate, 3) * 1e-3
    return int(min(MAX_CALLS, max(MIN_CALLS, round(LOOP_S / max(per_call_s, 1e-9)))))


@dataclasses.dataclass
class Row:
    name: str
    op: str
    direction: str
    input_shape: list
    output_shape: list
    bytes_moved: int
    bytes_read: int
    bytes_written: int
    tuned_ms: float
    default_ms: float
    torch_ms: float
    #: Calls per timed loop of each candidate (see LOOP_S).
    tuned_calls: int
    default_calls: int
    torch_calls: int
    source: str
    variant: str
    params: dict
    #: On a CUDA device, the dispatched and the default kernel alone: CUDA events around launches
    #: back to back on buffers allocated once (``_cuda_kernel_candidate``); None elsewhere.
    tuned_kernel_ms: float | None = None
    default_kernel_ms: float | None = None
    #: With ``tune_untuned``, for the untuned shapes: the problem tuned in this run (not stored),
    #: its winner timed as one more candidate beside the others; None otherwise.
    tuned_here_ms: float | None = None
    tuned_here_variant: str | None = None
    tuned_here_params: dict | None = None

    def reported(self, streams: dict) -> dict:
        """The row as the report and the rows file write it: its fields and ``derived(streams)``."""
        return dict(dataclasses.asdict(self), **self.derived(streams))

    def derived(self, streams: dict) -> dict:
        """Speeds and floors from the device's memory streams (``memory_bandwidth``).  The floor is
        the shape's bytes over the fastest copy; the stream floor is the largest of that floor and
        the times its reads alone and its writes alone take at the read and write streams' speeds,
        which no kernel moving those bytes beats unless its data stays in a cache."""
        copy_gbs = copy_bandwidth(streams)
        gbs = self.bytes_moved / (self.tuned_ms * 1e-3) / 1e9
        floor_ms = self.bytes_moved / (copy_gbs * 1e9) * 1e3
        stream_floor_ms = max(floor_ms, self.bytes_read / (streams["read_kernel"] * 1e6),
                              self.bytes_written / (streams["write_kernel"] * 1e6))
        return {
            "gbs": gbs,
            "fraction_of_copy": gbs / copy_gbs,
            "floor_ms": floor_ms,
            "times_floor": self.tuned_ms / floor_ms,
            "stream_floor_ms": stream_floor_ms,
            "times_stream_floor": self.tuned_ms / stream_floor_ms,
            "speedup_vs_torch": self.torch_ms / self.tuned_ms,
            "tuned_vs_default": self.default_ms / self.tuned_ms,
            "dispatched_vs_tuned_here": None if self.tuned_here_ms is None else self.tuned_here_ms / self.tuned_ms,
        }


#: What the columns mean on a CUDA device (the report's ``method``).
CUDA_METHOD = {
    "pool_tuner": "pool_tuner.torch on CUDA tensors: the functional forward, or the backward custom op autograd runs; "
                  "results from PyTorch's caching allocator, launches on its current stream",
    "torch": "torch.nn.functional (forward) and ATen's backward ops on the same tensors",
    "timing": "CUDA events around each loop of calls back to back",
    "kernels": "tuned_kernel_ms, default_kernel_ms: pool_tuner's dispatched and default kernel alone, launched back "
               "to back on buffers allocated once, between CUDA events",
}
#: The search budget of ``measure``'s ``tune_here``: the one the shipped records were tuned with
#: (tuning_cache/README.md), so that the comparison is with what shipping a record would give.
TUNE_HERE_BUDGET = {"strategy": "random_sample", "max_fevals": 8, "time_limit": 4}
#: The dtypes the suite runs in: numpy's, so that inputs are made on the host.
DTYPES = ("float32", "float16", "float64")

#: The copies that ``memory_bandwidth`` times; the fastest is the device's copy bandwidth.
COPY_METHODS = ("buffer_copy", "copy_kernel", "copy_kernel_streaming")
#: Everything ``memory_bandwidth`` times: the copies, and reading and writing alone.
STREAMS = COPY_METHODS + ("read_kernel", "write_kernel")
#: Rounds of ``memory_bandwidth``'s streams.
STREAM_REPEAT = 15
#: Elements each work-item of the bandwidth kernels' read kernel sums (passed as a define).
READ_RUN = 64
#: Buffer size for simulators (Oclgrind interprets every work-item: 64 KiB copies take 40 ms).
SIMULATOR_STREAM_BYTES = 2**20


def copy_bandwidth(streams: dict) -> float:
    """The device's copy bandwidth, the floor's: the fastest copy among ``streams`` (GB/s)."""
    return max(streams[name] for name in COPY_METHODS)


def _stream_elements(device, nbytes: int, unit: int) -> int:
    """float32 elements per stream buffer: ``nbytes`` (a simulator: SIMULATOR_STREAM_BYTES), at most
    a quarter of the device's memory and its largest allocation, rounded down to a multiple of
    ``unit`` (at least one)."""
    if device.info.is_simulator:
        nbytes = min(nbytes, SIMULATOR_STREAM_BYTES)
    nbytes = min(nbytes, device.info.max_allocation_bytes, device.info.memory_bytes // 4)
    return max(nbytes // (4 * unit), 1) * unit


def _bandwidth_kernels(device, queue) -> dict:
    """The kernels of ``kernels/bandwidth.cl`` (``.cu``) by name, built for ``device``."""
    source = f"#define READ_RUN {READ_RUN}\n" + kernel_source.read("bandwidth" + device.info.source_suffix)
    return {name: device.build(queue.context, source, name) for name in ("copy", "copy_streaming", "read", "write")}


def read_kernel(device, nbytes: int) -> Candidate:
    """A call that reads ``nbytes`` (rounded up to whole work-groups of the bandwidth kernels' read
    kernel) on ``device``'s queue, timed as a library call is, launch included: how fast a plain
    kernel reads an input of that size.  It is no floor: on PoCL the pooling kernels' loops, and
    PyTorch's, can read faster than it."""
    queue = device.queue
    read = _bandwidth_kernels(device, queue)["read"]
    block = (min(256, read.max_work_group_size),)
    sums = -(-max(nbytes // 4, 1) // (READ_RUN * block[0])) * block[0]
    src = device.to_device(np.ones(sums * READ_RUN, np.float32), queue)
    dst = device.empty((sums,), np.float32, queue, fill=0.0)
    candidate = Candidate(lambda: device.launch(queue, read, sums // block[0], block, (src, dst)),
                          lambda: device.synchronize(queue))
    candidate.call()  # proof that it reads every element: a read that did not would time nothing
    if not (device.to_host(dst) == READ_RUN).all():
        raise RuntimeError(f"the benchmark's read kernel did not read its input on {device.info.describe()}")
    return candidate


def memory_bandwidth(device, nbytes: int = STREAM_BYTES, repeat: int = STREAM_REPEAT) -> dict:
    """``{stream: GB/s}`` for each of ``STREAMS``, on two buffers of about ``nbytes`` (see
    ``_stream_elements``), interleaved, medians of ``repeat`` rounds.  A copy counts bytes read
    plus bytes written: ``buffer_copy`` (the backend's own copy: clEnqueueCopyBuffer,
    cuMemcpyDtoDAsync) and two copy kernels (``kernels/bandwidth.cl`` and ``.cu``; on CPUs they use
    every compute unit, where PoCL's buffer copy uses one thread; ``copy_kernel_streaming`` stores
    past the caches).  ``read_kernel`` reads a buffer (and writes a 64th as much),
    ``write_kernel`` fills one.  Every stream is first checked to do its work: a stream that did not
    would time nothing."""
    queue = device.queue
    kernels = _bandwidth_kernels(device, queue)
    # Work-groups of a power of two that every kernel can run (256 at most).
    limit = min([256] + [k.max_work_group_size for k in kernels.values()])
    block = (1 << (limit.bit_length() - 1),)
    count = _stream_elements(device, nbytes, READ_RUN * 256)  # whole groups of any block up to 256
    read_sums = count // READ_RUN
    host = np.random.default_rng().random(count, dtype=np.float32) + np.float32(1.0)
    src = device.to_device(host, queue)
    dst = device.empty((count,), np.float32, queue)
    fill_value = np.float32(0.5)

    def stream(name):
        if name == "buffer_copy":
            device.copy(dst, src, queue)
        elif name == "read_kernel":
            device.launch(queue, kernels["read"], read_sums // block[0], block, (src, dst))
        elif name == "write_kernel":
            device.launch(queue, kernels["write"], count // block[0], block, (dst, fill_value))
        else:
            kernel = kernels["copy_streaming" if name == "copy_kernel_streaming" else "copy"]
            device.launch(queue, kernel, count // block[0], block, (src, dst))
        device.synchronize(queue)

    for name in STREAMS:  # warm-up, and proof that each stream does its work
        device.copy(dst, np.zeros(count, np.float32), queue)
        stream(name)
        result = device.to_host(dst)
        if name == "read_kernel":
            done = np.allclose(result[:read_sums], host.reshape(read_sums, READ_RUN).sum(axis=1, dtype=np.float64),
                               rtol=1e-5, atol=0)
        elif name == "write_kernel":
            done = bool((result == fill_value).all())
        else:
            done = np.array_equal(result, host)
        if not done:
            raise RuntimeError(f"the benchmark's {name} did not do its work on {device.info.describe()}")
    moved = {name: 2 * count * 4 for name in COPY_METHODS}
    moved.update(read_kernel=(count + read_sums) * 4, write_kernel=count * 4)
    times = {name: [] for name in STREAMS}
    for _ in range(repeat):
        for name in STREAMS:
            start = time.perf_counter()
            stream(name)
            times[name].append(time.perf_counter() - start)
    return {name: moved[name] / float(np.median(t)) / 1e9 for name, t in times.items()}


def require_torch():
    """The ``torch`` module; a RuntimeError saying how to install it when it is missing, raised
    before any work: without PyTorch the suite's side-by-side columns would be empty."""
    try:
        import torch
    except ImportError:
        raise RuntimeError('pool-tuner bench times PyTorch beside pool_tuner and needs it installed: '
                           'pip install "pool-tuner[bench]"') from None
    return torch


def suite(names=None, argument: str = "preset") -> list:
    """``(name, op, input_shape, output_size)`` of the suite: every preset and the untuned shapes
    (``presets.UNTUNED``, named ``"untuned"``), or only the presets in ``names`` (``"untuned"``
    among them for those; ``argument``: the names' argument, or option, in errors)."""
    chosen = list(presets.PRESETS) + [presets.UNTUNED_NAME] if names is None else names
    for name in chosen:
        if name in presets.FUSED_PRESETS:
            raise ValueError(f"{argument} {name!r} is a fused (multi-level) preset: bench times single-level ops against "
                             f"PyTorch's one-to-one, which has no fused equivalent; benchmarks/pyramid.py times the "
                             f"fused presets against pool_tuner's and PyTorch's separate calls")
        if name not in presets.PRESETS and name not in ("all", presets.UNTUNED_NAME):
            raise ValueError(f"{argument} must be one of {sorted(presets.PRESETS) + ['all', presets.UNTUNED_NAME]}, "
                             f"got {name!r}")
    return [(name, op, shape, out) for name in chosen
            for op, shape, out in (presets.UNTUNED if name == presets.UNTUNED_NAME else presets.preset_shapes(name))]


def _torch_candidate(op, direction, x, output_size, grad, indices, torch_device: str) -> Candidate:
    """PyTorch's ATen kernel for this case on ``torch_device`` (``"cpu"``, ``"cuda:0"``)."""
    import torch
    import torch.nn.functional as F

    operation = OPS[op]
    ndim = operation.ndim

    def tensor(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(torch_device)

    xt = tensor(x)
    out_size = tuple(output_size)
    if ndim == 1:  # ATen implements 1d adaptive pooling through the 2d kernels
        xt, out_size = xt.unsqueeze(-2), (1,) + out_size
        grad = None if grad is None else grad[..., None, :]
        indices = None if indices is None else indices[..., None, :]
    aten = find(operation.kind, 2 if ndim <= 2 else 3)
    if DIRECTIONS[direction].reads_input:
        run = functools.partial(getattr(F, aten.name), xt, out_size)  # torch.nn.functional's name is the op's
    elif not operation.selects:
        run = functools.partial(getattr(torch.ops.aten, aten.aten_backward), tensor(grad), xt)
    else:
        run = functools.partial(getattr(torch.ops.aten, aten.aten_backward), tensor(grad), xt, tensor(indices))
    if xt.device.type == "cuda":
        return Candidate(run, functools.partial(torch.cuda.synchronize, xt.device))
    return Candidate(run, lambda: None)


def time_loop_cuda_events(candidate: Candidate, calls: int) -> float:
    """Milliseconds per call of ``calls`` calls of ``candidate`` back to back, between two CUDA
    events on PyTorch's current stream (the device's own clock, not the host's)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        candidate.call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def _cuda_tensors(problem: Problem, x, grad, indices, torch_device: str) -> list:
    """The tensors of a case on ``torch_device``: ``[x]`` (forward), ``[x, grad_out]`` or
    ``[x, grad_out, indices]`` (backward)."""
    import torch

    arrays = [x] + ([] if problem.flow.reads_input else
                    [grad] + ([indices] if problem.flow.reads_indices(problem.operation) else []))
    return [torch.from_numpy(np.ascontiguousarray(a)).to(torch_device) for a in arrays]


def _pool_tuner_torch_candidate(problem: Problem, tensors: list, variant=None, config=None) -> Candidate:
    """What a user of ``pool_tuner.torch`` calls on CUDA tensors: the functional forward, or the
    backward custom op autograd runs (``torch.ops.pool_tuner.<op>_backward``), with
    ``variant``/``config`` forced when given.  Results come from PyTorch's caching allocator."""
    import torch

    from . import torch as ptt

    out_size = list(problem.output_shape[-problem.ndim:])
    if problem.flow.reads_input:
        run = functools.partial(getattr(ptt, problem.op), tensors[0], out_size, variant=variant, config=config)
    else:
        backward = getattr(torch.ops.pool_tuner, problem.flow.op_name(problem.operation))
        run = functools.partial(backward, *tensors[1:], list(problem.input_shape),
                                ptt._encode_options(None, variant, config))
    return Candidate(run, functools.partial(torch.cuda.synchronize, tensors[0].device))


def _cuda_kernel_candidate(problem: Problem, tensors: list, variant=None, config=None) -> Candidate:
    """The kernel alone: the ``torch_cuda`` plan's prepared launch on PyTorch's current stream,
    on inputs and results (and a two-pass variant's scratch buffer) allocated once, so a call is
    one ``cuLaunchKernel`` per pass."""
    import torch

    from . import ops, torch_cuda

    inputs = tensors[:1] if problem.flow.reads_input else tensors[1:]
    size = problem.output_shape[-problem.ndim:] if problem.flow.reads_input else problem.input_shape
    fn = getattr(ops, problem.flow.op_name(problem.operation))
    plan = torch_cuda.plan(fn, inputs, size, {"device": None, "variant": variant, "config": config})
    results = [torch_cuda.empty_result(inputs[0], result, None)
               for result in plan.results + ((plan.scratch,) if plan.scratch is not None else ())]
    pointers = [t.data_ptr() for t in inputs + results]
    index = inputs[0].device.index
    launch = plan.prepared_launch()
    return Candidate(lambda: launch(torch_cuda.current_raw_stream(index), *pointers),
                     functools.partial(torch.cuda.synchronize, inputs[0].device))


def measure(name, op, shape, output_size, direction, device, repeat: int, rng, tune_here: bool = False,
            dtype: str = "float32") -> Row:
    """Interleaved medians of pool_tuner (dispatched and default) and PyTorch for one case, each
    timed in loops of calls back to back (``time_loop``).  On a CUDA device pool_tuner is timed as
    ``pool_tuner.torch`` on CUDA tensors and the loops between CUDA events, and the kernels alone
    are timed too (``_measure_cuda``).  With ``tune_here`` the problem is first tuned with the
    shipped records' budget (``TUNE_HERE_BUDGET``), without storing the result (so the dispatched
    candidate is still what dispatch does without it), and the tuning's winner is one more candidate."""
    import pool_tuner as pt

    problem = Problem.create(op, shape, output_size, dtype, direction=direction)
    tuned_here = None
    if tune_here:
        from . import tuner

        tuned_here = tuner.tune(op, shape, output_size, dtype, direction=direction, device=device, store=False,
                                **TUNE_HERE_BUDGET)
    if device.info.backend == "cuda":
        return _measure_cuda(name, problem, device, repeat, rng, tuned_here)
    out_size = problem.output_shape[-problem.ndim:]
    queue = device.queue
    x = rng.uniform(-1.0, 1.0, problem.input_shape).astype(dtype)
    grad = indices = None
    fn = getattr(pt, problem.flow.op_name(problem.operation))
    if problem.flow.reads_input:
        args = (device.to_device(x, queue), out_size)
    else:
        grad = rng.uniform(-1.0, 1.0, problem.output_shape).astype(dtype)
        if problem.operation.selects:
            _, indices = getattr(pt, op)(x, out_size, return_indices=True, device=device)
            args = (device.to_device(grad, queue), device.to_device(indices, queue), problem.input_shape)
        else:
            args = (device.to_device(grad, queue), problem.input_shape)
    default = dispatch.default_choice(problem, device)
    info = dispatch.describe(problem, device, dispatch.choose(problem, device))
    wait = functools.partial(device.synchronize, queue)
    candidates = [
        Candidate(functools.partial(fn, *args, device=device), wait),
        Candidate(functools.partial(fn, *args, device=device, variant=default.variant.name, config=default.config),
                  wait),
        _torch_candidate(op, direction, x, out_size, grad, indices, device.info.torch_device),
    ]
    if tuned_here is not None:
        candidates.append(Candidate(functools.partial(fn, *args, device=device, variant=tuned_here.best_variant,
                                                      config=tuned_here.best_params), wait))
    medians, calls = _interleaved(candidates, repeat, rng, time_loop)
    return Row(name, op, direction, list(problem.input_shape), list(problem.output_shape), problem.bytes_moved(),
               *problem.bytes_read_written(), *medians[:3], *calls[:3],
               info["source"], info["variant"], info["params"], None, None, *_tuned_here_fields(tuned_here, medians[3:]))


def _tuned_here_fields(tuned_here, medians: list) -> tuple:
    """``Row``'s ``tuned_here_*`` fields: the winner's time (the last candidate's median), variant
    and configuration; Nones without a tuning in the run."""
    if tuned_here is None:
        return (None, None, None)
    return (medians[-1], tuned_here.best_variant, tuned_here.best_params)


def _interleaved(candidates: list, repeat: int, rng, timer) -> tuple[list, list]:
    """Medians (ms per call) of ``repeat`` rounds of ``timer`` loops of each candidate, in a fresh
    order every round, and the calls per loop of each."""
    for candidate in candidates:  # warm-up: builds, first-touch, allocator pools
        time_loop(candidate, 2)
    calls = [calls_per_loop(candidate) for candidate in candidates]
    times = [[] for _ in candidates]
    for _ in range(repeat):
        for i in rng.permutation(len(candidates)):
            times[i].append(timer(candidates[i], calls[i]))
    return [float(np.median(t)) for t in times], calls


def _measure_cuda(name: str, problem: Problem, device, repeat: int, rng, tuned_here=None) -> Row:
    """``measure`` on a CUDA device: ``pool_tuner.torch`` (dispatched and default) against
    ``torch.nn.functional`` (PyTorch's ATen kernels), both on CUDA tensors with PyTorch's caching
    allocator, and pool_tuner's two kernels alone; every loop timed between CUDA events
    (``time_loop_cuda_events``)."""
    import pool_tuner as pt

    out_size = problem.output_shape[-problem.ndim:]
    x = rng.uniform(-1.0, 1.0, problem.input_shape).astype(problem.dtype)
    grad = indices = None
    if not problem.flow.reads_input:
        grad = rng.uniform(-1.0, 1.0, problem.output_shape).astype(problem.dtype)
        if problem.operation.returns_indices:
            _, indices = getattr(pt, problem.op)(x, out_size, return_indices=True, device=device)
    tensors = _cuda_tensors(problem, x, grad, indices, device.info.torch_device)
    default = dispatch.default_choice(problem, device)
    forced = dict(variant=default.variant.name, config=default.config)
    info = dispatch.describe(problem, device, dispatch.choose(problem, device))
    candidates = [
        _pool_tuner_torch_candidate(problem, tensors),
        _pool_tuner_torch_candidate(problem, tensors, **forced),
        _torch_candidate(problem.op, problem.direction, x, out_size, grad, indices, device.info.torch_device),
        _cuda_kernel_candidate(problem, tensors),
        _cuda_kernel_candidate(problem, tensors, **forced),
    ]
    if tuned_here is not None:
        candidates.append(_pool_tuner_torch_candidate(problem, tensors, variant=tuned_here.best_variant,
                                                      config=tuned_here.best_params))
    medians, calls = _interleaved(candidates, repeat, rng, time_loop_cuda_events)
    return Row(name, problem.op, problem.direction, list(problem.input_shape), list(problem.output_shape),
               problem.bytes_moved(), *problem.bytes_read_written(), *medians[:3], *calls[:3],
               info["source"], info["variant"], info["params"], *medians[3:5],
               *_tuned_here_fields(tuned_here, medians[5:]))


def _summary(rows: list) -> dict:
    """Geomeans of ``rows``' ratios, and the lowest fraction of copy bandwidth among the large ones."""
    big = [r for r in rows if r["bytes_moved"] >= 64e6]
    return {
        "geomean_speedup_vs_torch": geomean(r["speedup_vs_torch"] for r in rows),
        "geomean_times_floor": geomean(r["times_floor"] for r in rows),
        "geomean_times_stream_floor": geomean(r["times_stream_floor"] for r in rows),
        "geomean_tuned_vs_default": geomean(r["tuned_vs_default"] for r in rows),
        "min_fraction_of_copy_at_64MB": min((r["fraction_of_copy"] for r in big), default=None),
        "geomean_dispatched_vs_tuned_here": geomean(r["dispatched_vs_tuned_here"] for r in rows
                                                    if r["dispatched_vs_tuned_here"] is not None) if any(
            r["dispatched_vs_tuned_here"] is not None for r in rows) else None,
    }


def _is_global_row(row: dict) -> bool:
    """Whether a report row is global pooling (``variants.is_global``), suite and untuned shapes alike."""
    ndim = OPS[row["op"]].ndim
    return is_global(Problem.create(row["op"], row["input_shape"], row["output_shape"][-ndim:]))


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def run(names=None, directions=("forward", "backward"), device=None, repeat: int = 15, torch_threads: int | None = None,
        progress=None, tune_untuned: bool = False, dtype: str = "float32", stream_bytes: int = STREAM_BYTES,
        rows_path: Path | None = None) -> dict:
    """Run the suite in ``dtype`` (one of ``DTYPES``); returns the JSON-ready report.
    ``tune_untuned``: tune each of the untuned shapes in the run and time its winner beside
    dispatch's choice (``measure``'s ``tune_here``).  ``stream_bytes``: the bandwidth streams'
    buffer size (``memory_bandwidth``); small ones make a quick check, whose floors are a cache's.
    ``rows_path``: a file (emptied first) that gets each row as soon as it is measured, one JSON
    object a line, its floors from the streams timed before the suite -- what a run killed part way
    (a GPU lease's step timeout) keeps."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (numpy has no bfloat16 for the inputs), "
                         f"got {dtype!r}")
    torch = require_torch()
    dev = backends.resolve_device(device)
    if torch_threads:
        torch.set_num_threads(torch_threads)
    torch_info = {"version": torch.__version__, "threads": torch.get_num_threads()}
    # The streams are timed before and after the suite and each keeps the faster median: a shared
    # machine's bandwidth drifts by a third within minutes, and a floor is what the device can do.
    load_before = load_average()
    # They take as many rounds as the shapes, up to memory_bandwidth's default (a short run stays short).
    stream_repeat = min(repeat, STREAM_REPEAT)
    streams_before = memory_bandwidth(dev, nbytes=stream_bytes, repeat=stream_repeat)
    rng = np.random.default_rng()
    rows = []
    if rows_path is not None:
        rows_path.write_text("")
    for name, op, shape, out in suite(names):
        for direction in directions:
            rows.append(measure(name, op, shape, out, direction, dev, repeat, rng,
                                tune_here=tune_untuned and name == presets.UNTUNED_NAME, dtype=dtype))
            if rows_path is not None:
                with open(rows_path, "a", encoding="utf-8") as partial:
                    partial.write(json.dumps(rows[-1].reported(streams_before)) + "\n")
            if progress:
                progress(rows[-1])
    streams_after = memory_bandwidth(dev, nbytes=stream_bytes, repeat=stream_repeat)
    load_after = load_average()
    streams = {name: max(streams_before[name], streams_after[name]) for name in STREAMS}
    copy_gbs = copy_bandwidth(streams)
    report_rows = [r.reported(streams) for r in rows]
    summary = {}
    for direction in directions:
        picked = [r for r in report_rows if r["direction"] == direction]
        for label, group in ((direction, [r for r in picked if r["name"] != presets.UNTUNED_NAME]),
                             (f"{direction}, untuned shapes", [r for r in picked if r["name"] == presets.UNTUNED_NAME]),
                             (f"{direction}, global pooling", [r for r in picked if _is_global_row(r)])):
            if group:
                summary[label] = _summary(group)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": dev.info.describe(),
        "dtype": dtype,
        "host": platform.processor() or platform.machine(),
        "torch": torch_info,
        "copy_gbs": copy_gbs,
        "memory_gbs": streams,
        "memory_gbs_before_and_after": [streams_before, streams_after],
        "repeat": repeat,
        "stream_bytes": stream_bytes,
        "method": {"timing": "loops of calls back to back, then one wait for the device", "loop_s": LOOP_S,
                   "min_calls": MIN_CALLS, "max_calls": MAX_CALLS,
                   **({"cuda": CUDA_METHOD} if dev.info.backend == "cuda" else {})},
        "runtime_note": dev.info.runtime_note,
        "load_average": {"before": load_before, "after": load_after, "cpus": os.cpu_count()},
        "rows": report_rows,
        "summary": summary,
    }


def load_average() -> float | None:
    """The 1-minute load average of the machine (None where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def load_warning(report: dict) -> str | None:
    """Why the report's figures may not hold (a busy machine), or None: the load average before
    the run above half the CPUs (other work then competes with both sides of every comparison), or
    after it above the CPU count (the run itself keeps the CPUs busy, so more is someone else's)."""
    load = report.get("load_average") or {}
    before, after, cpus = load.get("before"), load.get("after"), load.get("cpus")
    if before is None or after is None or not cpus:
        return None
    if before <= cpus / 2 and after <= cpus:
        return None
    return (f"the machine was busy (load average {before:.2f} before the run, {after:.2f} after, on {cpus} CPUs): "
            f"other processes competed with the timings, so the figures, speed-ups included, are noisy; rerun "
            f"on an idle machine before relying on them")


def _shape_label(row: dict, separator: str = "->") -> str:
    return f"{'x'.join(map(str, row['input_shape']))}{separator}{'x'.join(map(str, row['output_shape']))}"


#: The table's columns: header, width, and how a row's cell is written.
COLUMNS = [
    ("pass", 8, lambda r: r["direction"]),
    ("pool_tuner ms", 13, lambda r: f"{r['tuned_ms']:.3f}"),
    ("PyTorch ms", 10, lambda r: f"{r['torch_ms']:.3f}"),
    ("vs PyTorch", 10, lambda r: f"{r['speedup_vs_torch']:.2f}x"),
    ("GB/s", 7, lambda r: f"{r['gbs']:.2f}"),
    ("% of copy", 9, lambda r: f"{100 * r['fraction_of_copy']:.0f}%"),
    ("x floor", 7, lambda r: f"{r['times_floor']:.2f}"),
    ("x stream floor", 14, lambda r: f"{r['times_stream_floor']:.2f}"),
    ("tuned vs default", 16, lambda r: f"{r['tuned_vs_default']:.2f}x"),
]
LEGEND = """\
pool_tuner ms, PyTorch ms: wall-clock time per call in loops of calls back to back on data already
  on the device, waiting for the device once per loop; medians of the interleaved loops
vs PyTorch: PyTorch ms / pool_tuner ms (above 1x: pool_tuner is faster)
GB/s: bytes read + written per second; % of copy: that against the device's fastest copy
x floor: time / the copy floor (the bytes moved at copy speed); x stream floor: time / the stream
  floor (also the reads alone at read speed and the writes alone at write speed); 1.00 is at the floor
tuned vs default: the default rules' choice's time / the dispatched kernel's (above 1x: tuning helped)
kernel: the dispatched variant, and where dispatch took it from (cache, nearest tuned shape, default)
On a CUDA device: pool_tuner is pool_tuner.torch on CUDA tensors, every loop is timed between CUDA
  events, and "kernel alone" is the dispatched (and default) kernel launched back to back on buffers
  allocated once"""


def format_table(report: dict) -> str:
    """The report as a table a person reads at a glance, with a legend of its columns below it."""
    streams = ", ".join(f"{name} {gbs:.1f}" for name, gbs in report["memory_gbs"].items())
    shapes = [f"{r['name']} {_shape_label(r)}" for r in report["rows"]]
    width = max([len("shape")] + [len(s) for s in shapes])
    lines = [f"{report['date']}  device {report['device']}  copy bandwidth {report['copy_gbs']:.1f} GB/s"
             f"  torch {report['torch']}",
             f"memory GB/s, the faster of before and after the suite: {streams} (floor: the fastest copy;"
             f" stream floor: also reads and writes alone)",
             f"{'shape':{width}s} " + " ".join(f"{h:>{w}s}" for h, w, _ in COLUMNS) + "  kernel"]
    if report.get("runtime_note"):
        lines.insert(1, report["runtime_note"])
    load = report.get("load_average")
    if load and load.get("before") is not None:
        lines.insert(1, f"load average (1 min): {load['before']:.2f} before, {load['after']:.2f} after the run, "
                        f"on {load['cpus']} CPUs")
    if load_warning(report):
        lines.insert(2, f"WARNING: {load_warning(report)}")
    for shape, r in zip(shapes, report["rows"]):
        kernels = ("" if r.get("tuned_kernel_ms") is None
                   else f"; kernel alone {r['tuned_kernel_ms']:.4f} ms, default's {r['default_kernel_ms']:.4f} ms")
        lines.append(f"{shape:{width}s} " + " ".join(f"{cell(r):>{w}s}" for _, w, cell in COLUMNS)
                     + f"  {r['variant']} ({r['source']}){kernels}")
    for direction, s in report["summary"].items():
        lines.append(f"{direction}: geomean {s['geomean_speedup_vs_torch']:.2f}x vs PyTorch, "
                     f"{s['geomean_times_floor']:.2f}x the copy floor, {s['geomean_times_stream_floor']:.2f}x the stream floor, "
                     f"tuned {s['geomean_tuned_vs_default']:.2f}x vs default"
                     + ("" if s["min_fraction_of_copy_at_64MB"] is None
                        else f", min {100 * s['min_fraction_of_copy_at_64MB']:.0f}% of copy bandwidth at >=64 MB")
                     + ("" if s.get("geomean_dispatched_vs_tuned_here") is None
                        else f"; dispatched {s['geomean_dispatched_vs_tuned_here']:.2f}x of tuning each in this run"))
    return "\n".join(lines + ["", LEGEND])


def plot(report: dict, path: Path) -> None:
    """Bar chart of milliseconds per call, ours beside PyTorch's, for each shape and direction, with
    each shape's copy floor and stream floor marked across its pair of bars and the speed-up above."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    rows = report["rows"]
    labels = [f"{r['name']}\n{_shape_label(r, chr(10) + '-> ')}\n{r['direction']}" for r in rows]
    positions = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(8.0, 1.15 * len(rows) + 3), 6))
    ours = ax.bar(positions - 0.2, [r["tuned_ms"] for r in rows], 0.4, label="pool_tuner (dispatched)")
    ax.bar(positions + 0.2, [r["torch_ms"] for r in rows], 0.4, label="PyTorch")
    for floor, style in (("floor_ms", dict(color="black", linestyle="--", linewidth=1.5, label="copy floor")),
                         ("stream_floor_ms", dict(color="red", linewidth=3, label="stream floor (reads, writes alone)"))):
        ax.hlines([r[floor] for r in rows], positions - 0.45, positions + 0.45, zorder=3, **style)
    for bar, r in zip(ours, rows):
        top = max(r["tuned_ms"], r["torch_ms"])
        ax.annotate(f"{r['speedup_vs_torch']:.2f}x", (bar.get_x() + 0.4, top), xytext=(0, 3),
                    textcoords="offset points", ha="center", fontsize=7)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.set_ylabel("milliseconds per call (log scale; lower is better)")
    ax.set_xticks(positions, labels, fontsize=7)
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.margins(y=0.12)
    ax.set_title(f"{report['device']} - {report['date']}\n(above each pair: PyTorch ms / pool_tuner ms)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, covering none
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # nothing cut off, however long the labels
    plt.close(fig)


#: The file of ``--out`` that gets each row as it is measured (``run``'s ``rows_path``).
ROWS_FILE = "bench_rows.jsonl"


def save(report: dict, directory: Path) -> tuple[Path, Path | None]:
    directory.mkdir(parents=True, exist_ok=True)
    json_path = directory / "bench.json"
    json_path.write_text(json.dumps(report, indent=1))
    png_path = directory / "bench.png"
    try:
        plot(report, png_path)
    except ImportError:
        png_path = None
    return json_path, png_path
