"""pool_tuner's own nvcc builds: kernel source -> cubin, cached on disk by content.

Why not PyCUDA's compiler cache: PyCUDA hashes a source that has an ``#include`` only after running
``nvcc --preprocess`` on it, and every pool_tuner program includes ``cuda_fp16.h``, so PyCUDA
started an nvcc process for every shape even when the cubin was on disk.  Here the key is the
sha256 of what decides the cubin and is known without running anything -- the source text, the
nvcc options, the target architecture and the identity of the nvcc used (``nvcc_identity``) -- so
a hit reads one file and starts no process.  Both CUDA build paths (PyCUDA's modules for
``pool_tuner.ops`` and the driver-API kernels of ``pool_tuner.torch``) take their cubins from here,
so a kernel both paths need is compiled once.

The cache lives in ``<pool_tuner's user cache directory>/cubin`` (``POOL_TUNER_CACHE_DIR``, see
``cache.default_user_dir``), or where ``POOL_TUNER_CUBIN_DIR`` says; files are written to a temporary name and renamed, so concurrent
processes never read half a cubin.  Within a process, one thread compiles a given key while
others asking for the same key wait for its result (no double compile).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import platformdirs

#: nvcc options of every build (the architecture is added per target).  Device code is optimised
#: by default; the templates declare their kernels ``extern "C"`` themselves (prelude.h).
NVCC_OPTIONS = ("-cubin",)
#: Seconds one nvcc run may take.
NVCC_TIMEOUT_S = 600
#: The environment variable naming a cubin directory of its own (``cache_dir``).
CUBIN_DIR_ENV = "POOL_TUNER_CUBIN_DIR"
#: Bumped when the key's recipe changes, so that old files are never read under a new meaning.
KEY_VERSION = "pool_tuner-cubin-v1"


class CudaCompileError(RuntimeError):
    """nvcc failed on a kernel source; the message holds the command and nvcc's output."""


def cache_dir() -> Path:
    """Where cubins are kept: the directory ``POOL_TUNER_CUBIN_DIR`` names, else ``cubin/`` in
    pool_tuner's user cache directory -- the directory of ``cache.default_user_dir``, worked out
    here because backends sit below ``cache``.  ``POOL_TUNER_CUBIN_DIR`` lets processes that keep
    their tuning records apart (test processes, each with a user cache of its own) share their
    builds."""
    shared = os.environ.get(CUBIN_DIR_ENV)
    if shared:
        return Path(shared).expanduser()
    configured = os.environ.get("POOL_TUNER_CACHE_DIR")
    root = Path(configured).expanduser() if configured else Path(platformdirs.user_cache_dir("pool_tuner"))
    return root / "cubin"


def nvcc_identity(nvcc: str) -> str:
    """What identifies the compiler ``nvcc`` without running it: its resolved path, size and
    modification time, and the toolkit's ``version.json`` beside ``bin/`` where there is one (a
    reinstalled or upgraded toolkit changes at least one of them)."""
    real = os.path.realpath(nvcc)
    stat = os.stat(real)
    version_file = Path(real).parent.parent / "version.json"
    try:
        version = version_file.read_text()
    except OSError:
        version = ""
    return f"{real}\0{stat.st_size}\0{stat.st_mtime_ns}\0{version}"


def cache_key(source: str, arch: str, nvcc: str, options=NVCC_OPTIONS) -> str:
    """The sha256 (hex) of everything that decides the cubin."""
    digest = hashlib.sha256()
    for part in (KEY_VERSION, source, "\0".join(options), arch, nvcc_identity(nvcc)):
        digest.update(part.encode())
        digest.update(b"\x01")
    return digest.hexdigest()


_LOCKS: dict = {}
_LOCKS_LOCK = threading.Lock()


def _key_lock(key: str) -> threading.Lock:
    with _LOCKS_LOCK:
        return _LOCKS.setdefault(key, threading.Lock())


def cubin(source: str, arch: str, nvcc: str) -> tuple[str, bytes]:
    """``(key, image)``: the cubin of ``source`` for ``arch`` (``sm_90``) built by ``nvcc`` (a
    path), from the cache or compiled now and stored.  Raises ``CudaCompileError`` when nvcc
    fails."""
    key = cache_key(source, arch, nvcc)
    path = cache_dir() / f"{key}.cubin"
    with _key_lock(key):
        try:
            return key, path.read_bytes()
        except OSError:
            pass
        image = compile_source(source, arch, nvcc)
        _store(path, image)
    return key, image


def compile_source(source: str, arch: str, nvcc: str, options=NVCC_OPTIONS) -> bytes:
    """Run nvcc on ``source`` for ``arch``; the cubin's bytes."""
    with tempfile.TemporaryDirectory(prefix="pool_tuner_nvcc_") as scratch:
        src, out = os.path.join(scratch, "kernel.cu"), os.path.join(scratch, "kernel.cubin")
        Path(src).write_text(source)
        command = [nvcc, *options, f"-arch={arch}", "-o", out, src]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=NVCC_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            raise CudaCompileError(f"nvcc could not be run ({' '.join(command)}): {exc}") from None
        if proc.returncode != 0 or not os.path.isfile(out):
            output = (proc.stderr + proc.stdout).strip()
            raise CudaCompileError(f"nvcc failed with status {proc.returncode} ({' '.join(command)}):\n{output}")
        return Path(out).read_bytes()


def _store(path: Path, image: bytes) -> None:
    """Write ``image`` to ``path`` through a temporary file and a rename.  A cache that cannot be
    written is a warning, not an error: the build itself succeeded, and the next process compiles
    again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin")
        with os.fdopen(handle, "wb") as out:
            out.write(image)
        os.replace(temporary, path)
    except OSError as exc:
        warnings.warn(f"the cubin cache {path.parent} could not be written ({exc}); kernels will be compiled "
                      f"again in the next process", RuntimeWarning, stacklevel=3)
