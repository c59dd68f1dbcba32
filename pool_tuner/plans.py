"""Call plans: the one place where every front end prepares a call.

A call's *signature* -- op and direction, each array's shape, strides and dtype, the output size
(forward) or input shape (backward), the device and pool_tuner's options (variant, config) --
fixes everything except the data: the validated problem, the memory layout, the dispatch decision,
the built kernel and its grid, which inputs need reordering, and the shapes and strides of every
result.  ``make_plan`` works all of that out once; the front ends (``ops`` for numpy and device
arrays, ``torch`` for CPU tensors, ``torch_cuda`` for CUDA tensors) memoise the plan by signature,
so every later call of that signature is a dictionary lookup, the results' allocation and one
launch.

Arrays are described to ``make_plan`` as ``ArraySpec``s (shape, strides in elements, dtype), so
that numpy arrays, device arrays and tensors are validated by the same rules and give the same
errors.  Plans live in ``PlanTable``s: ``memo`` tables, bounded and emptied whenever dispatch forgets its
decisions.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import numpy as np

from . import backends, dispatch, host_fallback, memo, shapes
from .backends import cuda_arrays
from .operations import DIRECTIONS
from .problem import ELEMENT_BYTES, LAYOUT_NAMES, OPS, Problem, check_dtype, check_fits


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """What a plan needs to know of an array: its logical shape, its strides in elements (not
    bytes) and its dtype (any form ``problem.check_dtype`` accepts)."""

    shape: tuple
    strides: tuple
    dtype: object


def numpy_spec(array) -> ArraySpec:
    """The spec of a numpy array, a PyOpenCL array or a CUDA array of any library, which is read
    through its ``__cuda_array_interface__`` alone (libraries name their strides differently; a
    torch tensor has no ``strides``).  Strides in bytes become element strides."""
    interface = cuda_arrays.cuda_array_interface(array)
    if interface is None:
        shape, strides, dtype = tuple(array.shape), array.strides, array.dtype
    else:
        dtype = cuda_arrays.interface_dtype(interface, array)
        shape = tuple(int(s) for s in interface["shape"])
        strides = interface.get("strides") or cuda_arrays.c_strides(shape, dtype.itemsize)
    itemsize = dtype.itemsize
    return ArraySpec(shape, tuple(s // itemsize if s % itemsize == 0 else None for s in strides), dtype)


def tensor_spec(tensor) -> ArraySpec:
    """The spec of a PyTorch tensor (strides in elements; ``torch.float32`` -> ``"float32"``)."""
    return ArraySpec(tuple(tensor.shape), tensor.stride(), str(tensor.dtype).removeprefix("torch."))


# ------------------------------------------------------------------ the signature of a call


def exact(value):
    """A memo key that tells apart arguments that merely compare equal (``8.0 == 8``,
    ``True == 1``), so that a bad argument never reuses a good call's plan: a sequence's key holds
    its elements' types (a nested sequence is never a valid size, so never gets stored)."""
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(value), tuple(map(type, value)))
    return (type(value), value)


def signature(op: str, direction: str, size, options, device, arrays: tuple) -> tuple:
    """The memo key of a call, the same function for every front end: the op's and direction's
    names, the output size (forward) or input shape (backward) as given (an int as itself, a
    sequence by ``exact``), pool_tuner's options in the front end's one form of them (the schema
    string of ``pool_tuner.torch``; ``(variant, config)`` of ``pool_tuner.ops``), where it runs
    (the ``device=`` argument and ``POOL_TUNER_DEVICE``, or the tensors' device), and each array's
    ``describe``.  Everything a plan decides follows from these, so a call whose key has a plan
    is not validated again."""
    return op, direction, size if type(size) is int else exact(size), options, device, arrays


def tensor_signature(op: str, direction: str, size, options, device, tensor) -> tuple:
    """``signature(op, direction, size, options, device, (describe_tensor(tensor),))`` in one
    step: the key of the eager forward of ``pool_tuner.torch``, made on every call of a layer
    inside models whose other layers leave the caches cold, where each function touched costs."""
    return (op, direction, size if type(size) is int else exact(size), options, device,
            ((type(tensor), tensor.shape, tensor.stride(), tensor.dtype),))


def options_text(device=None, variant=None, config=None) -> str:
    """pool_tuner's keyword options as one string: ``""`` (all defaults) or the JSON of those set,
    so that ``pool_tuner.torch``'s custom ops carry them in their schema (they survive compile and
    export) and its call paths key plans by one hashable form of them (a device object as its id)."""
    if device is None and variant is None and config is None:  # the usual case, on every call's path
        return ""
    options = {"device": getattr(getattr(device, "info", None), "id", device), "variant": variant, "config": config}
    options = {name: value for name, value in options.items() if value is not None}
    try:
        return json.dumps(options, sort_keys=True)
    except TypeError as error:
        raise TypeError(f"device, variant and config must be JSON values (str, int, dict of str to int): "
                        f"{error}") from None


@functools.lru_cache(maxsize=256)
def options_of(text: str) -> tuple:
    """The ``(name, value)`` keyword options that ``options_text`` made ``text`` of."""
    return tuple(json.loads(text).items()) if text else ()


def describe(array) -> tuple:
    """What of ``array`` a call's signature holds: its type, shape, strides and dtype as the array
    states them, and where it lives -- a PyOpenCL array its queue, a tensor its ``device``, a CUDA
    array of any library its ``__cuda_array_interface__``'s (``numpy_spec``) and the device holding
    it -- so that arrays of two devices never share a plan.  One rule per type of array, found on
    the type's first call.  Raises ``TypeError`` for what is no array (validation then explains)."""
    rule = _RULES.get(type(array))
    if rule is None:
        rule = _rule_of(array)
    return rule.describe(array)


def check_same_context(owner, array, name: str, first, first_name: str) -> None:
    """Device array ``array`` of a call must live in the context of the call's ``first`` (both on
    ``owner``): a kernel reads buffers of its own context only, and an array of another (the same
    device, a second context) would be left waiting on an event of a foreign context, which OpenCL
    refuses at the array's next read.  A ``ValueError`` naming both, before any launch."""
    context, first_context = owner.arrays.queue_of(array).context, owner.arrays.queue_of(first).context
    if context != first_context:
        raise ValueError(f"{name} must be in the context of {first_name} on {owner.info.describe()}; it is in "
                         f"another context of that device ({context} against {first_context})")


def device_of(array):
    """The device that holds ``array`` (a device array of any backend, ``Backend.device_of_array``),
    or None for host memory (numpy arrays, CPU tensors) and what is no array."""
    rule = _RULES.get(type(array))
    if rule is None:
        try:
            rule = _rule_of(array)
        except TypeError:
            return None
    return rule.device(array)


@dataclasses.dataclass(frozen=True)
class _Rule:
    """How ``describe`` and ``device_of`` read one type of array."""

    describe: object
    device: object


def _numpy_description(array) -> tuple:
    return np.ndarray, array.shape, array.strides, array.dtype


def describe_tensor(tensor) -> tuple:
    """The description of a PyTorch tensor without its device, for ``pool_tuner.torch``'s paths
    (eager and custom op, CPU and CUDA), which key the device in the signature's ``device``:
    one form, so that a signature called both ways has one plan."""
    return type(tensor), tensor.shape, tensor.stride(), tensor.dtype


def _tensor_description(tensor) -> tuple:
    """``describe`` of a tensor: ``describe_tensor``'s and the device it lives on."""
    return (*describe_tensor(tensor), tensor.device)


def _queued_description(array) -> tuple:
    """A PyOpenCL array: its queue decides the device and the results' queue."""
    return type(array), array.shape, array.strides, array.dtype, array.queue


def _interface_description(array) -> tuple:
    return type(array), numpy_spec(array), backends.device_of_array(array)


def _host(array) -> None:
    return None


def _tensor_device(tensor):
    return None if tensor.device.type == "cpu" else backends.device_of_array(tensor)


def _rule_of(array) -> _Rule:
    """The rule of ``array``'s type (see ``describe``), kept for the type's later calls."""
    if isinstance(array, np.ndarray):
        rule = _Rule(_numpy_description, _host)
    elif type(array).__module__.startswith("torch") and callable(getattr(array, "stride", None)):
        rule = _Rule(_tensor_description, _tensor_device)
    elif getattr(array, "queue", None) is not None and hasattr(array, "strides"):
        rule = _Rule(_queued_description, backends.device_of_array)
    elif cuda_arrays.cuda_array_interface(array) is not None:
        rule = _Rule(_interface_description, backends.device_of_array)
    else:
        raise TypeError(f"{type(array).__name__} is not an array pool_tuner reads")
    _RULES[type(array)] = rule
    return rule


#: type -> its rule (``describe``, ``device_of``).
_RULES: dict = {np.ndarray: _Rule(_numpy_description, _host)}


def strides_layout(shape: tuple, strides: tuple, ndim: int) -> str | None:
    """The layout name of an array with ``shape`` and element ``strides``: contiguous
    channels-first (``NCHW``-like) or channels-last (``NHWC``-like), else None.  Axes of size 1
    may have any stride; ambiguous cases (one channel, empty arrays) count as contiguous."""
    contiguous, channels_last = LAYOUT_NAMES[ndim]
    if math.prod(shape) == 0 or same_strides(shape, strides, shapes.c_strides(shape, 1)):
        return contiguous
    c = len(shape) - ndim - 1
    if c < 0:
        return None
    memory = shape[:c] + shape[c + 1:] + (shape[c],)
    return channels_last if same_strides(shape, strides, last_axis_to(shapes.c_strides(memory, 1), c)) else None


def same_strides(shape, strides, expected) -> bool:
    """Whether element ``strides`` address the memory of ``expected`` (axes of size 1 may have any)."""
    return all(n == 1 or s == e for n, s, e in zip(shape, strides, expected))


def last_axis_to(sequence, axis: int) -> tuple:
    """Move the last entry of a shape or strides tuple to position ``axis``."""
    items = list(sequence)
    items.insert(axis, items.pop())
    return tuple(items)


def element_strides(problem: Problem, logical_shape) -> tuple:
    """Element strides of a logical (channels-first) array stored in ``problem``'s memory order."""
    strides = shapes.c_strides(problem.memory_shape(logical_shape), 1)
    if problem.channels_last:
        strides = last_axis_to(strides, len(logical_shape) - problem.ndim - 1)
    return strides


def check_device_option(owner, device, name: str) -> None:
    """A ``device=`` argument, when given, must be the device that holds array ``name``."""
    if device is not None and backends.resolve_device(device) is not owner:
        raise ValueError(
            f"device={device!r} does not hold {name}: {name} is an array on "
            f"{owner.info.describe()}; pass device=None or that device"
        )


def check_float64(device, dtype: str, name: str) -> None:
    if dtype == "float64" and not device.info.supports_float64:
        raise TypeError(f"{name} has dtype float64, which {device.info.describe()} does not support; use float32")


def result_fill(dtype: str, zero: bool):
    """What a new result of dtype ``dtype`` holds before its kernel runs: zeros for a result with
    nothing to compute (``zero``: a backward pass with no outputs), else nothing (None: left
    uninitialised).  Asked once per plan and result; the test suite replaces it to poison every
    result (``tests/poisoning.py``)."""
    return 0 if zero else None


@dataclasses.dataclass(frozen=True)
class Result:
    """One array a plan produces: logical (channels-first) shape, element strides, the shape of
    its memory (channels-last: channel axis last) and dtype name (``"int64"`` for indices, else
    the input's).  ``flat``: a multi-level op's buffer of every level (pool_tuner.pyramid), one
    axis in memory order, which the front ends view level by level."""

    shape: tuple
    strides: tuple
    memory_shape: tuple
    dtype: str
    flat: bool = False


class Plan:
    """Everything one call signature does, decided on its first call.

    * ``problem``, ``device``, ``choice``: what runs where, as ``dispatch`` decided;
    * ``reorder``: per input, whether it must first be copied into the problem's memory order
      (inputs in neither layout; indices in another layout than ``grad_out``);
    * ``results``: the arrays the call returns (``Result``), in order: values (and, for a max
      forward, indices), or the input gradient;
    * ``launch``: the built kernel and grid (``dispatch.Launch``), None when there is nothing to
      compute -- built by ``make_plan``, or at the first launch where it says so;
      ``zero_fill``: whether the result is all zeros instead (a backward pass with no
      outputs);
    * ``fills``: per result, what it is filled with when allocated, or None (``result_fill``);
    * ``scratch``: the scratch buffer of a variant of two passes (``Variant.second_pass``), as a
      flat int64 ``Result`` that each call allocates with the results, or None;
    * ``nbytes``: per input, then per result (then the scratch buffer), the bytes of its memory.

    Every hit is ``run``, with the front end's allocator: on memory given by address (numpy
    arrays and CPU tensors on host memory, CUDA tensors) through the device's ``prepare``d
    launch, or on the device's own arrays (``ops``' device arrays) through its ``launch``.
    """

    __slots__ = ("problem", "device", "choice", "reorder", "results", "_launch", "_build", "zero_fill", "fills",
                 "scratch", "nbytes", "_prepared")

    def __init__(self, problem: Problem, device, choice, reorder: tuple, results: tuple, build_target, context):
        self.problem, self.device, self.choice = problem, device, choice
        self.reorder, self.results = reorder, results
        self.zero_fill = problem.is_empty and not problem.flow.reads_input and math.prod(problem.input_shape) > 0
        self.fills = tuple(result_fill(r.dtype, self.zero_fill) for r in results)
        self._launch = None
        self._build = None if problem.is_empty else (build_target, context)
        values, positions = problem.operation.output_counts(problem.input_shape, problem.output_shape)
        first = math.prod(problem.input_shape) if problem.flow.reads_input else values
        sizes = [first * ELEMENT_BYTES[problem.dtype]]
        if problem.flow.reads_indices(problem.operation):
            sizes.append(positions * ELEMENT_BYTES["int64"])
        sizes += [math.prod(r.shape) * ELEMENT_BYTES[r.dtype] for r in results]
        scratch = 0 if self._build is None else choice.variant.scratch_bytes(choice.config, problem)
        self.scratch = None
        if scratch:
            words = -(-scratch // ELEMENT_BYTES["int64"])
            self.scratch = Result((words,), (1,), (words,), "int64", flat=True)
            sizes.append(words * ELEMENT_BYTES["int64"])
        self.nbytes = tuple(sizes)
        self._prepared = None

    @property
    def launch(self):
        """The built kernel and grid (``dispatch.Launch``), built on first use; None when there is
        nothing to compute."""
        build = self._build  # read once: another thread may finish the build meanwhile
        if build is not None:
            self._launch = dispatch.prepare(*build, self.problem, self.choice)
            self._build = None
        return self._launch

    def build(self) -> None:
        """Build the kernel now, so that a configuration that cannot launch fails here -- where the
        device's kernels run in this process: the host fallback's plans build nothing (a forked
        child's build could wait forever on a lock of the driver held in its parent)."""
        if self.device.info.host_fallback is None:
            self.launch  # noqa: B018

    def prepared_launch(self):
        """The device's ``prepare``d launch of ``launch`` (``run(stream, *addresses, scalars=)``), made on
        first use: where the device's kernels cannot run in this process (a forked child of a PoCL
        process), ``host_fallback``'s instead."""
        if self._prepared is None:
            if self.device.info.host_fallback is not None:
                self._prepared = host_fallback.HostFallback(self.problem, self.results, self.nbytes, self._n_inputs)
            else:
                self._prepared = self._prepare(self.launch)
        return self._prepared

    @property
    def _n_inputs(self) -> int:
        return len(self.nbytes) - len(self.results) - (self.scratch is not None)

    def _prepare(self, launch):
        """The device's prepared launch of ``launch``, or of its passes one after the other."""
        passes = [self.device.prepare(step, self.nbytes, self._n_inputs) for step in launch.passes()]
        return passes[0] if len(passes) == 1 else Passes(passes)

    def run(self, inputs: list, allocate, address, stream=None, scalars: tuple | None = None) -> list:
        """Run the plan: ``inputs`` in the problem's memory order (``reorder`` done),
        ``allocate(result, fill)`` the front end's allocator of one result (a ``Result`` and what
        it is filled with, ``fills``: numpy, ``torch.empty_strided``, the device's ``empty``, ...),
        ``address(array)`` an array's address; ``stream``: the raw stream handle a device launches
        on (None: host memory, the results written when this returns); ``scalars``: this call's
        run-time kernel arguments (``Problem.with_arguments``: GeM's p and eps), written into the
        prepared launch's scalar slots for this call (None: the launch's own).  ``address`` None:
        the inputs and results are the device's own arrays (``Device.empty``,
        ``CallerArrays.wrap_input``), launched on queue ``stream`` by the device's ``launch``, each
        array's waits including it (``CallerArrays.track``).  A variant of two passes gets its
        scratch buffer from ``allocate`` too.  Returns the results as ``allocate`` made them."""
        outputs = [allocate(result, fill) for result, fill in zip(self.results, self.fills)]
        if self._launch is None and self._build is None:
            return outputs
        scratch = [] if self.scratch is None else [allocate(self.scratch, None)]  # alive until launched
        if address is None:
            self._launch_on_arrays(stream, [*inputs, *outputs, *scratch], scalars)
            return outputs
        prepared = self._prepared or self.prepared_launch()
        prepared(stream, *map(address, [*inputs, *outputs, *scratch]), scalars=scalars)
        return outputs

    def _launch_on_arrays(self, queue, arrays: list, scalars: tuple | None) -> None:
        """Launch on device arrays (``run`` with no ``address``): a device array is a kernel
        argument itself, and names its own queue or stream, which the device's ``launch`` orders
        the kernel after; a variant's passes run in order on that queue."""
        device = self.device
        for step in self.launch.passes():
            handle = device.launch(queue, step.kernel, step.groups, step.block,
                                   [*arrays, *(step.scalars if scalars is None else scalars)])
        for array in arrays:
            device.arrays.track(array, handle)


class Passes:
    """The prepared launches of a variant's passes (``dispatch.Launch.passes``), called as one:
    each on the same addresses and run-time scalars, in order -- on one stream, or one after the
    other returning once done over host memory."""

    __slots__ = ("steps",)

    def __init__(self, steps: list):
        self.steps = tuple(steps)

    def __call__(self, stream, *addresses, scalars=None) -> None:
        for step in self.steps:
            step(stream, *addresses, scalars=scalars)


def make_plan(op: str, direction: str, specs: list, size, device, variant=None, config=None, *,
              on_miss=None, names=None, context=None, build_target=None, before_build=None, build=True) -> Plan:
    """Validate a call and plan it (see the module docstring).

    ``specs``: ``[x]`` (forward), ``[grad_out]`` or ``[grad_out, indices]`` (backward), as
    ``ArraySpec``s; ``size``: the output size (forward) or the input shape (backward) -- for a
    multi-level op's backward ``(input_shape, output_size, layout)``, its ``grad_out`` and
    ``indices`` being the flat buffers of every level (``multi_level_backward``); ``device``:
    the device it runs on (resolved by the caller); ``names``: the arguments' names as the caller
    wrote them, for error messages; ``context``: the context the kernel is built in (default: the
    device's default queue's); ``build_target``: what builds it, when not the device itself
    (``torch_cuda``'s driver-API target, which is its own context); ``before_build(problem)``: a
    last check of the caller's, once the problem is known and before anything is built;
    ``build``: whether the kernel is built now, so that a configuration that cannot launch fails
    here (False: at the plan's first launch, for a plan that may never launch one -- a forward
    that ``torch_cpu`` races against PyTorch's kernel).  Raises ``TypeError`` / ``ValueError``
    naming the argument before anything is built."""
    operation, flow = OPS[op], DIRECTIONS[direction]
    ndim = operation.ndim
    first = specs[0]
    name = (names or (flow.argument,))[0]
    dtype = check_dtype(first.dtype, f"{name}.dtype")
    check_float64(device, dtype, name)
    if operation.multi_level and not flow.reads_input:
        return _make_plan(*multi_level_backward(op, specs, size, dtype, name), device, variant, config, on_miss,
                          context, build_target, before_build, build)
    layout = strides_layout(first.shape, first.strides, ndim)
    reorder = [layout is None]
    layout = layout or LAYOUT_NAMES[ndim][0]
    if flow.reads_input:
        problem = Problem.create(op, first.shape, size, dtype, layout, shape_name=name)
        results = [problem.output_shape] + ([problem.output_shape] if operation.selects else [])
        if operation.multi_level:
            return _make_plan(problem, tuple(reorder), flat_results(problem), device, variant, config, on_miss,
                              context, build_target, before_build, build)
    else:
        if isinstance(size, (str, bytes)) or not hasattr(size, "__len__") or type(size).__module__ == "numpy":
            raise TypeError(f"input_shape must be a tuple of ints, got {type(size).__name__}")
        problem = backward_problem(op, first.shape, tuple(size), dtype, layout, name)
        results = [problem.input_shape]
        if operation.selects:
            reorder.append(_check_indices_spec(specs[1] if len(specs) > 1 else None, first, problem))
    results = tuple(Result(shape, element_strides(problem, shape), problem.memory_shape(shape), d)
                    for shape, d in zip(results, flow.result_dtypes(dtype)))
    return _make_plan(problem, tuple(reorder), results, device, variant, config, on_miss, context, build_target,
                      before_build, build)


def _make_plan(problem, reorder, results, device, variant, config, on_miss, context, build_target, before_build,
               build) -> Plan:
    """``make_plan`` once the problem, the inputs' reordering and the results are known."""
    if before_build is not None:
        before_build(problem)
    check_fits(problem, device)
    choice = dispatch.choose(problem, device, variant, config, on_miss=on_miss)
    if build_target is None:
        build_target = device
        if context is None and device.info.host_fallback is None:  # the host fallback's plans touch no queue
            context = device.queue.context
    plan = Plan(problem, device, choice, reorder, results, build_target, context)
    if build:
        plan.build()
    return plan


def flat_results(problem: Problem) -> tuple:
    """The results of a multi-level forward: the values of every level in one flat buffer, and a
    selecting op's indices in another (pool_tuner.pyramid)."""
    values, positions = problem.operation.output_counts(problem.input_shape, problem.output_shape)
    results = [Result((values,), (1,), (values,), problem.dtype, flat=True)]
    if problem.operation.selects:
        results.append(Result((positions,), (1,), (positions,), "int64", flat=True))
    return tuple(results)


def multi_level_backward(op: str, specs: list, size, dtype: str, name: str) -> tuple:
    """``(problem, reorder, results)`` of a multi-level backward call: ``size`` is ``(input_shape,
    output_size, layout)``; ``specs`` the flat gradient buffer of every level and, for a selecting
    op, the flat indices buffer, each checked against the problem."""
    if not isinstance(size, tuple) or len(size) != 3:
        raise TypeError(f"a multi-level backward plan takes (input_shape, output_size, layout), got {size!r}")
    input_shape, output_size, layout = size
    problem = Problem.create(op, input_shape, output_size, dtype, layout, direction="backward",
                             shape_name="input_shape")
    values, positions = problem.operation.output_counts(problem.input_shape, problem.output_shape)
    expected = [(name, values, dtype)] + ([("indices", positions, "int64")] if problem.operation.selects else [])
    if len(specs) < len(expected) or specs[-1] is None:
        raise TypeError("indices must be the int64 indices of the forward pass")
    for spec, (label, count, wanted) in zip(specs, expected):
        if tuple(spec.shape) != (count,) or spec.strides not in ((1,), (None,)) and count > 1:
            raise ValueError(f"{label} must be the flat buffer of every level ({count} elements), got shape "
                             f"{tuple(spec.shape)}")
        if check_dtype_name(spec.dtype) != wanted and (wanted == "int64" or check_dtype(spec.dtype) != wanted):
            raise TypeError(f"{label} must have dtype {wanted}, got {spec.dtype}")
    results = (Result(problem.input_shape, element_strides(problem, problem.input_shape),
                      problem.memory_shape(problem.input_shape), dtype),)
    return problem, (False,) * len(expected), results


def backward_problem(op: str, grad_shape: tuple, input_shape: tuple, dtype: str, layout: str, name="grad_out") -> Problem:
    """The problem of a backward call: ``input_shape`` checked, and ``grad_out``'s shape against it."""
    ndim = OPS[op].ndim
    batch, spatial = shapes.split_input_shape(input_shape, ndim, "input_shape")
    grad_shape = tuple(grad_shape)
    if len(grad_shape) != len(batch) + ndim:  # which of the two is wrong cannot be known: name both
        raise ValueError(f"input_shape {tuple(input_shape)} has {len(batch) + ndim} dimensions and {name} "
                         f"{grad_shape} has {len(grad_shape)}; both must be {shapes.RANK_NAMES[ndim]} alike, the "
                         f"input_shape being the forward input's shape")
    if grad_shape[: len(batch)] != batch:
        raise ValueError(
            f"{name} must have shape {batch} + ({ndim} output sizes) to match input_shape "
            f"{tuple(input_shape)}, got {grad_shape}"
        )
    return Problem.create(op, batch + spatial, grad_shape[len(batch):], dtype, layout, direction="backward",
                          shape_name="input_shape")


def _check_indices_spec(indices: ArraySpec | None, grad_out: ArraySpec, problem: Problem) -> bool:
    """Max backward's ``indices``: int64 and of ``grad_out``'s shape, as the forward pass returns
    them.  Returns whether they must be reordered into the problem's layout first."""
    if indices is None:
        raise TypeError("indices must be the int64 indices returned by adaptive_max_pool*d(..., return_indices=True)")
    try:
        is_int64 = check_dtype_name(indices.dtype) == "int64"
    except TypeError:
        is_int64 = False
    if not is_int64:
        raise TypeError(f"indices must have dtype int64, got {indices.dtype}")
    if tuple(indices.shape) != tuple(grad_out.shape):
        raise ValueError(f"indices must have the shape of grad_out {tuple(grad_out.shape)}, got {tuple(indices.shape)}")
    return strides_layout(indices.shape, indices.strides, problem.ndim) != problem.layout


def check_dtype_name(dtype) -> str:
    """The name of a numpy or torch dtype (``torch.int64`` -> ``"int64"``), or of a dtype named as
    ``tensor_spec`` names it (``"bfloat16"``, which numpy does not know)."""
    text = str(dtype)
    if text.startswith("torch."):
        return text[len("torch."):]
    if isinstance(dtype, str) and dtype in ELEMENT_BYTES:
        return dtype
    try:
        return np.dtype(dtype).name
    except TypeError:
        raise TypeError(f"unknown dtype {dtype!r}") from None


class PlanTable:
    """A front end's plans by signature: a ``memo`` table, each plan filed under its problem (so
    it is bounded by the one memo limit and leaves with the problem's built kernel), emptied
    with dispatch's decisions (``dispatch.forget``: after tuning, or a change of cache directory)
    since a plan holds one.  Hits use ``get``, which keeps the problem recent: a warm call skips
    ``dispatch.choose``."""

    def __init__(self, name: str):
        self._table = memo.table(name)
        dispatch.register_dependent_memo(self._table)

    def get(self, key):
        """The plan of signature ``key``, or None (also for an unhashable ``key``)."""
        try:
            return self._table.get(key)
        except TypeError:
            return None

    def put(self, key, plan):
        """Keep ``plan`` (anything with a ``problem``) for ``key``, unless ``key`` is unhashable
        (such arguments are validated and planned on every call); returns ``plan``."""
        try:
            hash(key)
        except TypeError:
            return plan
        return self._table.put(plan.problem, key, plan)

    def clear(self) -> None:
        self._table.clear()

    def values(self) -> list:
        return self._table.values()

    def __len__(self):
        return len(self._table)
