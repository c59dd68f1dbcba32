"""Every bad argument raises TypeError/ValueError naming the argument, before any kernel is built."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import pool_tuner as pt
from pool_tuner import backends, dispatch
from pool_tuner.backends.opencl import OpenCLDevice
from pool_tuner.problem import Problem

OP2 = "adaptive_avg_pool2d"
GOOD = np.ones((2, 3, 8, 8), np.float32)


@pytest.fixture(autouse=True)
def no_kernel_may_run(monkeypatch):
    """Fail loudly if anything gets as far as building or launching a kernel."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a kernel was built or launched for bad input")

    monkeypatch.setattr(dispatch, "prepare", forbidden)
    monkeypatch.setattr(OpenCLDevice, "launch", staticmethod(forbidden))


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: pt.adaptive_avg_pool2d([[1.0]], 1), TypeError, "x must be a numpy.ndarray"),
        (lambda: pt.adaptive_avg_pool2d(np.ones((2, 3, 8, 8), np.int32), 1), TypeError, "x.dtype"),
        (lambda: pt.adaptive_avg_pool2d(np.ones((2, 3, 8, 8), np.complex64), 1), TypeError, "x.dtype"),
        (lambda: pt.adaptive_avg_pool2d(GOOD.astype(">f4"), 1), TypeError, "x.dtype must be in native byte order, got >f4"),
        (lambda: pt.adaptive_max_pool2d_backward(np.ones((2, 3, 4, 4), ">f8"), np.zeros((2, 3, 4, 4), np.int64),
                                                 (2, 3, 8, 8)), TypeError, "grad_out.dtype must be in native byte order"),
        (lambda: pt.explain(OP2, (2, 3, 8, 8), 2, dtype=">f4"), TypeError, "dtype must be in native byte order"),
        (lambda: pt.tune(OP2, (2, 3, 8, 8), 2, time_limit=-5), ValueError, "time_limit must be a positive number"),
        (lambda: pt.tune(OP2, (2, 3, 8, 8), 2, time_limit=float("nan")), ValueError, "time_limit must be a positive"),
        (lambda: pt.tune(OP2, (2, 3, 8, 8), 2, max_fevals=0), ValueError, "max_fevals must be a positive integer"),
        (lambda: pt.tune(OP2, (2, 3, 8, 8), 2, strategy="nonsense"), ValueError, "strategy must be a Kernel Tuner"),
        (lambda: pt.tune(OP2, (2, 3, 8, 8), 2, iterations=0), ValueError, "iterations must be a positive integer"),
        (lambda: pt.tune(OP2, (2, 3, 8, 8), 2, iterations="9"), ValueError, "iterations must be a positive integer"),
        (lambda: pt.tune(OP2, (2, 3, 8, 8), 2, variants=[]), ValueError, "variants must name at least one variant"),
        (lambda: pt.tune(OP2, (2, 3, 8, 8), 2, variants=["plane_reduce"]), ValueError,
         r"variants: no variant can run .* \(plane_reduce: only for global pooling"),
        (lambda: pt.tune(OP2, (100000, 100000, 5, 5), 3), ValueError, "output_size gives an output of shape"),
        (lambda: pt.tune(OP2, (1, 1, 50000, 50000), 1), ValueError, r"input_shape \(1, 1, 50000, 50000\): the problem's input"),
        (lambda: pt.adaptive_avg_pool2d(np.ones((8, 8), np.float32), 1), ValueError, "x must be 3-d or 4-d"),
        (lambda: pt.adaptive_avg_pool2d(np.ones((1, 2, 3, 8, 8), np.float32), 1), ValueError, "x must be 3-d or 4-d"),
        (lambda: pt.adaptive_avg_pool2d(np.ones((2, 3, 0, 8), np.float32), 1), ValueError, "pooled dimension of size 0"),
        (lambda: pt.adaptive_avg_pool2d(GOOD, -1), ValueError, r"output_size must be >= 0"),
        (lambda: pt.adaptive_avg_pool2d(GOOD, (2, -3)), ValueError, r"output_size\[1\] must be >= 0"),
        (lambda: pt.adaptive_avg_pool2d(GOOD, 2.5), TypeError, "output_size must be an int"),
        (lambda: pt.adaptive_avg_pool2d(GOOD, (2.0, 2)), TypeError, r"output_size\[0\] must be an int"),
        (lambda: pt.adaptive_avg_pool2d(GOOD, (2, 2, 2)), ValueError, "output_size must have 2 entries"),
        (lambda: pt.adaptive_avg_pool2d(GOOD, None), TypeError, "output_size must be an int"),
        (lambda: pt.adaptive_avg_pool2d(GOOD, True), TypeError, "output_size must be an int"),
        (lambda: pt.adaptive_avg_pool2d(GOOD, b"47"), TypeError, "output_size must be an int or a sequence of 2 ints/None, got bytes"),
        (lambda: pt.adaptive_avg_pool2d(GOOD, bytearray(b"47")), TypeError, "output_size must be an int or a sequence"),
        (lambda: pt.adaptive_avg_pool2d(GOOD, "47"), TypeError, "output_size must be an int or a sequence of 2 ints/None, got str"),
        (lambda: pt.adaptive_avg_pool2d(GOOD, "4x7"), TypeError, "output_size must be an int or a sequence"),
        (lambda: pt.explain(OP2, (2, 3, 8, 8), b"47"), TypeError, "output_size must be an int or a sequence"),
        (lambda: pt.adaptive_avg_pool2d(GOOD, 2, return_indices=True), TypeError, "return_indices"),
        (lambda: pt.adaptive_avg_pool2d(GOOD, 2, variant="fastest"), ValueError, "variant must be one of"),
        (lambda: pt.adaptive_avg_pool2d(GOOD, 2, config={"block_size_x": 64}), ValueError, "config= needs variant="),
        (lambda: pt.adaptive_avg_pool2d(GOOD, 2, variant="thread_per_output", config={"tile": 2}), ValueError, "unknown parameters"),
        (lambda: pt.adaptive_avg_pool2d(GOOD, 2, variant="thread_per_output", config={"block_size_x": 100}), ValueError, r"config\['block_size_x'\] must be one of"),
        (lambda: pt.adaptive_avg_pool2d(GOOD, 2, variant="thread_per_output", config=[64]), TypeError, "config must be a dict"),
        (lambda: pt.adaptive_avg_pool2d(GOOD, 2, variant="block_per_row", config={"block_size_x": 32, "threads_per_output": 64}), ValueError, "threads_per_output must not exceed"),
        (lambda: pt.adaptive_avg_pool2d(GOOD, 2, variant="plane_reduce"), ValueError, "only for global pooling"),
        (lambda: pt.adaptive_avg_pool2d(np.ones((1, 1, 2, 4097), np.float32), 1, variant="thread_per_row"),
         ValueError, "need 16388 bytes of column partials per work-item; the limit is 16384"),
        (lambda: pt.adaptive_max_pool1d_backward(np.ones((1, 2, 4), np.float32), np.array([[[0, 2, 4, 6]] * 2]), (1, 2, 9),
                                                 variant="thread_per_row"), ValueError, "is for average pooling"),
        (lambda: pt.adaptive_avg_pool1d_backward(np.ones((1, 2, 7), np.float32), (1, 2, 3), variant="thread_per_row"),
         ValueError, "at most two windows along W"),
        (lambda: pt.adaptive_avg_pool2d(GOOD, 2, device="cuda:7"), ValueError, "device must be one of"),
        (lambda: pt.adaptive_avg_pool2d(GOOD, 2, device=3), TypeError, "device must be a device id"),
        (lambda: pt.explain("adaptive_mean_pool2d", (2, 3, 8, 8), 2), ValueError, "op must be one of"),
        (lambda: pt.explain(OP2, (2, 3, 8, 8), 2, dtype="int8"), TypeError, "dtype must be one of"),
        (lambda: pt.explain(OP2, (2, 3, 8, 8), 2, layout="NWHC"), ValueError, "layout must be"),
        (lambda: pt.explain(OP2, (8,), 2, layout="NCHW"), ValueError, "input_shape must be 3-d or 4-d"),
        (lambda: pt.variants("adaptive_avg_pool4d"), ValueError, "op must be one of"),
        (lambda: pt.pooling_windows(-1, 3), ValueError, "in_size"),
        (lambda: pt.fixed_pool_equivalent(4, 1.5), TypeError, "out_size"),
    ],
)
def test_bad_argument_is_named(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("call", [
    lambda: pt.adaptive_avg_pool1d(np.ones((2, 3, 8), np.float32), 2**40),
    lambda: pt.adaptive_max_pool2d(GOOD, (3, 2**41)),
    lambda: pt.explain("adaptive_avg_pool1d", (2, 3, 8), 2**40),
    lambda: pt.explain(OP2, (2, 3, 8, 8), (2**31, 1), direction="backward"),
    lambda: pt.reference.adaptive_max_pool(GOOD, (2**40, 2), 2),
], ids=["1d", "2d", "explain", "explain-backward", "reference"])
def test_absurd_output_sizes_are_refused_before_any_allocation(call):
    """Sizes past int32 on an axis would otherwise fail with MemoryError inside window math."""
    with pytest.raises(ValueError, match=r"output_size\[\d\] must be <= 2147483647 \(2\*\*31 - 1\), got"):
        call()


def test_absurd_output_planes_are_refused():
    with pytest.raises(ValueError, match=r"output_size .* elements per plane; the limit is 9223372036854775807"):
        pt.explain("adaptive_avg_pool3d", (1, 1, 2, 2, 2), 2**31 - 1)


@pytest.mark.parametrize("size", [2**40, 2**63, (3, 2**64)])
def test_absurd_output_sizes_are_refused_by_pool_tuner_torch(size):
    torch = pytest.importorskip("torch")
    import pool_tuner.torch as ptt

    x = torch.from_numpy(GOOD)
    with pytest.raises(ValueError, match=r"output_size\[\d\] must be <= 2147483647"):
        ptt.adaptive_max_pool2d(x, size)
    with pytest.raises(ValueError, match=r"output_size\[\d\] must be <= 2147483647"):
        ptt.AdaptiveAvgPool2d(size)(x)


def test_bad_device_environment_variable_is_named(monkeypatch):
    monkeypatch.setenv("POOL_TUNER_DEVICE", "opencl:99:99")
    with pytest.raises(ValueError, match="POOL_TUNER_DEVICE must be one of"):
        pt.adaptive_avg_pool2d(GOOD, 2)


def test_array_on_another_device_is_refused():
    import pyopencl.array as cl_array

    from pool_tuner import backends

    others = [d for d in pt.devices() if d is not backends.default_device()]
    if not others:
        pytest.skip("needs two OpenCL devices (PoCL and Oclgrind)")
    x = cl_array.to_device(backends.default_device().queue, GOOD)
    with pytest.raises(ValueError, match="does not hold x"):
        pt.adaptive_avg_pool2d(x, 2, device=others[0].info.id)



def test_a_validated_forced_config_does_not_vouch_for_an_equal_bool():
    """Forced choices are memoised after validation; True == 1, but True is still refused."""
    problem, device = Problem.create(OP2, GOOD.shape, (2, 2)), backends.default_device()
    dispatch.choose(problem, device, "thread_per_output", {"row_lanes": 1})
    with pytest.raises(TypeError, match=r"config\['row_lanes'\] must be an int, got bool"):
        dispatch.choose(problem, device, "thread_per_output", {"row_lanes": True})


# ---------------------------------------------------------------- the error table (docs/design.md, "Errors")

ERRORS_DOC = Path(__file__).resolve().parent.parent / "docs" / "design.md"
G_SHAPE, G = (2, 3, 8, 8), np.ones((2, 3, 4, 4), np.float32)
IDX = np.zeros((2, 3, 4, 4), np.int64)


def _float64_on_a_device_without_doubles():
    with pytest.MonkeyPatch.context() as patch:
        device = backends.default_device()
        patch.setattr(device, "info", dataclasses.replace(device.info, supports_float64=False))
        pt.adaptive_avg_pool2d(GOOD.astype(np.float64), 2)


def _device_array_with_other_strides():
    import pyopencl.array as cl_array

    x = cl_array.to_device(backends.default_device().queue, GOOD).transpose((0, 1, 3, 2))
    pt.adaptive_avg_pool2d(x, 2)


def _array_on_another_device():
    import pyopencl.array as cl_array

    others = [d for d in pt.devices() if d is not backends.default_device() and d.info.backend == "opencl"]
    x = cl_array.to_device(backends.default_device().queue, GOOD)
    pt.adaptive_avg_pool2d(x, 2, device=others[0].info.id if others else "opencl:99:0")  # no other: an unknown id


def _arrays_in_two_contexts():
    import pyopencl as cl
    import pyopencl.array as cl_array

    device = backends.default_device()
    other = cl.CommandQueue(cl.Context([device.cl_device]))
    pt.adaptive_max_pool2d_backward(cl_array.to_device(other, G), cl_array.to_device(device.queue, IDX), G_SHAPE)


def _device_array_at_an_offset():
    import pyopencl.array as cl_array

    pt.adaptive_avg_pool2d(cl_array.to_device(backends.default_device().queue, GOOD)[1:], 2)


def _array_on_an_unserved_device():
    """As if pool_tuner served no OpenCL device: the array's device is one it does not serve."""
    import pyopencl.array as cl_array
    from pool_tuner.backends import opencl

    x = cl_array.to_device(backends.default_device().queue, GOOD)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(opencl, "list_devices", lambda: ())
        pt.adaptive_avg_pool2d(x, 2)


def _device_array_in_a_forked_child():
    """A device array where the device's kernels cannot run (a forked child of a process that
    started PoCL), as the device then says (``host_fallback``)."""
    import pyopencl.array as cl_array

    device = backends.default_device()
    x = cl_array.to_device(device.queue, np.ones((1, 2, 5, 3), np.float32))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(device, "info", dataclasses.replace(device.info, host_fallback="a forked child, as a test pretends"))
        pt.adaptive_avg_pool2d(x, (2, 3))


def _unknown_device_in_the_environment():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("POOL_TUNER_DEVICE", "opencl:99:99")
        pt.adaptive_avg_pool2d(GOOD, 2)


#: Each row of the documented error table (its first column) -> the exception of each part of the
#: row ("TypeError / ValueError" rows: one per part) and calls making each mistake it lists.
README_ERRORS = {
    "`x`/`grad_out` not a numpy or pyopencl array; integer, bool or complex dtype; float64 on a device without doubles": [
        (TypeError, lambda: pt.adaptive_avg_pool2d([[1.0]], 1)),
        (TypeError, lambda: pt.adaptive_avg_pool2d_backward(G.tolist(), G_SHAPE)),
        (TypeError, lambda: pt.adaptive_avg_pool2d(GOOD.astype(np.int16), 1)),
        (TypeError, lambda: pt.adaptive_avg_pool2d(GOOD.astype(bool), 1)),
        (TypeError, lambda: pt.adaptive_avg_pool2d(GOOD.astype(np.complex64), 1)),
        (TypeError, _float64_on_a_device_without_doubles),
    ],
    "wrong rank; zero-size pooled dimension; device arrays neither contiguous nor channels-last (with what to do: "
    "pyopencl cannot copy such a view), or not at the start of their buffer (pass `x.copy()`)": [
        (ValueError, lambda: pt.adaptive_avg_pool2d(np.ones((8, 8), np.float32), 1)),
        (ValueError, lambda: pt.adaptive_avg_pool2d(np.ones((2, 3, 8, 0), np.float32), 1)),
        (ValueError, _device_array_with_other_strides),
        (ValueError, _device_array_at_an_offset),
    ],
    "a pyopencl array on a device pool_tuner does not serve (the message names its device, the devices served and "
    "the way out)": [
        (ValueError, _array_on_an_unserved_device),
    ],
    "`output_size` of the wrong type (float, bool, None, str, bytes)": [
        (TypeError, lambda: pt.adaptive_avg_pool2d(GOOD, 2.0)),
        (TypeError, lambda: pt.adaptive_avg_pool2d(GOOD, (2, False))),
        (TypeError, lambda: pt.adaptive_avg_pool2d(GOOD, None)),
        (TypeError, lambda: pt.adaptive_avg_pool2d(GOOD, "47")),
        (TypeError, lambda: pt.adaptive_avg_pool2d(GOOD, b"47")),
    ],
    "`output_size` negative, above 2**31 - 1 on an axis, or with the wrong number of entries; results larger than "
    "the device can hold (one buffer, or its memory), checked before anything is sized by them": [
        (ValueError, lambda: pt.adaptive_avg_pool2d(GOOD, (-1, 2))),
        (ValueError, lambda: pt.adaptive_avg_pool2d(GOOD, (3, 2**41))),
        (ValueError, lambda: pt.adaptive_avg_pool2d(GOOD, (2,))),
        (ValueError, lambda: pt.adaptive_avg_pool2d(GOOD, (2**31 - 1, 2**31 - 1))),
    ],
    "backward `input_shape` with non-integers / of the wrong rank / not matching `grad_out` (a rank that differs "
    "from `grad_out`'s names both)": [
        (TypeError, lambda: pt.adaptive_avg_pool2d_backward(G, (2, 3, 8.0, 8))),
        (ValueError, lambda: pt.adaptive_avg_pool2d_backward(G, (8, 8))),
        (ValueError, lambda: pt.adaptive_avg_pool2d_backward(G, (2, 4, 8, 8))),
        (ValueError, lambda: pt.adaptive_avg_pool2d_backward(G, (3, 8, 8))),
    ],
    "a device array in a forked child of a process that started PoCL's worker threads (see "
    "[Fork](#threads-and-processes))": [
        (RuntimeError, _device_array_in_a_forked_child),
    ],
    "max backward `indices` missing or not int64": [
        (TypeError, lambda: pt.adaptive_max_pool2d_backward(G, None, G_SHAPE)),
        (TypeError, lambda: pt.adaptive_max_pool2d_backward(G, IDX.astype(np.int32), G_SHAPE)),
    ],
    "max backward `indices` of the wrong shape, outside `[0, plane size)` or outside its output's window (numpy inputs)": [
        (ValueError, lambda: pt.adaptive_max_pool2d_backward(G, IDX[:, :, :3], G_SHAPE)),
        (ValueError, lambda: pt.adaptive_max_pool2d_backward(G, IDX + 64, G_SHAPE)),
        (ValueError, lambda: pt.adaptive_max_pool2d_backward(G, IDX + 63, G_SHAPE)),
    ],
    "`return_indices` for average pooling (an unexpected keyword, as in PyTorch)": [
        (TypeError, lambda: pt.adaptive_avg_pool2d(GOOD, 2, return_indices=True)),
        (TypeError, lambda: pt.adaptive_avg_pool2d(GOOD, 2, True)),
    ],
    "unknown op, layout, variant or device id (`device=` or `POOL_TUNER_DEVICE`); an array on another device than `device=`; device arrays of one call in two contexts of their device": [
        (ValueError, lambda: pt.explain("adaptive_mean_pool2d", G_SHAPE, 2)),
        (ValueError, lambda: pt.explain(OP2, G_SHAPE, 2, layout="NWHC")),
        (ValueError, lambda: pt.adaptive_avg_pool2d(GOOD, 2, variant="fastest")),
        (ValueError, lambda: pt.adaptive_avg_pool2d(GOOD, 2, device="opencl:99:0")),
        (ValueError, _unknown_device_in_the_environment),
        (ValueError, _array_on_another_device),
        (ValueError, _arrays_in_two_contexts),
    ],
    "`config` not a dict, or a value of it not an int (a float, a bool)": [
        (TypeError, lambda: pt.adaptive_avg_pool2d(GOOD, 2, variant="thread_per_output", config=[64])),
        (TypeError, lambda: pt.adaptive_avg_pool2d(GOOD, 2, variant="thread_per_row", config={"block_size_x": 16.0})),
        (TypeError, lambda: pt.adaptive_avg_pool2d(GOOD, 2, variant="smem_tiled", config={"tile_x": 2.0})),
        (TypeError, lambda: pt.adaptive_avg_pool2d(GOOD, 2, variant="thread_per_output", config={"row_lanes": True})),
    ],
    "`config` with unknown parameters, values outside the search space, or illegal for the shape/device; `config` without `variant`": [
        (ValueError, lambda: pt.adaptive_avg_pool2d(GOOD, 2, variant="thread_per_output", config={"tile": 2})),
        (ValueError, lambda: pt.adaptive_avg_pool2d(GOOD, 2, variant="thread_per_output", config={"block_size_x": 100})),
        (ValueError, lambda: pt.adaptive_avg_pool2d(GOOD, 2, variant="plane_reduce", config={"block_size_x": 64})),
        (ValueError, lambda: pt.adaptive_avg_pool2d(GOOD, 2, config={"block_size_x": 64})),
    ],
    "a `dtype` name outside float32/float64/float16/bfloat16": [
        (TypeError, lambda: pt.explain(OP2, G_SHAPE, 2, dtype="int8")),
    ],
}


def readme_error_table() -> dict:
    """``{first column: exception column}`` of the table under docs/design.md's "## Errors"."""
    if not ERRORS_DOC.exists():  # tests run from an installed copy without the checkout
        pytest.skip("docs/design.md not found beside tests/")
    section = ERRORS_DOC.read_text().split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split(" | ") for line in section.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): cells[1].strip() for cells in rows[1:] if not set(cells[0]) <= set("-")}


def test_the_readme_error_table_lists_the_cases_tested_here():
    assert list(readme_error_table()) == list(README_ERRORS)


@pytest.mark.parametrize("row", list(README_ERRORS), ids=[f"row{i}" for i in range(len(README_ERRORS))])
def test_every_readme_error_row_raises_what_it_says(row):
    claimed = [name.strip(" `") for name in readme_error_table()[row].split("/")]
    cases = README_ERRORS[row]
    expected = [exc for exc, _ in cases]
    assert claimed == [exc.__name__ for exc in dict.fromkeys(expected)]
    for exc, call in cases:
        with pytest.raises(exc):
            call()


def test_a_torch_tensor_given_to_the_numpy_api_points_to_pool_tuner_torch():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="got Tensor; for PyTorch tensors use pool_tuner.torch"):
        pt.adaptive_avg_pool2d(torch.from_numpy(GOOD), 2)


def test_a_misspelt_variant_is_refused_when_the_module_is_made():
    torch = pytest.importorskip("torch")
    import pool_tuner.torch as ptt

    with pytest.raises(ValueError, match="variant must be one of .* for adaptive_max_pool2d forward, got 'thread_per_outptu'"):
        ptt.AdaptiveMaxPool2d(2, variant="thread_per_outptu")
    with pytest.raises(ValueError, match="got 'fastest'"):
        ptt.replace_pooling(torch.nn.Sequential(torch.nn.AdaptiveAvgPool1d(3)), variant="fastest")


@pytest.mark.parametrize("variant", [3, b"smem_tiled", ["smem_tiled"]], ids=["int", "bytes", "list"])
def test_a_variant_that_is_no_str_is_a_type_error_naming_it(variant):
    with pytest.raises(TypeError, match=r"variant must be a variant's name \(a str\), one of .* got "):
        pt.adaptive_avg_pool2d(GOOD, 2, variant=variant)


def test_tune_refuses_one_variant_name_given_as_a_str(user_cache):
    """``variants="smem_tiled"`` was read letter by letter ("got 's'")."""
    with pytest.raises(TypeError, match=r"variants must be a list of variant names, got the str 'smem_tiled'"):
        pt.tune("adaptive_avg_pool2d", GOOD.shape, 2, variants="smem_tiled")
