"""64-bit safety (docs/design.md, Numerics: 64-bit offsets wherever numel can pass 2^31-1).

``Problem.index_64`` picks the kernels' index width: 32-bit only when every element count stays
``OVERSHOOT_MARGIN`` below 2^31-1 (work-items may run up to one work-group of outputs past the
end before their bound check) and every window product ``(i + 1) * (o + 1)`` of a pooled axis
fits too (the window formulas compute ``(o + 1) * I + O - 1`` and ``(i + 1) * O + I - 1``).

- the selection at its exact boundaries, per element count and per axis, and against an
  independent statement of the rule on random (never allocated) shapes;
- ``INDEX_64`` reaching the compiled source, and ``explain``'s ``index_bits``;
- real runs on PoCL whose window products overflow 32 bits while the arrays stay tiny
  (I = 46340 -> O = 46341: ``(I + 1) * (O + 1) > 2^31``), every variant, against an exact oracle;
- the 64-bit kernels of every variant on small shapes (index width forced), against the reference;
- ``slow``: real inputs of more than 2^31 elements (skipped where the device cannot allocate them);
- the multi-level ops: the selection over every level, the 64-bit build of every variant, and a
  pyramid level whose window products pass 32 bits.
"""

import gc
import math
import os

import numpy as np
import pyopencl.array as cl_array
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import pool_tuner as pt
from pool_tuner import backends, dispatch, reference, shapes
from pool_tuner.backends.opencl import OpenCLDevice
from pool_tuner.problem import INT32_LIMIT, LAYOUT_NAMES, OPS, OVERSHOOT_MARGIN, Problem

#: The single-level ops and their variants (the multi-level ops: the end of this file).
#: GeM (an operator with run-time arguments, whose backward takes x) has tests of its own: test_gem.py
OPS = {op: operation for op, operation in OPS.items() if not operation.multi_level and not operation.arguments}
from pool_tuner.variants import REGISTRY
REGISTRY = {key: table for key, table in REGISTRY.items() if key[0] in OPS}

from conftest import GLOBAL_ONLY, random_input, tiered

LIMIT = INT32_LIMIT - OVERSHOOT_MARGIN  # 2147418111 = 3 * 6673 * 107269
assert LIMIT == 3 * 6673 * 107269
assert LIMIT + 1 == 2**16 * 32767


def bits(op, shape, size, direction="forward"):
    return 64 if Problem.create(op, shape, size, direction=direction).index_64 else 32


# ---------------------------------------------------------------------- the selection rule


@pytest.mark.parametrize("shape,size,expected", [
    # input element count at the margin (every window product tiny: spatial sizes 1)
    ((107269, 3 * 6673, 1), 1, 32),                 # numel = LIMIT exactly, output numel too
    ((32767, 2**16, 1), 1, 64),                     # numel = LIMIT + 1
    ((2, 2**30 - 1, 1), 1, 64),                     # numel = 2^31 - 2: inside the margin band
    ((1, INT32_LIMIT, 1), 1, 64),                   # numel = 2^31 - 1
    ((1, 2**31, 1), 1, 64),
    ((3 * 6673, 107269, 1), 0, 32),                 # empty output, numel = LIMIT
    # output element count at the margin (upsampling a tiny input)
    ((1, 3 * 6673, 1), 107268, 32),                 # output numel = LIMIT - 20019; window product (2)(107269)
    ((1, 3 * 6673, 1), 107269, 32),                 # output numel = LIMIT exactly
    ((1, 32767, 1), 2**16, 64),                     # output numel = LIMIT + 1
    # window products with tiny arrays: (I + 1) * (O + 1) at LIMIT and above
    ((1, 1, 20018), 107268, 32),                    # (20019)(107269) = LIMIT
    ((1, 1, 20018), 107269, 64),                    # LIMIT + 20019
    ((1, 1, 107268), 20018, 32),                    # the same, downsampling
    ((1, 1, 107269), 20018, 64),
    ((1, 1, 46340), 46340, 64),                     # I = O: numel 46340, yet 46341^2 > LIMIT
    ((1, 1, 46339), 46339, 32),                     # 46340^2 = 2147395600 <= LIMIT
])
def test_1d_boundaries(shape, size, expected):
    assert bits("adaptive_avg_pool1d", shape, size) == expected
    assert bits("adaptive_max_pool1d", shape, size) == expected
    # the backward pass of the same problem uses the same width
    assert bits("adaptive_avg_pool1d", shape, size, "backward") == expected


@pytest.mark.parametrize("ndim,axis", [(2, 0), (2, 1), (3, 0), (3, 1), (3, 2)])
def test_window_product_boundary_on_every_axis(ndim, axis):
    """The window product is checked on every pooled axis (T, H and W), in both directions."""
    op = f"adaptive_avg_pool{ndim}d"
    for i, o, expected in [(20018, 107268, 32), (20018, 107269, 64), (107269, 20018, 64), (46339, 46339, 32)]:
        in_spatial = [1] * ndim
        out_spatial = [1] * ndim
        in_spatial[axis], out_spatial[axis] = i, o
        assert bits(op, (1, 1, *in_spatial), tuple(out_spatial)) == expected, (i, o, axis)
        assert bits(op, (1, *in_spatial), tuple(out_spatial)) == expected, "batch-less"


def test_element_count_counts_every_axis():
    """Counts multiply batch, channels and every pooled axis (2d and 3d at the boundary)."""
    assert bits("adaptive_avg_pool2d", (3, 6673, 107269, 1), (1, 1)) == 32
    assert bits("adaptive_avg_pool2d", (3, 6673, 107270, 1), (1, 1)) == 64
    assert bits("adaptive_avg_pool3d", (3, 1, 6673, 107269, 1), (1, 1, 1)) == 32
    assert bits("adaptive_avg_pool3d", (1, 2, 2**14, 32767, 2), (1, 1, 1)) == 64  # LIMIT + 1
    assert bits("adaptive_max_pool2d", (0, 3, 46340, 1), (46340, 1)) == 64  # empty batch: the axes' products count


def _oracle(input_shape, output_shape, ndim) -> bool:
    """The documented rule, restated: 64-bit unless every element count is at most
    2^31 - 1 - margin and every pooled axis has (I + 1) * (O + 1) within the same bound."""
    bound = 2**31 - 1 - OVERSHOOT_MARGIN
    counts = [math.prod(input_shape), math.prod(output_shape)]
    products = [(i + 1) * (o + 1) for i, o in zip(input_shape[-ndim:], output_shape[-ndim:])]
    return any(c > bound for c in counts) or any(p > bound for p in products)


def _size():  # sizes clustered where the boundaries lie: tiny, near sqrt(2^31), huge
    return st.one_of(st.integers(0, 8), st.integers(46000, 46400), st.integers(1, 2**17), st.integers(1, 2**33))


@settings(max_examples=300, deadline=None)
@given(ndim=st.sampled_from([1, 2, 3]), batchless=st.booleans(), data=st.data())
def test_selection_matches_the_rule(ndim, batchless, data):
    batch = (data.draw(_size()),) if batchless else (data.draw(_size()), data.draw(_size()))
    spatial = tuple(max(1, data.draw(_size())) for _ in range(ndim))
    size = tuple(data.draw(_size()) for _ in range(ndim))
    # sizes that output_size's own bounds refuse (tests/test_bad_input.py) never reach a kernel
    assume(max(size) <= shapes.MAX_OUTPUT_EXTENT and math.prod(size) <= shapes.MAX_OUTPUT_PLANE)
    problem = Problem.create(f"adaptive_max_pool{ndim}d", batch + spatial, size)
    assert problem.index_64 == _oracle(problem.input_shape, problem.output_shape, ndim)


def test_margin_covers_every_variants_overshoot():
    """Work-items index up to one work-group's worth of elements past the end before their bound
    check: the margin must cover the largest such group over every search space."""
    worst = 0
    for table in REGISTRY.values():
        for variant in table.values():
            for config in variant.configurations():
                per_item = config.get("outputs_per_thread", config.get("inputs_per_thread", 1))
                worst = max(worst, math.prod(variant.block(config)) * per_item)
    assert worst <= OVERSHOOT_MARGIN, f"a work-group may overshoot by {worst} > OVERSHOOT_MARGIN"


# ---------------------------------------------------------------------- INDEX_64 reaches the kernel


def test_define_follows_the_selection():
    small = Problem.create("adaptive_avg_pool1d", (1, 2, 46339), 46339)
    wide = Problem.create("adaptive_avg_pool1d", (1, 2, 46340), 46341)
    assert small.defines()["INDEX_64"] == 0 and wide.defines()["INDEX_64"] == 1
    for problem, value in ((small, 0), (wide, 1)):
        variant = REGISTRY[(problem.op, "forward")]["thread_per_output"]
        source = variant.program(variant.default, problem)
        assert f"#define INDEX_64 {value}\n" in source
        assert "#if INDEX_64\ntypedef int64_t_ index_t;" in source  # the prelude acts on it


@pytest.fixture
def built_sources(monkeypatch):
    """Every kernel source built during the test (a fresh launch memo, so nothing is reused)."""
    sources = []
    original = OpenCLDevice.build

    def recording_build(self, context, source, kernel_name):
        sources.append(source)
        return original(self, context, source, kernel_name)

    monkeypatch.setattr(OpenCLDevice, "build", recording_build)
    dispatch.forget()
    yield sources
    dispatch.forget()


@pytest.mark.parametrize("length,size,width", [(46339, 46339, 32), (46340, 46341, 64)])
def test_launch_compiles_the_selected_width(length, size, width, built_sources, rng):
    x = random_input(rng, (1, 2, length))
    pt.adaptive_avg_pool1d(x, size)
    assert len(built_sources) == 1
    assert f"#define INDEX_64 {int(width == 64)}\n" in built_sources[0]
    assert pt.explain("adaptive_avg_pool1d", x.shape, size)["index_bits"] == width


# ---------------------------------------------------------------------- real runs, 64-bit windows

BIG_I, BIG_O = 46340, 46341  # (I + 1) * (O + 1) = 2147534562 > 2^31: 32-bit window math overflows


def _windows(i_size, o_size):
    """Exact int64 windows (written out again here, independent of pool_tuner.windows)."""
    o = np.arange(o_size, dtype=np.int64)
    return (o * i_size) // o_size, -((-(o + 1) * i_size) // o_size)


def _oracle_forward(kind, x, o_size):
    """Exact forward over the last axis of ``x`` (float64 values, first-position argmax)."""
    starts, ends = _windows(x.shape[-1], o_size)
    x = x.astype(np.float64)
    if kind == "avg":
        csum = np.concatenate([np.zeros(x.shape[:-1] + (1,)), np.cumsum(x, axis=-1)], axis=-1)
        return (csum[..., ends] - csum[..., starts]) / (ends - starts), None
    best = x[..., starts]
    where = np.broadcast_to(starts, best.shape).copy()
    for j in range(1, int((ends - starts).max())):
        pos = np.minimum(starts + j, ends - 1)
        cand = x[..., pos]
        better = (cand > best) & (starts + j < ends)
        best, where = np.where(better, cand, best), np.where(better, pos, where)
    return best, where


def _oracle_backward(kind, grad, indices, i_size):
    """Exact backward over the last axis: scatter of each output's gradient into its window."""
    starts, ends = _windows(i_size, grad.shape[-1])
    out = np.zeros(grad.shape[:-1] + (i_size,))
    flat_out, flat_grad = out.reshape(-1, i_size), grad.reshape(-1, grad.shape[-1]).astype(np.float64)
    if kind == "max":
        flat_idx = indices.reshape(flat_grad.shape)
        for p in range(flat_out.shape[0]):
            np.add.at(flat_out[p], flat_idx[p], flat_grad[p])
        return out
    share = flat_grad / (ends - starts)
    for j in range(int((ends - starts).max())):
        pos = starts + j
        ok = pos < ends
        for p in range(flat_out.shape[0]):
            np.add.at(flat_out[p], pos[ok], share[p, ok])
    return out


def _spatial(ndim, n):
    """Pooled sizes with the long axis last (1d), first (2d: H; 3d: T)."""
    return (n,) if ndim == 1 else (n,) + (1,) * (ndim - 1)




def _real_cases():
    cases = []
    for ndim in (1, 2, 3):
        for kind in ("avg", "max"):
            op = f"adaptive_{kind}_pool{ndim}d"
            for direction in ("forward", "backward"):
                # 1d: every variant but the global-pooling ones (these windows are not global) and
                # forward thread_per_row (a 46340-element row exceeds its private row; backward
                # thread_per_row, average pooling only, has no such limit); 2d: forward
                # thread_per_row too, whose window rows run along the long axis H
                if ndim == 1:
                    skip = GLOBAL_ONLY + (("thread_per_row",) if direction == "forward" or kind == "max" else ())
                    names = [n for n in REGISTRY[(op, direction)] if n not in skip]
                elif ndim == 2 and direction == "forward":
                    names = [None, "thread_per_row"]
                else:
                    names = [None]
                for name in names:
                    if (name, kind) == ("channels_gather", "max"):
                        continue  # its max indices go in as contiguous device arrays (below); its avg case runs
                    channels_last_only = name in ("channels_vector", "channels_gather")
                    layouts = [LAYOUT_NAMES[ndim][1 if channels_last_only else 0]]
                    for layout in layouts:
                        cases.append(pytest.param(op, direction, name, layout,
                                                  id=f"{op}-{direction}-{name or 'dispatched'}-{layout}"))
    return cases


def _to_layout(a, ndim, layout):
    if layout != LAYOUT_NAMES[ndim][1]:
        return a
    c = a.ndim - ndim - 1
    return np.moveaxis(np.ascontiguousarray(np.moveaxis(a, c, -1)), -1, c)


@pytest.mark.parametrize("op,direction,variant,layout", _real_cases())
def test_window_products_beyond_32_bits(op, direction, variant, layout, rng):
    """I = 46340 -> O = 46341 (and the backward of it): tiny arrays, 64-bit window math."""
    kind, ndim = OPS[op]
    in_shape = (1, 3) + _spatial(ndim, BIG_I)
    out_size = _spatial(ndim, BIG_O)
    assert pt.explain(op, in_shape, out_size, layout=layout, direction=direction,
                      variant=variant)["index_bits"] == 64
    x = random_input(rng, (1, 3, BIG_I))  # the long axis, as 1d rows
    want, want_idx = _oracle_forward(kind, x, BIG_O)
    as_input = lambda a: _to_layout(a.reshape(a.shape[:2] + _spatial(ndim, a.shape[-1])), ndim, layout)  # noqa: E731
    forced = {} if variant is None else {"variant": variant}
    if direction == "forward":
        result = getattr(pt, op)(as_input(x), out_size, **({"return_indices": True} if kind == "max" else {}), **forced)
        values, indices = result if kind == "max" else (result, None)
        np.testing.assert_allclose(values.reshape(1, 3, BIG_O), want, rtol=1e-6, atol=1e-6)
        if kind == "max":
            np.testing.assert_array_equal(indices.reshape(1, 3, BIG_O), want_idx)
    else:
        grad = random_input(rng, (1, 3, BIG_O))
        if kind == "max":
            # Device arrays: numpy indices are validated on the host, where numpy 2.4's
            # unravel_index bug rejects these (see test_properties.py); not the subject here.
            queue = backends.default_device().queue
            on_device = lambda a: cl_array.to_device(queue, np.ascontiguousarray(as_input(a)))  # noqa: E731
            got = getattr(pt, f"{op}_backward")(on_device(grad), on_device(want_idx.astype(np.int64)), in_shape,
                                                **forced).get()
        else:
            got = getattr(pt, f"{op}_backward")(as_input(grad), in_shape, **forced)
        np.testing.assert_allclose(got.reshape(1, 3, BIG_I), _oracle_backward(kind, grad, want_idx, BIG_I),
                                   rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- every variant, 64-bit build


def _forced_cases():
    cases = []
    for (op, direction), table in REGISTRY.items():
        kind, ndim = OPS[op]
        for name in table:
            # both layouts in 2d; contiguous 1d and channels-last 3d (channels_vector, channels_gather:
            # channels-last only)
            layouts = {1: LAYOUT_NAMES[1][:1], 2: LAYOUT_NAMES[2], 3: LAYOUT_NAMES[3][1:]}[ndim]
            if name in ("channels_vector", "global_channels", "channels_gather"):
                layouts = LAYOUT_NAMES[ndim][1:]
            # channels-first only (global_broadcast: a global grad_out reads as contiguous)
            if name in ("plane_reduce", "thread_per_row", "global_planes", "global_broadcast"):
                layouts = LAYOUT_NAMES[ndim][:1]
            if (direction, name, kind) == ("backward", "thread_per_row", "max"):  # average pooling only
                continue
            for layout in layouts:
                cases.append(pytest.param(op, direction, name, layout, id=f"{op}-{direction}-{name}-{layout}"))
    return tiered(cases, group=lambda values: values[:3])  # core: each variant's first layout


FORCED_SHAPES = {1: ((2, 3, 11), (4,)), 2: ((2, 3, 7, 5), (3, 4)), 3: ((1, 2, 5, 4, 3), (2, 3, 2))}


@pytest.mark.parametrize("op,direction,variant,layout", _forced_cases())
def test_64_bit_kernels_of_every_variant(op, direction, variant, layout, monkeypatch, built_sources, rng):
    """The INDEX_64 build of every variant is exercised on a small shape (width forced) against
    the reference: the 64-bit path must compile and compute exactly like the 32-bit one."""
    monkeypatch.setattr(Problem, "index_64", property(lambda self: True))
    kind, ndim = OPS[op]
    shape, size = FORCED_SHAPES[ndim]
    if variant in GLOBAL_ONLY:
        size = (1,) * ndim
    out_shape = shape[:2] + size
    fn = getattr(pt, op if direction == "forward" else f"{op}_backward")
    if direction == "forward":
        x = random_input(rng, shape)
        result = fn(_to_layout(x, ndim, layout), size, variant=variant,
                    **({"return_indices": True} if kind == "max" else {}))
        expected = reference.forward(op, x, size)
        if kind == "max":
            np.testing.assert_array_equal(result[0], expected[0])
            np.testing.assert_array_equal(result[1], expected[1])
        else:
            np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-6)
    else:
        grad = random_input(rng, out_shape)
        if kind == "max":
            _, idx = reference.forward(op, random_input(rng, shape), size)
            result = fn(_to_layout(grad, ndim, layout), _to_layout(idx, ndim, layout), shape, variant=variant)
            expected = reference.backward(op, grad, shape, idx)
        else:
            result = fn(_to_layout(grad, ndim, layout), shape, variant=variant)
            expected = reference.backward(op, grad, shape)
        np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-6)
    assert built_sources and all("#define INDEX_64 1\n" in s for s in built_sources)


# ---------------------------------------------------------------------- slow: more than 2^31 elements


def _require_memory(nbytes, host_copies):
    device = backends.default_device()
    cl_device = device.cl_device
    if cl_device.max_mem_alloc_size < nbytes or cl_device.global_mem_size < nbytes:
        pytest.skip(f"{device.info.describe()} allocates at most {cl_device.max_mem_alloc_size / 2**30:.1f} GiB per "
                    f"buffer ({cl_device.global_mem_size / 2**30:.1f} GiB in all); this test needs one of "
                    f"{nbytes / 2**30:.1f} GiB")
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if host < nbytes * host_copies + 2**31:
        pytest.skip(f"needs about {nbytes * host_copies / 2**30:.0f} GiB of host memory, the machine has "
                    f"{host / 2**30:.0f} GiB")


def _sparse_average(length, out, marks):
    """float16 (1, 1, length) -> out through pt.adaptive_avg_pool1d, checked in closed form.

    The input is zero except a sparse lattice of multiples of 1024 and a few marks (e.g. around
    element 2^31): every window sum is a multiple of 1024 below 2^34, exact in the kernel's float32
    accumulator, so the expected means follow from the nonzero positions alone (no reference pass
    over the input, no copy of it)."""
    _require_memory(length * 2, host_copies=2)  # the numpy input and the device's copy of it
    x = np.zeros((1, 1, length), np.float16)  # calloc: pages appear as they are written
    step = 524_287 if length > 2**28 else 997  # primes: the lattice never lines up with the windows
    lattice = np.arange(0, length, step, dtype=np.int64)
    marks = np.setdiff1d(np.asarray(marks, np.int64), lattice)
    positions = np.concatenate([lattice, marks])
    weights = np.concatenate([1024.0 * (1 + lattice // step % 7), 1024.0 * (2 + np.arange(marks.size) % 5)])
    x[0, 0, positions] = weights.astype(np.float16)
    starts, ends = _windows(length, out)
    sums = np.array([weights[(positions >= s) & (positions < e)].sum() for s, e in zip(starts, ends)])
    expected = sums / (ends - starts)
    result = pt.adaptive_avg_pool1d(x, out)
    del x
    gc.collect()
    assert result.shape == (1, 1, out) and result.dtype == np.float16
    np.testing.assert_allclose(result[0, 0].astype(np.float64), expected, rtol=2**-10, atol=0)


def _tall_maximum(height):
    """float16 (1, 1, height, 1) -> (1, 1): one window of ``height`` rows, its maximum near the end."""
    _require_memory(height * 2, host_copies=2)
    x = np.zeros((1, 1, height, 1), np.float16)
    peak = height - 12345 % height
    x[0, 0, peak, 0] = 7.0
    values, indices = pt.adaptive_max_pool2d(x, (1, 1), return_indices=True)
    del x
    gc.collect()
    assert values[0, 0, 0, 0] == 7.0 and indices[0, 0, 0, 0] == peak


def test_sparse_average_and_tall_maximum_checks_on_small_inputs():
    """The two checks below, at sizes every machine runs (32-bit), so their arithmetic is tested."""
    length = 2**22 + 12345
    _sparse_average(length, 7, [length // 2 - 1, length // 2, length // 2 + 1, length - 1])
    _tall_maximum(2**20 + 3)


@pytest.mark.slow
def test_real_1d_average_over_2_31_elements():
    """(1, 1, 2^31 + 2^20) -> 7 in float16 on the default device, marks around element 2^31."""
    length = 2**31 + 2**20
    assert pt.explain("adaptive_avg_pool1d", (1, 1, length), 7, dtype="float16")["index_bits"] == 64
    _sparse_average(length, 7, [2**31 - 1, 2**31, 2**31 + 1, length - 1])


@pytest.mark.slow
def test_real_2d_max_window_of_more_than_2_31_rows():
    """(1, 1, 2^31 + 2^20, 1) -> (1, 1) in float16: a single window of more than 2^31 rows."""
    height = 2**31 + 2**20
    assert pt.explain("adaptive_max_pool2d", (1, 1, height, 1), (1, 1), dtype="float16")["index_bits"] == 64
    _tall_maximum(height)


# ---------------------------------------------------------------------- the multi-level ops

from pool_tuner.variants import REGISTRY as ALL_VARIANTS  # noqa: E402
from pool_tuner.problem import OPS as ALL_OPS  # noqa: E402

from conftest import variants_legal_for  # noqa: E402

#: (op, input shape, output size): small, non-divisible, one level upsampling.
MULTI_LEVEL_SHAPES = {
    "adaptive_avg_pool_pyramid1d": ((2, 3, 11), [1, 4, 13]),
    "adaptive_max_pool_pyramid1d": ((2, 3, 11), [1, 4, 13]),
    "adaptive_avg_pool_pyramid2d": ((2, 3, 7, 5), [1, (3, 4), 2]),
    "adaptive_max_pool_pyramid2d": ((2, 3, 7, 5), [1, (3, 4), 2]),
    "adaptive_avg_pool_pyramid3d": ((1, 2, 5, 4, 3), [1, (2, 3, 2)]),
    "adaptive_max_pool_pyramid3d": ((1, 2, 5, 4, 3), [1, (2, 3, 2)]),
    "adaptive_avgmax_pool2d": ((2, 3, 7, 5), (3, 4)),
}


def test_multi_level_selection_counts_every_level():
    """A window product of any level, or the outputs of every level together, past the margin."""
    op = "adaptive_avg_pool_pyramid1d"
    assert bits(op, (1, 2, 46339), [3, 46339]) == 32
    assert bits(op, (1, 2, 46340), [3, 46341]) == 64 == bits(op, (1, 2, 46340), [46341, 3])
    # each level's outputs below the limit, the levels' together above it (never allocated)
    planes = LIMIT // 2 + 1
    assert bits(op, (1, planes, 1), [1]) == 32
    assert bits(op, (1, planes, 1), [1, 1]) == 64
    assert bits("adaptive_avgmax_pool2d", (1, 1, 1, 46340), (1, 46341)) == 64


def _multi_level_forced_cases():
    """Every multi-level (op, direction, variant) in each layout it takes (pyramid_columns:
    channels-first only)."""
    cases = []
    for (op, direction), table in ALL_VARIANTS.items():
        if op in MULTI_LEVEL_SHAPES:
            shape, sizes = MULTI_LEVEL_SHAPES[op]
            for layout in LAYOUT_NAMES[ALL_OPS[op].ndim]:
                legal = variants_legal_for(Problem.create(op, shape, sizes, layout=layout, direction=direction))
                cases += [pytest.param(op, direction, name, layout, id=f"{op}-{direction}-{name}-{layout}")
                          for name in table if name in legal]
    return tiered(cases, group=lambda values: values[:3])  # core: each variant's first layout


def _multi_level_run(op, direction, x_or_shape, sizes, grads=None, indices=None, layout=None, **forced):
    """Run a multi-level op through its public function: forward ``(values, indices)`` per level,
    or the backward's input gradient (avgmax as ``mode="cat"``, its levels split along the
    channels); arrays are given, and the results compared, with logical axes."""
    operation = ALL_OPS[op]
    lay = (lambda a: _to_layout(a, operation.ndim, layout)) if layout else (lambda a: a)  # noqa: E731
    if direction == "forward":
        x = lay(x_or_shape)
        if operation.kind == "avgmax":
            both, index = pt.adaptive_avgmax_pool2d(x, sizes, "cat", return_indices=True, **forced)
            channels = x.shape[1]
            return [both[:, :channels], both[:, channels:]], [index]
        if operation.kind == "avg":
            return pt.adaptive_avg_pool_pyramid(x, sizes, **forced), []
        return pt.adaptive_max_pool_pyramid(x, sizes, True, **forced)
    if operation.kind == "avgmax":
        return pt.adaptive_avgmax_pool2d_backward(lay(np.concatenate(grads, axis=1)), lay(indices[0]), x_or_shape,
                                                  "cat", **forced)
    if operation.kind == "avg":
        return pt.adaptive_avg_pool_pyramid_backward([lay(g) for g in grads], x_or_shape, **forced)
    return pt.adaptive_max_pool_pyramid_backward([lay(g) for g in grads], [lay(i) for i in indices], x_or_shape,
                                                 **forced)


@pytest.mark.parametrize("op,direction,variant,layout", _multi_level_forced_cases())
def test_64_bit_kernels_of_every_multi_level_variant(op, direction, variant, layout, monkeypatch, built_sources, rng):
    """The INDEX_64 build of every multi-level variant on a small shape (width forced), against the
    float64 reference."""
    monkeypatch.setattr(Problem, "index_64", property(lambda self: True))
    shape, sizes = MULTI_LEVEL_SHAPES[op]
    x = random_input(rng, shape)
    values, indices = reference.forward(op, x, sizes)
    if direction == "forward":
        got_values, got_indices = _multi_level_run(op, direction, x, sizes, layout=layout, variant=variant)
        for got, want in zip(got_values, values, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        for got, want in zip(got_indices, indices, strict=True):
            np.testing.assert_array_equal(got, want)
    else:
        grads = [random_input(rng, v.shape) for v in values]
        got = _multi_level_run(op, direction, shape, sizes, grads, indices, layout=layout, variant=variant)
        np.testing.assert_allclose(got, reference.backward(op, grads, shape, indices or None), rtol=1e-5, atol=1e-6)
    assert built_sources and all("#define INDEX_64 1\n" in s for s in built_sources)


@pytest.mark.parametrize("kind", ["avg", "max"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_multi_level_window_products_beyond_32_bits(kind, direction, rng):
    """A 1d pyramid I = 46340 -> [46341, 3]: tiny arrays, 64-bit window math in one level, against
    the exact per-level oracle, by every variant that takes it."""
    op = f"adaptive_{kind}_pool_pyramid1d"
    shape, sizes = (1, 3, BIG_I), [BIG_O, 3]
    problem = Problem.create(op, shape, sizes, direction=direction)
    assert problem.index_64
    x = random_input(rng, shape)
    wants = [_oracle_forward(kind, x, size) for size in sizes]
    grads = [random_input(rng, (1, 3, size)) for size in sizes]
    names = variants_legal_for(problem)
    assert names
    for name in names:
        if direction == "forward":
            values, indices = _multi_level_run(op, direction, x, sizes, variant=name)
            for got, got_indices, (want, want_idx) in zip(values, indices or [None] * 2, wants, strict=True):
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
                if kind == "max":
                    np.testing.assert_array_equal(got_indices, want_idx)
        else:
            indices = [want_idx.astype(np.int64) for _, want_idx in wants] if kind == "max" else None
            got = _multi_level_run(op, direction, shape, sizes, grads, indices, variant=name)
            expected = sum(_oracle_backward(kind, g, want_idx, BIG_I) for g, (_, want_idx) in zip(grads, wants))
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
