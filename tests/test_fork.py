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

from conftest import RUN_SEED, random_input

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


def test_a_forked_child_computes_what_its_parent_computed(rng):
    x = random_input(rng, (2, 3, 11, 9))
    grad = random_input(rng, (2, 3) + OUT)
    avg = pt.adaptive_avg_pool2d(x, OUT)
    values, indices = pt.adaptive_max_pool2d(x, OUT, return_indices=True)
    avg_grad = pt.adaptive_avg_pool2d_backward(grad, x.shape)
    max_grad = pt.adaptive_max_pool2d_backward(grad, indices, x.shape)

    def same_as_parent():
        again_values, again_indices = pt.adaptive_max_pool2d(x, OUT, return_indices=True)
        return (np.array_equal(pt.adaptive_avg_pool2d(x, OUT), avg) and np.array_equal(again_values, values)
                and np.array_equal(again_indices, indices)
                and np.array_equal(pt.adaptive_avg_pool2d_backward(grad, x.shape), avg_grad)
                and np.array_equal(pt.adaptive_max_pool2d_backward(grad, indices, x.shape), max_grad))

    def new_shape_is_right():  # a kernel the parent never built
        expected = reference.forward("adaptive_avg_pool2d", x, (3, 2))
        return np.allclose(pt.adaptive_avg_pool2d(x, (3, 2)), expected, rtol=1e-5, atol=1e-6)

    def child():
        grandchild = _in_child(same_as_parent)  # a child that forks again
        return same_as_parent() and new_shape_is_right() and _wait(grandchild) == 0

    assert _wait(_in_child(child)) == 0
    assert np.array_equal(pt.adaptive_avg_pool2d(x, OUT), avg)  # and the parent still works


def test_pool_tuner_asks_pocl_for_its_fork_fallback_unless_the_user_chose_drivers():
    from pool_tuner.backends import opencl

    environ = {}
    assert "set by pool_tuner" in opencl.request_pocl_fork_fallback(environ)
    assert environ == {opencl.POCL_DEVICES_ENV: "pthread basic", opencl.POCL_DEVICES_MARK_ENV: "1"}
    assert opencl.fallback_requested(environ)
    for users in ({opencl.POCL_DEVICES_ENV: "pthread"},  # the mark inherited, the value the user's
                  {opencl.POCL_DEVICES_ENV: "pthread", opencl.POCL_DEVICES_MARK_ENV: "1"}):
        environ = dict(users)
        assert "as set by the user" in opencl.request_pocl_fork_fallback(environ)
        assert environ == users and not opencl.fallback_requested(environ)
    pocl = [d for d in opencl.list_devices() if d.is_pocl]
    assert [d.id for d in pocl] == ["opencl:pocl:0"] and pocl[0].fork_fallback is not None


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
        assert torch.equal(avg, want_avg) and torch.equal(values, want_values) and torch.equal(indices, want_indices)
        x = dataset.input(index).numpy()
        np.testing.assert_allclose(avg.numpy(), reference.forward("adaptive_avg_pool2d", x, OUT), rtol=1e-5, atol=1e-6)
        workers.add(pid)
    assert len(workers) == 2 and os.getpid() not in workers
