"""Test-wide setup: poisoned outputs and a private tuning cache.

Every output buffer is filled with NaN before its kernel runs (``poisoning.py``: so an element a
kernel fails to write can never match a reference by accident); set before pool_tuner is imported,
pool_tuner.torch
never hands a layer to PyTorch's own kernel, and the user tuning cache lives in a temporary
directory, so tests neither read nor pollute the developer's.
"""

import importlib.util
import os
import random
import tempfile
import zlib
from pathlib import Path

# pool_tuner.torch runs pool_tuner's kernels, never PyTorch's in their place, except in the tests of
# that choice (tests/test_torch_cpu.py), which turn it back on.
os.environ["POOL_TUNER_PYTORCH_CANDIDATE"] = "0"
os.environ.setdefault("POOL_TUNER_CACHE_DIR", tempfile.mkdtemp(prefix="pool_tuner_test_cache_"))
os.environ.pop("POOL_TUNER_DEVICE", None)
os.environ.pop("POOL_TUNER_AUTOTUNE", None)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import poisoning  # noqa: E402
from pool_tuner import backends, kernel_source  # noqa: E402
from pool_tuner.problem import Problem  # noqa: E402
from pool_tuner.variants import variants_for  # noqa: E402

poisoning.install()
SHIPPED_CACHE_DIR = kernel_source.shipped_cache_dir()
_EMPTY_SHIPPED_DIR = tempfile.mkdtemp(prefix="pool_tuner_test_shipped_")
kernel_source.shipped_cache_dir = lambda: kernel_source.Path(_EMPTY_SHIPPED_DIR)


#: Fresh random inputs on every run; POOL_TUNER_TEST_SEED=<n> replays a run (printed in the header).
#: The seed is put in the environment before pytest-xdist starts its workers, so that every worker
#: draws from the one the header prints.
os.environ.setdefault("POOL_TUNER_TEST_SEED", str(random.randrange(2**31)))
RUN_SEED = int(os.environ["POOL_TUNER_TEST_SEED"])


def pytest_report_header(config):
    return f"pool_tuner test seed: POOL_TUNER_TEST_SEED={RUN_SEED}"


@pytest.fixture
def rng(request):
    """A generator per test, from the run seed and the test id."""
    return np.random.default_rng([RUN_SEED, zlib.crc32(request.node.nodeid.encode())])


def gem_p_term_magnitude(grad, output, p) -> float:
    """The summed magnitude of dL/dp's terms (``grad * y * log(y) / p`` per output, up to the eps
    clamp): dL/dp sums terms of both signs, so its error is relative to their magnitude, not to the
    sum, which cancellation can bring near zero."""
    output = np.asarray(output, np.float64)
    return float(np.abs(np.asarray(grad, np.float64) * output * np.log(output)).sum() / p)


def random_input(rng, shape, dtype=np.float32):
    """Random values in [-2, 2) away from zero, never all zeros."""
    x = rng.uniform(-2.0, 2.0, size=shape)
    x[np.abs(x) < 1e-3] = 0.5
    return x.astype(dtype)


def outputs_and_gradients(model, x, grad_seed=0):
    """``model(x)``, the gradient for ``x`` and each parameter's gradient (by name), after a
    backward pass of a seeded random gradient and with seeded dropout masks: what two models that
    should compute the same thing are compared by."""
    import torch

    x = x.clone().requires_grad_()
    torch.manual_seed(grad_seed)  # the same dropout masks, if any, for both models
    y = model(x)
    y.backward(torch.from_numpy(np.random.default_rng(grad_seed).standard_normal(y.shape).astype(np.float32)))
    return y.detach(), x.grad, {name: p.grad for name, p in model.named_parameters()}


@pytest.fixture
def candidate_on(monkeypatch):
    """PyTorch's computation is a candidate of the CPU race (``torch_cpu.pytorch_candidate``),
    whatever the environment says; dispatch state forgotten before and after."""
    from pool_tuner import dispatch, torch_cpu

    monkeypatch.setattr(torch_cpu, "pytorch_candidate", True)
    dispatch.forget()
    yield
    dispatch.forget()


#: The exhaustive tier (setup.cfg's ``exhaustive`` marker; docs/design.md, Quality bars): cases
#: that the README's test command deselects and the CI's second pytest run (``.ci/run``) runs.
EXHAUSTIVE = pytest.mark.exhaustive


def tiered(cases, core=lambda values: False, group=None) -> list:
    """``cases`` (``pytest.param`` each) with those outside the core tier marked ``exhaustive``: a
    case is core where ``core(case.values)`` holds, or where it is the first of its
    ``group(case.values)`` (so every group keeps one case in the suite a developer runs)."""
    seen, result = set(), []
    for case in cases:
        key = group(case.values) if group is not None else None
        first = group is not None and key not in seen
        seen.add(key)
        if core(case.values) or first:
            result.append(case)
        else:
            result.append(pytest.param(*case.values, id=case.id, marks=[*case.marks, EXHAUSTIVE]))
    return result


@pytest.fixture
def user_cache(tmp_path, monkeypatch):
    """A private, empty user tuning cache; no autotuning; dispatch state forgotten before and
    after.  The working directory is tmp_path too, in case Kernel Tuner leaves files there."""
    from pool_tuner import dispatch

    directory = tmp_path / "user_cache"
    monkeypatch.setenv("POOL_TUNER_CACHE_DIR", str(directory))
    monkeypatch.delenv("POOL_TUNER_CUBIN_DIR", raising=False)  # its cubins under it too
    monkeypatch.delenv("POOL_TUNER_AUTOTUNE", raising=False)
    monkeypatch.delenv("POOL_TUNER_DEVICE", raising=False)
    monkeypatch.chdir(tmp_path)
    dispatch.forget()
    yield directory
    dispatch.forget()


#: Variants legal only for global pooling (every output size 1).
GLOBAL_ONLY = ("plane_reduce", "global_planes", "global_channels", "global_blocks", "global_broadcast")


def legal_variants(op, direction, shape, output_size, dtype="float32", layout=None):
    """Names of the variants whose default configuration is legal for the problem on the default
    device (channels_vector needs channels-last memory)."""
    return variants_legal_for(Problem.create(op, shape, output_size, dtype, layout, direction=direction))


def variants_legal_for(problem):
    """legal_variants of a Problem already made."""
    limits = backends.default_device().info.limits
    return [name for name, variant in variants_for(problem.op, problem.direction).items()
            if variant.is_legal({}, problem, limits)]


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as a module, for tests of the scripts the project ships
    beside its package; skipped where benchmarks/ is not beside the tests (an installed package)."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    if not script.exists():
        pytest.skip("benchmarks/ is not beside the tests (installed package)")
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
