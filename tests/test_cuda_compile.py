"""pool_tuner's own cubin cache (``backends.cuda_compile``) and the two CUDA build paths on it:
a hit starts no process, a source both paths need is compiled once, modules are loaded once per
context and kept.  The nvcc tests compile for real (no GPU needed) and skip without nvcc."""

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from pool_tuner.backends import cuda, cuda_compile, cuda_driver
from pool_tuner.problem import Problem
from pool_tuner.variants import REGISTRY

from cuda_fakes import PRIMARY_CONTEXT, FakeDriver, fake_cuda_device

try:
    NVCC, NO_NVCC = cuda.find_nvcc(), None
except cuda.NvccNotFoundError as why:
    NVCC, NO_NVCC = None, str(why)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason=f"compiles with nvcc: {NO_NVCC}")


def _source(size=(4, 7)):
    problem = Problem.create("adaptive_avg_pool2d", (2, 3, 10, 9), size)
    variant = REGISTRY[("adaptive_avg_pool2d", "forward")]["thread_per_output"]
    return variant.program(variant.default_for(problem), problem)


@pytest.fixture
def no_process(monkeypatch):
    """Make starting any process an error (from the moment the fixture's ``arm()`` is called)."""
    real = subprocess.run

    def forbidden(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[0] if args else kwargs.get('args')}")

    def arm():
        monkeypatch.setattr(subprocess, "run", forbidden)

    yield arm
    monkeypatch.setattr(subprocess, "run", real)


@needs_nvcc
def test_a_hit_reads_the_cubin_and_starts_no_process(user_cache, no_process):
    source = _source()
    key, image = cuda_compile.cubin(source, "sm_80", NVCC)
    assert image[:4] == b"\x7fELF", "nvcc -cubin makes an ELF image"
    assert (user_cache / "cubin" / f"{key}.cubin").read_bytes() == image
    no_process()
    assert cuda_compile.cubin(source, "sm_80", NVCC) == (key, image)
    assert cuda._compile(source, "sm_80") == image  # the backend's builds use the same cache


@needs_nvcc
def test_processes_with_user_caches_of_their_own_share_one_cubin_directory(user_cache, tmp_path, monkeypatch):
    """POOL_TUNER_CUBIN_DIR (set by benchmarks/isolated_tests.py for its test processes, each with a
    user cache of its own): what one process compiled, another reads without running nvcc."""
    shared = tmp_path / "shared_cubins"
    monkeypatch.setenv(cuda_compile.CUBIN_DIR_ENV, str(shared))
    source = _source((3, 5))
    key, image = cuda_compile.cubin(source, "sm_80", NVCC)
    assert (shared / f"{key}.cubin").read_bytes() == image
    assert not (user_cache / "cubin").exists()
    other = tmp_path / "other_process_cache"
    script = textwrap.dedent(f"""
        import sys
        from pool_tuner.backends import cuda_compile

        def no_nvcc(*args, **kwargs):
            raise AssertionError("compiled again")

        cuda_compile.compile_source = no_nvcc
        key, image = cuda_compile.cubin(sys.stdin.read(), "sm_80", {NVCC!r})
        print(key, len(image))
    """)
    proc = subprocess.run([sys.executable, "-c", script], input=source, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, POOL_TUNER_CACHE_DIR=str(other)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [key, str(len(image))]
    assert not (other / "cubin").exists()


@needs_nvcc
def test_the_key_follows_source_arch_options_and_compiler(tmp_path):
    source = _source()
    key = cuda_compile.cache_key(source, "sm_80", NVCC)
    assert len(key) == 64 and key == cuda_compile.cache_key(source, "sm_80", NVCC)
    assert key != cuda_compile.cache_key(_source((4, 6)), "sm_80", NVCC)
    assert key != cuda_compile.cache_key(source, "sm_90", NVCC)
    assert key != cuda_compile.cache_key(source, "sm_80", NVCC, options=("-cubin", "-G"))
    other = tmp_path / "bin" / "nvcc"  # another compiler: another identity
    other.parent.mkdir()
    other.write_bytes(b"#!/bin/sh\n")
    assert key != cuda_compile.cache_key(source, "sm_80", str(other))


@needs_nvcc
def test_nvcc_errors_carry_its_output(user_cache):
    with pytest.raises(cuda_compile.CudaCompileError, match="(?s)nvcc failed with status .*error: expected a declaration"):
        cuda_compile.cubin("this is not C++;", "sm_80", NVCC)
    assert not list((user_cache / "cubin").glob("*.cubin"))


def test_concurrent_requests_for_one_source_compile_once(user_cache, monkeypatch):
    compiled, gate = [], threading.Event()

    def slow_compile(source, arch, nvcc, options=cuda_compile.NVCC_OPTIONS):
        compiled.append(source)
        gate.wait(5)
        return b"\x7fELF" + source.encode()

    monkeypatch.setattr(cuda_compile, "compile_source", slow_compile)
    monkeypatch.setattr(cuda_compile, "nvcc_identity", lambda nvcc: "fake nvcc")
    results = []
    threads = [threading.Thread(target=lambda: results.append(cuda_compile.cubin("src", "sm_90", "nvcc")))
               for _ in range(4)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join()
    assert compiled == ["src"] and len(set(results)) == 1 and len(results) == 4


def test_a_source_compiles_once_and_loads_once_for_every_kernel_and_caller(user_cache, monkeypatch):
    """``CudaDevice.build`` of one source's kernels, for any caller's context key: one nvcc run,
    the module loaded once for all of them, the same kernel on every call."""
    compiled = []
    monkeypatch.setattr(cuda_compile, "compile_source", lambda source, arch, nvcc: compiled.append(source) or
                        b"cubin:" + source.encode())
    monkeypatch.setattr(cuda_compile, "nvcc_identity", lambda nvcc: "fake nvcc")
    monkeypatch.setattr(cuda, "find_nvcc", lambda nvcc=None: "nvcc")
    driver = FakeDriver()
    driver.set_current(PRIMARY_CONTEXT)
    monkeypatch.setattr(cuda_driver, "library", lambda: driver)
    cuda_driver.primary_context.cache_clear()
    cuda.forget_builds()
    device = fake_cuda_device()
    try:
        for name in ("copy", "read", "copy"):
            kernel = device.build(None, "bandwidth source", name)
            assert kernel is device.build("any context", "bandwidth source", name)
        assert compiled == ["bandwidth source"], "one compile for every kernel of the source"
        assert driver.modules == [(b"cubin:bandwidth source", PRIMARY_CONTEXT)]
    finally:
        cuda_driver.primary_context.cache_clear()
        cuda.forget_builds()
