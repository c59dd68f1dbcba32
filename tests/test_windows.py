"""pool_tuner.windows against brute force computed independently (exact rationals, exhaustive search)."""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import numpy as np
import pytest

from pool_tuner import windows
from pool_tuner.windows import fixed_pool_equivalent, inverse_windows, max_window, pooling_windows

SIZES = range(1, 65)


@functools.lru_cache(maxsize=None)
def brute_windows(in_size: int, out_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Windows straight from the definition, with exact rational arithmetic:
    output o pools [floor(o*I/O), ceil((o+1)*I/O))."""
    starts = tuple(math.floor(Fraction(o * in_size, out_size)) for o in range(out_size))
    ends = tuple(math.ceil(Fraction((o + 1) * in_size, out_size)) for o in range(out_size))
    return starts, ends


def brute_fixed_solutions(in_size: int, out_size: int) -> set[tuple[int, int]]:
    """Every (kernel, stride) in 1..I x 1..I whose unpadded fixed pooling gives exactly ``out_size``
    outputs with windows [o*s, o*s + k) equal to the adaptive windows."""
    starts, ends = brute_windows(in_size, out_size)
    starts = np.array(starts)
    ends = np.array(ends)
    o = np.arange(out_size)
    solutions = set()
    for s in range(1, in_size + 1):
        if not np.array_equal(o * s, starts):
            continue
        for k in range(1, in_size + 1):
            n_outputs = (in_size - k) // s + 1
            if n_outputs == out_size and np.array_equal(o * s + k, ends):
                solutions.add((k, s))
    return solutions


@pytest.mark.parametrize("in_size", SIZES)
def test_pooling_windows_exhaustive(in_size):
    for out_size in SIZES:
        starts, ends = pooling_windows(in_size, out_size)
        exp_starts, exp_ends = brute_windows(in_size, out_size)
        assert starts.dtype == np.int64 and ends.dtype == np.int64
        assert starts.shape == ends.shape == (out_size,)
        assert starts.tolist() == list(exp_starts), (in_size, out_size)
        assert ends.tolist() == list(exp_ends), (in_size, out_size)


@pytest.mark.parametrize("in_size", SIZES)
def test_fixed_pool_equivalent_exhaustive(in_size):
    for out_size in SIZES:
        solutions = brute_fixed_solutions(in_size, out_size)
        got = fixed_pool_equivalent(in_size, out_size)
        if not solutions:
            assert got is None, (in_size, out_size, got)
            continue
        assert got is not None, (in_size, out_size, solutions)
        kernel, stride, padding = got
        assert padding == 0
        assert (kernel, stride) in solutions, (in_size, out_size, got, solutions)
        assert all(type(v) is int for v in got), got
        if out_size > 1:
            # With two or more outputs the stride (starts[1]) and kernel (ends[0]) are forced.
            assert len(solutions) == 1, (in_size, out_size, solutions)
        if in_size % out_size == 0:
            assert got == (in_size // out_size, in_size // out_size, 0)


def test_fixed_pool_equivalent_closed_form():
    # Writing I = s*O + r: the starts o*s + floor(o*r/O) are evenly spaced by s >= 1 only when
    # r <= 1 and I >= O, and then every window has size s + r.  So a fixed equivalent exists exactly
    # when O divides I (k = s = I/O) or I % O == 1 with I > O (k = s + 1, e.g. 7 -> 3 is k=3, s=2).
    for in_size in SIZES:
        for out_size in SIZES:
            s, r = divmod(in_size, out_size)
            expected = (s + r, s, 0) if (r == 0 or (r == 1 and s >= 1)) else None
            if out_size == 1:
                expected = (in_size, in_size, 0)
            assert fixed_pool_equivalent(in_size, out_size) == expected, (in_size, out_size)


@pytest.mark.parametrize("in_size", SIZES)
def test_inverse_windows_exhaustive(in_size):
    i = np.arange(in_size)[:, None]
    for out_size in SIZES:
        starts, ends = (np.array(a) for a in brute_windows(in_size, out_size))
        # member[i, o]: input i lies in the window of output o (brute force)
        member = (starts[None, :] <= i) & (i < ends[None, :])
        first, last = inverse_windows(in_size, out_size)
        assert first.dtype == np.int64 and last.dtype == np.int64
        assert first.shape == last.shape == (in_size,)
        assert np.all(first < last), (in_size, out_size)
        o = np.arange(out_size)[None, :]
        claimed = (first[:, None] <= o) & (o < last[:, None])
        assert np.array_equal(member, claimed), (in_size, out_size)


def test_max_window_exact_and_bound(monkeypatch):
    """Exact by scanning; past EXACT_MAX_WINDOW_LIMIT outputs a closed-form bound that is never
    below the true maximum (a gather loop is dropped when the inverse window's maximum is 1) and is
    exact whenever O divides I."""
    exact = {(i, o): max_window(i, o) for i in range(1, 65) for o in range(0, 65)}
    for (i, o), value in exact.items():
        starts, ends = pooling_windows(i, o)
        assert value == int((ends - starts).max(initial=0))
    monkeypatch.setattr(windows, "EXACT_MAX_WINDOW_LIMIT", 0)
    max_window.cache_clear()  # memoised: the exact answers above must not be reused
    try:
        bounds = {(i, o): max_window(i, o) for i, o in exact}
    finally:
        max_window.cache_clear()
    assert bounds != exact, "the bound was never used"
    for (i, o), value in exact.items():
        bound = bounds[i, o]
        assert bound >= value and bound <= value + 1
        if o and i % o == 0:
            assert bound == value


def test_explicit_cases():
    assert fixed_pool_equivalent(7, 3) == (3, 2, 0)
    assert fixed_pool_equivalent(10, 4) is None
    assert fixed_pool_equivalent(8, 4) == (2, 2, 0)
    assert fixed_pool_equivalent(5, 1) == (5, 5, 0)
    assert fixed_pool_equivalent(1, 3) is None  # every window is [0, 1): stride 0
    assert fixed_pool_equivalent(5, 5) == (1, 1, 0)
    starts, ends = pooling_windows(14, 4)
    assert list(zip(starts.tolist(), ends.tolist())) == [(0, 4), (3, 7), (7, 11), (10, 14)]
    starts, ends = pooling_windows(10, 4)
    assert list(zip(starts.tolist(), ends.tolist())) == [(0, 3), (2, 5), (5, 8), (7, 10)]
    # upsampling: 2 -> 3 gives [0,1), [0,2), [1,2)
    starts, ends = pooling_windows(2, 3)
    assert list(zip(starts.tolist(), ends.tolist())) == [(0, 1), (0, 2), (1, 2)]
    first, last = inverse_windows(14, 4)
    assert list(zip(first.tolist(), last.tolist())) == [(0, 1)] * 3 + [(0, 2)] + [(1, 2)] * 3 + [(2, 3)] * 3 + [
        (2, 4)
    ] + [(3, 4)] * 3


def test_zero_outputs_and_numpy_ints():
    starts, ends = pooling_windows(9, 0)
    assert starts.dtype == np.int64 and ends.dtype == np.int64
    assert starts.shape == ends.shape == (0,)
    starts, ends = pooling_windows(np.int64(14), np.int32(4))
    assert starts.tolist() == [0, 3, 7, 10] and ends.tolist() == [4, 7, 11, 14]
    assert fixed_pool_equivalent(np.int64(7), np.int64(3)) == (3, 2, 0)


@pytest.mark.parametrize("in_size, out_size", [(2**40 + 3, 7), (2**40 + 3, 4099), (2**59 + 5, 13)])
def test_huge_sizes(in_size, out_size):
    starts, ends = pooling_windows(in_size, out_size)
    assert starts.dtype == np.int64 and ends.dtype == np.int64
    exp_starts, exp_ends = brute_windows(in_size, out_size)
    assert starts.tolist() == list(exp_starts)
    assert ends.tolist() == list(exp_ends)
    # windows of a non-divisible huge case differ in size, so no fixed equivalent
    assert fixed_pool_equivalent(in_size, out_size) is None


def test_huge_sizes_float_division_would_be_wrong():
    # Guard that the huge case really exercises exact integer arithmetic: float64 division is off.
    in_size, out_size = 2**59 + 5, 13
    exp_starts, _ = brute_windows(in_size, out_size)
    float_starts = [math.floor(o * in_size / out_size) for o in range(out_size)]
    assert float_starts != list(exp_starts)


@pytest.mark.parametrize("func", [pooling_windows, inverse_windows, fixed_pool_equivalent])
@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((-1, 3), ValueError, "in_size"),
        ((0, 3), ValueError, "in_size"),
        ((4, -2), ValueError, "out_size"),
        ((4.0, 2), TypeError, "in_size"),
        ((4, 2.0), TypeError, "out_size"),
        ((True, 2), TypeError, "in_size"),
        ((4, False), TypeError, "out_size"),
        (("4", 2), TypeError, "in_size"),
        ((4, None), TypeError, "out_size"),
    ],
)
def test_bad_sizes(func, args, exc, match):
    with pytest.raises(exc, match=match):
        func(*args)


@pytest.mark.parametrize("func", [inverse_windows, fixed_pool_equivalent])
def test_zero_out_size_rejected_where_meaningless(func):
    with pytest.raises(ValueError, match="out_size"):
        func(4, 0)


def test_sizes_whose_window_products_overflow_int64_are_refused():
    with pytest.raises(ValueError, match="must fit in int64"):
        pooling_windows(2**61, 5)
    with pytest.raises(ValueError, match="must fit in int64"):
        inverse_windows(5, 2**61)
