"""Kernel templates: locating them, rendering them with ``#define``s, hashing them.

A kernel program is the text ``defines + prelude.h + windows.h + <template>``: one template per op
family and direction (``pool_forward.c``, ...), written once for CUDA and OpenCL C; the prelude maps
the few differences.  Shapes, dtype, index width, variant and tuning parameters all arrive as
``#define`` lines, so one rendered program is one specialised kernel.

The sha256 of the templates is part of every tuning-cache key: editing a kernel makes its tuned
records stale.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
from pathlib import Path

#: Headers prepended to every template, in this order.
HEADERS = ("prelude.h", "windows.h", "tiles.h")


def _data_dir(package: str, source_dir: str) -> Path:
    """Directory of a data package: the installed ``pool_tuner.<package>`` (a namespace package,
    so its ``__path__`` is used), or ``<source_dir>/`` beside the package when running from a
    source checkout that was not installed."""
    try:
        module = importlib.import_module(f"pool_tuner.{package}")
    except ModuleNotFoundError:
        module = None
    for entry in getattr(module, "__path__", ()):
        if Path(entry).is_dir():
            return Path(entry)
    return Path(__file__).resolve().parent.parent / source_dir


@functools.cache
def kernel_dir() -> Path:
    return _data_dir("kernels", "kernels")


@functools.cache
def shipped_cache_dir() -> Path:
    return _data_dir("tuning_cache", "tuning_cache")


@functools.cache
def read(name: str) -> str:
    path = kernel_dir() / name
    try:
        return path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"pool_tuner kernel source {name!r} not found in {kernel_dir()}") from None


@functools.cache
def template_hash(template: str) -> str:
    """sha256 over the headers and one template: identifies the kernel code of a cache record."""
    digest = hashlib.sha256()
    for name in HEADERS + (template,):
        digest.update(name.encode() + b"\0" + read(name).encode() + b"\0")
    return digest.hexdigest()


def format_defines(defines: dict) -> str:
    lines = []
    for name, value in defines.items():
        if isinstance(value, bool):
            value = int(value)
        lines.append(f"#define {name} {value}")
    return "\n".join(lines) + "\n"


def render(template: str, defines: dict) -> str:
    """The complete program text for one specialised kernel: defines, headers, template."""
    return format_defines(defines) + "\n".join(read(name) for name in HEADERS + (template,))
