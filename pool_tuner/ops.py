"""The public pooling functions: validate, dispatch, launch.

Each call validates all of its arguments (raising ``TypeError``/``ValueError`` that name the
argument) before anything is built or launched, asks ``dispatch`` for the variant and configuration,
and launches the memoised kernel.  numpy in -> numpy out (through the default queue of the chosen
device); ``pyopencl.array.Array`` in -> array out on the input's own queue, no host round trip.
"""

from __future__ import annotations

import os

import numpy as np

from . import backends, dispatch
from .backends import opencl
from .problem import Problem, check_dtype
from .variants import variants_for

#: Set to "1" to fill every output with NaN before its kernel runs, so that an output element a
#: kernel forgets to write cannot pass a comparison by accident (the test suite sets it).
POISON_ENV = "POOL_TUNER_POISON_OUTPUTS"
poison_outputs = os.environ.get(POISON_ENV) == "1"


def _locate(x, device):
    """Return ``(device, queue, is_device_array)`` for input ``x`` and the ``device=`` argument."""
    owner = backends.device_of_array(x)
    if owner is not None:
        if device is not None and backends.resolve_device(device) is not owner:
            raise ValueError(
                f"device={device!r} does not hold x: x is a pyopencl array on {owner.describe()}; "
                "pass device=None or that device"
            )
        return owner, x.queue, True
    if not isinstance(x, np.ndarray):
        raise TypeError(f"x must be a numpy.ndarray or a pyopencl.array.Array, got {type(x).__name__}")
    chosen = backends.resolve_device(device)
    return chosen, chosen.queue, False


def _check_float64(device, dtype):
    if dtype == "float64" and not device.supports_float64:
        raise TypeError(f"x has dtype float64, which {device.describe()} does not support; use float32")


def _device_input(x, queue, is_device):
    if not is_device:
        return opencl.cl_array.to_device(queue, np.ascontiguousarray(x))
    if not x.flags.c_contiguous:
        raise ValueError("x must be a C-contiguous pyopencl array (channels-first, no strides)")
    return x if x.offset == 0 else x.copy()


_PROBLEMS: dict = {}


def _problem(op, x, output_size) -> Problem:
    """The validated problem for a call, memoised on (op, shape, dtype, output_size) so repeated
    calls skip validation; unhashable output sizes (lists) are validated every time."""
    key = (op, x.shape, x.dtype, output_size)
    try:
        return _PROBLEMS[key]
    except KeyError:
        pass
    except TypeError:
        key = None
    dtype = check_dtype(getattr(x, "dtype", None), "x.dtype")
    problem = Problem.create(op, x.shape, output_size, dtype, shape_name="x")
    if key is not None:
        _PROBLEMS[key] = problem
    return problem


def pool_forward(op: str, x, output_size, *, device=None, variant=None, config=None):
    """Shared body of every forward op."""
    dev, queue, is_device = _locate(x, device)
    problem = _problem(op, x, output_size)
    _check_float64(dev, problem.dtype)
    choice = dispatch.choose(problem, dev, variant, config)
    if problem.is_empty:
        out = opencl.cl_array.empty(queue, problem.output_shape, problem.dtype)
        return out if is_device else out.get()
    launch = dispatch.prepare(dev, queue.context, problem, choice)
    x_dev = _device_input(x, queue, is_device)
    out = opencl.cl_array.empty(queue, problem.output_shape, problem.dtype)
    if poison_outputs:
        out.fill(np.nan)
    out.add_event(dev.launch(queue, launch.kernel, launch.groups, launch.block, (x_dev.data, out.data)))
    return out if is_device else out.get()


def adaptive_avg_pool1d(x, output_size, *, device=None, variant=None, config=None):
    """Adaptive average pooling of ``(N, C, L)`` or ``(C, L)`` to ``output_size``."""
    return pool_forward("adaptive_avg_pool1d", x, output_size, device=device, variant=variant, config=config)


def adaptive_avg_pool2d(x, output_size, *, device=None, variant=None, config=None):
    """Adaptive average pooling of ``(N, C, H, W)`` or ``(C, H, W)`` to ``output_size`` (an int or
    an ``(H, W)`` pair whose entries may be ``None`` to keep that size)."""
    return pool_forward("adaptive_avg_pool2d", x, output_size, device=device, variant=variant, config=config)


def adaptive_avg_pool3d(x, output_size, *, device=None, variant=None, config=None):
    """Adaptive average pooling of ``(N, C, T, H, W)`` or ``(C, T, H, W)`` to ``output_size``."""
    return pool_forward("adaptive_avg_pool3d", x, output_size, device=device, variant=variant, config=config)


def explain(op, input_shape, output_size, dtype="float32", layout=None, device=None, *, variant=None, config=None) -> dict:
    """What a call would run, without running it: variant, params, ``source`` of the decision
    (``forced``/``cache``/``nearest``/``default``), device, and more.  ``layout=None`` means contiguous channels-first."""
    dev = backends.resolve_device(device)
    problem = Problem.create(op, input_shape, output_size, dtype, layout)
    info = dispatch.describe(problem, dev, dispatch.choose(problem, dev, variant, config, allow_tuning=False))
    info["autotune_on_miss"] = os.environ.get(dispatch.AUTOTUNE_ENV) == "1"
    return info


def devices() -> list:
    """Every device pool_tuner can run on, with stable ids (``opencl:<platform>:<device>``)."""
    return backends.all_devices()


def variants(op: str, direction: str = "forward") -> list:
    """Names of the kernel variants available for ``op`` (e.g. ``"adaptive_avg_pool2d"``)."""
    return list(variants_for(op, direction))


__all__ = ["adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "explain", "devices", "variants"]
