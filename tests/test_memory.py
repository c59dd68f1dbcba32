"""The OpenCL memory pool for results: reuse is correct, memory can be released, and the pool is
used only where it is safe (the device's own queue) and wanted."""

import gc
import os
import subprocess
import sys

import numpy as np
import pyopencl as cl
import pyopencl.array as cl_array
import pytest

import pool_tuner as pt
from pool_tuner import backends, ops, plans, reference
from pool_tuner.backends import opencl

from conftest import random_input
from poisoning import UNPOISONED, poisoned_fill

# 8 x 64 x 32 x 32 float32 = 2 MiB: large enough that page faults of fresh memory would matter.
LARGE = (8, 64, 32, 32)


@pytest.fixture
def device():
    device = backends.resolve_device(None)
    if device.info.backend != "opencl":
        pytest.skip("the memory pool belongs to the OpenCL backend")
    device.release_memory()
    yield device
    device.release_memory()


@pytest.fixture(params=[True, False], ids=["poisoned", "not-poisoned"])
def poisoning(request, monkeypatch):
    """Reuse must be correct whether or not the outputs are filled with NaN first."""
    monkeypatch.setattr(plans, "result_fill", poisoned_fill if request.param else UNPOISONED)
    ops._PLANS.clear()  # plans ask what their results hold when they are made
    yield
    ops._PLANS.clear()


def test_large_results_reuse_freed_memory_and_stay_exact(device, poisoning, rng):
    pointers = []
    for _ in range(3):
        grad = random_input(rng, LARGE[:2] + (5, 7))
        result = pt.adaptive_avg_pool2d_backward(cl_array.to_device(device.queue, grad), LARGE)
        np.testing.assert_allclose(result.get(), reference.adaptive_avg_pool_backward(grad, LARGE, 2), rtol=1e-5, atol=1e-6)
        pointers.append(result.base_data.int_ptr if result.base_data is not None else result.data.int_ptr)
        del result
        gc.collect()
    # The second and third results were carved from the memory the first one gave back.
    assert pointers[1] == pointers[0] and pointers[2] == pointers[0]


def test_release_memory_frees_what_the_pool_holds(device, rng):
    x = cl_array.to_device(device.queue, random_input(rng, LARGE[:2] + (64, 64)))
    pooled = pt.adaptive_avg_pool2d(x, (5, 7))
    result = pt.adaptive_avg_pool2d_backward(pooled, x.shape)
    assert device.release_memory() == 0  # still referenced: nothing to free
    del pooled, result
    gc.collect()
    assert pt.release_memory() >= 1
    assert pt.release_memory() == 0


def test_small_results_are_pooled_too(device, rng):
    small = cl_array.to_device(device.queue, random_input(rng, (2, 3, 8, 8)))
    result = pt.adaptive_avg_pool2d(small, 3)
    np.testing.assert_allclose(result.get(), reference.adaptive_avg_pool(small.get(), 3, 2), rtol=1e-5, atol=1e-6)
    del result
    gc.collect()
    assert device.release_memory() >= 1


def test_foreign_queues_get_fresh_buffers(device, rng):
    own_queue = cl.CommandQueue(device.queue.context)
    grad = cl_array.to_device(own_queue, random_input(rng, LARGE[:2] + (5, 7)))
    result = pt.adaptive_avg_pool2d_backward(grad, LARGE)
    assert result.queue is own_queue
    del result
    gc.collect()
    assert device.release_memory() == 0


def test_pool_can_be_turned_off(device, monkeypatch, rng):
    monkeypatch.setattr(opencl, "memory_pool_enabled", False)
    grad = cl_array.to_device(device.queue, random_input(rng, LARGE[:2] + (5, 7)))
    result = pt.adaptive_avg_pool2d_backward(grad, LARGE)
    del result
    gc.collect()
    assert device.release_memory() == 0


@pytest.mark.parametrize("value, enabled", [("0", False), ("1", True), (None, True)])
def test_pool_switch_is_read_from_the_environment_at_import(value, enabled):
    env = {k: v for k, v in os.environ.items() if k != opencl.MEMORY_POOL_ENV}
    if value is not None:
        env[opencl.MEMORY_POOL_ENV] = value
    code = "from pool_tuner.backends import opencl; print(opencl.memory_pool_enabled)"
    printed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert printed.stdout.strip() == str(enabled)


@pytest.mark.parametrize("value, enabled", [("off", False), ("False", False), ("on", True), (" ", True)])
def test_pool_switch_takes_a_switchs_words(value, enabled):
    env = {**os.environ, opencl.MEMORY_POOL_ENV: value}
    code = "from pool_tuner.backends import opencl; print(opencl.memory_pool_enabled)"
    printed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert printed.stdout.strip() == str(enabled) and not printed.stderr


@pytest.mark.parametrize("value", ["abc", "2", "offf"])
def test_a_pool_switch_that_is_no_switch_word_warns_and_pools(value):
    """An unreadable switch names the variable and what it takes, rather than pooling in silence,
    and does not stop the program at import."""
    env = {**os.environ, opencl.MEMORY_POOL_ENV: value}
    code = "from pool_tuner.backends import opencl; print(opencl.memory_pool_enabled)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "True"
    assert f"RuntimeWarning: {opencl.MEMORY_POOL_ENV}={value!r} is neither on (1, true, yes, on) nor off" in proc.stderr
