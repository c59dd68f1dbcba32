"""The driver-API launch path (``backends.cuda_driver`` and ``CudaDevice.prepare``) against a
fake libcuda (tests/cuda_fakes.py): argument marshalling, stream handles, contexts, threads,
memoised builds.  Runs everywhere; what only a GPU can show is in tests/test_cuda.py."""

import ctypes
import pathlib
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest

from pool_tuner import dispatch, plans
from pool_tuner.backends import cuda, cuda_driver
from pool_tuner.problem import Problem

from cuda_fakes import MAX_THREADS, OTHER_CONTEXT, PRIMARY_CONTEXT, FakeDriver, fake_cuda_device

KERNEL = cuda_driver.DriverKernel(ordinal=0, context=PRIMARY_CONTEXT, function=0xF00D, name="pool_forward",
                                  max_threads_per_block=MAX_THREADS)


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(cuda_driver, "library", lambda: fake)
    cuda_driver.primary_context.cache_clear()
    cuda.forget_builds()
    yield fake
    cuda_driver.primary_context.cache_clear()
    cuda.forget_builds()


def test_launch_passes_pointers_grid_block_and_stream_handle(driver):
    driver.set_current(PRIMARY_CONTEXT)
    launch = cuda_driver.PreparedLaunch(KERNEL, 37, (128, 2), 3, (np.int64(2**40 + 6),), lib=driver)
    launch(0x5EED, 0x7000, 0x8000, 2**63 + 8)
    (record,) = driver.launches
    assert record["function"] == 0xF00D
    assert record["grid"] == (37, 1, 1) and record["block"] == (128, 2, 1) and record["shared"] == 0
    assert record["stream"] == 0x5EED and record["extra"] is None
    assert record["arguments"] == [0x7000, 0x8000, 2**63 + 8, 2**40 + 6]  # full 64-bit pointers, then the planes
    assert record["context"] == PRIMARY_CONTEXT
    assert not [c for c in driver.calls if c == "pop" or c[0] == "push"], "no push when the primary context is current"


def test_every_call_reuses_the_argument_array(driver):
    """No per-call ctypes array: the driver sees the same kernelParams each time, new values in it."""
    driver.set_current(PRIMARY_CONTEXT)
    launch = cuda_driver.PreparedLaunch(KERNEL, 1, (32,), 2, (), lib=driver)
    for i in range(3):
        launch(0, 0x1000 * (i + 1), 0x1100 * (i + 1))
    assert len({r["params_address"] for r in driver.launches}) == 1
    assert [r["arguments"] for r in driver.launches] == [[0x1000 * k, 0x1100 * k] for k in (1, 2, 3)]


def test_a_calls_scalars_go_into_the_same_slots_and_the_launchs_own_come_back_without_them(driver):
    """A learnt GeM p: each call's scalars written into the prepared slots (the kernel reads the
    64-bit plane count, then the float32 p, as the fake reads them here by address), the launch's
    own when a call passes none; a call with another number of scalars is refused before launching."""
    driver.set_current(PRIMARY_CONTEXT)
    defaults = (np.int64(6), np.float32(3.0))
    launch = cuda_driver.PreparedLaunch(KERNEL, 1, (32,), 1, defaults, lib=driver)
    for scalars in ((np.int64(6), np.float32(2.5)), None, (np.int64(7), np.float32(1.25))):
        launch(0, 0x1000, scalars=scalars)
    assert len({r["params_address"] for r in driver.launches}) == 1
    params = driver.launches[0]["params_address"]
    slot = ctypes.c_void_p.from_address(params + 2 * ctypes.sizeof(ctypes.c_void_p)).value  # pointer, planes, p
    assert ctypes.c_float.from_address(slot).value == 1.25, "the p slot holds the last call's p"
    assert [r["arguments"][1] for r in driver.launches] == [6, 6, 7]
    with pytest.raises(TypeError, match="takes 2 run-time scalars, got 1"):
        launch(0, 0x1000, scalars=(np.int64(6),))
    assert len(driver.launches) == 3


def test_a_thread_without_a_context_gets_the_primary_one_made_current_and_kept(driver):
    """The runtime's rule, PyTorch's and CuPy's: no push and pop around the launch; the primary
    context bound with cuCtxSetCurrent and left current for the thread's later work."""
    driver.set_current(None)
    launch = cuda_driver.PreparedLaunch(KERNEL, 1, (32,), 2, (), lib=driver)
    launch(0, 1, 2)
    launch(0, 1, 2)
    assert [r["context"] for r in driver.launches] == [PRIMARY_CONTEXT] * 2
    assert driver.calls == [("set", PRIMARY_CONTEXT)]
    assert driver.current() == PRIMARY_CONTEXT


def test_a_launch_under_the_kernels_context_is_one_driver_call(driver):
    """As a launch of PyTorch's own: the current context is asked for only when the driver refuses
    a launch (no context current, or another one), never on a launch it takes."""
    driver.set_current(PRIMARY_CONTEXT)
    asked = []
    driver.on_get_current = lambda: asked.append("cuCtxGetCurrent")
    launch = cuda_driver.PreparedLaunch(KERNEL, 1, (32,), 2, (), lib=driver)
    for i in range(3):
        launch(0, i, i + 1)
    assert len(driver.launches) == 3 and not asked and not driver.calls


def test_a_launch_under_another_current_context_is_refused_naming_both(driver):
    driver.functions[KERNEL.function] = KERNEL.context  # its module loaded there: the driver refuses it elsewhere
    driver.set_current(OTHER_CONTEXT)
    launch = cuda_driver.PreparedLaunch(KERNEL, 1, (32,), 2, (), lib=driver)
    with pytest.raises(cuda_driver.ContextError, match=r"current CUDA context \(0xd0, device 1\).*0xc0, cuda:0"):
        launch(0, 1, 2)
    assert not driver.launches and driver.current() == OTHER_CONTEXT
    assert [c for c in driver.calls if c != "cuInit" and c[0] != "cuDevicePrimaryCtxRetain"] == [], \
        "nothing made current, pushed or popped (the message asks which context is the primary one)"


def test_a_refused_launch_of_a_kernel_of_a_non_primary_context_does_not_call_it_the_primary_one(driver):
    """A kernel loaded into ``pycuda.autoinit``'s context, launched under the primary one: the
    message named the autoinit context "cuda:0's primary context, where PyTorch's tensors live"."""
    own = driver.create_context(0)
    kernel = cuda_driver.DriverKernel(ordinal=0, context=own, function=0xF00D, name="pool_forward",
                                      max_threads_per_block=MAX_THREADS)
    driver.functions[kernel.function] = own  # its module loaded there: the driver refuses it elsewhere
    driver.set_current(PRIMARY_CONTEXT)
    launch = cuda_driver.PreparedLaunch(kernel, 1, (32,), 2, (), lib=driver)
    with pytest.raises(cuda_driver.ContextError) as refused:
        launch(0, 0x1000, 0x1100)
    message = str(refused.value)
    assert f"{PRIMARY_CONTEXT:#x}" in message and f"{own:#x}" in message
    assert "primary context, where PyTorch" not in message and "other than its primary one" in message


def test_failed_launch_raises(driver):
    driver.set_current(None)
    driver.launch_status = 719
    launch = cuda_driver.PreparedLaunch(KERNEL, 1, (32,), 2, (), lib=driver)
    with pytest.raises(cuda_driver.DriverError, match=r"cuLaunchKernel\(pool_forward\) failed: CUDA_ERROR_FAKE \(719\)"):
        launch(0, 1, 2)
    assert driver.current() == PRIMARY_CONTEXT


def test_wrong_number_of_pointers_is_a_type_error(driver):
    launch = cuda_driver.PreparedLaunch(KERNEL, 1, (32,), 2, (), lib=driver)
    with pytest.raises(TypeError, match="takes 2 device pointers, got 3"):
        launch(0, 1, 2, 3)
    assert not driver.launches


def test_concurrent_launches_never_launch_another_threads_pointers(driver):
    """The argument slots are shared; each launch must carry its own thread's pointers even when
    the interpreter switches threads between filling the slots and the driver reading them."""
    driver.set_current(PRIMARY_CONTEXT)
    driver.on_launch = lambda: time.sleep(0)  # a thread switch between fill and read
    launch = cuda_driver.PreparedLaunch(KERNEL, 1, (32,), 2, (), lib=driver)
    pointers = {}
    started = threading.Barrier(4)  # all alive at once: no thread's id is reused by another

    def worker(base):
        driver.set_current(PRIMARY_CONTEXT)
        pointers[threading.get_ident()] = [base, base + 1]
        started.wait()
        for _ in range(300):
            launch(0, base, base + 1)

    threads = [threading.Thread(target=worker, args=(0x10000 * (k + 1),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(driver.launches) == 1200
    assert all(r["arguments"] == pointers[r["thread"]] for r in driver.launches)


def test_load_kernel_loads_into_the_current_context_else_the_primary_one(driver):
    driver.set_current(None)
    kernel = cuda_driver.load_kernel(0, b"\x7fELF-cubin", "pool_backward")
    assert driver.modules == [(b"\x7fELF-cubin", PRIMARY_CONTEXT)]
    assert ("cuModuleGetFunction", 0x101, b"pool_backward") in driver.calls
    assert kernel == cuda_driver.DriverKernel(0, PRIMARY_CONTEXT, 0xF001, "pool_backward", MAX_THREADS)
    assert driver.current() == PRIMARY_CONTEXT, "the primary context stays current"
    own = driver.create_context(0)
    driver.set_current(own)  # a context of the caller's own (pycuda.autoinit makes one)
    assert cuda_driver.load_kernel(0, b"other", "pool_forward").context == own
    assert driver.modules[-1] == (b"other", own)
    assert driver.calls.count(("cuDevicePrimaryCtxRetain", 0)) == 1  # retained once per device
    assert not [c for c in driver.calls if c == "pop" or c[0] == "push"]


def _problem_and_choice(device, shape=(2, 3, 10, 9), size=(4, 7)):
    problem = Problem.create("adaptive_avg_pool2d", shape, size)
    return problem, dispatch.choose(problem, device, "thread_per_output")


def test_the_device_builds_once_per_kernel_without_pycuda(driver, monkeypatch):
    compiled = []

    def fake_compile(source, arch):
        compiled.append(arch)
        return b"cubin of " + source.encode()[-16:]

    def no_pycuda():
        raise AssertionError("the driver path must not use PyCUDA beyond its compiler")

    monkeypatch.setattr(cuda, "_compile", fake_compile)
    monkeypatch.setattr(cuda, "_pycuda", no_pycuda)
    device = fake_cuda_device()
    context = device.queue.context
    problem, choice = _problem_and_choice(device)
    launch = dispatch.prepare(device, context, problem, choice)
    again = dispatch.prepare(device, context, problem, choice)
    assert again is launch and compiled == ["sm_90"] and len(driver.modules) == 1
    assert isinstance(launch.kernel, cuda_driver.DriverKernel) and launch.kernel.context == PRIMARY_CONTEXT
    variant, params = choice.variant, choice.config
    assert (launch.groups, launch.block) == (variant.groups(params, problem), variant.block(params))
    source = variant.program(params, problem)
    assert driver.modules[0][0] == b"cubin of " + source.encode()[-16:]


def test_the_device_refuses_blocks_the_loaded_kernel_cannot_run(driver, monkeypatch):
    monkeypatch.setattr(cuda, "_compile", lambda source, arch: b"cubin")
    driver.max_threads = 64  # register pressure: fewer threads than the device's limit
    device = fake_cuda_device()
    problem = Problem.create("adaptive_avg_pool2d", (2, 3, 10, 9), (4, 7))
    choice = dispatch.choose(problem, device, "thread_per_output", {"block_size_x": 128})
    with pytest.raises(ValueError, match="at most 64"):
        dispatch.prepare(device, device.queue.context, problem, choice)


def test_a_plan_of_two_passes_runs_both_on_the_callers_stream_over_its_scratch(driver, monkeypatch):
    """global_blocks splitting four huge planes: the Plan allocates the scratch buffer with the
    front end's allocator after the results, and launches the split kernel then the merging one
    (a second build of the same file, COMBINE_PASS 1) on the caller's stream with the same
    pointers."""
    sources = []

    def fake_compile(source, arch):
        sources.append(source)
        return b"cubin %d" % len(sources)

    monkeypatch.setattr(cuda, "_compile", fake_compile)
    device = fake_cuda_device()
    shape = (1, 4, 4096, 4096)
    spec = plans.ArraySpec(shape, tuple(int(s) for s in np.cumprod((1,) + shape[:0:-1])[::-1]), "float32")
    plan = plans.make_plan("adaptive_max_pool2d", "forward", [spec], 1, device, variant="global_blocks")
    assert plan.choice.config["split"] == 64
    allocated = []

    def allocate(result, fill):
        allocated.append(result)
        return 0x100000 * len(allocated)

    plan.run([0x7000], allocate, lambda address: address, stream=0x5EED)
    assert [r.dtype for r in allocated] == ["float32", "int64", "int64"]
    assert allocated[2].flat and allocated[2].shape == (4 * 64 * 2,)  # a value and a position per part
    first, second = driver.launches
    assert first["arguments"] == second["arguments"] == [0x7000, 0x100000, 0x200000, 0x300000, 4]
    assert (first["grid"], second["grid"]) == ((4 * 64, 1, 1), (1, 1, 1))
    assert first["stream"] == second["stream"] == 0x5EED and first["function"] != second["function"]
    assert ["#define COMBINE_PASS 1" in source for source in sources] == [False, True]


def test_prepared_launch_checks_the_grid(driver):
    device = fake_cuda_device()
    with pytest.raises(ValueError, match="1 to"):
        device.prepare(dispatch.Launch(KERNEL, 0, (32,), ()), (4, 4), 1)
    assert isinstance(device.prepare(dispatch.Launch(KERNEL, 5, (32,), ()), (4, 4), 1), cuda_driver.PreparedLaunch)


# ---------------------------------------------------------------------- through a real C ABI

class _RecordedLaunch(ctypes.Structure):
    """``struct launch`` of tests/data/stub_libcuda.c."""

    _fields_ = [("function", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p), ("pointers", ctypes.c_uint64 * 4),
                ("context", ctypes.c_void_p), ("extra", ctypes.c_void_p)]


@pytest.fixture(scope="module")
def stub_libcuda(tmp_path_factory):
    """tests/data/stub_libcuda.c built as a shared library, signatures declared as for libcuda."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler on PATH to build the stub libcuda")
    library = tmp_path_factory.mktemp("stub_libcuda") / "libstubcuda.so"
    source = pathlib.Path(__file__).parent / "data" / "stub_libcuda.c"
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return cuda_driver.declare_signatures(ctypes.CDLL(str(library)))


def test_launch_arguments_cross_a_c_abi_intact(stub_libcuda):
    """Grid, block, stream, 64-bit pointers, the 64-bit plane count and a 64-bit context handle
    arrive in C as given, on both paths (no context current: the kernel's bound; already current)."""
    lib = stub_libcuda
    ctypes.c_int.in_dll(lib, "n_pointers").value = 4  # three pointers and the plane count
    context = 0xC0000000C0  # above 2^32: a handle truncated to an int would not compare equal
    kernel = cuda_driver.DriverKernel(0, context, 0xF00D, "pool_forward", 1024)
    launch = cuda_driver.PreparedLaunch(kernel, 2**31 - 1, (128, 4), 3, (np.int64(2**40 + 6),), lib=lib)
    recorded = _RecordedLaunch.in_dll(lib, "last_launch")
    counts = {name: ctypes.c_int.in_dll(lib, name) for name in ("pushes", "pops", "sets")}
    pointers = [2**63 + 8, 0x1000, 0xDEADBEEF0000]
    try:
        launch(0x7FFF00001234, *pointers)  # this thread has no current context: the kernel's is bound
        assert (recorded.function, list(recorded.grid), list(recorded.block)) == (0xF00D, [2**31 - 1, 1, 1],
                                                                                  [128, 4, 1])
        assert (recorded.shared, recorded.stream, recorded.extra) == (0, 0x7FFF00001234, None)
        assert list(recorded.pointers) == pointers + [2**40 + 6] and recorded.context == context
        assert {name: count.value for name, count in counts.items()} == {"pushes": 0, "pops": 0, "sets": 1}

        launch(0, 1, 2, 3)  # current now: nothing bound again
        assert list(recorded.pointers) == [1, 2, 3, 2**40 + 6] and recorded.stream is None
        assert recorded.context == context
        assert {name: count.value for name, count in counts.items()} == {"pushes": 0, "pops": 0, "sets": 1}
    finally:
        lib.cuCtxSetCurrent(None)  # the stub's per-thread stack outlives the test


def test_load_kernel_through_a_c_abi(stub_libcuda, monkeypatch):
    monkeypatch.setattr(cuda_driver, "library", lambda: stub_libcuda)
    cuda_driver.primary_context.cache_clear()
    try:
        kernel = cuda_driver.load_kernel(3, b"\x7fELF cubin", "pool_backward")
    finally:
        cuda_driver.primary_context.cache_clear()
        stub_libcuda.cuCtxSetCurrent(None)
    assert kernel == cuda_driver.DriverKernel(3, 0xC0000000C3, 0xF00D, "pool_backward", 1024)


# ---------------------------------------------------------------------- one-off launches and stream calls

def test_a_one_off_launch_passes_pointers_and_scalars_in_order(driver):
    driver.set_current(PRIMARY_CONTEXT)
    cuda_driver.launch(KERNEL, 7, (64, 2), 0x5EED, [0x7000, np.int64(-3), 2**63 + 8, np.int64(2**40)])
    (record,) = driver.launches
    assert record["grid"] == (7, 1, 1) and record["block"] == (64, 2, 1) and record["stream"] == 0x5EED
    assert record["arguments"] == [0x7000, 2**64 - 3, 2**63 + 8, 2**40]
    assert record["context"] == PRIMARY_CONTEXT and driver.calls == []


def test_fill_sets_8_byte_elements_as_two_words(driver):
    driver.set_current(PRIMARY_CONTEXT)
    cuda_driver.fill(0x1000, 0x7FF8000000000000, 8, 5, 2)
    cuda_driver.fill(0x2000, 0x7E00, 2, 9, 2)
    assert [c for c in driver.calls if c[0].startswith("cuMemset")] == [
        ("cuMemsetD2D32Async", 0x1000, 8, 0, 1, 5, 2), ("cuMemsetD2D32Async", 0x1004, 8, 0x7FF80000, 1, 5, 2),
        ("cuMemsetD16Async", 0x2000, 0x7E00, 9, 2)]


def test_a_stream_join_makes_its_event_once(driver):
    driver.set_current(PRIMARY_CONTEXT)
    join = cuda_driver.StreamJoin()
    join(0xA, 0xB)
    join(0xA, 2)
    event = 0xE001
    assert driver.calls == [("cuEventCreate", 2), ("cuEventRecord", event, 0xB), ("cuStreamWaitEvent", 0xA, event),
                            ("cuEventRecord", event, 2), ("cuStreamWaitEvent", 0xA, event)]
