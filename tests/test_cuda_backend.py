"""The CUDA backend's arrays and launches for ``pool_tuner.ops`` (PyCUDA GPUArrays) against a fake
PyCUDA: results from the device's memory pool, no event recorded per launch (only
``timed_launch`` records its two), the pool freed on request.  Runs everywhere; test_cuda.py runs
the same on a GPU."""

import sys
import types

import numpy as np
import pytest

from pool_tuner.backends import cuda

from cuda_fakes import fake_cuda_device


class _FakePyCuda:
    """What the backend uses of ``pycuda.driver``, ``pycuda.gpuarray`` and ``pycuda.tools``,
    recording events made, allocations and launches."""

    def __init__(self):
        self.events, self.allocations, self.launches, self.pools = [], [], [], []
        fake = self

        class Event:
            def __init__(self):
                fake.events.append(self)

            def record(self, stream=None):
                pass

            def synchronize(self):
                pass

            def time_till(self, other):
                return 0.25

        class Context:
            @staticmethod
            def pop():
                pass

        class DeviceMemoryPool:
            def __init__(self):
                self.held_blocks, self.freed = 0, 0
                fake.pools.append(self)

            def allocate(self, nbytes):
                fake.allocations.append(nbytes)
                return 0x1000 * len(fake.allocations)

            def free_held(self):
                self.freed += self.held_blocks
                self.held_blocks = 0

        def empty(shape, dtype, allocator=None):
            assert allocator is not None, "a result allocated outside the pool (cuMemAlloc/cuMemFree per call)"
            return types.SimpleNamespace(shape=shape, dtype=dtype,
                                         gpudata=allocator(int(np.prod(shape)) * np.dtype(dtype).itemsize))

        self.driver = types.SimpleNamespace(Event=Event, Context=Context)
        self.gpuarray = types.SimpleNamespace(empty=empty)
        self.tools = types.SimpleNamespace(DeviceMemoryPool=DeviceMemoryPool)


class _Kernel:
    def __init__(self, launches):
        self.launches, self.arg_format = launches, None

    def prepare(self, arg_format):
        self.arg_format = arg_format

    def prepared_async_call(self, grid, block, stream, *values):
        self.launches.append((grid, block, stream, values))


class _Context:
    def push(self):
        pass

    def synchronize(self):
        pass


@pytest.fixture
def backend(monkeypatch):
    fake = _FakePyCuda()
    monkeypatch.setattr(cuda, "_pycuda", lambda: (fake.driver, fake.gpuarray))
    monkeypatch.setitem(sys.modules, "pycuda.tools", fake.tools)
    device = fake_cuda_device()
    device._context = _Context()
    return device, fake


def test_results_come_from_the_devices_memory_pool(backend):
    device, fake = backend
    first = device.empty((2, 3, 4), np.float32)
    second = device.empty((5,), np.int64)
    assert fake.allocations == [2 * 3 * 4 * 4, 5 * 8] and len(fake.pools) == 1
    assert int(first.gpudata) != int(second.gpudata)


def test_a_launch_records_no_event_and_a_timed_launch_two(backend):
    device, fake = backend
    kernel = _Kernel(fake.launches)
    out = device.empty((8,), np.float32)
    for _ in range(3):
        handle = device.launch(None, kernel, 4, (32,), [out, np.int64(8)])
        handle.wait()
    assert not fake.events, "events made per launch"
    assert kernel.arg_format == "P" + np.dtype(np.int64).char and len(fake.launches) == 3
    assert fake.launches[0][:2] == ((4, 1), (32, 1, 1)) and fake.launches[0][3] == (int(out.gpudata), np.int64(8))
    assert device.timed_launch(None, kernel, 4, (32,), [out, np.int64(8)]) == 0.25
    assert len(fake.events) == 2 and len(fake.launches) == 4
    with pytest.raises(ValueError, match="1 to"):
        device.launch(None, kernel, 0, (32,), [out])


def test_release_memory_frees_what_the_pool_holds(backend):
    device, fake = backend
    assert device.release_memory() == 0  # no pool yet: nothing made, nothing freed
    device.empty((4,), np.float32)
    (pool,) = fake.pools
    pool.held_blocks = 3  # three results dropped since
    assert device.release_memory() == 3 and pool.freed == 3 and device.release_memory() == 0
