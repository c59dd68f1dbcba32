"""The public pooling ops as objects: what each op is, in one definition that every module reads.

An ``Operation`` says what the kernels, the reference, dispatch, the tuner and the PyTorch glue
need to know of an op -- its kind (``avg``, ``max``), its rank, whether it selects (keeps one
element of each window, and so has a position per output), whether it returns those positions as
indices and the bytes an ideal kernel moves -- so that no module tests an op's name.  Its float64
reference is ``pool_tuner.reference.forward`` / ``backward``, which read these same attributes (the
reference sits above this module, so that the op table imports nothing of it).  ``OPERATIONS`` maps
each public name (``"adaptive_avg_pool2d"``) to its operation.
"""

from __future__ import annotations

import dataclasses
import math

#: The pooling kinds and the kernel define of each (kernels/operators.h).
KINDS = {"avg": "POOL_AVG", "max": "POOL_MAX"}
RANKS = (1, 2, 3)
#: Bytes of one index (int64) of a selecting op.
INDEX_BYTES = 8


@dataclasses.dataclass(frozen=True)
class Operation:
    """One public pooling op: ``name`` (its public function's name), ``kind`` and ``ndim`` (the
    number of pooled trailing axes)."""

    name: str
    kind: str
    ndim: int

    def __iter__(self):
        """An operation also unpacks as ``(kind, ndim)``, the form the op table had before it held
        operations (``kind, ndim = OPS[op]``, ``OPS[op][1]``)."""
        return iter((self.kind, self.ndim))

    def __getitem__(self, index):
        return (self.kind, self.ndim)[index]

    @property
    def selects(self) -> bool:
        """Whether each output is one element of its window (max), which also has a position: the
        forward pass writes it, the backward pass routes the output's gradient to it alone."""
        return self.kind == "max"

    @property
    def returns_indices(self) -> bool:
        """Whether the public function can return the selected positions (``return_indices``)."""
        return self.selects

    def output_size_of(self, input_shape, output_shape):
        """The ``output_size`` argument that gives ``output_shape`` from ``input_shape``: what a
        cache record's shapes mean as a call."""
        return tuple(output_shape[len(input_shape) - self.ndim:])

    def kernel_defines(self) -> dict:
        """The ``#define`` that makes kernels/operators.h this op's operator."""
        return {KINDS[self.kind]: 1}

    # ------------------------------------------------------------------ traffic

    def bytes_read_written(self, direction: str, input_shape, output_shape, itemsize: int) -> tuple[int, int]:
        """``(bytes read, bytes written)`` by an ideal kernel.  Forward reads the input and writes
        the output (a selecting op also its int64 indices); backward reads the output gradient
        (and the indices) and writes the input gradient."""
        inputs, outputs = math.prod(input_shape) * itemsize, math.prod(output_shape) * itemsize
        indices = math.prod(output_shape) * INDEX_BYTES if self.selects else 0
        if direction == "forward":
            return inputs, outputs + indices
        return outputs + indices, inputs


OPERATIONS = {
    f"adaptive_{kind}_pool{ndim}d": Operation(f"adaptive_{kind}_pool{ndim}d", kind, ndim)
    for kind in KINDS for ndim in RANKS
}
