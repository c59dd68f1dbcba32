"""Concurrent calls and concurrent tuning (docs/design.md, "Threads and processes").

Many threads call the public API at once with a tiny switch interval, so that the interpreter
changes threads between almost any two bytecodes: every result must be bit-identical to the one
the same call gave alone (which itself matches the float64 reference), and nothing may crash.
Without the launch lock this returned other calls' (or freed) memory and segfaulted.
"""

import os
import sys
import threading

import numpy as np
import pytest

import pool_tuner as pt
from pool_tuner import reference, tuner

from conftest import random_input

THREADS = 8
SWITCH_INTERVAL = 1e-5
#: (input shape, output size) of the calls: small, so that thousands of calls take seconds.
CASES = [((2, 4, 9, 11), (4, 3)), ((1, 3, 7, 7), (3, 5)), ((3, 2, 12, 5), (5, 2)), ((2, 5, 6, 8), (6, 8))]


@pytest.fixture
def switching_often():
    previous = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL)
    yield
    sys.setswitchinterval(previous)


def _run_threads(work, count=THREADS) -> list:
    """Run ``work(thread_index)`` on ``count`` threads started together; the exceptions raised."""
    errors, start = [], threading.Barrier(count)

    def run(index):
        start.wait()
        try:
            work(index)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def _numpy_calls(rng) -> list:
    """Each case as calls of the numpy API (forward and backward, avg and max) with their
    single-threaded results, which are checked against the float64 reference first."""
    calls = []
    for shape, out in CASES:
        x = random_input(rng, shape)
        grad = random_input(rng, shape[:2] + out)
        avg = pt.adaptive_avg_pool2d(x, out)
        values, indices = pt.adaptive_max_pool2d(x, out, return_indices=True)
        avg_grad = pt.adaptive_avg_pool2d_backward(grad, shape)
        max_grad = pt.adaptive_max_pool2d_backward(grad, indices, shape)
        expected_values, expected_indices = reference.forward("adaptive_max_pool2d", x, out)
        np.testing.assert_allclose(avg, reference.forward("adaptive_avg_pool2d", x, out), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(values, expected_values.astype(np.float32))
        np.testing.assert_array_equal(indices, expected_indices)
        np.testing.assert_allclose(avg_grad, reference.backward("adaptive_avg_pool2d", grad, shape),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(max_grad, reference.backward("adaptive_max_pool2d", grad, shape, indices),
                                   rtol=1e-5, atol=1e-6)
        calls += [
            (lambda x=x, out=out: pt.adaptive_avg_pool2d(x, out), avg),
            (lambda x=x, out=out: pt.adaptive_max_pool2d(x, out, return_indices=True), (values, indices)),
            (lambda g=grad, s=shape: pt.adaptive_avg_pool2d_backward(g, s), avg_grad),
            (lambda g=grad, i=indices, s=shape: pt.adaptive_max_pool2d_backward(g, i, s), max_grad),
        ]
    return calls


def _same(got, expected) -> bool:
    if isinstance(expected, tuple):
        return all(_same(g, e) for g, e in zip(got, expected))
    return got.dtype == expected.dtype and np.array_equal(got, expected)


def test_concurrent_numpy_calls_match_single_threaded_results(rng, switching_often):
    calls = _numpy_calls(rng)
    per_thread = 500
    wrong = []

    def work(index):
        order = np.random.default_rng([index, 1]).integers(len(calls), size=per_thread)
        for i in order:
            call, expected = calls[i]
            if not _same(call(), expected):
                wrong.append(int(i))

    assert _run_threads(work) == []
    assert wrong == [], f"{len(wrong)} of {THREADS * per_thread} concurrent calls differ from the single-threaded ones"


def test_concurrent_torch_modules_forward_and_backward_match_single_threaded_results(rng, switching_often):
    torch = pytest.importorskip("torch")
    import pool_tuner.torch as ptt

    modules = [(ptt.AdaptiveAvgPool2d(out), ptt.AdaptiveMaxPool2d(out), shape, out) for shape, out in CASES]
    inputs = [torch.from_numpy(random_input(rng, shape)) for _, _, shape, _ in modules]
    weights = [torch.from_numpy(random_input(rng, shape[:2] + out)) for _, _, shape, out in modules]

    def step(i):
        avg, maximum, _, _ = modules[i]
        x = inputs[i].clone().requires_grad_(True)
        loss = ((avg(x) + maximum(x)) * weights[i]).sum()
        loss.backward()
        return avg(inputs[i]).numpy(), maximum(inputs[i]).numpy(), x.grad.numpy()

    expected = [step(i) for i in range(len(modules))]
    for i, (_, _, shape, out) in enumerate(modules):  # the single-threaded results are right
        x = inputs[i].numpy()
        np.testing.assert_allclose(expected[i][0], reference.forward("adaptive_avg_pool2d", x, out), rtol=1e-5, atol=1e-6)
        values, indices = reference.forward("adaptive_max_pool2d", x, out)
        np.testing.assert_array_equal(expected[i][1], values.astype(np.float32))
        gradient = (reference.backward("adaptive_avg_pool2d", weights[i].numpy(), shape)
                    + reference.backward("adaptive_max_pool2d", weights[i].numpy(), shape, indices))
        np.testing.assert_allclose(expected[i][2], gradient, rtol=1e-5, atol=1e-5)
    per_thread = 60
    wrong = []

    def work(index):
        for i in np.random.default_rng([index, 2]).integers(len(modules), size=per_thread):
            if not all(np.array_equal(g, e) for g, e in zip(step(i), expected[i])):
                wrong.append(int(i))

    assert _run_threads(work) == []
    assert wrong == [], f"{len(wrong)} of {THREADS * per_thread} concurrent training steps differ"


CHEAP = dict(variants=["thread_per_output"], strategy="random_sample", max_fevals=2)


def test_two_threads_tune_one_at_a_time_and_leave_the_working_directory_alone(user_cache, tmp_path, monkeypatch):
    """Tuning runs one problem at a time per process, and never moves the working directory of
    the application's other threads (it did, with os.chdir, for the whole of every search)."""
    here = tmp_path / "working_directory"
    here.mkdir()
    monkeypatch.chdir(here)
    here = os.getcwd()
    searching, overlaps, seen_directories = [], [], set()
    search = tuner.tune_variant

    def watched_search(*args, **kwargs):
        searching.append(threading.get_ident())
        if len(searching) > 1:
            overlaps.append(list(searching))
        try:
            return search(*args, **kwargs)
        finally:
            searching.remove(threading.get_ident())

    monkeypatch.setattr(tuner, "tune_variant", watched_search)
    done = threading.Event()

    def watch_directory():
        while not done.is_set():
            seen_directories.add(os.getcwd())

    watcher = threading.Thread(target=watch_directory)
    watcher.start()
    results = {}
    try:
        errors = _run_threads(lambda i: results.setdefault(i, pt.tune("adaptive_avg_pool2d", (2, 3, 5 + i, 7), (3, 4),
                                                                         **CHEAP)), count=2)
    finally:
        done.set()
        watcher.join()
    assert errors == []
    assert overlaps == []
    assert seen_directories == {here}
    assert os.listdir(here) == []
    assert all(result.stored for result in results.values())


def test_racing_layers_give_one_answer_to_every_thread(rng, switching_often, monkeypatch):
    """With PyTorch's kernel a candidate (``pool_tuner.torch_cpu``), layers first called by 8
    threads at once -- their races run concurrently -- give every thread, on every call, the bits
    the layer gives a single thread afterwards; so does the numpy API called beside them."""
    torch = pytest.importorskip("torch")
    import pool_tuner.torch as ptt
    from pool_tuner import dispatch, torch_cpu

    monkeypatch.setattr(torch_cpu, "pytorch_candidate", True)
    dispatch.forget()
    shapes = [((3, 16, 21, 17), (5, 6))] + CASES
    layers = [(ptt.AdaptiveAvgPool2d(out), ptt.AdaptiveMaxPool2d(out)) for _, out in shapes]
    arrays = [random_input(rng, shape) for shape, _ in shapes]
    inputs = [torch.from_numpy(x) for x in arrays]
    seen = [[] for _ in shapes]
    per_thread = 40

    def work(index):
        for i in np.random.default_rng([index, 3]).integers(len(shapes), size=per_thread):
            avg, maximum = layers[i]
            _, out = shapes[i]
            seen[i].append((avg(inputs[i]).numpy(), maximum(inputs[i]).numpy(), pt.adaptive_avg_pool2d(arrays[i], out)))

    try:
        assert _run_threads(work) == []
        wrong = 0
        for i, (_, out) in enumerate(shapes):
            expected = (layers[i][0](inputs[i]).numpy(), layers[i][1](inputs[i]).numpy(),
                        pt.adaptive_avg_pool2d(arrays[i], out))
            wrong += sum(not all(np.array_equal(g, e) for g, e in zip(got, expected)) for got in seen[i])
        assert wrong == 0, f"{wrong} of {THREADS * per_thread} concurrent calls differ from the single-threaded ones"
    finally:
        dispatch.forget()
