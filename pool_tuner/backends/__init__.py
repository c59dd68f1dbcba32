"""Device backends and device selection.

Each backend module (``cuda``, ``opencl``) exposes ``list_devices()`` returning device objects
with the same small interface: ``id``, ``name``, ``limits``, ``fingerprint``, ``build``, ``launch``.
This module picks one: the ``device=`` argument, else ``POOL_TUNER_DEVICE``, else a CUDA GPU, else an
OpenCL GPU, else PoCL's CPU device (the embedded default).  The Oclgrind simulator is only ever used
when asked for by id.  The CUDA backend is optional (``pool-tuner[cuda]``): without PyCUDA, a driver
or a GPU it lists no devices, and importing pool_tuner never needs it.
"""

from __future__ import annotations

import os

from . import cuda, opencl

ENV_DEVICE = "POOL_TUNER_DEVICE"


def all_devices() -> list:
    """CUDA devices first (none without PyCUDA/driver/GPU), then OpenCL devices."""
    return list(cuda.list_devices()) + list(opencl.list_devices())


def _by_id() -> dict:
    return {d.id: d for d in all_devices()}


def default_device():
    """The device used when none is named: a CUDA GPU, else an OpenCL GPU, else a CPU device
    (PoCL's), else any non-simulator device."""
    devices = [d for d in all_devices() if not d.is_simulator]
    is_cuda = lambda d: getattr(d, "backend", None) == cuda.BACKEND  # noqa: E731
    for wanted in (lambda d: d.is_gpu and is_cuda(d), lambda d: d.is_gpu, lambda d: d.is_cpu, lambda d: True):
        for device in devices:
            if wanted(device):
                return device
    hint = "" if opencl.import_error() is None else f" (PyOpenCL failed to import: {opencl.import_error()})"
    raise RuntimeError(
        "pool_tuner found no usable OpenCL device" + hint + "; install PoCL with "
        "`pip install pocl-binary-distribution` or a vendor OpenCL driver"
    )


def resolve_device(device=None, name: str = "device"):
    """Turn a ``device=`` argument (None, an id string or a device object) into a device."""
    if device is None:
        device = os.environ.get(ENV_DEVICE) or None
        if device is None:
            return default_device()
        name = ENV_DEVICE
    if hasattr(device, "id") and hasattr(device, "limits"):
        return device
    if not isinstance(device, str):
        raise TypeError(f"{name} must be a device id string or a device from pool_tuner.devices(), got {type(device).__name__}")
    table = _by_id()
    if device not in table:
        raise ValueError(f"{name} must be one of the available device ids {sorted(table)}, got {device!r}")
    return table[device]


def device_of_array(array):
    """The device that holds a backend array (a ``pyopencl.array.Array``, a PyCUDA ``GPUArray`` or
    any ``__cuda_array_interface__`` object), or None if ``array`` is not a device array."""
    if opencl.is_device_array(array):
        devices = opencl.list_devices()
        for d in devices:  # the common case first: an array on a device's default queue
            if d.holds_default_queue_of(array):
                return d
        for d in devices:
            if d.owns(array):
                return d
        raise ValueError("x is a pyopencl array on a device that pool_tuner cannot see")
    return cuda.device_of_array(array)
