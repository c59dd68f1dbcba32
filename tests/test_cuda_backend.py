"""The CUDA backend's arrays and launches for ``pool_tuner.ops`` against a fake PyCUDA and a fake
libcuda (tests/cuda_fakes.py): results from the memory pool of their stream, launches through the
driver API on the stream a CUDA array's ``__cuda_array_interface__`` names (else the legacy
default stream) with no host wait, a stream joined to another's with an event made once, no
PyCUDA stream or event made per call, a first call refused during graph capture.  Runs
everywhere; test_cuda.py and test_cuda_gpu.py run the same on a GPU."""

import sys

import numpy as np
import pytest

import pool_tuner as pt
from pool_tuner import ops
from pool_tuner.backends import cuda, cuda_driver

from cuda_fakes import PRIMARY_CONTEXT, FakeContext, FakeDriver, FakePyCuda, ForeignArray, fake_cuda_device

LEGACY, PER_THREAD, SIDE, OTHER = 1, 2, 0x7F00DEAD0, 0x7F00BEEF0
KERNEL = cuda_driver.DriverKernel(ordinal=0, context=PRIMARY_CONTEXT, function=0xF00D, name="pool_forward",
                                  max_threads_per_block=1024)


@pytest.fixture
def backend(monkeypatch):
    """A fake device with the fake PyCUDA and driver; kernels "compile" to their source."""
    fake, driver = FakePyCuda(), FakeDriver()
    driver.set_current(PRIMARY_CONTEXT)
    monkeypatch.setattr(cuda, "_pycuda", lambda: (fake.driver, fake.gpuarray))
    monkeypatch.setitem(sys.modules, "pycuda.tools", fake.tools)
    monkeypatch.setattr(cuda_driver, "library", lambda: driver)
    monkeypatch.setattr(cuda, "_compile", lambda source, arch: b"cubin:" + source.encode())
    device = fake_cuda_device()
    device._context = FakeContext()
    monkeypatch.setattr(cuda, "list_devices", lambda: (device,))
    cuda_driver.primary_context.cache_clear()
    cuda.forget_builds()
    ops._PLANS.clear()
    yield device, fake, driver
    cuda_driver.primary_context.cache_clear()
    cuda.forget_builds()
    ops._PLANS.clear()


def _named(driver, name):
    return [c for c in driver.calls if isinstance(c, tuple) and c[0] == name]


# ---------------------------------------------------------------------- the backend's own calls

def test_results_come_from_the_memory_pool_of_their_stream(backend):
    device, fake, _ = backend
    first = device.empty((2, 3, 4), np.float32)
    second = device.empty((5,), np.int64)
    on_side = device.empty((5,), np.int64, cuda.CudaQueue(device.context, SIDE))
    assert fake.allocations == [2 * 3 * 4 * 4, 5 * 8, 5 * 8] and len(fake.pools) == 2
    assert len({int(a.gpudata) for a in (first, second, on_side)}) == 3
    assert first.__cuda_array_interface__["stream"] == LEGACY and on_side.__cuda_array_interface__["stream"] == SIDE


def test_a_launch_goes_through_the_driver_and_records_no_event(backend):
    device, fake, driver = backend
    out = device.empty((8,), np.float32)
    for _ in range(3):
        device.launch(None, KERNEL, 4, (32,), [out, np.int64(8)]).wait()
    assert not fake.events and not fake.streams and driver.events == 0, "events or streams made per launch"
    assert [launch["stream"] for launch in driver.launches] == [LEGACY] * 3
    assert driver.launches[0]["arguments"] == [int(out.gpudata), 8]
    assert driver.launches[0]["grid"] == (4, 1, 1) and driver.launches[0]["block"] == (32, 1, 1)
    assert _named(driver, "cuStreamSynchronize") == [("cuStreamSynchronize", LEGACY)] * 3  # the waits asked for
    assert device.timed_launch(None, KERNEL, 4, (32,), [out, np.int64(8)]) == 0.25
    assert driver.events == 2 and len(_named(driver, "cuEventDestroy")) == 2 and len(driver.launches) == 4
    with pytest.raises(ValueError, match="1 to"):
        device.launch(None, KERNEL, 0, (32,), [out])


def test_release_memory_frees_what_every_pool_holds(backend):
    device, fake, _ = backend
    assert device.release_memory() == 0  # no pool yet: nothing made, nothing freed
    device.empty((4,), np.float32)
    device.empty((4,), np.float32, cuda.CudaQueue(device.context, SIDE))
    first, second = fake.pools
    first.held_blocks, second.held_blocks = 3, 2  # results dropped since
    assert device.release_memory() == 5 and (first.freed, second.freed) == (3, 2) and device.release_memory() == 0


# ---------------------------------------------------------------------- pool_tuner.ops on CUDA arrays

@pytest.mark.parametrize("stream", [LEGACY, PER_THREAD, SIDE], ids=["legacy", "per-thread", "handle"])
def test_a_call_launches_on_the_stream_the_interface_names_without_a_host_wait(backend, stream):
    _, _, driver = backend
    x = ForeignArray((2, 3, 10, 9), 0xA0000, stream)
    y = pt.adaptive_avg_pool2d(x, (4, 7))
    (launch,) = driver.launches
    assert launch["stream"] == stream and launch["arguments"][:2] == [0xA0000, int(y.gpudata)]
    assert y.__cuda_array_interface__["stream"] == stream and y.shape == (2, 3, 4, 7)
    assert not _named(driver, "cuStreamSynchronize"), "the host waited for the producer's stream"
    poison = _named(driver, "cuMemsetD32Async")  # the test suite poisons results, on the launch's stream
    assert poison and all(call[-1] == stream for call in poison)


@pytest.mark.parametrize("named", [..., None], ids=["no-stream-key", "stream-None"])
def test_a_call_on_an_array_naming_no_stream_launches_on_the_legacy_default_stream(backend, named):
    _, _, driver = backend
    y = pt.adaptive_max_pool2d(ForeignArray((2, 3, 10, 9), 0xA0000, named), (4, 7))
    assert [launch["stream"] for launch in driver.launches] == [LEGACY]
    assert y.__cuda_array_interface__["stream"] == LEGACY
    assert not _named(driver, "cuStreamWaitEvent") and not _named(driver, "cuStreamSynchronize")


def test_a_channels_last_result_names_the_stream_too(backend):
    _, _, driver = backend
    x = ForeignArray((2, 3, 10, 9), 0xA0000, SIDE)
    x.strides = (3 * 10 * 9 * 4, 4, 9 * 3 * 4, 3 * 4)  # channels-last memory
    y = pt.adaptive_avg_pool2d(x, (4, 7))
    assert y.strides == (3 * 4 * 7 * 4, 4, 7 * 3 * 4, 3 * 4) and y.__cuda_array_interface__["stream"] == SIDE


def test_a_warm_call_makes_no_pycuda_stream_or_event_and_no_driver_event(backend):
    _, fake, driver = backend
    x = ForeignArray((2, 3, 10, 9), 0xA0000, SIDE)
    pt.adaptive_avg_pool2d(x, (4, 7))
    events = driver.events
    for _ in range(3):
        pt.adaptive_avg_pool2d(x, (4, 7))
    assert not fake.events and not fake.streams and driver.events == events == 0
    assert len(driver.launches) == 4 and len(fake.pools) == 1


def test_indices_on_another_stream_are_waited_for_on_the_device(backend):
    """Max backward: ``grad_out`` on one stream, ``indices`` on another.  The launch goes to
    grad_out's stream, after an event recorded on the indices' stream; the event is made once."""
    _, _, driver = backend
    grad = ForeignArray((2, 3, 4, 7), 0xA0000, SIDE)
    indices = ForeignArray((2, 3, 4, 7), 0xB0000, OTHER, np.int64)
    for _ in range(2):
        driver.calls.clear()
        pt.adaptive_max_pool2d_backward(grad, indices, (2, 3, 10, 9))
        waits = [c for c in driver.calls if c[0] in ("cuEventRecord", "cuStreamWaitEvent")]
        (event,) = {c[1] for c in waits if c[0] == "cuEventRecord"}
        assert waits == [("cuEventRecord", event, OTHER), ("cuStreamWaitEvent", SIDE, event)]
    assert [launch["stream"] for launch in driver.launches] == [SIDE, SIDE] and driver.events == 1
    assert not _named(driver, "cuStreamSynchronize")


@pytest.mark.parametrize("indices_stream", [SIDE, None], ids=["same-stream", "names-none"])
def test_indices_on_the_same_stream_or_none_need_no_wait(backend, indices_stream):
    _, _, driver = backend
    grad = ForeignArray((2, 3, 4, 7), 0xA0000, SIDE)
    indices = ForeignArray((2, 3, 4, 7), 0xB0000, indices_stream, np.int64)
    pt.adaptive_max_pool2d_backward(grad, indices, (2, 3, 10, 9))
    assert [launch["stream"] for launch in driver.launches] == [SIDE]
    assert not _named(driver, "cuStreamWaitEvent") and driver.events == 0


def test_a_first_call_during_capture_is_refused_and_a_warm_one_is_captured(backend):
    _, _, driver = backend
    x = ForeignArray((2, 3, 10, 9), 0xA0000, SIDE)
    driver.capturing.add(SIDE)
    with pytest.raises(ValueError, match="call each signature once before capture"):
        pt.adaptive_avg_pool2d(x, (4, 7))
    assert not driver.launches
    driver.capturing.clear()
    pt.adaptive_avg_pool2d(x, (4, 7))
    driver.capturing.add(SIDE)
    pt.adaptive_avg_pool2d(x, (4, 7))
    assert [launch["stream"] for launch in driver.launches] == [SIDE, SIDE]


def test_numpy_calls_launch_on_the_legacy_default_stream(backend, monkeypatch):
    """numpy in, numpy out: copied in, launched on the default queue, copied back."""
    device, _, driver = backend
    monkeypatch.setattr(device, "to_device",
                        lambda host, queue=None: cuda.as_gpuarray(ForeignArray(host.shape, 0xC0000)))
    monkeypatch.setattr(device, "to_host", lambda array: np.zeros(array.shape, array.dtype))
    pt.adaptive_avg_pool2d(np.ones((2, 3, 10, 9), np.float32), (4, 7), device=device.id)
    assert [launch["stream"] for launch in driver.launches] == [LEGACY]
