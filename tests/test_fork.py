"""A process that used pool_tuner and then forks gives its child a working library (docs/design.md,
"Threads and processes"): the child's first call used to wait forever for PoCL's worker threads,
which a forked child does not have.  Each child reports through its exit status; a child that
does not finish in time fails the test instead of hanging it.
"""

import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

import pool_tuner as pt
from pool_tuner import reference

from conftest import RUN_SEED, gem_p_term_magnitude, random_input

TIMEOUT = 120
OUT = (4, 5)


def _wait(pid: int, timeout: float = TIMEOUT) -> int:
    """The exit code of child ``pid``; kills it and fails if it runs longer than ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child did not finish within {timeout} s: it hangs in pool_tuner")


def _in_child(check) -> int:
    """Fork; the child exits with 0 if ``check()`` is true, else 1 (2 if it raised)."""
    pid = os.fork()
    if pid == 0:
        status = 2
        try:
            status = 0 if check() else 1
        finally:
            os._exit(status)
    return pid


def _close(got, want) -> bool:
    return np.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_forked_child_computes_what_its_parent_computed(rng):
    """The child pools on the host (pool_tuner.host_fallback): max values and indices exactly the
    parent's, averages and gradients to float32 rounding, and explain names the fallback."""
    x = random_input(rng, (2, 3, 11, 9))
    grad = random_input(rng, (2, 3) + OUT)
    avg = pt.adaptive_avg_pool2d(x, OUT)
    values, indices = pt.adaptive_max_pool2d(x, OUT, return_indices=True)
    avg_grad = pt.adaptive_avg_pool2d_backward(grad, x.shape)
    max_grad = pt.adaptive_max_pool2d_backward(grad, indices, x.shape)
    assert pt.explain("adaptive_avg_pool2d", x.shape, OUT)["host_fallback"] is None

    def same_as_parent():
        again_values, again_indices = pt.adaptive_max_pool2d(x, OUT, return_indices=True)
        return (_close(pt.adaptive_avg_pool2d(x, OUT), avg) and np.array_equal(again_values, values)
                and np.array_equal(again_indices, indices)
                and _close(pt.adaptive_avg_pool2d_backward(grad, x.shape), avg_grad)
                and _close(pt.adaptive_max_pool2d_backward(grad, indices, x.shape), max_grad))

    def new_shape_is_right():  # a shape the parent never ran
        expected = reference.forward("adaptive_avg_pool2d", x, (3, 2))
        return _close(pt.adaptive_avg_pool2d(x, (3, 2)), expected)

    def explain_names_the_fallback():
        return "forked child" in (pt.explain("adaptive_avg_pool2d", x.shape, OUT)["host_fallback"] or "")

    def child():
        grandchild = _in_child(same_as_parent)  # a child that forks again
        return (same_as_parent() and new_shape_is_right() and explain_names_the_fallback()
                and _wait(grandchild) == 0)

    assert _wait(_in_child(child)) == 0
    assert np.array_equal(pt.adaptive_avg_pool2d(x, OUT), avg)  # and the parent still works


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_a_forked_child_runs_every_kind_of_op(rng, layout):
    """Pyramids, avgmax and 1d/3d ops, forward and backward, channels-last too, in the child."""
    x = random_input(rng, (2, 4, 10, 9))
    if layout == "channels_last":
        x = np.moveaxis(np.ascontiguousarray(np.moveaxis(x, 1, -1)), -1, 1)
    sizes = [1, 2, (3, 4)]
    pt.adaptive_avg_pool2d(x, 2)  # the parent uses PoCL first

    def child():
        ok = True
        levels = pt.adaptive_avg_pool_pyramid(x, sizes)
        for got, want in zip(levels, reference.forward("adaptive_avg_pool_pyramid2d", x, sizes)[0]):
            ok &= _close(got, want)
        values, indices = pt.adaptive_max_pool_pyramid(x, sizes, return_indices=True)
        want_values, want_indices = reference.forward("adaptive_max_pool_pyramid2d", x, sizes)
        ok &= all(np.array_equal(a, b) for a, b in zip(values + indices, want_values + want_indices))
        grads = [random_input(rng, v.shape) for v in values]
        ok &= _close(pt.adaptive_max_pool_pyramid_backward(grads, indices, x.shape),
                     reference.backward("adaptive_max_pool_pyramid2d", grads, x.shape, indices))
        ok &= _close(pt.adaptive_avg_pool_pyramid_backward(grads, x.shape),
                     reference.backward("adaptive_avg_pool_pyramid2d", grads, x.shape))
        joined = pt.adaptive_avgmax_pool2d(x, 3)
        avg, mx = reference.forward("adaptive_avgmax_pool2d", x, 3)[0]
        ok &= _close(joined, 0.5 * (avg + mx))
        x3 = random_input(rng, (2, 3, 5, 6, 7))
        ok &= _close(pt.adaptive_avg_pool3d(x3, (2, 3, 4)), reference.forward("adaptive_avg_pool3d", x3, (2, 3, 4)))
        g1 = random_input(rng, (2, 3, 4))
        ok &= _close(pt.adaptive_avg_pool1d_backward(g1, (2, 3, 13)),
                     reference.backward("adaptive_avg_pool1d", g1, (2, 3, 13)))
        return ok

    assert _wait(_in_child(child)) == 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_a_forked_child_rounds_to_the_dtype_as_the_kernels_do(rng, dtype):
    """The host fallback stores each dtype as the kernels do (bfloat16 as its bits, rounded to
    nearest even): the child's results are the parent's up to one unit in the last place."""
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        numpy_dtype = ml_dtypes.bfloat16
    else:
        numpy_dtype = np.dtype(dtype)
    x = random_input(rng, (2, 3, 11, 9)).astype(numpy_dtype)
    avg = pt.adaptive_avg_pool2d(x, OUT)
    values, indices = pt.adaptive_max_pool2d(x, OUT, return_indices=True)
    ulp = {"float16": 2e-3, "bfloat16": 1.6e-2, "float64": 1e-12}[dtype]

    def child():
        again_values, again_indices = pt.adaptive_max_pool2d(x, OUT, return_indices=True)
        again = pt.adaptive_avg_pool2d(x, OUT)
        return (again.dtype == avg.dtype and np.array_equal(again_indices, indices)
                and np.array_equal(again_values.astype(np.float64), values.astype(np.float64))
                and np.allclose(again.astype(np.float64), avg.astype(np.float64), rtol=ulp, atol=ulp))

    assert _wait(_in_child(child)) == 0


def test_a_device_array_in_a_forked_child_is_refused_not_hung(rng):
    import pyopencl.array as cl_array
    from pool_tuner.backends import opencl

    pocl = [d for d in opencl.list_devices() if d.is_pocl and d.info.is_cpu]
    if not pocl:
        pytest.skip("no PoCL CPU device")
    x = cl_array.to_device(pocl[0].queue, random_input(rng, (2, 3, 8, 8)))
    pt.adaptive_avg_pool2d(x, 2).finish()

    def child():
        try:
            pt.adaptive_avg_pool2d(x, 2)
        except RuntimeError as exc:
            return "spawn" in str(exc) and ".get()" in str(exc)
        return False

    assert _wait(_in_child(child)) == 0


SIZES = [(9, 7), (10, 11), (12, 6)]


def _pooled_dataset(torch, count: int):
    """A dataset whose items pool_tuner pools in ``__getitem__``: a fresh random input per index,
    through the torch module and the numpy API (made here: torch is optional)."""
    import pool_tuner.torch as ptt

    class PooledDataset(torch.utils.data.Dataset):
        pool = ptt.AdaptiveAvgPool2d(OUT)

        def __len__(self):
            return count

        def __getitem__(self, index):
            x = self.input(index)
            values, indices = pt.adaptive_max_pool2d(x.numpy(), OUT, return_indices=True)
            return index, self.pool(x), torch.from_numpy(values), torch.from_numpy(indices), os.getpid()

        @staticmethod
        def input(index):
            size = SIZES[index % len(SIZES)]
            return torch.from_numpy(random_input(np.random.default_rng([RUN_SEED, index]), (3,) + size))

    return PooledDataset()


def test_dataloader_workers_forked_after_the_parent_used_pool_tuner():
    torch = pytest.importorskip("torch")
    if multiprocessing.get_start_method() != "fork":
        pytest.skip("the default start method of this platform does not fork")
    dataset = _pooled_dataset(torch, 12)
    expected = [dataset[i] for i in range(len(dataset))]  # the parent uses pool_tuner first
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, timeout=TIMEOUT)
    workers = set()
    for index, avg, values, indices, pid in loader:
        _, want_avg, want_values, want_indices, _ = expected[index]
        assert torch.equal(values, want_values) and torch.equal(indices, want_indices)  # exact on the host too
        torch.testing.assert_close(avg, want_avg, rtol=1e-5, atol=1e-6)
        x = dataset.input(index).numpy()
        np.testing.assert_allclose(avg.numpy(), reference.forward("adaptive_avg_pool2d", x, OUT), rtol=1e-5, atol=1e-6)
        workers.add(pid)
    assert len(workers) == 2 and os.getpid() not in workers


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("size", [1, (3, 4)])
def test_a_forked_child_pools_gem_with_its_own_p_on_the_host(rng, layout, size):
    """GeM with a p and eps other than the defaults (a learnt p), forward and backward (x and p),
    global and windowed, in the child: the host fallback takes the call's run-time arguments."""
    x = np.abs(random_input(rng, (2, 4, 10, 9))) + 0.1
    if layout == "channels_last":
        x = np.moveaxis(np.ascontiguousarray(np.moveaxis(x, 1, -1)), -1, 1)
    p, eps = 2.5, 1e-3
    out = pt.adaptive_gem_pool2d(x, size, p, eps)  # the parent uses PoCL first
    grad = random_input(rng, out.shape)
    grad_x, grad_p = pt.adaptive_gem_pool2d_backward(grad, x, size, p, eps)

    # dL/dp sums terms of both signs (grad is random in both): its error is relative to their magnitude
    p_tolerance = 1e-5 * gem_p_term_magnitude(grad, reference.adaptive_gem_pool(x, size, 2, p, eps), p)

    def child():
        ok = _close(pt.adaptive_gem_pool2d(x, size, p, eps), reference.adaptive_gem_pool(x, size, 2, p, eps))
        ok &= _close(pt.adaptive_gem_pool2d(x, size), reference.adaptive_gem_pool(x, size, 2))
        want_x, want_p = reference.adaptive_gem_pool_backward(grad, x, size, 2, p, eps)
        got_x, got_p = pt.adaptive_gem_pool2d_backward(grad, x, size, p, eps)
        ok &= _close(got_x, want_x) and abs(got_p - want_p) <= p_tolerance
        return ok and _close(got_x, grad_x) and abs(got_p - grad_p) <= p_tolerance

    assert _wait(_in_child(child)) == 0


@pytest.mark.usefixtures("candidate_on")
def test_a_forked_child_races_against_its_own_launch_floor(rng):
    """The race of PyTorch's kernel against pool_tuner's skips pool_tuner's side below the device's
    launch floor; in a forked child pool_tuner's side is the host fallback, so the child measures
    its own floor instead of leaning on the parent's, and its layers give PyTorch's results."""
    torch = pytest.importorskip("torch")
    import pool_tuner.torch as ptt

    layer = ptt.AdaptiveAvgPool2d(OUT)
    x = torch.from_numpy(random_input(rng, (1, 3, 11, 9)))
    layer(x)
    parent_floor = pt.explain("adaptive_avg_pool2d", (1, 3, 11, 9), OUT)["measured_candidate"]["floor_ms"]
    y = torch.from_numpy(random_input(rng, (1, 3, 12, 9)))

    def check():
        torch.set_num_threads(1)  # as DataLoader's workers do: PyTorch's own thread pool hangs a forked child
        result = layer(y)
        race = pt.explain("adaptive_avg_pool2d", (1, 3, 12, 9), OUT)["measured_candidate"]
        return (race["floor_ms"] != parent_floor and race["floor_ms"] > 0
                and torch.allclose(result, torch.nn.functional.adaptive_avg_pool2d(y, OUT), rtol=1e-5, atol=1e-6))

    assert _wait(_in_child(check)) == 0


def test_a_child_forked_while_another_thread_builds_kernels_neither_hangs_nor_builds(rng):
    """Another thread of the parent builds kernels while the main thread forks: the child used to
    hang inside ``os.fork`` itself (clearing its memos released the parent's kernels, whose release
    waits on PoCL's compiler lock, held by that thread at the fork; 3 of 10 children here), or at its
    first call, which built a kernel the host fallback does not run.  Each child pools a new shape
    and checks it against the reference; about one fork in three met the lock held."""
    import threading

    x = random_input(rng, (2, 3, 10, 9))
    pt.adaptive_avg_pool2d(x, OUT)
    stop = threading.Event()

    def build_new_shapes():
        for i in range(10_000):
            if stop.is_set():
                return
            pt.adaptive_max_pool2d(x, (3 + i % 7, 4 + i % 5))
            pt.adaptive_avg_pool2d(x, (1 + i % 9, 2 + i % 7))

    builder = threading.Thread(target=build_new_shapes, daemon=True)
    builder.start()
    try:
        for child in range(8):
            time.sleep(0.15)
            size = (5, 3 + child)
            pid = _in_child(lambda: _close(pt.adaptive_avg_pool2d(x, size), reference.adaptive_avg_pool(x, size, 2)))
            assert _wait(pid, timeout=30) == 0
    finally:
        stop.set()
        builder.join()


def test_a_forked_child_keeps_what_its_parent_memoised_alive():
    """What the child forgets of its parent's memos is never released there (``memo.keep_alive``):
    releasing a parent's OpenCL object in the child can wait forever on the driver's locks."""
    from pool_tuner import memo

    released = []

    class Held:
        def __del__(self):
            released.append(True)

    table = memo.table("test_fork.kept")
    owner = object()
    table.put(owner, "key", Held())
    try:
        pid = _in_child(lambda: table.peek("key") is None and not released)
        assert _wait(pid) == 0, "the child forgot the entry and kept it alive"
    finally:
        table.clear()
