"""The CUDA backend's arrays and launches for ``pool_tuner.ops`` against a fake libcuda
(tests/cuda_fakes.py): results from the memory pool of their context and stream, launches through the
driver API on the stream a CUDA array's ``__cuda_array_interface__`` names (else the legacy
default stream) with no host wait, a stream joined to another's with an event made once, no
PyCUDA stream or event made per call, a first call refused during graph capture.  Runs
everywhere; test_cuda.py and test_cuda_gpu.py run the same on a GPU."""

import numpy as np
import pytest

import pool_tuner as pt
from pool_tuner.backends import cuda, cuda_driver

from cuda_fakes import PRIMARY_CONTEXT, ForeignArray, forget_fake_gpu, install_fake_gpu

LEGACY, PER_THREAD, SIDE, OTHER = 1, 2, 0x7F00DEAD0, 0x7F00BEEF0
KERNEL = cuda_driver.DriverKernel(ordinal=0, context=PRIMARY_CONTEXT, function=0xF00D, name="pool_forward",
                                  max_threads_per_block=1024)


@pytest.fixture
def backend(monkeypatch):
    """A fake device on the fake driver, no context current yet (a fresh thread): the first call
    makes the primary context current."""
    device, fake, driver = install_fake_gpu(monkeypatch)
    yield device, fake, driver
    forget_fake_gpu()


def _named(driver, name):
    return [c for c in driver.calls if isinstance(c, tuple) and c[0] == name]


# ---------------------------------------------------------------------- the backend's own calls

def test_results_come_from_the_memory_pool_of_their_context_and_stream(backend):
    device, _, driver = backend
    first = device.empty((2, 3, 4), np.float32)
    second = device.empty((5,), np.int64)
    on_side = device.empty((5,), np.int64, cuda.CudaQueue(PRIMARY_CONTEXT, SIDE))
    assert [c[2] for c in _named(driver, "cuMemAlloc")] == [2 * 3 * 4 * 4, 5 * 8, 5 * 8]
    assert len({a.ptr for a in (first, second, on_side)}) == 3
    assert {driver.memory[a.ptr][0] for a in (first, second, on_side)} == {PRIMARY_CONTEXT}
    assert first.__cuda_array_interface__["stream"] == LEGACY and on_side.__cuda_array_interface__["stream"] == SIDE
    address = second.ptr
    del second
    again = device.empty((5,), np.int64)  # a dropped block is reused on its stream, not allocated again
    assert again.ptr == address and len(_named(driver, "cuMemAlloc")) == 3


def test_a_launch_goes_through_the_driver_and_records_no_event(backend):
    device, _, driver = backend
    out = device.empty((8,), np.float32)
    for _ in range(3):
        device.launch(None, KERNEL, 4, (32,), [out, np.int64(8)]).wait()
    assert driver.events == 0, "events made per launch"
    assert [launch["stream"] for launch in driver.launches] == [LEGACY] * 3
    assert driver.launches[0]["arguments"] == [out.ptr, 8]
    assert driver.launches[0]["grid"] == (4, 1, 1) and driver.launches[0]["block"] == (32, 1, 1)
    assert _named(driver, "cuStreamSynchronize") == [("cuStreamSynchronize", LEGACY)] * 3  # the waits asked for
    assert device.launch(None, KERNEL, 4, (32,), [out, np.int64(8)], timed=True) == 0.25
    assert driver.events == 2 and len(_named(driver, "cuEventDestroy")) == 2 and len(driver.launches) == 4
    with pytest.raises(ValueError, match="1 to"):
        device.launch(None, KERNEL, 0, (32,), [out])


def test_release_memory_frees_what_every_pool_holds(backend):
    device, _, driver = backend
    assert device.release_memory() == 0  # no pool yet: nothing made, nothing freed
    kept = device.empty((4,), np.float32)
    for _ in range(3):
        device.empty((4,), np.float32, cuda.CudaQueue(PRIMARY_CONTEXT, SIDE))  # dropped at once: held
    device.empty((8,), np.float32)
    assert device.release_memory() == 2 and device.release_memory() == 0
    assert len(_named(driver, "cuMemFree")) == 2 and kept.ptr in driver.memory


# ---------------------------------------------------------------------- pool_tuner.ops on CUDA arrays

@pytest.mark.parametrize("stream", [LEGACY, PER_THREAD, SIDE], ids=["legacy", "per-thread", "handle"])
def test_a_call_launches_on_the_stream_the_interface_names_without_a_host_wait(backend, stream):
    _, _, driver = backend
    x = ForeignArray((2, 3, 10, 9), 0xA0000, stream)
    y = pt.adaptive_avg_pool2d(x, (4, 7))
    (launch,) = driver.launches
    assert launch["stream"] == stream and launch["arguments"][:2] == [0xA0000, y.ptr]
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
    x = ForeignArray((2, 3, 10, 9), 0xA0000, SIDE, strides=(3 * 10 * 9 * 4, 4, 9 * 3 * 4, 3 * 4))  # channels-last
    y = pt.adaptive_avg_pool2d(x, (4, 7))
    assert y.strides == (3 * 4 * 7 * 4, 4, 7 * 3 * 4, 3 * 4) and y.__cuda_array_interface__["stream"] == SIDE


def test_a_warm_call_makes_no_driver_event_and_reuses_its_memory(backend):
    _, _, driver = backend
    x = ForeignArray((2, 3, 10, 9), 0xA0000, SIDE)
    pt.adaptive_avg_pool2d(x, (4, 7))
    events = driver.events
    for _ in range(3):
        pt.adaptive_avg_pool2d(x, (4, 7))
    assert driver.events == events == 0
    assert len(driver.launches) == 4 and len(_named(driver, "cuMemAlloc")) == 1


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


def test_a_warm_call_during_capture_whose_pool_is_empty_is_refused_with_what_to_do(backend):
    """A warm call allocates its result from the pool of its stream; where that pool has no free
    block (the warm-up ran on another stream, or its result is alive) it called cuMemAlloc during
    capture, which the driver refuses and which invalidates the capture."""
    _, _, driver = backend
    warm_up = pt.adaptive_avg_pool2d(ForeignArray((2, 3, 10, 9), 0xA0000, OTHER), (4, 7))  # another stream
    kept = pt.adaptive_avg_pool2d(ForeignArray((2, 3, 10, 9), 0xA0000, SIDE), (4, 7))  # alive during capture
    allocations = len(_named(driver, "cuMemAlloc"))
    driver.capturing.add(SIDE)
    with pytest.raises(ValueError, match="being captured.*Warm up each call on the capturing stream"):
        pt.adaptive_avg_pool2d(ForeignArray((2, 3, 10, 9), 0xA0000, SIDE), (4, 7))
    assert len(_named(driver, "cuMemAlloc")) == allocations and len(driver.launches) == 2
    del kept  # released before capture: its block serves the captured call
    pt.adaptive_avg_pool2d(ForeignArray((2, 3, 10, 9), 0xA0000, SIDE), (4, 7))
    assert len(driver.launches) == 3 and warm_up.stream == OTHER


def test_numpy_calls_launch_on_the_legacy_default_stream(backend, monkeypatch):
    """numpy in, numpy out: copied in, launched on the default queue, copied back, in the primary
    context made current."""
    device, _, driver = backend
    x = np.random.default_rng(0).random((2, 3, 10, 9), np.float32)
    y = pt.adaptive_avg_pool2d(x, (4, 7), device=device.info.id)
    assert [launch["stream"] for launch in driver.launches] == [LEGACY]
    (copy_in,) = _named(driver, "cuMemcpyHtoD")
    assert copy_in[1] == driver.launches[0]["arguments"][0] and copy_in[2] == x.nbytes
    assert isinstance(y, np.ndarray) and y.shape == (2, 3, 4, 7)
    assert np.isnan(y).all(), "the poisoned result came back (the fake kernel writes nothing)"
