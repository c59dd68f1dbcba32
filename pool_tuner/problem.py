"""A pooling problem: everything about one call that selects and specialises a kernel.

``Problem`` is hashable and compact; it keys the in-memory dispatch tables and the compiled-kernel
cache, and (with the device and kernel sources) the tuning cache.  It also derives the ``#define``s
that every template receives: the plane count, the 3-axis input/output sizes (1d and 2d padded with
leading size-1 axes), the dtype and the index width.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import shapes

#: op name -> (pooling kind, number of pooled axes)
OPS = {
    f"adaptive_{kind}_pool{ndim}d": (kind, ndim) for kind in ("avg", "max") for ndim in (1, 2, 3)
}
DIRECTIONS = ("forward", "backward")
#: Ops with kernels in this version (the others are listed by ``OPS`` so errors can say so).
IMPLEMENTED = {("adaptive_avg_pool1d", "forward"), ("adaptive_avg_pool2d", "forward"), ("adaptive_avg_pool3d", "forward")}
DTYPES = {"float32": "DTYPE_FLOAT32", "float64": "DTYPE_FLOAT64"}
#: Memory layouts by rank: contiguous channels-first, and channels-last.
LAYOUT_NAMES = {1: ("NCL", "NLC"), 2: ("NCHW", "NHWC"), 3: ("NCDHW", "NDHWC")}
INT32_LIMIT = 2**31 - 1
#: Work-items may run past the last output by up to one work-group's worth of outputs (at most
#: 1024 threads x 8 outputs each); a 32-bit launch keeps this much headroom below 2^31.
OVERSHOOT_MARGIN = 1 << 16


def check_op(op, direction: str = "forward") -> tuple[str, int]:
    if not isinstance(op, str) or op not in OPS:
        raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if (op, direction) not in IMPLEMENTED:
        raise ValueError(
            f"op {op!r} ({direction}) has no kernels in this version of pool_tuner; "
            f"available: {sorted(o for o, d in IMPLEMENTED if d == direction)}"
        )
    return OPS[op]


def check_dtype(dtype, name: str = "dtype") -> str:
    try:
        canonical = np.dtype(dtype).name
    except TypeError:
        raise TypeError(f"{name} must be one of {sorted(DTYPES)}, got {dtype!r}") from None
    if canonical not in DTYPES:
        raise TypeError(f"{name} must be one of {sorted(DTYPES)}, got {canonical}")
    return canonical


def check_layout(layout, ndim: int, name: str = "layout") -> str:
    contiguous, channels_last = LAYOUT_NAMES[ndim]
    if layout != contiguous:
        allowed = f"{contiguous!r} (channels-last {channels_last!r} is not supported yet)"
        raise ValueError(f"{name} must be {allowed} for {ndim}d pooling, got {layout!r}")
    return layout


@dataclasses.dataclass(frozen=True)
class Problem:
    op: str
    direction: str
    dtype: str
    layout: str
    input_shape: tuple
    output_shape: tuple

    @classmethod
    def create(cls, op, input_shape, output_size, dtype="float32", layout=None, direction="forward", shape_name="input_shape"):
        """Validate every argument and build the problem (raises before anything is compiled)."""
        _, ndim = check_op(op, direction)
        dtype = check_dtype(dtype)
        layout = check_layout(LAYOUT_NAMES[ndim][0] if layout is None else layout, ndim)
        batch, spatial = shapes.split_input_shape(input_shape, ndim, shape_name)
        out_spatial = shapes.resolve_output_size(output_size, spatial)
        return cls(op, direction, dtype, layout, batch + spatial, batch + out_spatial)

    @property
    def kind(self) -> str:
        return OPS[self.op][0]

    @property
    def ndim(self) -> int:
        return OPS[self.op][1]

    @property
    def planes(self) -> int:
        return math.prod(self.input_shape[: -self.ndim])

    @property
    def in_spatial(self) -> tuple:
        """Pooled input sizes padded to 3 axes (T, H, W)."""
        return (1,) * (3 - self.ndim) + tuple(self.input_shape[-self.ndim :])

    @property
    def out_spatial(self) -> tuple:
        return (1,) * (3 - self.ndim) + tuple(self.output_shape[-self.ndim :])

    @property
    def is_empty(self) -> bool:
        return math.prod(self.output_shape) == 0

    @property
    def index_64(self) -> bool:
        """Whether 32-bit offsets could overflow: element counts, or the window products
        ``(o + 1) * I`` and ``(i + 1) * O`` of any axis, near 2^31."""
        limit = INT32_LIMIT - OVERSHOOT_MARGIN
        if math.prod(self.input_shape) > limit or math.prod(self.output_shape) > limit:
            return True
        return any((i + 1) * (o + 1) > limit for i, o in zip(self.in_spatial, self.out_spatial))

    def defines(self) -> dict:
        """The shape, dtype and index-width ``#define``s every template receives."""
        (it, ih, iw), (ot, oh, ow) = self.in_spatial, self.out_spatial
        return {
            DTYPES[self.dtype]: 1,
            "INDEX_64": int(self.index_64),
            f"POOL_{self.kind.upper()}": 1,
            "N_PLANES": self.planes,
            "IN_T": it, "IN_H": ih, "IN_W": iw,
            "OUT_T": ot, "OUT_H": oh, "OUT_W": ow,
        }

    def bytes_moved(self) -> int:
        """Bytes read plus bytes written by an ideal kernel: the bandwidth floor's numerator."""
        itemsize = np.dtype(self.dtype).itemsize
        return (math.prod(self.input_shape) + math.prod(self.output_shape)) * itemsize
