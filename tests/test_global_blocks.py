"""global_blocks, the global-pooling forward variant shaped for GPUs, run on PoCL through the public
functions with ``variant=`` (which forces a variant whatever kind of device it is shaped for):
against the float64 reference (and PyTorch CPU for max's NaN rule) with fresh random inputs and
poisoned outputs, on tiny and huge planes, odd sizes, both layouts, batch-less inputs, every
dtype, and NaN / -inf / tied planes for max.  Its legality: GPU devices only unless forced, global
pooling only.  (Its 64-bit build: tests/test_index64.py; CUDA compile: tests/test_compile_check.py;
Oclgrind: tests/test_oclgrind.py.)"""

import random

import numpy as np
import pytest

import pool_tuner as pt
from pool_tuner import backends, reference
from pool_tuner.problem import LAYOUT_NAMES, Problem
from pool_tuner.variants import variants_for

from conftest import EXHAUSTIVE, RUN_SEED, random_input, tiered
from test_matrix import as_float64, check_result, in_layout, np_dtype

torch = pytest.importorskip("torch")

NAME = "global_blocks"
VARIANT = variants_for("adaptive_avg_pool2d")[NAME]
OPS = {1: ("adaptive_avg_pool1d", "adaptive_max_pool1d"), 2: ("adaptive_avg_pool2d", "adaptive_max_pool2d"),
       3: ("adaptive_avg_pool3d", "adaptive_max_pool3d")}
#: (input shape, pooled rank): one-element and tiny planes (many teams per work-group), odd sizes,
#: a plane of 150k elements (a whole work-group per plane, many steps per member), batch-less.
SHAPES = [
    ((3, 5, 1, 1), 2),
    ((2, 7, 2, 3), 2),
    ((4, 33, 7, 7), 2),
    ((2, 3, 13, 17), 2),
    ((1, 3, 300, 500), 2),
    ((5, 19, 19), 2),          # batch-less
    ((3, 6, 1021), 1),
    ((2, 3, 3, 5, 7), 3),
]


def forced_configs(problem, count=1):
    """The default, the first and last configuration that the kernel can run for ``problem``
    (forced, so the device kind aside), and ``count`` random others, drawn from the run's seed:
    each run tries others, and ``POOL_TUNER_TEST_SEED`` replays a run's."""
    limits = backends.default_device().info.limits
    runnable = [c for c in VARIANT.configurations() if VARIANT.refusal(c, problem, limits, forced=True) is None]
    picks = [VARIANT.default_for(problem), runnable[0], runnable[-1]]
    picks += random.Random(f"{RUN_SEED} {problem.input_shape}").sample(runnable, min(count, len(runnable)))
    return [dict(c) for c in dict.fromkeys(tuple(sorted(c.items())) for c in picks)]


def _cases():
    cases = []
    for shape, ndim in SHAPES:
        # one-element planes are contiguous in either memory format
        for layout in LAYOUT_NAMES[ndim][:1 if shape[-ndim:] == (1,) * ndim else 2]:
            for op in OPS[ndim]:
                problem = Problem.create(op, shape, 1, layout=layout)
                for config in forced_configs(problem):
                    label = "-".join(f"{v}" for v in config.values())
                    cases.append(pytest.param(op, shape, layout, config, id=f"{op}-{shape}-{layout}-{label}"))
    # core: the default of every shape and layout, and every configuration of the odd-sized planes
    return tiered(cases, core=lambda values: values[1] == (2, 3, 13, 17), group=lambda values: values[:3])


def check_forward(op, out, x):
    """Means within the dtype's tolerance of the float64 reference of the stored input; maxima and
    their int64 positions exactly.  A 1x1 output reads as contiguous in either memory format."""
    ndim = int(op[-2])
    expected, layout = reference.forward(op, x, 1), LAYOUT_NAMES[ndim][0]
    if "avg" in op:
        check_result(out, expected, x.dtype, layout, ndim)
        return
    (values, indices), (ref_values, ref_indices) = out, expected
    check_result(values, ref_values, x.dtype, layout, ndim, exact=True)
    assert indices.dtype == np.int64
    np.testing.assert_array_equal(indices, ref_indices)


def run(op, x, config=None, variant=NAME):
    fn = getattr(pt, op)
    if "max" in op:
        return fn(x, 1, True, variant=variant, config=config)
    return fn(x, 1, variant=variant, config=config)


@pytest.mark.parametrize("op,shape,layout,config", _cases())
def test_configurations_match_the_reference(op, shape, layout, config, rng):
    ndim = int(op[-2])
    x = in_layout(random_input(rng, shape), ndim, layout)
    check_forward(op, run(op, x, config), x)


#: (op, layout, dtype) beyond float32: each dtype once in the core tier (its first op and layout).
DTYPE_CASES = tiered([pytest.param(op, layout, dtype, id=f"{op}-{layout}-{dtype}")
                      for dtype in ("float64", "float16", "bfloat16") for op in OPS[2] for layout in LAYOUT_NAMES[2]],
                     group=lambda values: values[2])


@pytest.mark.parametrize("op,layout,dtype", DTYPE_CASES)
def test_every_dtype(op, layout, dtype, rng):
    """float16 and bfloat16 accumulate in float32: a mean of 40000 elements stays within the
    dtype's tolerance of the float64 reference of the stored input."""
    x = in_layout(random_input(rng, (2, 3, 200, 200), np.float64).astype(np_dtype(dtype)), 2, layout)
    check_forward(op, run(op, x, {"threads_per_plane": 256, "accumulators": 4}), x)


def special_planes(rng, shape):
    """Planes of the values that decide max's position rule: ties (first wins), all -inf (the first
    position), several NaNs among numbers (the last NaN), one NaN, +inf beside a NaN."""
    x = np.round(random_input(rng, shape) * 2) / 2  # few distinct values: many ties
    planes = x.reshape(-1, shape[-2] * shape[-1])
    size = planes.shape[1]
    planes[0] = -np.inf
    picks = rng.choice(size, 3, replace=False)
    planes[1, picks] = np.nan
    planes[2, rng.integers(size)] = np.nan
    planes[3, rng.integers(size)] = np.inf
    planes[3, rng.integers(size)] = np.nan
    planes[4] = 1.0
    planes[5, :] = -np.inf
    planes[5, size - 1] = -1.0
    return x


@pytest.mark.parametrize("config", [{"threads_per_plane": 1, "accumulators": 1, "block_size_x": 64},
                                    {"threads_per_plane": 8, "accumulators": 8, "block_size_x": 64},
                                    {"threads_per_plane": 64, "accumulators": 2, "block_size_x": 256}])
@pytest.mark.parametrize("layout", LAYOUT_NAMES[2])
def test_max_position_rule_on_nan_inf_and_ties(layout, config, rng):
    x = in_layout(special_planes(rng, (2, 4, 19, 23)), 2, layout)
    values, indices = run("adaptive_max_pool2d", x, config)
    ref_values, ref_indices = reference.forward("adaptive_max_pool2d", x, 1)
    np.testing.assert_array_equal(as_float64(values), ref_values)  # NaN equal to NaN
    np.testing.assert_array_equal(indices, ref_indices)
    t_values, t_indices = torch.nn.functional.adaptive_max_pool2d(torch.from_numpy(np.ascontiguousarray(x)), 1,
                                                                  return_indices=True)
    np.testing.assert_array_equal(values, t_values.numpy())
    np.testing.assert_array_equal(indices, t_indices.numpy())


def test_shaped_for_gpus_only_unless_forced():
    """On PoCL (a CPU device) the variant is no candidate -- tuning, measured dispatch, rules and
    records pass it over -- yet ``variant=`` runs it; on a GPU's limits it is legal."""
    problem = Problem.create("adaptive_avg_pool2d", (2, 64, 7, 7), 1)
    cpu = backends.default_device().info.limits
    assert cpu.device_type == "cpu"
    assert not VARIANT.is_legal({}, problem, cpu)
    with pytest.raises(ValueError, match="shaped for gpu devices and this is a cpu device"):
        VARIANT.check_config({}, problem, cpu)
    assert VARIANT.check_config({}, problem, cpu, forced=True) == VARIANT.default_for(problem)
    gpu = type(cpu)(max_work_group_size=1024, local_mem_size=48 * 1024, device_type="gpu")
    assert VARIANT.is_legal({}, problem, gpu)
    assert pt.explain("adaptive_avg_pool2d", (2, 64, 7, 7), 1, variant=NAME)["variant"] == NAME


def test_only_global_pooling(rng):
    with pytest.raises(ValueError, match="only for global pooling"):
        pt.adaptive_avg_pool2d(random_input(rng, (2, 3, 8, 8)), 2, variant=NAME)
    with pytest.raises(ValueError, match="threads_per_plane must not exceed the plane size"):
        pt.adaptive_avg_pool2d(random_input(rng, (2, 3, 2, 3)), 1, variant=NAME, config={"threads_per_plane": 8})
    with pytest.raises(ValueError, match="threads_per_plane must not exceed block_size_x"):
        pt.adaptive_avg_pool2d(random_input(rng, (2, 3, 64, 64)), 1, variant=NAME,
                               config={"threads_per_plane": 256, "block_size_x": 128})


@pytest.mark.parametrize("plane,team,channels_last_team", [(1, 1, 1), (7, 1, 1), (8, 1, 1), (49, 4, 4), (361, 32, 8),
                                                            (3136, 256, 8), (4225, 256, 8)])
def test_default_team_leaves_each_member_enough_elements(plane, team, channels_last_team):
    """Channels-last, at least 32 teams (neighbouring channels) per work-group of 256."""
    for layout, expected in (("NCL", team), ("NLC", channels_last_team)):
        problem = Problem.create("adaptive_avg_pool1d", (8, 64, plane), 1, layout=layout)
        assert VARIANT.default_for(problem)["threads_per_plane"] == expected, layout


def test_tuning_it_alone_on_a_cpu_device_says_why_before_tuning(user_cache):
    with pytest.raises(ValueError, match="variants: no variant can run .*global_blocks: .*shaped for gpu devices"):
        pt.tune("adaptive_avg_pool2d", (2, 8, 7, 7), 1, variants=[NAME], store=False, max_fevals=2)


def test_a_cpu_record_naming_it_is_passed_over_with_a_warning(user_cache):
    """A record of this very CPU device and shape whose winner is global_blocks (hand-edited: no
    tuning there tries it) is not legal here, so dispatch warns and the rules decide."""
    from pool_tuner import cache, dispatch

    problem = Problem.create("adaptive_avg_pool2d", (2, 64, 7, 7), 1)
    fingerprint = backends.default_device().info.fingerprint
    best = {"variant": NAME, "params": VARIANT.default_for(problem), "time_ms": 0.01}
    dispatch.tuning_cache().store(cache.make_record(problem, fingerprint, cache.record_kernel_hash(problem, fingerprint),
                                                    best, []))
    dispatch.forget()
    with pytest.warns(cache.CacheWarning, match="not legal here"):
        info = pt.explain("adaptive_avg_pool2d", (2, 64, 7, 7), 1)
    assert info["source"] == "default" and info["variant"] != NAME


#: Teams whose merge rounds cross the warp exchange's edge (WARP_WIDTH 32 lanes, kernels/gpu.h) in
#: every way: channels-first teams wider than a warp (local rounds, then warp rounds), teams of a
#: few lanes several to a warp (warp rounds only); channels-last teams interleaved one per slot
#: (members 1 apart: warp rounds from distance 16 down) and 8 or 2 slots apart (the rounds of
#: distance 32 and more in local memory, the rest within the warp).  On OpenCL the warp rounds
#: exchange through local memory with __shfl_down_sync's lane rules, so their arithmetic runs here.
WARP_CONFIGS = [{"block_size_x": 64, "threads_per_plane": 64, "accumulators": 2},
                {"block_size_x": 256, "threads_per_plane": 8, "accumulators": 1},
                {"block_size_x": 128, "threads_per_plane": 128, "accumulators": 4},
                {"block_size_x": 128, "threads_per_plane": 16, "accumulators": 1},
                {"block_size_x": 512, "threads_per_plane": 256, "accumulators": 1}]


#: (op, layout, configuration): every configuration channels-first, the first channels-last in the
#: core tier.
WARP_CASES = tiered([pytest.param(op, layout, config, id=f"{op}-{layout}-{config['block_size_x']}-"
                                                         f"{config['threads_per_plane']}")
                     for op in OPS[2] for layout in LAYOUT_NAMES[2] for config in WARP_CONFIGS],
                    core=lambda values: values[1] == LAYOUT_NAMES[2][0], group=lambda values: values[:2])


@pytest.mark.parametrize("op,layout,config", WARP_CASES)
def test_warp_rounds_match_the_local_memory_tree_and_the_reference(op, layout, config, rng):
    """warp_shuffle merges the same pairs as the tree: the same bits (max: the NaN, -inf and tie
    planes' positions too), and the reference's."""
    x = in_layout(special_planes(rng, (3, 6, 19, 23)) if "max" in op else random_input(rng, (3, 6, 19, 23)), 2, layout)
    shuffled = run(op, x, {**config, "warp_shuffle": 1})
    tree = run(op, x, {**config, "warp_shuffle": 0})
    for a, b in zip(*(r if "max" in op else (r,) for r in (shuffled, tree))):
        np.testing.assert_array_equal(a, b)
    check_special_forward(op, shuffled, x)


def check_special_forward(op, out, x):
    """``check_forward``, where max's planes may hold NaNs: its values (NaN equal to NaN) and
    positions exactly the reference's."""
    if "avg" in op:
        check_forward(op, out, x)
        return
    values, indices = out
    ref_values, ref_indices = reference.forward(op, x, 1)
    np.testing.assert_array_equal(as_float64(values), ref_values)
    np.testing.assert_array_equal(indices, ref_indices)


def offset_view(x, elements):
    """``x``'s values in a C-contiguous array that starts ``elements`` elements past an aligned
    allocation: what a slice of a larger array hands over."""
    storage = np.empty((x.size + 8) * x.itemsize + 64, np.uint8)
    start = -storage.ctypes.data % 64 + elements * x.itemsize
    view = storage[start:start + x.nbytes].view(x.dtype).reshape(x.shape)
    view[...] = x
    assert view.ctypes.data % 64 == elements * x.itemsize
    return view


@pytest.mark.parametrize("offset", [0, 1, 2], ids=lambda o: f"offset{o}")
@pytest.mark.parametrize("dtype", ["float32", *(pytest.param(d, marks=EXHAUSTIVE) for d in ("float64", "float16", "bfloat16"))])
@pytest.mark.parametrize("vector_width", [2, 4])
@pytest.mark.parametrize("op", OPS[2])
def test_vector_loads_on_aligned_and_offset_inputs(op, vector_width, dtype, offset, rng):
    """Planes of 20x22 and 4x4 elements (multiples of 4) read vector_width at a time from an input
    that starts on a vector boundary, and element by element from one that does not (offset by one
    or two elements): both the reference's results, max's positions on tie/NaN planes exactly."""
    for shape in ((2, 6, 20, 22), (2, 7, 4, 4)):
        base = special_planes(rng, shape) if "max" in op and shape[-1] > 4 else random_input(rng, shape)
        x = offset_view(base.astype(np_dtype(dtype)), offset)
        for team, accumulators in ((4, 4), (32, 1)):
            if team * vector_width > shape[-1] * shape[-2]:
                continue
            config = {"threads_per_plane": team, "accumulators": accumulators, "vector_width": vector_width,
                      "block_size_x": 64}
            check_special_forward(op, run(op, x, config), x)


def test_vector_width_legality(rng):
    """Vectors are neighbouring positions of a channels-first plane whose size they divide."""
    with pytest.raises(ValueError, match="vector_width > 1 needs channels-first memory"):
        run("adaptive_avg_pool2d", in_layout(random_input(rng, (2, 8, 4, 4)), 2, "NHWC"), {"vector_width": 2})
    with pytest.raises(ValueError, match="vector_width must divide the plane size 15"):
        run("adaptive_avg_pool2d", random_input(rng, (2, 8, 3, 5)), {"vector_width": 2})
    with pytest.raises(ValueError, match="threads_per_plane must not exceed the plane size 16 divided by vector_width 4"):
        run("adaptive_avg_pool2d", random_input(rng, (2, 8, 4, 4)), {"vector_width": 4, "threads_per_plane": 8})
    gpu = type(backends.default_device().info.limits)(max_work_group_size=1024, local_mem_size=48 * 1024,
                                                        device_type="gpu")
    problem = Problem.create("adaptive_avg_pool2d", (2, 8, 4, 4), 1)
    assert {c["vector_width"] for c in VARIANT.legal_configurations(problem, gpu)} == {1, 2, 4}


# ---------------------------------------------------------------- split planes: a second pass

#: Configurations that cut each plane into parts (``split``) merged by the second pass: one member
#: per part, a team with the warp rounds, vector loads; 128 parts of a 64-member team.
SPLIT_CONFIGS = [
    {"split": 2, "threads_per_plane": 1, "accumulators": 1, "block_size_x": 64},
    {"split": 8, "threads_per_plane": 32, "accumulators": 4, "block_size_x": 128, "warp_shuffle": 1},
    {"split": 16, "threads_per_plane": 64, "accumulators": 2, "block_size_x": 64, "vector_width": 4},
    {"split": 128, "threads_per_plane": 64, "accumulators": 8, "block_size_x": 256},
]


def split_id(config):
    return "-".join(f"{k[:3]}{v}" for k, v in config.items())


def split_configs(problem):
    """Those of ``SPLIT_CONFIGS`` that the kernel can run for ``problem`` (vector loads need
    channels-first planes whose length they divide)."""
    limits = backends.default_device().info.limits
    return [c for c in SPLIT_CONFIGS if VARIANT.refusal({**VARIANT.default_for(problem), **c}, problem, limits,
                                                        forced=True) is None]


#: (op, layout, dtype): float32 in every op and layout in the core tier, the other dtypes once each.
SPLIT_DTYPE_CASES = tiered([pytest.param(op, layout, dtype, id=f"{op}-{layout}-{dtype}")
                            for dtype in ("float32", "float64", "float16", "bfloat16")
                            for op in OPS[2] for layout in LAYOUT_NAMES[2]],
                           core=lambda values: values[2] == "float32", group=lambda values: values[2])


@pytest.mark.parametrize("op,layout,dtype", SPLIT_DTYPE_CASES)
def test_split_planes_match_the_reference(op, layout, dtype, rng):
    """Three planes of 70k elements, each cut into parts over work-groups whose results a second
    pass merges, every dtype, either layout: the float64 reference of the stored input."""
    x = in_layout(random_input(rng, (1, 3, 256, 272), np.float64).astype(np_dtype(dtype)), 2, layout)
    check_forward(op, run(op, x, SPLIT_CONFIGS[1]), x)


#: (op kind, shape, rank): each rank once in the core tier (average pooling's 1-d and 3-d, max
#: pooling's batch-less 2-d), the other kind's exhaustive.
SPLIT_RANK_CASES = tiered([pytest.param(op_kind, shape, ndim, id=f"{('avg', 'max')[op_kind]}-{ndim}d")
                           for shape, ndim in [((2, 3, 40001), 1), ((3, 2, 9, 61, 67), 3), ((4, 123, 129), 2)]
                           for op_kind in (0, 1)],
                          core=lambda values: (values[0], values[2]) in {(0, 1), (0, 3), (1, 2)})


@pytest.mark.parametrize("op_kind,shape,ndim", SPLIT_RANK_CASES)
def test_split_planes_of_every_rank_and_batch_less(shape, ndim, op_kind, rng):
    """Parts that do not divide the plane (the last part shorter), every rank, a batch-less input."""
    op = OPS[ndim][op_kind]
    for layout in LAYOUT_NAMES[ndim]:
        x = in_layout(random_input(rng, shape), ndim, layout)
        for config in split_configs(Problem.create(op, shape, 1, layout=layout)):
            check_forward(op, run(op, x, config), x)


@pytest.mark.parametrize("config", SPLIT_CONFIGS, ids=split_id)
@pytest.mark.parametrize("layout", LAYOUT_NAMES[2])
def test_split_planes_keep_max_position_rule_across_parts(layout, config, rng):
    """NaN, -inf and ties placed so that the rule is decided between parts (the winner in a late
    part, ties across parts): the reference's positions and PyTorch's, exactly."""
    if config.get("vector_width", 1) > 1 and layout == "NHWC":
        pytest.skip("vector loads need channels-first memory")
    x = special_planes(rng, (2, 4, 128, 130))
    planes = x.reshape(8, -1)
    size = planes.shape[1]
    planes[6] = 2.0                          # a tie over every part: the first position
    planes[7, :] = 0.0
    planes[7, [5, size // 2, size - 3]] = 9.0  # a tie between parts 0, the middle and the last
    x = in_layout(x, 2, layout)
    values, indices = run("adaptive_max_pool2d", x, config)
    ref_values, ref_indices = reference.forward("adaptive_max_pool2d", x, 1)
    np.testing.assert_array_equal(as_float64(values), ref_values)
    np.testing.assert_array_equal(indices, ref_indices)
    t_values, t_indices = torch.nn.functional.adaptive_max_pool2d(torch.from_numpy(np.ascontiguousarray(x)), 1,
                                                                  return_indices=True)
    np.testing.assert_array_equal(values, t_values.numpy())
    np.testing.assert_array_equal(indices, t_indices.numpy())


def test_split_planes_are_deterministic_and_a_few_huge_planes_work(rng):
    """1x4x2048x2048 -> 1 (four planes of 4M elements) on the default's split: the same bits on
    every run, within float32's tolerance of the reference and of PyTorch."""
    x = rng.standard_normal((1, 4, 2048, 2048), dtype=np.float32)
    problem = Problem.create("adaptive_avg_pool2d", x.shape, 1)
    config = VARIANT.default_for(problem)
    assert config["split"] == 64
    first = run("adaptive_avg_pool2d", x, config)
    assert np.array_equal(first, run("adaptive_avg_pool2d", x, config))
    check_forward("adaptive_avg_pool2d", first, x)
    np.testing.assert_allclose(first, torch.nn.functional.adaptive_avg_pool2d(torch.from_numpy(x), 1).numpy(),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", OPS[2])
def test_split_planes_through_every_front_end(op, rng):
    """``pool_tuner.torch`` (eager, and autograd's custom op with a gradient) and PyOpenCL arrays
    allocate the scratch buffer their own way and launch both passes: the same results as numpy."""
    import pyopencl.array as cl_array

    import pool_tuner.torch as ptt

    config = SPLIT_CONFIGS[1]
    x = random_input(rng, (2, 3, 100, 101))
    expected = run(op, x, config)
    fn = getattr(ptt, op)
    kwargs = {"return_indices": True} if "max" in op else {}
    eager = fn(torch.from_numpy(x), 1, variant=NAME, config=config, **kwargs)
    t = torch.from_numpy(x).requires_grad_()
    with_grad = fn(t, 1, variant=NAME, config=config, **kwargs)
    queue = backends.default_device().queue
    on_device = getattr(pt, op)(cl_array.to_device(queue, x), 1, *([True] if "max" in op else []), variant=NAME,
                                config=config)
    for got in (eager, with_grad):
        for g, e in zip(got if "max" in op else (got,), expected if "max" in op else (expected,)):
            np.testing.assert_array_equal(g.detach().numpy(), e)
    for g, e in zip(on_device if "max" in op else (on_device,), expected if "max" in op else (expected,)):
        np.testing.assert_array_equal(g.get(), e)


def test_split_legality_and_default():
    """``split`` leaves every member of every part an element; the default splits only planes huge
    enough for parts of ``MIN_PART_ELEMENTS`` and only while the launch is short of ``MIN_GROUPS``."""
    limits = backends.default_device().info.limits
    small = Problem.create("adaptive_avg_pool2d", (1, 2, 16, 16), 1)
    with pytest.raises(ValueError, match="split must not exceed the plane size 256"):
        VARIANT.check_config({"split": 8, "threads_per_plane": 64}, small, limits, forced=True)
    assert VARIANT.check_config({"split": 4, "threads_per_plane": 64}, small, limits, forced=True)["split"] == 4
    for shape, split in [((1, 4, 4096, 4096), 64), ((2, 1, 16384, 16384), 128), ((8, 2048, 64, 64), 1),
                         ((32, 2048, 7, 7), 1), ((1, 1, 100, 100), 1), ((1, 1, 1024, 1024), 64)]:
        problem = Problem.create("adaptive_avg_pool2d", shape, 1)
        assert VARIANT.default_for(problem)["split"] == split, shape
        params = VARIANT.default_for(problem)
        assert (VARIANT.second_pass(params, problem) is None) == (split == 1)
        assert VARIANT.scratch_bytes(params, problem) == (0 if split == 1 else -(-shape[0] * shape[1] * split // 2) * 16)
