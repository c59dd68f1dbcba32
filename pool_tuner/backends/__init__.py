"""Device backends and device selection.

Each backend module in ``BACKENDS`` implements the contract of ``backends.base`` (``Backend`` at
module level, ``Device`` for its devices); this module only picks a device through that contract:
the ``device=`` argument, else ``POOL_TUNER_DEVICE``, else a GPU (CUDA's first), else a CPU device
(PoCL's, the embedded default).  The Oclgrind simulator is only ever used when asked for by id.  The
CUDA backend is optional (``pool-tuner[cuda]``): without PyCUDA, a driver or a GPU it lists no
devices, and importing pool_tuner never needs it.
"""

from __future__ import annotations

import functools
import os

from . import cuda, opencl
from .base import Backend, Device, DeviceInfo, DeviceLimits

ENV_DEVICE = "POOL_TUNER_DEVICE"
#: The backends, in the order their devices are listed and preferred.
BACKENDS = (cuda, opencl)


def _env_device_setting():
    """``POOL_TUNER_DEVICE`` as the environment holds it (None when unset)."""
    return os.environ.get(ENV_DEVICE)


#: ``POOL_TUNER_DEVICE`` as the environment holds it (bytes on POSIX, None when unset): a memo key
#: for the call paths, which read it on every call so that a changed setting applies at once.
#: Where the platform's ``os.environ`` has its own table (CPython on POSIX), a lookup in it bound to
#: the key, which runs no Python at all where ``os.environ.get`` takes several Python calls.
env_device_setting = (functools.partial(os.environ._data.get, os.environ.encodekey(ENV_DEVICE))
                      if hasattr(os.environ, "_data") and hasattr(os.environ, "encodekey") else _env_device_setting)


def backend_name(backend) -> str:
    """A backend module's name, its devices' id prefix (``backends/cuda.py``: ``cuda``)."""
    return backend.__name__.rsplit(".", 1)[-1]


def all_devices() -> list:
    """Every device of every backend, backend by backend (CUDA first)."""
    return [device for backend in BACKENDS for device in backend.list_devices()]


def default_device():
    """The device used when none is named: a GPU (CUDA's first, being listed first), else a CPU
    device (PoCL's), else any non-simulator device."""
    devices = [d for d in all_devices() if not d.info.is_simulator]
    for wanted in (lambda d: d.info.is_gpu, lambda d: d.info.is_cpu, lambda d: True):
        for device in devices:
            if wanted(device):
                return device
    why = "; ".join(f"{backend_name(b)}: {b.missing(None)}" for b in BACKENDS if b.missing(None) is not None)
    raise RuntimeError(
        "pool_tuner found no usable device" + (f" ({why})" if why else "") + "; install PoCL with "
        "`pip install pocl-binary-distribution` or a vendor OpenCL driver"
    )


def resolve_device(device=None, name: str = "device"):
    """Turn a ``device=`` argument (None, an id string or a device object) into a device."""
    if device is None:
        device = os.environ.get(ENV_DEVICE) or None
        if device is None:
            return default_device()
        name = ENV_DEVICE
    if not isinstance(device, str):
        if isinstance(getattr(device, "info", None), DeviceInfo):
            return device
        raise TypeError(f"{name} must be a device id string or a device from pool_tuner.devices(), got {type(device).__name__}")
    devices = all_devices()
    for candidate in devices:
        if candidate.info.id == device:
            return candidate
    prefix = device.split(":", 1)[0]
    hints = [backend.missing(device) for backend in BACKENDS if backend_name(backend) == prefix]
    hint = "".join(f"; {h}" for h in hints if h)
    raise ValueError(f"{name} must be one of the available device ids {sorted(d.info.id for d in devices)}, "
                     f"got {device!r}{hint}")


def device_of_array(array):
    """The device that holds a backend array (a ``pyopencl.array.Array``, a PyCUDA ``GPUArray`` or
    any ``__cuda_array_interface__`` object), or None if ``array`` is not a device array."""
    for backend in BACKENDS:
        device = backend.device_of_array(array)
        if device is not None:
            return device
    return None


__all__ = ["BACKENDS", "Backend", "backend_name", "Device", "DeviceInfo", "DeviceLimits", "ENV_DEVICE", "all_devices",
           "default_device",
           "env_device_setting", "device_of_array", "resolve_device"]
