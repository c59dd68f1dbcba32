"""The device contract of backends/base.py: both backends implement every member with the
contract's arguments, and OpenCL device ids keep their meaning when another OpenCL driver is
installed.

The CUDA device is built here from made-up properties (``SYNTHETIC_H100``: no GPU, no PyCUDA
needed): its identity, fingerprint, limits and Kernel Tuner arguments come from them alone.
"""

import dataclasses
import inspect

import numpy as np
import pytest

import pool_tuner as pt
from pool_tuner import backends, device_tuning
from pool_tuner.backends import base, cuda, opencl

#: Properties of a made-up H100-like device (not read from any GPU).
SYNTHETIC_H100 = cuda.CudaProperties(name="NVIDIA H100 80GB HBM3 (synthetic)", compute_capability=(9, 0),
                                     multiprocessors=132, max_threads_per_block=1024,
                                     max_shared_memory_per_block=48 * 1024, total_memory=80 * 2**30,
                                     driver_version=13000)


def contract_members(protocol) -> dict:
    """``{name: protocol member}``: annotated attributes (value None), methods and properties."""
    members = {name: None for name in protocol.__annotations__}
    members.update({name: value for name, value in vars(protocol).items()
                    if not name.startswith("_") and (callable(value) or isinstance(value, property))})
    return members


def _parameters(function) -> list:
    return [p for p in inspect.signature(function).parameters if p != "self"]


def check_implements(instance, protocol) -> list:
    """What ``instance`` lacks of ``protocol`` or implements with other arguments.  Read
    statically (``inspect.getattr_static``): evaluating the CUDA device's ``queue`` would need a GPU."""
    problems = []
    for name, member in contract_members(protocol).items():
        try:
            found = inspect.getattr_static(instance, name)
        except AttributeError:
            problems.append(f"no {name}")
            continue
        if callable(member) and not isinstance(member, property):
            function = found.__func__ if isinstance(found, (staticmethod, classmethod)) else found
            if not callable(function):
                problems.append(f"{name} is not a method")
            elif _parameters(function) != _parameters(member):
                problems.append(f"{name}{_parameters(function)} != contract {_parameters(member)}")
    return problems


def test_the_contract_lists_what_the_issue_asks_for():
    members = contract_members(base.Device)
    for name in ("info", "build", "launch", "empty", "release_memory", "copy", "queue"):
        assert name in members
    for name in ("id", "fingerprint", "limits", "backend", "is_gpu", "name"):  # all in one description
        assert name in {field.name for field in dataclasses.fields(base.DeviceInfo)}
    assert check_implements(object(), base.Device)  # the check can fail


#: The most members the contract may have: the Device protocol and the module-level Backend one
#: together (issue 34 asks for 12: compile, load, launch, allocate/free, copy in and out,
#: synchronise, describe); the adapter for the caller's device arrays (``CallerArrays``) apart.
MOST_CONTRACT_MEMBERS = 12
MOST_CALLER_ARRAY_MEMBERS = 6


def test_the_contract_stays_small():
    """What a new backend writes: the contract's members, counted as ``check_implements`` reads
    them (a description object such as ``info`` is one member)."""
    assert len(contract_members(base.Device)) + len(contract_members(base.Backend)) <= MOST_CONTRACT_MEMBERS
    assert len(contract_members(base.CallerArrays)) <= MOST_CALLER_ARRAY_MEMBERS
    # tuning and fingerprint tiers are not the backend's to write
    for gone in ("kernel_tuner_arguments", "tuning", "fingerprint_levels", "fingerprint", "id", "limits"):
        assert gone not in contract_members(base.Device)
    # what follows from the contract is written once, not by each backend
    for derived in ("to_device", "to_host", "synchronize"):
        assert derived not in contract_members(base.Device) and derived in vars(base.Conveniences)
    assert issubclass(opencl.OpenCLDevice, base.Conveniences) and issubclass(cuda.CudaDevice, base.Conveniences)


def test_device_info_is_frozen():
    device = backends.default_device()
    with pytest.raises(dataclasses.FrozenInstanceError):
        device.info.id = "opencl:other:0"


@pytest.mark.parametrize("device", opencl.list_devices(), ids=lambda d: d.info.id)
def test_opencl_devices_implement_the_contract(device):
    assert check_implements(device, base.Device) == []
    assert check_implements(device.arrays, base.CallerArrays) == []
    assert isinstance(device, base.Device)  # runtime_checkable
    assert device.info.limits == base.DeviceLimits(int(device.cl_device.max_work_group_size),
                                                   int(device.cl_device.local_mem_size),
                                                   "cpu" if device.info.fingerprint["type"] == "cpu" else "gpu")
    assert device_tuning.kernel_tuner_arguments(device) == {"lang": "OpenCL", "platform": device.platform_index,
                                                            "device": device.device_index}


def test_the_cuda_device_implements_the_contract_without_a_gpu():
    device = cuda.CudaDevice(0, SYNTHETIC_H100)
    assert check_implements(device, base.Device) == []
    assert check_implements(device.arrays, base.CallerArrays) == []
    assert device.info.id == "cuda:0" and device.info.torch_device == "cuda:0"
    assert device.info.limits == base.DeviceLimits(1024, 48 * 1024, "gpu")
    assert device.info.fingerprint == {"backend": "cuda", "name": SYNTHETIC_H100.name, "compute_capability": "9.0",
                                       "multiprocessors": 132, "driver": 13000}
    # PyCUDA's backend of Kernel Tuner: plain "CUDA" would make Kernel Tuner pick cuda-python first.
    assert device_tuning.kernel_tuner_arguments(cuda.CudaDevice(1, SYNTHETIC_H100)) == {"lang": "PYCUDA", "device": 1}


@pytest.mark.parametrize("module", backends.BACKENDS, ids=backends.backend_name)
def test_backend_modules_implement_the_module_contract(module):
    assert isinstance(module, base.Backend)
    for name, member in contract_members(base.Backend).items():
        if callable(member):
            assert _parameters(getattr(module, name)) == _parameters(member), name
    assert all(d.info.id.startswith(backends.backend_name(module) + ":") for d in module.list_devices())


# ---------------------------------------------------------------------- device ids


def test_platform_slugs():
    assert opencl.platform_slug("Portable Computing Language") == "pocl"
    assert opencl.platform_slug("Oclgrind") == "oclgrind"
    assert opencl.platform_slug("NVIDIA CUDA") == "nvidia-cuda"
    assert opencl.platform_slug("Intel(R) OpenCL Graphics") == "intel-opencl-graphics"
    assert opencl._unique_slugs(["Oclgrind", "NVIDIA CUDA", "NVIDIA CUDA"]) == ["oclgrind", "nvidia-cuda", "nvidia-cuda-2"]


def _ids_with_platforms(monkeypatch, reorder) -> dict:
    """Device ids, keyed by (platform name, device name), as listed when the ICD loader reports
    its platforms in the order ``reorder`` gives."""
    platforms = opencl.cl.get_platforms()
    monkeypatch.setattr(opencl.cl, "get_platforms", lambda: reorder(platforms))
    listed = opencl.enumerate_devices()
    monkeypatch.undo()
    return {(d.info.platform_name, d.info.name): d.info.id for d in listed}


def test_opencl_ids_do_not_move_when_another_driver_is_installed(monkeypatch):
    """PoCL was opencl:0:0 alone and opencl:1:0 beside Oclgrind; now it is opencl:pocl:0 both ways."""
    if len(opencl.cl.get_platforms()) < 2:
        pytest.skip("needs two OpenCL platforms (the test extras install Oclgrind beside PoCL)")
    together = _ids_with_platforms(monkeypatch, lambda ps: ps)
    reversed_ = _ids_with_platforms(monkeypatch, lambda ps: ps[::-1])
    alone = _ids_with_platforms(monkeypatch, lambda ps: [p for p in ps if p.name == opencl.POCL_PLATFORM])
    assert together == reversed_
    assert alone and all(together[key] == alone[key] for key in alone)
    assert "opencl:pocl:0" in alone.values()


def test_an_old_numeric_id_fails_naming_the_new_one(monkeypatch):
    pocl = backends.resolve_device("opencl:pocl:0")
    old = f"opencl:{pocl.platform_index}:{pocl.device_index}"
    with pytest.raises(ValueError, match=f"device must be one of .*got '{old}'.*{old} is now 'opencl:pocl:0'"):
        pt.adaptive_avg_pool2d(np.ones((1, 2, 4, 4), np.float32), 2, device=old)
    monkeypatch.setenv(backends.ENV_DEVICE, old)
    with pytest.raises(ValueError, match=f"POOL_TUNER_DEVICE must be one of .*got '{old}'.*{old} is now 'opencl:pocl:0'"):
        backends.resolve_device(None)
    with pytest.raises(ValueError, match="no device is at that position now"):
        backends.resolve_device("opencl:99:0")


def test_a_cuda_id_without_the_backend_says_why():
    if cuda.list_devices():
        pytest.skip("a CUDA device is present")
    with pytest.raises(ValueError, match=r"got 'cuda:0'; the CUDA backend is unavailable .*pool-tuner\[cuda\]"):
        backends.resolve_device("cuda:0")
