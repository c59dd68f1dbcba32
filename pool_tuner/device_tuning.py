"""How each backend's devices are tuned: the arguments that make Kernel Tuner's ``tune_kernel``
compile and time on a device, and where a tuning on it must run.

Tuner-side, not part of the device contract (``backends/base.py``), which holds only what every
call needs: a backend's devices are tuned through its entry in ``_TUNING`` below, and a backend
without one cannot be tuned (``TuningUnavailable``: its calls use the untuned decision).

OpenCL: Kernel Tuner's OpenCL backend, numbering devices as the ICD loader does; a tuning runs on
the calling thread (PyOpenCL's objects work from any thread).  CUDA: Kernel Tuner's PyCUDA backend,
and every tuning on the process's one CUDA tuning thread with Kernel Tuner set up to compile with
pool_tuner's nvcc (``backends/cuda_tuning.py`` says why).
"""

from __future__ import annotations

from .backends import cuda, cuda_tuning
from .backends.base import TuningUnavailable


def kernel_tuner_arguments(device) -> dict:
    """``lang`` and the device (and platform) indices of ``device`` in Kernel Tuner's numbering.
    Raises ``RuntimeError`` for a device that cannot be tuned in this process (its kernels cannot
    run here: ``DeviceInfo.host_fallback``)."""
    return _tuning_of(device)[0](device)


def run(device, work):
    """Run ``work()`` -- a tuning on ``device``: Kernel Tuner's searches and the race -- where and
    how that device's tuning must run, and return its result.  Raises ``TuningUnavailable`` when
    the device cannot be tuned in this process."""
    return _tuning_of(device)[1](device, work)


def _opencl_arguments(device) -> dict:
    if device.info.host_fallback is not None:
        raise RuntimeError(f"{device.info.describe()} cannot be tuned in this process: {device.info.host_fallback}; "
                           f"tune in a process that was not forked")
    return {"lang": "OpenCL", "platform": device.platform_index, "device": device.device_index}


def _run_here(device, work):
    return work()


def _cuda_arguments(device) -> dict:
    """Kernel Tuner's PyCUDA backend on the device's ordinal: ``lang="PYCUDA"``, because plain
    ``"CUDA"`` makes Kernel Tuner pick cuda-python first, which pool_tuner does not depend on."""
    return {"lang": "PYCUDA", "device": device.ordinal}


def _run_on_cuda_tuning_thread(device, work):
    """Run ``work()`` on the process's CUDA tuning thread, with Kernel Tuner's PyCUDA backend set
    up to compile with the nvcc pool_tuner uses, and wait for it.  Raises ``TuningUnavailable``
    when no nvcc is found, the driver is older than the nvcc, or its toolkit lacks
    ``libcudadevrt``."""
    if cuda_tuning.on_tuning_thread():  # a tuning within a tuning: already set up
        return work()
    try:
        nvcc = cuda.find_nvcc()
    except cuda.NvccNotFoundError as why:
        raise TuningUnavailable(f"{device.info.describe()} cannot be tuned: {why}") from None
    cuda_tuning.check_driver(device.properties.driver_version, nvcc, device.info.describe())
    variables = cuda_tuning.kernel_tuner_environment(nvcc)

    def in_environment():
        with cuda_tuning.environment(variables):
            return work()

    return cuda_tuning.run(in_environment)


#: Per backend (``DeviceInfo.backend``): its Kernel Tuner arguments, and how a tuning on it runs.
_TUNING = {
    "opencl": (_opencl_arguments, _run_here),
    "cuda": (_cuda_arguments, _run_on_cuda_tuning_thread),
}


def _tuning_of(device) -> tuple:
    found = _TUNING.get(device.info.backend)
    if found is None:
        raise TuningUnavailable(f"{device.info.describe()} cannot be tuned: pool_tuner tunes no "
                                f"{device.info.backend} device")
    return found
