"""Argument checking shared by the reference, the kernels and the command line.

Every public entry point validates its arguments here, before any kernel is built or launched,
and raises ``TypeError``/``ValueError`` whose message names the argument and what is allowed.
"""

from __future__ import annotations

import numbers

RANK_NAMES = {1: "(N, C, L) or (C, L)", 2: "(N, C, H, W) or (C, H, W)", 3: "(N, C, T, H, W) or (C, T, H, W)"}

#: The largest output size of one pooled axis: int32's maximum.  Window bounds are computed per
#: output index (host arrays of that length, device grids over it), so a larger size fails deep
#: inside window math or a launch instead of here; no real layer comes near it.
MAX_OUTPUT_EXTENT = 2**31 - 1
#: The largest output plane (product of the pooled output sizes): int64's maximum, since max
#: pooling's indices are int64 positions within the plane (PyTorch's).
MAX_OUTPUT_PLANE = 2**63 - 1


def check_int(value, name: str, *, minimum: int | None = None) -> int:
    """Return ``value`` as a Python int, rejecting bools, floats and other non-integers."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def split_input_shape(shape, ndim: int, name: str = "x") -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Split the logical shape of an ``ndim``-d pooling input into ``(batch_dims, spatial_dims)``.

    ``batch_dims`` is ``(N, C)`` or ``(C,)`` (batch-less input).  Batch and channel counts may be
    0 (the result is empty, as in PyTorch); a pooled dimension of size 0 is an error.
    """
    try:
        shape = tuple(shape)
    except TypeError:
        raise TypeError(f"{name} must have a shape (a sequence of ints), got {type(shape).__name__}") from None
    # an array's sizes are x.shape[i]; a shape argument's (input_shape) its own entries
    item = f"{name}[{{}}]" if name.endswith("shape") else f"{name}.shape[{{}}]"
    shape = tuple(check_int(s, item.format(i), minimum=0) for i, s in enumerate(shape))
    if len(shape) not in (ndim + 1, ndim + 2):
        raise ValueError(
            f"{name} must be {ndim + 1}-d or {ndim + 2}-d {RANK_NAMES[ndim]} for {ndim}d pooling, "
            f"got shape {shape}"
        )
    batch, spatial = shape[: len(shape) - ndim], shape[len(shape) - ndim :]
    if any(s == 0 for s in spatial):
        raise ValueError(
            f"{name} has a pooled dimension of size 0 (shape {shape}); pooled dimensions must be >= 1"
        )
    return batch, spatial


def resolve_output_size(output_size, in_spatial: tuple[int, ...], name: str = "output_size") -> tuple[int, ...]:
    """Resolve ``output_size`` (an int, or a sequence of ints and ``None``) against the input's
    pooled dimensions: an int applies to every axis, ``None`` keeps the input size.  Sizes are
    bounded (MAX_OUTPUT_EXTENT, MAX_OUTPUT_PLANE) before anything is allocated for them."""
    ndim = len(in_spatial)
    if output_size is None:
        raise TypeError(f"{name} must be an int or a sequence of {ndim} ints/None, got None")
    if isinstance(output_size, numbers.Integral) and not isinstance(output_size, bool):
        entries = (check_int(output_size, name, minimum=0),) * ndim
    elif isinstance(output_size, (str, bytes, bytearray)):  # sequences, but of characters or byte codes
        raise TypeError(
            f"{name} must be an int or a sequence of {ndim} ints/None, got {type(output_size).__name__} {output_size!r}"
        )
    else:
        try:
            entries = tuple(output_size)
        except TypeError:
            raise TypeError(
                f"{name} must be an int or a sequence of {ndim} ints/None, got {type(output_size).__name__}"
            ) from None
        if len(entries) != ndim:
            raise ValueError(f"{name} must have {ndim} entries for {ndim}d pooling, got {len(entries)}: {output_size!r}")
    resolved = []
    for axis, (entry, size) in enumerate(zip(entries, in_spatial)):
        if entry is None:
            resolved.append(size)
        else:
            resolved.append(check_int(entry, f"{name}[{axis}]", minimum=0))
            if resolved[-1] > MAX_OUTPUT_EXTENT:
                raise ValueError(f"{name}[{axis}] must be <= {MAX_OUTPUT_EXTENT} (2**31 - 1), got {resolved[-1]}")
    plane = 1
    for size in resolved:
        plane *= size
    if isinstance(plane, int) and plane > MAX_OUTPUT_PLANE:  # a dynamic (symbolic) input size is not checked
        raise ValueError(f"{name} {tuple(resolved)} has {plane} elements per plane; the limit is "
                         f"{MAX_OUTPUT_PLANE} (2**63 - 1, the range of int64 indices)")
    return tuple(resolved)


def c_strides(shape, itemsize: int) -> tuple:
    """Byte strides of a C-contiguous array of ``shape`` (an axis of size 0 counts as size 1)."""
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))
