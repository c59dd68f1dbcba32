"""Window math of adaptive pooling, in exact 64-bit integer arithmetic.

Along one axis with input size ``I`` and output size ``O``, output ``o`` pools the input
half-open range ``[floor(o*I/O), ceil((o+1)*I/O))``. When ``I % O != 0`` the windows differ in
size and neighbours overlap, which is why fixed-window pooling libraries cannot express the op
in general.  The inverse map (which outputs read input ``i``) is
``[floor(i*O/I), ceil((i+1)*O/I))``; the gather backward kernels rely on it.

Everything here is integer arithmetic on Python ints / int64 arrays: floating point division
would put ``floor``/``ceil`` one off for large sizes.
"""

from __future__ import annotations

import functools

import numpy as np

__all__ = [
    "pooling_windows",
    "inverse_windows",
    "fixed_pool_equivalent",
    "max_window",
]


#: The int64 window arithmetic computes (o + 1) * I and (i + 1) * O; both must fit in int64.
MAX_SIZE_PRODUCT = 2**63 - 1


def _check_sizes(in_size, out_size, *, allow_zero_out: bool):
    for name, value in (("in_size", in_size), ("out_size", out_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    in_size, out_size = int(in_size), int(out_size)
    if in_size < 1:
        raise ValueError(f"in_size must be >= 1, got {in_size}")
    if out_size < (0 if allow_zero_out else 1):
        bound = 0 if allow_zero_out else 1
        raise ValueError(f"out_size must be >= {bound}, got {out_size}")
    if (in_size + 1) * (out_size + 1) > MAX_SIZE_PRODUCT:
        raise ValueError(
            f"(in_size + 1) * (out_size + 1) must fit in int64 for exact window math, got {in_size} and {out_size}"
        )
    return in_size, out_size


def pooling_windows(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(starts, ends)``, int64 arrays of length ``out_size``: output ``o`` pools
    input ``[starts[o], ends[o])``."""
    in_size, out_size = _check_sizes(in_size, out_size, allow_zero_out=True)
    o = np.arange(out_size, dtype=np.int64)
    starts = (o * in_size) // out_size if out_size else o
    ends = -((-(o + 1) * in_size) // out_size) if out_size else o
    return starts.astype(np.int64), ends.astype(np.int64)


#: Above this many outputs ``max_window`` returns its closed-form bound instead of scanning.
EXACT_MAX_WINDOW_LIMIT = 1 << 16


@functools.lru_cache(maxsize=4096, typed=True)  # pure, and asked per axis of every new problem
def max_window(in_size: int, out_size: int) -> int:
    """Largest window along one axis (0 for an empty output); ``max_window(O, I)`` is the most
    outputs any one input belongs to.  Kernels drop an axis's gather loop when that is 1, so it
    must never be too small; for more than ``EXACT_MAX_WINDOW_LIMIT`` outputs it is the bound
    ``ceil(I/O) + 1`` (exact when ``O`` divides ``I``), never less than the true maximum."""
    in_size, out_size = _check_sizes(in_size, out_size, allow_zero_out=True)
    if out_size == 0:
        return 0
    if out_size > EXACT_MAX_WINDOW_LIMIT:
        return -(-in_size // out_size) + (in_size % out_size != 0)
    starts, ends = pooling_windows(in_size, out_size)
    return int((ends - starts).max())


def inverse_windows(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(first, last)``, int64 arrays of length ``in_size``: input ``i`` is pooled by
    exactly the outputs ``[first[i], last[i])``.

    This is the window rule with the roles of ``I`` and ``O`` swapped; it holds for every
    ``I, O >= 1`` (``tests/test_windows.py`` checks it against brute force).
    """
    in_size, out_size = _check_sizes(in_size, out_size, allow_zero_out=False)
    return pooling_windows(out_size, in_size)


@functools.lru_cache(maxsize=4096, typed=True)  # pure, and asked per axis of every new problem
def fixed_pool_equivalent(in_size: int, out_size: int) -> tuple[int, int, int] | None:
    """Return ``(kernel, stride, padding)`` of an ordinary (fixed-window, unpadded) pooling that
    reproduces the adaptive windows exactly, or ``None`` when none does.

    Adaptive windows are reproducible when every window has the same size ``k`` and
    consecutive starts differ by the same ``s``: then output ``o`` is ``[o*s, o*s + k)``, which is
    pooling with kernel ``k``, stride ``s`` and no padding.  This holds for every divisible case
    (``k = s = I/O``) and for some non-divisible ones, e.g. 7 -> 3 is ``k=3, s=2``; it fails for
    e.g. 10 -> 4 (windows of size 3 and 4).  ``padding`` is always 0, returned so the tuple maps
    directly onto ``nn.AvgPool*d(kernel, stride, padding)``.
    """
    in_size, out_size = _check_sizes(in_size, out_size, allow_zero_out=False)
    starts, ends = pooling_windows(in_size, out_size)
    sizes = ends - starts
    kernel = int(sizes[0])
    if np.any(sizes != kernel):
        return None
    stride = int(starts[1] - starts[0]) if out_size > 1 else kernel
    if np.any(np.diff(starts) != stride):
        return None
    if stride < 1:
        # O > I with equal sizes (e.g. 1 -> 3: every window is [0, 1)): a stride of 0 is not
        # an ordinary pooling.
        return None
    return kernel, stride, 0
