"""The public pooling functions: validate, dispatch, launch.

Each call validates all of its arguments (raising ``TypeError``/``ValueError`` that name the
argument) before anything is built or launched, asks ``dispatch`` for the variant and configuration
(handing it the tuner's tune-on-miss, ``POOL_TUNER_AUTOTUNE=1``), and launches the memoised kernel.
Devices are used only through the contract of ``backends.base``.  numpy in -> numpy out (through the default queue of the chosen
device); a device array in (``pyopencl.array.Array``, or any ``__cuda_array_interface__`` object:
PyCUDA ``GPUArray``, CuPy, Numba, PyTorch CUDA tensors, ...) -> the same kind of array out, on the
input's own queue/stream and context, no host round trip.

Memory layout: contiguous (channels-first) and channels-last inputs are recognised from their
strides and processed in place; the result has the same memory format.  Other strided numpy
inputs are copied to contiguous first.
"""

from __future__ import annotations

import functools
import math
import operator

import numpy as np

from . import backends, dispatch, gem_forms, measured, plans, tuner
from .operations import BACKWARD
from .problem import OPS, Problem
from .variants import variants_for
from .windows import pooling_windows

#: Plans of numpy and device-array calls by signature (``plans``).
_PLANS = plans.PlanTable("ops.plans")


def _plan(op: str, direction: str, arrays: list, size, device, variant, config, names, check_data=None) -> plans.Plan:
    """The plan of a call on numpy or device ``arrays``: memoised by signature, made (validated,
    dispatched, built) on the first call of a signature.  ``check_data(problem)`` checks what
    the signature does not fix (the values of max backward's indices) on every call, before
    anything is built."""
    first = arrays[0]
    try:
        key = plans.signature(op, direction, size, (variant, dispatch.config_key(config)),
                              (device, backends.env_device_setting()), tuple(map(plans.describe, arrays)))
    except (TypeError, AttributeError):  # an unhashable or ill-typed argument: validation explains
        key = None
    plan = _PLANS.get(key) if key is not None else None
    if plan is not None:
        if check_data is not None:
            check_data(plan.problem)
        return plan
    owner = plans.device_of(first)
    if owner is not None:
        plans.check_device_option(owner, device, names[0])
        queue = owner.arrays.queue_of(first)
        owner.arrays.check_first_call(queue, names[0])
        chosen, context = owner, queue.context
        owner.arrays.wrap_input(first, names[0])
    else:
        if not isinstance(first, np.ndarray):
            hint = ("; for PyTorch tensors use pool_tuner.torch (the same functions, with autograd)"
                    if type(first).__module__.startswith("torch") else "")
            raise TypeError(f"{names[0]} must be a numpy.ndarray or a device array (pyopencl Array, PyCUDA "
                            f"GPUArray, __cuda_array_interface__), got {type(first).__name__}{hint}")
        chosen, context = backends.resolve_device(device), None
    specs = [plans.numpy_spec(first)]
    if len(arrays) > 1:
        specs.append(_indices_spec(arrays[1], first, owner))
    if owner is not None:
        check_data = _device_layouts_check(specs, names[0], check_data)
    plan = plans.make_plan(op, direction, specs, size, chosen, variant, config, on_miss=tuner.tune_on_miss,
                           names=names, context=context, before_build=check_data)
    return _PLANS.put(key, plan) if key is not None else plan


def _device_layouts_check(specs: list, name: str, check_data):
    """Device arrays are never copied into another layout: a check (for ``make_plan``'s
    ``before_build``) that they are contiguous or channels-last, the indices like ``grad_out``."""

    def check(problem):
        first = specs[0]
        if problem.operation.multi_level and not problem.flow.reads_input:
            return  # the flat buffers of every level (pool_tuner.fused checked each level's layout)
        if plans.strides_layout(first.shape, first.strides, problem.ndim) is None:
            raise ValueError(f"{name} must be contiguous or channels-last; got strides {first.strides} (in elements) "
                             f"for shape {first.shape}. Device arrays are never copied behind your back: pass a "
                             f"contiguous copy (PyOpenCL cannot copy such a view on the device, so make the data "
                             f"contiguous where it is produced, or pool a numpy array, which is copied for you)")
        if len(specs) > 1 and plans.strides_layout(specs[1].shape, specs[1].strides, problem.ndim) != problem.layout:
            raise ValueError(f"indices must have the memory layout of grad_out ({problem.layout})")
        if check_data is not None:
            check_data(problem)

    return check


def _indices_spec(indices, grad_out, owner):
    """Max backward's ``indices`` as a spec, after the checks that need the array itself: the
    same kind of array as ``grad_out``, on the same device."""
    if indices is None:
        return None
    indices_owner = plans.device_of(indices)
    if (owner is not None) != (indices_owner is not None) or not hasattr(indices, "dtype"):
        raise TypeError(f"indices must be the same kind of array as grad_out ({type(grad_out).__name__}), "
                        f"got {type(indices).__name__}")
    if owner is not None:
        if indices_owner is not owner:
            raise ValueError("indices must be on the same device as grad_out")
        plans.check_same_context(owner, indices, "indices", grad_out, "grad_out")
        owner.arrays.wrap_input(indices, "indices")
    return plans.numpy_spec(indices)


def pool_forward(op: str, x, output_size, return_indices=False, *, device=None, variant=None, config=None,
                 arguments=None):
    """Shared body of every forward op; ``arguments``: the values of the operator's run-time
    arguments (``Operation.arguments``, name -> number), None for their defaults."""
    plan = _plan(op, "forward", [x], output_size, device, variant, config, ("x",))
    scalars = None if arguments is None else plan.problem.with_arguments(arguments)
    results = _delivered(plan, _run(plan, [x], ("x",), scalars), x)
    if plan.problem.operation.returns_indices and return_indices:
        return results[0], results[1]
    return results[0]


def pool_backward(op: str, grad_out, input_shape, indices=None, *, device=None, variant=None, config=None):
    """Shared body of every backward op."""
    arrays = [grad_out, indices] if OPS[op].selects else [grad_out]
    # numpy indices are checked against the problem's windows once it is known, before any launch
    check_data = (functools.partial(_check_indices_in_windows, indices)
                  if isinstance(indices, np.ndarray) and indices.size else None)
    plan = _plan(op, "backward", arrays, input_shape, device, variant, config, ("grad_out",), check_data)
    return _delivered(plan, _run(plan, arrays, ("grad_out", "indices")), grad_out)[0]


def _delivered(plan: plans.Plan, results: list, first) -> list:
    """Results of a call on device arrays as the kind of array the caller gave (``CallerArrays.deliver``:
    a torch tensor for a torch tensor, a CuPy array for a CuPy array, ...); numpy results as they
    are."""
    if isinstance(first, np.ndarray):
        return results
    queue = plan.device.arrays.queue_of(first)
    return [plan.device.arrays.deliver(r, queue) for r in results]


def memory_layout(x, ndim: int) -> str | None:
    """The layout name of a numpy or device array's memory (``plans.strides_layout``)."""
    spec = plans.numpy_spec(x)
    return plans.strides_layout(spec.shape, spec.strides, ndim)


def _run(plan: plans.Plan, arrays: list, names: tuple, scalars: tuple | None = None) -> list:
    """Run a plan on numpy or device arrays; returns its results in the caller's kind of array.
    ``scalars``: the call's run-time kernel arguments, where not the plan's (``Problem.with_arguments``)."""
    if not isinstance(arrays[0], np.ndarray):
        device = plan.device
        queue = device.arrays.queue_of(arrays[0])  # the caller's array: a CUDA array's interface names its stream
        arrays = [device.arrays.wrap_input(a, name) for a, name in zip(arrays, names)]
        return _run_on_device_arrays(plan, arrays, queue, scalars=scalars)
    problem = plan.problem
    arrays = [_in_memory_order(a, problem) if reorder else a for a, reorder in zip(arrays, plan.reorder)]
    if not plan.device.info.shares_host_memory:  # through copies on the device
        queue = plan.device.queue
        # a multi-level backward's inputs are flat buffers, already in memory order (pool_tuner.fused)
        flat = problem.operation.multi_level and not problem.flow.reads_input
        copies = [plan.device.to_device((a if flat else _in_memory_order(a, problem)).view(_storage_dtype(a.dtype)),
                                        queue)
                  for a in arrays]
        results = _run_on_device_arrays(plan, copies, queue, logical=False, scalars=scalars)
        return [_logical(plan.device.to_host(r).view(_result_dtype(result, arrays[0])), problem, result)
                for r, result in zip(results, plan.results)]
    outputs = plan.run(arrays, functools.partial(_empty_result, arrays[0].dtype), _address, scalars=scalars)
    return [_logical(out, problem, result) for out, result in zip(outputs, plan.results)]


def _run_on_device_arrays(plan: plans.Plan, arrays: list, queue, logical: bool = True, scalars=None) -> list:
    """Run a plan on device arrays (kernel arguments, in memory order): results on ``queue``,
    with the input's layout when ``logical`` (else in memory order, as stored); ``scalars``: the
    call's run-time arguments, where not the launch's."""
    device, problem = plan.device, plan.problem
    dtype = arrays[0].dtype

    def allocate(result: plans.Result, fill):
        return device.empty(result.memory_shape, np.int64 if result.dtype == "int64" else dtype, queue,
                            stored_fill(fill, result.dtype))

    outputs = plan.run(arrays, allocate, None, queue, scalars)
    if not logical or not problem.channels_last or plan.results[0].flat:
        return outputs
    return [device.arrays.strided_view(out, result.shape, tuple(s * out.dtype.itemsize for s in result.strides))
            for out, result in zip(outputs, plan.results)]


def _in_memory_order(array: np.ndarray, problem: Problem) -> np.ndarray:
    """A numpy array (logical, channels-first axes) as a C-contiguous array in the problem's
    memory order: a copy only when it is not already so."""
    if problem.channels_last:
        array = np.moveaxis(array, array.ndim - problem.ndim - 1, -1)
    return np.ascontiguousarray(array)


def _logical(out: np.ndarray, problem: Problem, result: plans.Result) -> np.ndarray:
    """A result in memory order seen with the logical (channels-first) axes (a multi-level op's flat
    buffers are viewed level by level later, ``pyramid.views``)."""
    if not problem.channels_last or result.flat:
        return out
    return np.moveaxis(out, -1, out.ndim - problem.ndim - 1)


#: A numpy array's address (``plans.Plan.run``).
_address = operator.attrgetter("ctypes.data")


def _empty_result(dtype, result: plans.Result, fill) -> np.ndarray:
    """A result in memory order (``plans.Plan.run``'s allocator): of ``dtype`` (the input's), or
    int64 for indices, filled with ``fill`` unless it is None."""
    out = np.empty(result.memory_shape, np.int64 if result.dtype == "int64" else dtype)
    if fill is not None:
        out.fill(fill)
    return out


def _result_dtype(result: plans.Result, first: np.ndarray):
    return np.int64 if result.dtype == "int64" else first.dtype


def _storage_dtype(dtype):
    """bfloat16 travels to devices as its uint16 bits."""
    return np.dtype(np.uint16) if np.dtype(dtype).name == "bfloat16" else np.dtype(dtype)


def stored_fill(fill, dtype: str):
    """A result's ``fill`` (``plans.result_fill``) as a value of its device array, whose bfloat16 is
    stored as uint16 bits (``_storage_dtype``)."""
    if fill is None or dtype != "bfloat16" or not fill:
        return fill
    import ml_dtypes  # only for a bfloat16 result filled with other than zeros

    return np.array(fill, ml_dtypes.bfloat16).view(np.uint16)[()]


def _check_indices_in_windows(indices, problem):
    """numpy indices only (device arrays are not read back): each inside its output's window.
    The gather kernels never dereference an index, so a bad one cannot fault -- but it would
    silently drop a gradient, hence the check."""
    plane_shape = problem.input_shape[-problem.ndim:]
    if indices.min() < 0 or indices.max() >= math.prod(plane_shape):
        raise ValueError(f"indices must lie in [0, {math.prod(plane_shape)}) (positions within the pooled plane)")
    # Raveled first: numpy 2.4's unravel_index misplaces coordinates of some multi-d inputs.
    coords = [c.reshape(indices.shape) for c in np.unravel_index(indices.ravel(), plane_shape)]
    for axis, coord in enumerate(coords):
        i_size = problem.input_shape[-problem.ndim + axis]
        o_size = problem.output_shape[-problem.ndim + axis]
        starts, ends = pooling_windows(i_size, o_size)
        shape = [1] * indices.ndim
        shape[indices.ndim - problem.ndim + axis] = o_size
        if np.any(coord < starts.reshape(shape)) or np.any(coord >= ends.reshape(shape)):
            raise ValueError("indices must each lie inside their output's pooling window, as returned by the forward pass")


def _doc_forward(operation):
    ndim = operation.ndim
    shape = {1: "(N, C, L) or (C, L)", 2: "(N, C, H, W) or (C, H, W)", 3: "(N, C, T, H, W) or (C, T, H, W)"}[ndim]
    extra = ("" if not operation.returns_indices else
             " With ``return_indices=True`` also returns int64 indices (positions within each pooled "
             "plane, as PyTorch); NaN wins, ties go to the first position.")
    return (f"Adaptive {operation.description} pooling of a {shape} array to ``output_size`` (an int, or "
            f"{ndim} entries that may be ``None`` to keep that size).{extra}")


def _make_forward(op):
    operation = OPS[op]
    if not operation.returns_indices:
        def forward(x, output_size, *, device=None, variant=None, config=None):
            return pool_forward(op, x, output_size, device=device, variant=variant, config=config)
    else:
        def forward(x, output_size, return_indices=False, *, device=None, variant=None, config=None):
            return pool_forward(op, x, output_size, return_indices, device=device, variant=variant, config=config)
    forward.__name__ = forward.__qualname__ = op
    forward.__doc__ = _doc_forward(operation)
    return forward


def _make_backward(op):
    if not OPS[op].selects:
        def backward(grad_out, input_shape, *, device=None, variant=None, config=None):
            return pool_backward(op, grad_out, input_shape, device=device, variant=variant, config=config)
    else:
        def backward(grad_out, indices, input_shape, *, device=None, variant=None, config=None):
            return pool_backward(op, grad_out, input_shape, indices, device=device, variant=variant, config=config)
    backward.__name__ = backward.__qualname__ = BACKWARD.op_name(OPS[op])
    backward.__doc__ = (f"Gradient of {op} with respect to its input, as a deterministic gather "
                        f"(no atomics: bit-identical across runs and variants).")
    return backward


adaptive_avg_pool1d = _make_forward("adaptive_avg_pool1d")
adaptive_avg_pool2d = _make_forward("adaptive_avg_pool2d")
adaptive_avg_pool3d = _make_forward("adaptive_avg_pool3d")
adaptive_max_pool1d = _make_forward("adaptive_max_pool1d")
adaptive_max_pool2d = _make_forward("adaptive_max_pool2d")
adaptive_max_pool3d = _make_forward("adaptive_max_pool3d")
adaptive_avg_pool1d_backward = _make_backward("adaptive_avg_pool1d")
adaptive_avg_pool2d_backward = _make_backward("adaptive_avg_pool2d")
adaptive_avg_pool3d_backward = _make_backward("adaptive_avg_pool3d")
adaptive_max_pool1d_backward = _make_backward("adaptive_max_pool1d")
adaptive_max_pool2d_backward = _make_backward("adaptive_max_pool2d")
adaptive_max_pool3d_backward = _make_backward("adaptive_max_pool3d")


def _explain_own_backward(problem: Problem, device) -> dict:
    """``explain`` of a backward ``problem`` whose op runs a kernel of its own (GeM's input
    gradient, ``Operation.backward_kernel``, in the form ``gem_forms.input_gradient_form`` chooses for
    the problem and device) in its one configuration: source ``own`` (no variant, rule, record or
    measurement decides it), explain's other fields empty."""
    form = gem_forms.input_gradient_form(device, problem)
    return {"op": problem.op, "direction": problem.direction, "dtype": problem.dtype, "layout": problem.layout,
            "input_shape": list(problem.input_shape), "output_shape": list(problem.output_shape),
            "variant": form.kernel, "params": dict(form.config),
            "source": "own", "device": device.info.describe(), "cache_key": None, "record_key": None, "tier": None,
            "record_origin": None, "problem_class": problem.problem_class, "distance": None,
            "nearest_beyond_bound": None, "rule": None, "rule_config": None, "rule_evidence": None, "measured": None,
            "index_bits": 64 if problem.index_64 else 32, "partial": None, "autotune_on_miss": False,
            "benchmark_on_miss": False, "measured_candidate": None, "host_fallback": device.info.host_fallback}


def explain(op, input_shape, output_size, dtype="float32", layout=None, device=None, *, direction="forward",
            variant=None, config=None) -> dict:
    """What a call would run, without running it: variant, params, ``source`` of the decision
    (``forced``/``cache``/``nearest``/``measured``/``default``; ``own`` for a backward that runs its
    op's own kernel, ``Operation.backward_kernel``: its name and one configuration), device, cache key; ``measured``: for a
    measured dispatch, its candidates and their times (``pool_tuner.measured``), else None;
    ``nearest_beyond_bound``: where the default rules decide though a record of another shape
    applies, that record, its distance and why it did not decide (``dispatch.nearest_bound``),
    else None; ``autotune_on_miss`` / ``benchmark_on_miss``: whether a call's first use of an untuned problem
    would tune or measure it; ``partial``: for a
    decision from an interrupted tuning's record, what that tuning covered (else None);
    ``measured_candidate``: where ``pool_tuner.torch`` raced PyTorch's own kernel on this problem
    for CPU tensors in this process, the times and the winner that such calls run (else None);
    ``host_fallback``: why the device's kernels cannot run in this process (a forked child of a
    process that started PoCL), whose calls on host memory are then pooled on the host (else None).
    ``layout=None`` means contiguous channels-first; ``direction="backward"`` explains the
    backward pass."""
    dev = backends.resolve_device(device)
    problem = Problem.create(op, input_shape, output_size, dtype, layout, direction=direction)
    plans.check_fits(problem, dev)
    if problem.direction == BACKWARD.name and problem.operation.backward_kernel is not None:
        if variant is not None or config is not None:
            raise ValueError(f"variant and config choose among the backward variants; {op}'s backward runs no "
                             f"variant but its own kernel {problem.operation.backward_kernel} in one configuration, "
                             f"got variant={variant!r}, config={config!r}")
        return _explain_own_backward(problem, dev)
    info = dispatch.describe(problem, dev, dispatch.choose(problem, dev, variant, config, memoise=False))
    record = dispatch.tuning_cache().lookup(info["record_key"]) if info["record_key"] else None
    # An interrupted tuning's record: what it covered (see pool_tuner.tuner), else None.
    info["partial"] = None if record is None else record.get("partial")
    info["autotune_on_miss"] = tuner.autotune_enabled()
    info["benchmark_on_miss"] = measured.enabled()
    # Where another kernel raced pool_tuner's on this problem in this process (pool_tuner.torch's
    # PyTorch candidate for CPU tensors): both times and the winner, which is what such calls run.
    info["measured_candidate"] = dispatch.measured_candidate(problem, dev)
    # Where the device's kernels cannot run in this process (a forked child of a PoCL process): why,
    # as calls on host memory then run on the host (pool_tuner.host_fallback); else None.
    info["host_fallback"] = dev.info.host_fallback
    return info


def release_memory() -> int:
    """Free the device memory that pool_tuner holds for reuse by later results (OpenCL results on
    a device's own queue and CUDA results other than torch tensors come from a memory pool, see docs/design.md
    "Memory"); returns the number of blocks freed.  Arrays still referenced are untouched."""
    return sum(device.release_memory() for device in backends.all_devices())


def devices() -> list:
    """Every device pool_tuner can run on; each one's ``info`` describes it, with an id that keeps
    its meaning when other drivers are installed (``info.id``: ``cuda:<ordinal>``,
    ``opencl:<platform>:<device>`` such as ``opencl:pocl:0``)."""
    return backends.all_devices()


def variants(op: str, direction: str = "forward") -> list:
    """Names of the kernel variants available for ``op`` (e.g. ``"adaptive_avg_pool2d"``)."""
    return list(variants_for(op, direction))
