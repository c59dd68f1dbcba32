"""The public pooling ops as objects: what each op is, in one definition that every module reads.

An ``Operation`` says what the kernels, the reference, dispatch, the tuner and the PyTorch glue
need to know of an op -- its kind (``avg``, ``max``, ``avgmax``), its rank, whether it selects
(keeps one element of each window, and so has a position per output), whether it returns those
positions as indices, how many levels (results) it has and the bytes an ideal kernel moves -- so
that no module tests an op's name.  Its float64 reference is ``pool_tuner.reference.forward`` /
``backward``, which read these same attributes (the reference sits above this module, so that the
op table imports nothing of it).  ``OPERATIONS`` maps each public name
(``"adaptive_avg_pool2d"``) to its operation.

A ``Direction`` (``FORWARD``, ``BACKWARD``; ``DIRECTIONS`` by name) says what a pass of an op
reads and writes and what its functions are called, so that no module tests a direction's name
either: a problem's ``flow`` is its direction (``Problem.direction`` stays the name, which keys
the cache).  ``FUNCTIONS`` maps every per-rank function name, forward and backward
(``"adaptive_max_pool2d_backward"``), to its operation and direction.

Multi-level ops pool one input to several output sizes in one pass (pool_tuner.pyramid):
``adaptive_{avg,max}_pool_pyramid{1,2,3}d`` take a list of output sizes, one level each;
``adaptive_avgmax_pool2d`` takes one output size and has two levels of it, an average and a max.
Their ``Problem.output_shape`` is the batch dimensions followed by every level's pooled sizes in
turn, so that a problem stays six plain fields (and a cache record's shapes stay lists of ints).
"""

from __future__ import annotations

import dataclasses
import math

#: The pooling kinds and the kernel defines of each (kernels/operators.h): avgmax is the max
#: operator with the window sums kept beside it (ALSO_MEAN, kernels/pyramid.h); gem is the
#: generalized mean, whose operator is a header of its own (``OPERATOR_HEADERS``).
KINDS = {"avg": {"POOL_AVG": 1}, "max": {"POOL_MAX": 1}, "avgmax": {"POOL_MAX": 1, "ALSO_MEAN": 1},
         "gem": {"POOL_GEM": 1}}
#: The header (under ``kernels/``) that defines each kind's operator, where it is not
#: operators.h: a new op brings its operator in a header only its own programs include, so that
#: the programs of the other ops -- and the kernel hashes of their tuning records -- stay as they were.
OPERATOR_HEADERS = {"gem": "operators/gem.h"}
#: Run-time arguments of a kind's operator: ``(name, default)`` pairs, passed to its kernels after
#: the plane count (``Problem.scalars``) in the accumulation type, so that a new value (a learnt
#: exponent changes every training step) needs no new build.
KIND_ARGUMENTS = {"gem": (("p", 3.0), ("eps", 1e-6))}
#: The kind whose default rules (pool_tuner/default_rules.json) a kind follows, where it has none
#: of its own: GeM is an accumulating reduction with avg's memory traffic.
RULES_KIND = {"gem": "avg"}
#: The kernel a kind's backward pass runs instead of the backward variants, where it has one of its
#: own, and its one configuration: GeM's input gradient (pool_tuner/gem.py) takes the outputs'
#: coefficients and x, not the output's gradient that the variants route -- ``block_size_x``
#: work-items, each taking ``items_per_thread`` inputs ``block_size_x`` apart.
OWN_BACKWARD_KERNELS = {"gem": ("gem_input_gradient", {"block_size_x": 256, "items_per_thread": 1})}
RANKS = (1, 2, 3)
#: Bytes of one index (int64) of a selecting op.
INDEX_BYTES = 8


@dataclasses.dataclass(frozen=True)
class Operation:
    """One public pooling op: ``name`` (its public function's name), ``kind``, ``ndim`` (the
    number of pooled trailing axes) and ``pyramid`` (whether it takes a list of output sizes)."""

    name: str
    kind: str
    ndim: int
    pyramid: bool = False

    def __iter__(self):
        """An operation also unpacks as ``(kind, ndim)``, the form the op table had before it held
        operations (``kind, ndim = OPS[op]``, ``OPS[op][1]``)."""
        return iter((self.kind, self.ndim))

    def __getitem__(self, index):
        return (self.kind, self.ndim)[index]

    @property
    def selects(self) -> bool:
        """Whether some output is one element of its window (max), which also has a position: the
        forward pass writes it, the backward pass routes the output's gradient to it alone."""
        return self.kind in ("max", "avgmax")

    @property
    def operator_header(self) -> str:
        """The kernel header (under ``kernels/``) that defines this op's operator."""
        return OPERATOR_HEADERS.get(self.kind, "operators.h")

    @property
    def arguments(self) -> tuple:
        """The operator's run-time arguments as ``(name, default)`` pairs (GeM: ``p``, ``eps``);
        empty for ops that have none."""
        return KIND_ARGUMENTS.get(self.kind, ())

    @property
    def backward_kernel(self) -> str | None:
        """The kernel this op's backward pass runs instead of the backward variants
        (``OWN_BACKWARD_KERNELS``), or None: the op's backward is dispatched among the variants."""
        found = OWN_BACKWARD_KERNELS.get(self.kind)
        return None if found is None else found[0]

    @property
    def backward_kernel_config(self) -> dict | None:
        """The one configuration of ``backward_kernel`` (a copy), or None where there is none."""
        found = OWN_BACKWARD_KERNELS.get(self.kind)
        return None if found is None else dict(found[1])

    @property
    def rules_kind(self) -> str:
        """The kind whose default rules dispatch this op (``RULES_KIND``; else its own)."""
        return RULES_KIND.get(self.kind, self.kind)

    @property
    def in_pytorch(self) -> bool:
        """Whether ``torch.nn.functional`` has this op by its name (PyTorch has no GeM)."""
        return not self.arguments and not self.multi_level

    @property
    def returns_indices(self) -> bool:
        """Whether the public function can return the selected positions (``return_indices``);
        avgmax keeps them for its backward pass only."""
        return self.kind == "max"

    @property
    def multi_level(self) -> bool:
        """Whether one call gives several results (levels) from one pass over the input."""
        return self.pyramid or self.kind == "avgmax"

    @property
    def function_name(self) -> str:
        """The public function that runs this op, ``pool_tuner.<function_name>(x, output_size)``: a
        pyramid's rank is taken from its input, so the pyramids of every rank share one."""
        return f"adaptive_{self.kind}_pool_pyramid" if self.pyramid else self.name

    @property
    def aten_backward(self) -> str:
        """The name of ATen's backward op of this single-level op (``torch.ops.aten``), PyTorch's
        own gradient kernel: ATen's average one is private (``_adaptive_avg_pool2d_backward``)."""
        return ("_" if not self.selects else "") + BACKWARD.op_name(self)

    @property
    def fixed_pool(self) -> str:
        """The name of ``torch.nn.functional``'s fixed-window pooling of this single-level op's
        kind and rank (``avg_pool2d``): what a pooled axis with one window size and stride is."""
        return f"{self.kind}_pool{self.ndim}d"

    @property
    def fx_names(self) -> tuple:
        """The names under which torch.fx records ``torch.nn.functional``'s form of this
        single-level op: a max pooling's form dispatches to ``_adaptive_max_pool2d`` where it
        returns no indices."""
        return (self.name, "_" + self.name) if self.returns_indices else (self.name,)

    def level_ops(self, levels: int) -> tuple:
        """The single-level operation that each of ``levels`` levels is (a single-level op: itself):
        a multi-level op's level is exactly that op applied to the input at the level's size."""
        kinds = ("avg", "max") if self.kind == "avgmax" else (self.kind,) * levels
        return tuple(find(kind, self.ndim) for kind in kinds)

    def level_kinds(self, levels: int) -> tuple:
        """The kind (``avg`` or ``max``) of each of ``levels`` levels."""
        return tuple(level.kind for level in self.level_ops(levels))

    @property
    def selecting_level(self) -> "Operation":
        """The single-level selecting op of this rank (max pooling): what the indices of a
        multi-level op's max levels are the indices of."""
        return find("max", self.ndim)

    @property
    def also_mean(self) -> bool:
        """Whether the kernels keep each window's sum beside its selection (avgmax's average
        level, ``ALSO_MEAN``)."""
        return "ALSO_MEAN" in KINDS[self.kind]

    @property
    def description(self) -> str:
        """What the op computes, in words (``"average"``, ``"max"``, ``"average and max"``)."""
        return {"avg": "average", "max": "max", "avgmax": "average and max",
                "gem": "generalized-mean (GeM)"}[self.kind]

    def resolve_levels(self, output_size, in_spatial: tuple, name: str = "output_size") -> tuple:
        """The pooled sizes of every level, from a call's ``output_size`` (a pyramid's: a
        non-empty sequence of output sizes, each an int or ``ndim`` ints/None)."""
        from .shapes import resolve_output_size

        if not self.pyramid:
            spatial = resolve_output_size(output_size, in_spatial, name)
            return (spatial,) * len(self.level_kinds(1))
        if isinstance(output_size, (str, bytes, bytearray)) or not hasattr(output_size, "__len__"):
            raise TypeError(f"{name} must be a non-empty sequence of output sizes (each an int or "
                            f"{self.ndim} ints/None), got {type(output_size).__name__} {output_size!r}")
        if len(output_size) == 0:
            raise ValueError(f"{name} must hold at least one output size, got {output_size!r}")
        return tuple(resolve_output_size(size, in_spatial, f"{name}[{level}]") for level, size in enumerate(output_size))

    def output_shape(self, batch: tuple, levels: tuple) -> tuple:
        """The problem's ``output_shape``: the batch dimensions, then each distinct result size
        (avgmax's two levels share one)."""
        return tuple(batch) + tuple(n for spatial in (levels if self.pyramid else levels[:1]) for n in spatial)

    def levels_of(self, input_shape, output_shape) -> tuple:
        """The pooled sizes of every level of a problem (``output_shape``'s inverse)."""
        tail = tuple(output_shape[len(input_shape) - self.ndim:])
        if not self.pyramid:
            return (tail,) * len(self.level_kinds(1))
        return tuple(tail[k:k + self.ndim] for k in range(0, len(tail), self.ndim))

    def output_size_of(self, input_shape, output_shape):
        """The ``output_size`` argument that gives ``output_shape`` from ``input_shape``: what a
        cache record's shapes mean as a call."""
        if self.pyramid:
            return list(self.levels_of(input_shape, output_shape))
        return tuple(output_shape[len(input_shape) - self.ndim:])

    def kernel_defines(self) -> dict:
        """The ``#define``s that make kernels/operators.h this op's operator."""
        return dict(KINDS[self.kind])

    # ------------------------------------------------------------------ traffic

    def output_counts(self, input_shape, output_shape) -> tuple[int, int]:
        """``(values, indices)``: how many output values every level has together, and how many
        of them are positions of a max level (the int64 indices written beside them)."""
        batch = math.prod(input_shape[:len(input_shape) - self.ndim])
        levels = self.levels_of(input_shape, output_shape)
        sizes = [batch * math.prod(spatial) for spatial in levels]
        return sum(sizes), sum(n for n, level in zip(sizes, self.level_ops(len(levels))) if level.selects)

    def bytes_read_written(self, direction: str, input_shape, output_shape, itemsize: int) -> tuple[int, int]:
        """``(bytes read, bytes written)`` by an ideal kernel.  Forward reads the input and writes
        the outputs of every level (a max level also its int64 indices); backward reads the
        output gradients (and the indices) and writes the input gradient once."""
        values, positions = self.output_counts(input_shape, output_shape)
        inputs, outputs = math.prod(input_shape) * itemsize, values * itemsize
        return DIRECTIONS[direction].read_written(inputs, outputs + positions * INDEX_BYTES)


@dataclasses.dataclass(frozen=True)
class Direction:
    """One pass of an op: ``forward`` pools the input into the outputs (and a selecting op's
    indices); ``backward`` routes the output gradients (through those indices) into the input's
    gradient.  Its attributes are what the front ends, plans and tools ask of a pass."""

    name: str
    #: Whether the pass reads the op's input (forward) rather than its outputs' gradients.
    reads_input: bool
    #: The name public functions give the array the pass reads first (``x``, ``grad_out``).
    argument: str
    #: PyTorch's name of that argument (``torch.nn.functional``'s ``input``; ``grad_out``).
    torch_argument: str
    #: What the name of the pass's function adds to its op's name.
    suffix: str

    def op_name(self, operation: Operation) -> str:
        """The per-rank name of this pass of ``operation``: the ``pool_tuner.ops`` function and
        ``torch.ops.pool_tuner`` custom op (``adaptive_max_pool2d_backward``)."""
        return operation.name + self.suffix

    def reads_indices(self, operation: Operation) -> bool:
        """Whether the pass takes the selected positions as an input (a selecting op's backward)."""
        return operation.selects and not self.reads_input

    def result_dtypes(self, dtype: str) -> list:
        """The dtypes of the pass's results, in order: the values (or the input's gradient), then
        a forward's int64 positions (which a non-selecting op does not return)."""
        return [dtype, "int64"] if self.reads_input else [dtype]

    def read_written(self, input_side: int, output_side: int) -> tuple:
        """``(read, written)`` of a pass from the sizes of the op's two sides: forward reads the
        input side and writes the output side, backward the reverse."""
        return (input_side, output_side) if self.reads_input else (output_side, input_side)


FORWARD = Direction("forward", reads_input=True, argument="x", torch_argument="input", suffix="")
BACKWARD = Direction("backward", reads_input=False, argument="grad_out", torch_argument="grad_out",
                     suffix="_backward")
DIRECTIONS = {direction.name: direction for direction in (FORWARD, BACKWARD)}


def _all() -> dict:
    ops = [Operation(f"adaptive_{kind}_pool{ndim}d", kind, ndim) for kind in ("avg", "max") for ndim in RANKS]
    ops += [Operation(f"adaptive_{kind}_pool_pyramid{ndim}d", kind, ndim, pyramid=True)
            for kind in ("avg", "max") for ndim in RANKS]
    ops.append(Operation("adaptive_avgmax_pool2d", "avgmax", 2))
    ops += [Operation(f"adaptive_gem_pool{ndim}d", "gem", ndim) for ndim in RANKS]
    return {op.name: op for op in ops}


OPERATIONS = _all()
_BY_KIND = {(op.kind, op.ndim, op.pyramid): op for op in OPERATIONS.values()}


def find(kind: str, ndim: int, pyramid: bool = False) -> Operation:
    """The operation of ``kind`` pooling ``ndim`` axes (a pyramid: of a list of output sizes)."""
    return _BY_KIND[(kind, ndim, pyramid)]


#: Every per-rank function name of every op and direction -> ``(operation, direction)``.
FUNCTIONS = {direction.op_name(op): (op, direction) for op in OPERATIONS.values() for direction in DIRECTIONS.values()}
#: The single-level ops that are PyTorch's own (``torch.nn.functional`` has each by this name).
SINGLE_LEVEL = tuple(name for name, op in OPERATIONS.items() if op.in_pytorch)
