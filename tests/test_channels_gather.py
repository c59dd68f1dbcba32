"""channels_gather, the channels-last backward gather, through the public backward functions with
``variant=``: every rank, avg and max, uniform and non-uniform windows, upsampling, batch-less inputs,
channel counts its runs divide and ones they do not (a masked last run), every dtype;
against the float64 reference and bit for bit against thread_per_input (the project's one summation
order).  Its legality: channels-last problems only, even when forced.  (Its 64-bit build:
tests/test_index64.py; CUDA compile: tests/test_compile_check.py; Oclgrind: tests/test_oclgrind.py;
the hash of the records: tests/test_kernel_source.py.)"""

import random

import numpy as np
import pytest

import pool_tuner as pt
from pool_tuner import backends, reference
from pool_tuner.problem import LAYOUT_NAMES, Problem
from pool_tuner.shapes import resolve_output_size
from pool_tuner.variants import variants_for

from conftest import random_input, tiered
from test_matrix import TOLERANCES, as_float64, backward, check_result, in_layout, np_dtype

NAME = "channels_gather"
VARIANT = variants_for("adaptive_avg_pool2d", "backward")[NAME]

#: (input shape, output size): non-uniform and uniform windows, upsampling, O = I, size-1 axes,
#: batch-less; channel counts that the default run of 64 divides,
#: that only narrower runs divide (72, 130), and odd ones.
SHAPES = {
    1: [((2, 5, 13), 5), ((3, 64, 12), 4), ((70, 9), 4), ((2, 3, 5), 9)],
    2: [((2, 5, 10, 9), (4, 7)), ((2, 48, 8, 8), (4, 4)), ((1, 72, 17, 17), (5, 5)), ((33, 7, 6), (3, 2)),
        ((1, 3, 1, 9), (1, 4)), ((2, 130, 6, 5), (6, 5)), ((1, 128, 3, 4), (7, 9))],
    3: [((2, 3, 5, 6, 7), (3, 4, 2)), ((1, 16, 4, 4, 4), 2), ((9, 3, 4, 5), (2, 5, 2))],
}


def configs_for(problem, count=2):
    """The default, the first and last legal configuration, and a seeded random few (masked runs
    among them where the channel count allows)."""
    legal = VARIANT.legal_configurations(problem, backends.default_device().info.limits)
    picks = [VARIANT.check_config({}, problem, backends.default_device().info.limits), legal[0], legal[-1]]
    picks += random.Random(str(problem.input_shape)).sample(legal, min(count, len(legal)))
    return [dict(c) for c in dict.fromkeys(tuple(sorted(c.items())) for c in picks)]


def _cases():
    cases = []
    for ndim, shapes in SHAPES.items():
        layout = LAYOUT_NAMES[ndim][1]
        for shape, size in shapes:
            for kind in ("avg", "max"):
                op = f"adaptive_{kind}_pool{ndim}d"
                problem = Problem.create(op, shape, size, "float32", layout, direction="backward")
                for config in configs_for(problem):
                    label = "-".join(str(v) for v in config.values())
                    cases.append(pytest.param(op, shape, size, config, id=f"{op}-{shape}->{size}-{label}"))
    return tiered(cases, group=lambda values: values[:3])  # core: every problem's first configuration


def gradients(op, shape, size, dtype, rng, **kwargs):
    """(ours, thread_per_input's, the float64 reference) for fresh random channels-last inputs."""
    ndim = int(op[-2])
    layout = LAYOUT_NAMES[ndim][1]
    dt = np_dtype(dtype)
    x = in_layout(random_input(rng, shape, np.float64).astype(dt), ndim, layout)
    out_shape = shape[:-ndim] + resolve_output_size(size, shape[-ndim:])
    grad_out = in_layout(random_input(rng, out_shape, np.float64).astype(dt), ndim, layout)
    indices = ref_indices = None
    if op.startswith("adaptive_max"):
        _, ref_indices = reference.forward(op, x, size)
        indices = in_layout(ref_indices, ndim, layout)
    ours = backward(op, grad_out, shape, indices, variant=NAME, **kwargs)
    gather = backward(op, grad_out, shape, indices, variant="thread_per_input")
    return ours, gather, reference.backward(op, grad_out, shape, ref_indices)


@pytest.mark.parametrize("op,shape,size,config", _cases())
def test_matches_the_reference_and_thread_per_input_bit_for_bit(op, shape, size, config, rng):
    ndim = int(op[-2])
    ours, gather, expected = gradients(op, shape, size, "float32", rng, config=config)
    check_result(ours, expected, np.dtype(np.float32), LAYOUT_NAMES[ndim][1], ndim)
    assert ours.tobytes() == gather.tobytes(), "the sums differ from the gathers' order"


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
@pytest.mark.parametrize("op", ["adaptive_avg_pool2d", "adaptive_max_pool2d", "adaptive_avg_pool3d"])
@pytest.mark.parametrize("config", [{}, {"channels_per_item": 4}, {"rows_per_item": 4, "positions_per_item": 4}],
                         ids=["default", "masked", "tiles"])
def test_every_dtype(op, dtype, config, rng):
    """Every storage dtype, with the default run, a masked one (4 does not divide 130 or 5) and
    tiles whose rows and positions take the stored sums of the ones before them."""
    shape, size = {2: ((2, 130, 6, 7), (4, 3)), 3: ((2, 5, 5, 6, 7), (3, 4, 2))}[int(op[-2])]
    ours, gather, expected = gradients(op, shape, size, dtype, rng, config=config)
    got = as_float64(ours)
    assert not np.isnan(got).any(), "some input gradients were never written (poisoned NaN left)"
    np.testing.assert_allclose(got, expected, **TOLERANCES[dtype])
    assert ours.tobytes() == gather.tobytes()


def test_refused_for_channels_first_problems_even_when_forced():
    """Its offsets assume channels-last memory: no rule, record or ``variant=`` may run it on a
    channels-first problem."""
    grad_out = np.ones((2, 8, 3, 3), np.float32)
    with pytest.raises(ValueError, match="channels_gather.*needs channels-last memory"):
        pt.adaptive_avg_pool2d_backward(grad_out, (2, 8, 7, 7), variant=NAME)
    problem = Problem.create("adaptive_avg_pool2d", (2, 8, 7, 7), 3, direction="backward")
    assert not VARIANT.is_legal({}, problem, backends.default_device().info.limits)
    assert VARIANT.refusal(VARIANT.default, problem, backends.default_device().info.limits, forced=True)


@pytest.mark.parametrize("channels,expected", [(768, 64), (512, 64), (96, 32), (72, 8), (130, 2), (3, 1), (1, 1)])
def test_the_default_run_is_the_widest_that_divides_the_channels(channels, expected):
    problem = Problem.create("adaptive_avg_pool2d", (2, channels, 9, 9), 4, layout="NHWC", direction="backward")
    assert VARIANT.default_for(problem)["channels_per_item"] == expected


@pytest.mark.parametrize("op,shape,size,runs", [
    ("adaptive_avg_pool2d", (8, 768, 17, 17), (5, 5), (16, 16)),  # overlapping windows: the longest runs
    ("adaptive_avg_pool2d", (2, 64, 7, 7), (4, 4), (4, 4)),  # ... that fit
    ("adaptive_avg_pool2d", (2, 64, 17, 12), (5, 12), (1, 16)),  # along H only (W keeps its width)
    ("adaptive_avg_pool2d", (2, 64, 12, 17), (6, 5), (16, 1)),  # along W only (H's windows 2 apart)
    ("adaptive_avg_pool2d", (4, 512, 60, 60), (6, 6), (1, 1)),  # windows that do not overlap
    ("adaptive_avg_pool2d", (2, 32, 56, 56), (85, 85), (1, 1)),  # upsampling
    ("adaptive_max_pool2d", (8, 768, 17, 17), (5, 5), (1, 1)),  # max: no two positions share a gradient
    ("adaptive_avg_pool1d", (2, 64, 30), (7,), (16, 1)),
    ("adaptive_avg_pool2d", (2, 64, 17, 17), (0, 5), (16, 1)),  # an empty output
    ("adaptive_avg_pool3d", (2, 64, 4, 9, 9), (2, 4, 4), (8, 8))])
def test_the_default_runs_where_windows_overlap(op, shape, size, runs):
    """The default takes runs of positions (rows) along W (H) where the average's windows overlap
    there, and one position (row) elsewhere."""
    problem = Problem.create(op, shape, size, layout=LAYOUT_NAMES[len(shape) - 2][1], direction="backward")
    config = VARIANT.default_for(problem)
    assert (config["positions_per_item"], config["rows_per_item"]) == runs


def test_runs_wider_than_the_channels_are_refused():
    problem = Problem.create("adaptive_avg_pool2d", (2, 6, 9, 9), 4, layout="NHWC", direction="backward")
    limits = backends.default_device().info.limits
    assert VARIANT.is_legal({"channels_per_item": 4}, problem, limits)  # masked: 4 and 2 channels
    with pytest.raises(ValueError, match="channels_per_item must not exceed the number of channels"):
        VARIANT.check_config({"channels_per_item": 8}, problem, limits)


@pytest.mark.parametrize("dtype,widest", [("float32", 128), ("float16", 128), ("float64", 64)])
def test_runs_past_the_register_budget_are_refused(dtype, widest, rng):
    """A work-item's sums are one accumulation-type value per channel, kept in registers: runs past
    ``REGISTER_WORDS`` 32-bit words spill on CUDA (256 channels of float32 and 128 of float64 did in
    ``compile-check cuda``), so they are refused, on every device, naming the parameter and the
    widest run allowed; the widest allowed run still gives the reference's result and the gathers'
    bits."""
    shape, size = (1, 256, 5, 6), (3, 4)
    grad_out = np.zeros((1, 3, 4, 256), np_dtype(dtype)).transpose(0, 3, 1, 2)
    with pytest.raises(ValueError, match=f"channels_per_item must keep the sums within 128 .*at most {widest} "):
        pt.adaptive_avg_pool2d_backward(grad_out, shape, variant=NAME, config={"channels_per_item": widest * 2})
    ours, gather, expected = gradients("adaptive_avg_pool2d", shape, size, dtype, rng,
                                       config={"channels_per_item": widest})
    np.testing.assert_allclose(as_float64(ours), expected, **TOLERANCES[dtype])
    assert ours.tobytes() == gather.tobytes()


@pytest.mark.parametrize("op,shape,size,layout,chosen", [
    ("adaptive_avg_pool2d", (8, 768, 17, 17), (5, 5), "NHWC", True),
    ("adaptive_avg_pool3d", (2, 64, 4, 9, 9), (2, 4, 4), "NDHWC", True),
    ("adaptive_avg_pool1d", (2, 64, 30), (7,), "NLC", True),
    ("adaptive_avg_pool2d", (8, 768, 17, 17), (5, 5), "NCHW", False),
    ("adaptive_avg_pool2d", (8, 768, 17, 17), (1, 1), "NHWC", False),  # global: broadcast
    ("adaptive_max_pool2d", (8, 768, 17, 17), (5, 5), "NHWC", False),  # max, small outputs: plane_scatter's
    ("adaptive_max_pool2d", (2, 64, 24, 24), (37, 37), "NHWC", True),  # max, 1369 outputs per plane
    ("adaptive_max_pool2d", (2, 64, 24, 24), (37, 37), "NCHW", False),
])
def test_the_cpu_rules_send_channels_last_average_backward_here(op, shape, size, layout, chosen, user_cache):
    """With no record, a CPU dispatches every non-global channels-last avg backward, and max backward
    of 1263 outputs per plane or more, to channels_gather, and names the rule with its evidence."""
    info = pt.explain(op, shape, size, layout=layout, direction="backward")
    if backends.default_device().info.limits.device_type != "cpu":
        pytest.skip("the rule is a CPU rule")
    assert info["source"] == "default"
    assert (info["variant"] == NAME) == chosen, info
    if chosen:
        assert info["rule_evidence"].startswith("by hand: benchmarks/grid_race.py")


def test_refused_for_global_pooling():
    """A global grad_out (one value per plane) is the same memory in either layout and reads as
    channels-first, so a channels-last global problem (tune's or explain's ``layout=``) must not
    pick a variant that its calls could not run."""
    problem = Problem.create("adaptive_avg_pool2d", (2, 8, 7, 7), 1, layout="NHWC", direction="backward")
    with pytest.raises(ValueError, match="not for global pooling"):
        VARIANT.check_config({}, problem, backends.default_device().info.limits, forced=True)


@pytest.mark.parametrize("op,shape,size", [
    ("adaptive_avg_pool2d", (2, 48, 17, 17), (5, 5)), ("adaptive_max_pool2d", (2, 48, 17, 17), (5, 5)),
    ("adaptive_avg_pool2d", (3, 20, 6, 9), (4, 13)), ("adaptive_avg_pool3d", (2, 16, 3, 5, 10), (2, 3, 4)),
    ("adaptive_avg_pool1d", (2, 24, 30), (7,))])
@pytest.mark.parametrize("positions_per_item", [2, 4, 8])
def test_runs_along_w_whole_and_short(op, shape, size, positions_per_item, rng):
    """Runs of positions along W that divide the width and ones that leave a short last run per row
    (17, 9, 10 and 30 wide): every input written once, in the gathers' order."""
    if positions_per_item > shape[-1]:
        pytest.skip("wider than the row")
    config = {"positions_per_item": positions_per_item, "channels_per_item": 8, "block_size_x": 4}
    ndim = int(op[-2])
    ours, gather, expected = gradients(op, shape, size, "float32", rng, config=config)
    check_result(ours, expected, np.dtype(np.float32), LAYOUT_NAMES[ndim][1], ndim)
    assert ours.tobytes() == gather.tobytes(), "the sums differ from the gathers' order"


@pytest.mark.parametrize("shape,parameter,extent", [((2, 8, 9, 3), "positions_per_item", "width"),
                                                     ((2, 8, 3, 9), "rows_per_item", "height")])
def test_tiles_past_the_input_are_refused(shape, parameter, extent):
    """Runs wider than the input's rows, and tiles taller than its planes, are refused by name."""
    problem = Problem.create("adaptive_avg_pool2d", shape, 2, layout="NHWC", direction="backward")
    limits = backends.default_device().info.limits
    assert VARIANT.is_legal({parameter: 2}, problem, limits)
    with pytest.raises(ValueError, match=f"{parameter} must not exceed the input's {extent}"):
        VARIANT.check_config({parameter: 4}, problem, limits)


@pytest.mark.parametrize("op,shape,size", [
    ("adaptive_avg_pool2d", (2, 48, 17, 17), (5, 5)), ("adaptive_max_pool2d", (2, 48, 17, 17), (5, 5)),
    ("adaptive_avg_pool2d", (3, 20, 9, 6), (13, 4)), ("adaptive_avg_pool2d", (2, 8, 12, 10), (3, 1)),
    ("adaptive_avg_pool3d", (2, 16, 3, 10, 5), (2, 4, 3)), ("adaptive_max_pool3d", (2, 16, 3, 10, 5), (2, 4, 3)),
    ("adaptive_avg_pool1d", (2, 24, 30), (7,))])
@pytest.mark.parametrize("rows_per_item,positions_per_item", [(2, 1), (4, 4), (8, 2), (16, 8)])
def test_tiles_of_rows_whole_and_short(op, shape, size, rows_per_item, positions_per_item, rng):
    """Tiles of rows by positions whose rows (positions) inside the same windows take the row's
    (position's) sums before them, and that divide the height or leave a short last tile (17, 9,
    10 and 12 high); downsampling, upsampling (no two rows share their windows) and windows of
    the whole width; avg and max (whose positions never share): every input written once, in the
    gathers' order."""
    height = shape[-2] if int(op[-2]) >= 2 else 1
    if rows_per_item > max(height, 1) and rows_per_item > 1 or positions_per_item > shape[-1]:
        pytest.skip("taller (wider) than the input")
    config = {"rows_per_item": rows_per_item, "positions_per_item": positions_per_item, "channels_per_item": 8,
              "block_size_x": 4}
    ndim = int(op[-2])
    ours, gather, expected = gradients(op, shape, size, "float32", rng, config=config)
    check_result(ours, expected, np.dtype(np.float32), LAYOUT_NAMES[ndim][1], ndim)
    assert ours.tobytes() == gather.tobytes(), "the sums differ from the gathers' order"


