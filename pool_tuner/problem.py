"""A pooling problem: everything about one call that selects and specialises a kernel.

``Problem`` is hashable and compact; it keys the in-memory dispatch tables and (with the device and
kernel sources) the tuning cache, and its ``kernel_key`` -- the problem without its batch extent --
keys the built kernels.  It also derives what every template receives: as ``#define``s the channel
count, the 3-axis input/output sizes (1d and 2d padded with leading size-1 axes), the dtype and the
index width; as run-time ``scalars`` the plane count, so that a new batch size needs no new build.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from . import shapes
from .operations import DIRECTIONS as DIRECTION_OBJECTS
from .operations import OPERATIONS, Operation
from .windows import fixed_pool_equivalent, max_window

#: op name -> its ``operations.Operation``
OPS = OPERATIONS
DIRECTIONS = tuple(DIRECTION_OBJECTS)
#: Storage dtypes and their kernel defines; float16/bfloat16 accumulate in float32.
DTYPES = {
    "float32": "DTYPE_FLOAT32",
    "float64": "DTYPE_FLOAT64",
    "float16": "DTYPE_FLOAT16",
    "bfloat16": "DTYPE_BFLOAT16",
}
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}
#: Bytes per element of every array a call holds: the dtypes, and int64 indices.
ELEMENT_BYTES = {**ITEMSIZE, "int64": 8}
#: Memory layouts by rank: contiguous channels-first, and channels-last.
LAYOUT_NAMES = {1: ("NCL", "NLC"), 2: ("NCHW", "NHWC"), 3: ("NCDHW", "NDHWC")}
INT32_LIMIT = 2**31 - 1
#: Work-items may run past the last output by up to one work-group's worth of outputs (at most
#: 1024 threads x 8 outputs each); a 32-bit launch keeps this much headroom below 2^31.
OVERSHOOT_MARGIN = 1 << 16
#: The problem classes (``Problem.problem_class``), in the order their rules are tried.
PROBLEM_CLASSES = ("pyramid", "upsampling", "global", "uniform", "non-uniform")


def check_op(op, direction: str = "forward") -> Operation:
    """The operation named ``op``, after checking ``op`` and ``direction``."""
    if not isinstance(op, str) or op not in OPS:
        raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    return OPS[op]


def check_dtype(dtype, name: str = "dtype") -> str:
    """Canonical dtype name; ``"bfloat16"`` is accepted by name and as ``ml_dtypes.bfloat16``."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return dtype
    try:
        numpy_dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be one of {sorted(DTYPES)}, got {dtype!r}") from None
    canonical = numpy_dtype.name
    if not numpy_dtype.isnative:  # the kernels read native-order bytes
        raise TypeError(f"{name} must be in native byte order, got {numpy_dtype.str}; convert with "
                        f".astype({canonical!r})")
    if canonical not in DTYPES:
        raise TypeError(f"{name} must be one of {sorted(DTYPES)}, got {canonical}")
    return canonical


def check_layout(layout, ndim: int, name: str = "layout") -> str:
    if layout not in LAYOUT_NAMES[ndim]:
        contiguous, channels_last = LAYOUT_NAMES[ndim]
        raise ValueError(
            f"{name} must be {contiguous!r} (contiguous) or {channels_last!r} (channels-last) for "
            f"{ndim}d pooling, got {layout!r}"
        )
    return layout


@dataclasses.dataclass(frozen=True)
class Problem:
    op: str
    direction: str
    dtype: str
    layout: str
    input_shape: tuple
    output_shape: tuple

    def __post_init__(self):
        # Derived once, when the problem is made, as plain attributes (not fields: equality, hash,
        # pickling and ``dataclasses.fields`` see only the six above).  A problem is consulted
        # several times on every call's path and hashed as a key of the dispatch memos, where each
        # property call or tuple hash costs microseconds with the cold caches after a blocking wait.
        # ``operation`` and ``flow`` are the op and the direction as objects (pool_tuner.operations).
        operation = check_op(self.op, self.direction)
        object.__setattr__(self, "operation", operation)
        object.__setattr__(self, "flow", DIRECTION_OBJECTS[self.direction])
        object.__setattr__(self, "kind", operation.kind)
        object.__setattr__(self, "ndim", operation.ndim)
        ndim = operation.ndim
        object.__setattr__(self, "channels_last", self.layout == LAYOUT_NAMES[ndim][1])
        # Every level's pooled sizes padded to 3 axes (T, H, W); one level for single-level ops.
        object.__setattr__(self, "levels", tuple((1,) * (3 - ndim) + tuple(spatial) for spatial in
                                                 operation.levels_of(self.input_shape, self.output_shape)))
        object.__setattr__(self, "_hash", hash((self.op, self.direction, self.dtype, self.layout,
                                                 self.input_shape, self.output_shape)))

    def __hash__(self):
        return self._hash

    def __reduce__(self):
        """Pickle the six fields only: the hash of strings differs between processes."""
        return (Problem, (self.op, self.direction, self.dtype, self.layout, self.input_shape, self.output_shape))

    @classmethod
    def create(cls, op, input_shape, output_size, dtype="float32", layout=None, direction="forward", shape_name="input_shape"):
        """Validate every argument and build the problem (raises before anything is compiled)."""
        operation = check_op(op, direction)
        ndim = operation.ndim
        dtype = check_dtype(dtype)
        layout = check_layout(LAYOUT_NAMES[ndim][0] if layout is None else layout, ndim)
        batch, spatial = shapes.split_input_shape(input_shape, ndim, shape_name)
        if not operation.multi_level:
            return cls(op, direction, dtype, layout, batch + spatial, batch + shapes.resolve_output_size(output_size, spatial))
        levels = operation.resolve_levels(output_size, spatial, "output_sizes" if operation.pyramid else "output_size")
        return cls(op, direction, dtype, layout, batch + spatial, operation.output_shape(batch, levels))

    @property
    def output_size(self) -> tuple:
        """The ``output_size`` argument of ``create`` that made this problem."""
        return self.operation.output_size_of(self.input_shape, self.output_shape)

    @property
    def planes(self) -> int:
        return math.prod(self.input_shape[: -self.ndim])

    @property
    def channels(self) -> int:
        return self.input_shape[-self.ndim - 1]

    def memory_shape(self, logical_shape) -> tuple:
        """The shape of ``logical_shape`` (channels-first) in this problem's memory order."""
        if not self.channels_last:
            return tuple(logical_shape)
        c = len(logical_shape) - self.ndim - 1
        return tuple(logical_shape[:c]) + tuple(logical_shape[c + 1:]) + (logical_shape[c],)

    @property
    def in_spatial(self) -> tuple:
        """Pooled input sizes padded to 3 axes (T, H, W)."""
        return (1,) * (3 - self.ndim) + tuple(self.input_shape[-self.ndim :])

    @property
    def out_spatial(self) -> tuple:
        """Pooled output sizes padded to 3 axes (T, H, W); a multi-level op's first level (see ``levels``)."""
        return self.levels[0]

    @property
    def is_empty(self) -> bool:
        return self.operation.output_counts(self.input_shape, self.output_shape)[0] == 0

    @functools.cached_property
    def problem_class(self) -> str:
        """Which kind of pooling this is, by the shape of its windows -- the one rule that dispatch's
        nearest-shape search, ``explain`` and ``cache show`` read (design.md, Dispatch):

        * ``upsampling``: some pooled output extent exceeds its input extent (windows repeat inputs);
        * ``global``: every pooled output extent is 1 (a plane reduces to one value);
        * ``uniform``: downsampling in which every pooled axis has a fixed-pool equivalent (one window
          size and stride, so kernels get them as constants; an empty axis has no windows to differ);
        * ``non-uniform``: the remaining downsampling, whose windows differ in size or overlap;
        * ``pyramid``: a multi-level op (several output sizes, pool_tuner.pyramid), whose kernels
          are its own.

        Kernels take different paths for these (per-plane reductions, constant-size unrolled
        windows, variable windows, repeated inputs), so a configuration tuned for one class says
        little about another, whatever the sizes.  Computed once per problem, on first use.
        """
        if self.operation.multi_level:
            return "pyramid"
        axes = list(zip(self.input_shape[-self.ndim:], self.output_shape[-self.ndim:]))
        if any(o > i for i, o in axes):
            return "upsampling"
        if all(o == 1 for _, o in axes):
            return "global"
        if all(o == 0 or fixed_pool_equivalent(i, o) is not None for i, o in axes):
            return "uniform"
        return "non-uniform"

    @functools.cached_property
    def speed_features(self) -> tuple:
        """What decides a kernel's speed within a problem class, as positive numbers: the largest
        window along each pooled axis, the input and the output plane sizes, the number of planes
        and the bytes an ideal kernel moves.  Dispatch's nearest-shape distance compares the logs
        of these (design.md, Dispatch), so doubling any one of them counts the same."""
        ins = self.input_shape[-self.ndim:]
        levels = [level[3 - self.ndim:] for level in self.levels]
        windows = tuple(max(max_window(i, level[axis]) for level in levels) for axis, i in enumerate(ins))
        outs = sum(math.prod(level) for level in levels)
        return (*windows, math.prod(ins), outs, self.planes, self.bytes_moved())

    @property
    def index_64(self) -> bool:
        """Whether 32-bit offsets could overflow: element counts, or the window products
        ``(o + 1) * I`` and ``(i + 1) * O`` of any axis, near 2^31."""
        limit = INT32_LIMIT - OVERSHOOT_MARGIN
        outputs = self.operation.output_counts(self.input_shape, self.output_shape)[0]
        if math.prod(self.input_shape) > limit or outputs > limit:
            return True
        return any((i + 1) * (o + 1) > limit for level in self.levels for i, o in zip(self.in_spatial, level))

    @property
    def kernel_key(self) -> tuple:
        """What a built kernel of this problem depends on (with the variant and its configuration):
        the problem without its batch extent, which reaches kernels at run time (``scalars``), plus
        the index width, which the batch extent can change.  Problems with equal keys have equal
        ``defines``, so every batch size of a per-sample shape shares one build."""
        return (self.op, self.direction, self.dtype, self.layout, self.channels,
                self.in_spatial, self.levels, self.index_64)

    @property
    def scalars(self) -> tuple:
        """The run-time arguments every kernel takes after its buffers (``PLANES_PARAM`` in
        kernels/prelude.h): the plane count, as the 64-bit integer the kernels declare; then, for
        the forward kernels of an op whose operator has run-time arguments (GeM's ``p``, ``eps``),
        their defaults (``with_arguments`` puts a call's own values in their place)."""
        return self.with_arguments(dict(self.operation.arguments))

    def with_arguments(self, values: dict) -> tuple:
        """``scalars`` with the operator's run-time arguments of ``values`` (name -> number), in the
        kernels' accumulation type (float64 for float64, else float32)."""
        planes = (np.int64(self.planes),)
        if not self.flow.reads_input:
            return planes
        acc = np.float64 if self.dtype == "float64" else np.float32
        return planes + tuple(acc(values[name]) for name, _ in self.operation.arguments)

    def arguments_of(self, scalars: tuple | None) -> dict:
        """The operator's run-time arguments (name -> float) that ``scalars`` (``with_arguments``'
        form; None: ``scalars``, their defaults) pass."""
        values = scalars[1:] if scalars is not None and self.flow.reads_input else ()
        return {name: float(value) for (name, _), value in zip(self.operation.arguments, values)}

    def defines(self) -> dict:
        """The per-sample shape, dtype and index-width ``#define``s every template receives.  The
        plane count is not one of them (``scalars``): sizes are defines so that divisions by them
        become multiply-shifts, and the planes, the outermost extent, are never a divisor.  The
        channel count is one only in channels-last memory, the one layout whose addressing divides
        by it (``kernels/windows.h``): channels-first problems that differ only in their channels
        (a model's squeeze-excitation blocks at one resolution) share one program."""
        (it, ih, iw), (ot, oh, ow) = self.in_spatial, self.out_spatial
        common = {
            DTYPES[self.dtype]: 1,
            "INDEX_64": int(self.index_64),
            **self.operation.kernel_defines(),
            "CHANNELS_LAST": int(self.channels_last),
            **({"N_CHANNELS": self.channels} if self.channels_last else {}),
            "IN_T": it, "IN_H": ih, "IN_W": iw,
        }
        uniform = {}
        for axis, i, o in zip("THW", self.in_spatial, self.out_spatial):
            fixed = fixed_pool_equivalent(i, o) if o else None
            uniform[f"UNIFORM_{axis}"] = int(fixed is not None)
            if fixed is not None:
                uniform[f"KERNEL_{axis}"], uniform[f"STRIDE_{axis}"] = fixed[0], fixed[1]
            # The longest window: the box that the small-window path of the forward kernel unrolls.
            # A uniform axis's box must be exactly its kernel (its taps are not clamped), and past
            # EXACT_MAX_WINDOW_LIMIT outputs max_window is only a bound.
            uniform[f"MAX_WINDOW_{axis}"] = fixed[0] if fixed is not None else max_window(i, o) if o else 0
            # The most outputs that pool one input: at 1 the gather loops of the axis vanish
            # (INVERSE_COUNT in windows.h).
            uniform[f"MAX_INVERSE_WINDOW_{axis}"] = max_window(o, i) if o else 0
        defines = {**common, "OUT_T": ot, "OUT_H": oh, "OUT_W": ow, **uniform}
        if self.operation.multi_level:
            # The shared headers see the first level (``out_spatial``); the pyramid kernels read
            # every level from these tables (kernels/pyramid.h).
            from . import pyramid

            defines.update(pyramid.kernel_defines(self))
        return defines

    def bytes_read_written(self) -> tuple[int, int]:
        """``(bytes read, bytes written)`` by an ideal kernel (``Operation.bytes_read_written``)."""
        return self.operation.bytes_read_written(self.direction, self.input_shape, self.output_shape,
                                                 ITEMSIZE[self.dtype])

    def bytes_moved(self) -> int:
        """Bytes read plus bytes written by an ideal kernel: the bandwidth floor's numerator."""
        return sum(self.bytes_read_written())


def check_fits(problem: Problem, device, names=("output_size", "input_shape")) -> None:
    """The results of ``problem`` must fit ``device``: each in one allocation, all in its memory.
    Checked before anything is sized by the output (window tables, buffers), so that a mistyped
    size (``output_size=(2**31 - 1, 1)``) is a ``ValueError`` naming the argument instead of an
    allocation failure deep inside numpy or the driver.  ``names``: the argument that sizes a
    forward's results and a backward's, as the caller spells them."""
    itemsize = ELEMENT_BYTES[problem.dtype]
    if problem.flow.reads_input:
        values, positions = problem.operation.output_counts(problem.input_shape, problem.output_shape)
        parts, name = [values * itemsize, positions * ELEMENT_BYTES["int64"]], names[0]
        what = f"an output of shape {problem.output_shape}"
    else:
        parts, name = [math.prod(problem.input_shape) * itemsize], names[1]
        what = f"an input gradient of shape {problem.input_shape}"
    info = device.info
    if max(parts) > info.max_allocation_bytes or sum(parts) > info.memory_bytes:
        raise ValueError(f"{name} gives {what} ({_gib(sum(parts))}), more than {info.describe()} can hold "
                         f"({_gib(info.max_allocation_bytes)} in one buffer, {_gib(info.memory_bytes)} in all); "
                         f"check {name}")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3g} GiB"
