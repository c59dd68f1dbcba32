"""pool_tuner leaves the user's OpenCL world as it found it (docs/design.md, "The user's process"):
no variable of os.environ changes, the user's platform lists the same devices with and without
pool_tuner whatever the import order, and arrays on any device of a context the user made are
accepted -- or refused with a message that names the array's device, the devices pool_tuner serves
and what to do.

PoCL reads its variables once per process, when OpenCL is first listed, so each check runs in a
fresh interpreter of its own.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import pyopencl as cl
import pyopencl.array as cl_array

import pool_tuner as pt
from pool_tuner import reference
from pool_tuner.backends import opencl

from conftest import random_input

TIMEOUT = 300

#: Prints, as JSON: the user's PoCL devices, and what changed in os.environ and in the environment
#: of a child process started afterwards, where the user lists PoCL's devices and (unless argv[1]
#: is "without") pool_tuner is imported and called, in the order argv[1] names.  PoCL itself adds
#: a variable to the process's environment when it starts (seen by children), hence the comparison
#: with a run without pool_tuner.
SEE = r"""
import json, os, subprocess, sys
import numpy as np

def pocl_devices():
    import pyopencl as cl
    return [d.name for p in cl.get_platforms() if p.name == "Portable Computing Language" for d in p.get_devices()]

before = dict(os.environ)
seen = {}
if sys.argv[1] != "pool_tuner_first":
    seen["user"] = pocl_devices()
if sys.argv[1] != "without":
    import pool_tuner as pt
    pt.adaptive_avg_pool2d(np.ones((1, 2, 5, 5), np.float32), 2)
if sys.argv[1] == "pool_tuner_first":
    seen["user"] = pocl_devices()
child = subprocess.run([sys.executable, "-c", "import os, json; print(json.dumps(dict(os.environ)))"],
                       capture_output=True, text=True, check=True)
print(json.dumps({"devices": seen["user"], "environ_changed": sorted(set(before.items()) ^ set(os.environ.items())),
                  "child_environ_changed": sorted(set(before.items()) ^ set(json.loads(child.stdout).items()))}))
"""


def _clean_env() -> dict:
    """The test's environment less PoCL's variables and pool_tuner's old marks: a user who set none."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("POCL_", "POOL_TUNER_SET_"))}


def _run(code: str, *args) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], env=_clean_env(), capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("order", ["pool_tuner_first", "user_first"])
def test_the_users_devices_and_environment_are_unchanged(order):
    without = json.loads(_run(SEE, "without"))
    assert without["environ_changed"] == []
    assert json.loads(_run(SEE, order)) == without


IDIOM = r"""
import numpy as np, pyopencl as cl, pyopencl.array as cl_array
import pool_tuner as pt
from pool_tuner import reference
x = np.random.default_rng().uniform(-2, 2, (2, 3, 9, 7)).astype(np.float32)
pt.adaptive_avg_pool2d(x, 2)  # pool_tuner lists OpenCL first
platform = [p for p in cl.get_platforms() if p.name == "Portable Computing Language"][0]
ctx = cl.Context(platform.get_devices())
q = cl.CommandQueue(ctx)
y = pt.adaptive_avg_pool2d(cl_array.to_device(q, x), 2).get()
print(float(np.abs(y - reference.forward("adaptive_avg_pool2d", x, 2)).max()) < 1e-5)
"""


def test_the_pyopencl_idiom_on_the_users_own_context():
    assert _run(IDIOM) == "True"


def test_an_array_on_a_device_pool_tuner_does_not_serve_is_refused_with_what_to_do(rng, monkeypatch):
    """As if pool_tuner served every device but PoCL's (a device it cannot list): the array's
    device, the devices served and the ways out are named, for device=None and for device=."""
    listed = opencl.list_devices()
    pocl = [d for d in listed if d.is_pocl and d.info.is_cpu]
    if not pocl:
        pytest.skip("no PoCL CPU device")
    queue = cl.CommandQueue(cl.Context([pocl[0].cl_device]))
    x = cl_array.to_device(queue, random_input(rng, (1, 2, 6, 6)))
    served = tuple(d for d in listed if not d.is_pocl)
    monkeypatch.setattr(opencl, "list_devices", lambda: served)
    for device in (None, served[0].info.id) if served else (None,):
        with pytest.raises(ValueError) as caught:
            pt.adaptive_avg_pool2d(x, 2, device=device)
        message = str(caught.value)
        assert pocl[0].info.name in message and ".get()" in message, message
        assert all(d.info.id in message for d in served), message


def test_a_user_context_on_the_served_device_is_accepted(rng):
    pocl = [d for d in opencl.list_devices() if d.is_pocl and d.info.is_cpu]
    if not pocl:
        pytest.skip("no PoCL CPU device")
    queue = cl.CommandQueue(cl.Context(pocl[0].cl_device.platform.get_devices()))
    x = random_input(rng, (2, 3, 9, 7))
    y = pt.adaptive_avg_pool2d(cl_array.to_device(queue, x), (4, 3)).get()
    np.testing.assert_allclose(y, reference.forward("adaptive_avg_pool2d", x, (4, 3)), rtol=1e-5, atol=1e-6)


def _two_contexts_of_the_served_device():
    pocl = [d for d in opencl.list_devices() if d.is_pocl and d.info.is_cpu]
    if not pocl:
        pytest.skip("no PoCL CPU device")
    return pocl[0].queue, cl.CommandQueue(cl.Context([pocl[0].cl_device]))


@pytest.mark.parametrize("call", ["max backward", "GeM backward", "GeM backward's output", "pyramid backward"])
def test_arrays_of_one_call_in_two_contexts_are_refused_by_name(rng, call):
    """Arrays of one device in two contexts: a kernel reads buffers of one context only (PoCL's
    ran it anyway), and the first array was left waiting on the other context's event, so that
    OpenCL refused its next read (INVALID_CONTEXT).  Refused naming the array, and both arrays
    stay readable."""
    queue, other = _two_contexts_of_the_served_device()
    x = random_input(rng, (2, 3, 9, 7))
    if call == "max backward":
        _, indices = pt.adaptive_max_pool2d(cl_array.to_device(queue, x), (4, 3), return_indices=True)
        grad = cl_array.to_device(other, random_input(rng, (2, 3, 4, 3)))
        with pytest.raises(ValueError, match="indices must be in the context of grad_out"):
            pt.adaptive_max_pool2d_backward(grad, indices, x.shape)
        kept = indices
    elif call == "GeM backward":
        x_dev = cl_array.to_device(queue, x + 2.0)
        grad = cl_array.to_device(other, random_input(rng, (2, 3, 4, 3)))
        with pytest.raises(ValueError, match="grad_out must be in the context of x"):
            pt.adaptive_gem_pool2d_backward(grad, x_dev, (4, 3))
        kept = x_dev
    elif call == "GeM backward's output":
        x_dev = cl_array.to_device(queue, x + 2.0)
        grad = cl_array.to_device(queue, random_input(rng, (2, 3, 4, 3)))
        output = cl_array.to_device(other, pt.adaptive_gem_pool2d(x + 2.0, (4, 3)))
        with pytest.raises(ValueError, match="output must be in the context of x"):
            pt.adaptive_gem_pool2d_backward(grad, x_dev, (4, 3), output=output)
        kept = output
    else:
        grads = [cl_array.to_device(queue, random_input(rng, (2, 3, 1, 1))),
                 cl_array.to_device(other, random_input(rng, (2, 3, 2, 2)))]
        with pytest.raises(ValueError, match=r"grad_outs\[1\] must be in the context of grad_outs\[0\]"):
            pt.adaptive_avg_pool_pyramid_backward(grads, x.shape)
        kept, grad = grads
    kept.get()
    grad.get()
