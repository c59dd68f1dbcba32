"""Kernel sources: locating them, putting a variant's program together, hashing it.

``kernels/`` holds one file per variant and direction (``forward/<variant>.c``,
``backward/<variant>.c``), each written once for CUDA and OpenCL C over shared headers:

* ``prelude.h``    -- the only place where CUDA and OpenCL C differ;
* ``windows.h``    -- window bounds and memory offsets;
* ``operators.h``  -- the pooling op as a small operator (identity, map, combine, finish, and for
  selecting ops such as max the position rule): the only file that names an op of the first
  three; a newer op brings its operator in a header of its own under ``operators/``
  (``Operation.operator_header``, e.g. GeM's ``operators/gem.h``), which takes operators.h's place
  in that op's programs alone, so the others' programs and record hashes do not change;
* ``reduction.h``  -- forward: reducing windows through the operator;
* ``gradients.h``  -- backward: routing gradients through the operator;
* ``tiles.h``      -- the tiles of the tiled variants (only their programs include it);
* ``gpu.h``        -- the prelude of the variants shaped for GPUs alone (warp exchange, vector
  loads): where CUDA and OpenCL C differ for them; only their programs include it.

A program is ``defines + headers + variant file`` (``program_files``): the per-sample shape, dtype,
op, index width and tuning parameters arrive as ``#define`` lines, so one rendered program is one
specialised kernel; the plane count is a kernel argument (``Problem.scalars``), so every batch size
of a per-sample shape shares it.

Kernel identity in the tuning cache: ``template_hash(template)`` is the sha256 of every file of one
variant's program, and the cache key's kernel hash (``cache.kernel_hash``) combines those of
every variant of the problem's direction that is legal on the record's kind of device
(``Variant.device_types``: ``cpu`` or ``gpu``).  A record ranks all the variants its device could
run against each other (its best, default and runners-up), so editing any one of them -- or a
header -- can change which wins: that code identifies the record, and the key stays one per
problem.  A variant shaped for GPUs alone (``global_blocks``) was never a candidate on a CPU, so
it is no part of a CPU record's hash: adding or editing it -- or ``gpu.h``, which only such
variants' programs include -- leaves the CPU records current.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import re
from pathlib import Path

#: Headers at the start of every program, in this order; an op whose operator is a header of its own
#: (``Operation.operator_header``) has that header in operators.h's place.
OPERATOR_HEADER = "operators.h"
HEADERS = ("prelude.h", "windows.h", OPERATOR_HEADER)
#: Headers of one direction's programs, after HEADERS.
DIRECTION_HEADERS = {"forward": ("reduction.h",), "backward": ("gradients.h",)}
#: Headers of one direction's multi-level programs, before the variant's file: pyramid.h reduces
#: cells with reduction.h, in either direction.
PYRAMID_HEADERS = {"forward": ("pyramid.h",), "backward": ("reduction.h", "pyramid.h")}
#: Variants (in either direction) that tile the array they write: their programs include tiles.h.
TILED_VARIANTS = ("smem_tiled",)
#: Variants shaped for GPUs alone (``Variant.device_types == ("gpu",)``): their programs include
#: gpu.h, their prelude, after the direction's headers.
GPU_VARIANTS = ("global_blocks",)
#: The variants of multi-level ops are named with this prefix: their programs include pyramid.h.
PYRAMID_PREFIX = "pyramid_"


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


def variant_file(direction: str, variant: str) -> str:
    """The file of one variant's kernel, relative to ``kernels/``: its program's ``template``."""
    return f"{direction}/{variant}.c"


def program_files(template: str, operator_header: str = OPERATOR_HEADER) -> tuple:
    """Every file of the program of ``template`` (a variant's file, ``"<direction>/<variant>.c"``),
    in order: the headers, then the variant's file.  ``operator_header`` is the op's operator
    (``Operation.operator_header``): operators.h, or a header of a newer op's own that takes its
    place in that op's programs alone."""
    direction, _, file = template.partition("/")
    if direction not in DIRECTION_HEADERS or not file.endswith(".c"):
        raise ValueError(f"template must be '<direction>/<variant>.c' with direction one of "
                         f"{sorted(DIRECTION_HEADERS)}, got {template!r}")
    name = file[: -len(".c")]
    gpu = ("gpu.h",) if name in GPU_VARIANTS else ()
    tiles = ("tiles.h",) if name in TILED_VARIANTS else ()
    levels = PYRAMID_HEADERS[direction] if name.startswith(PYRAMID_PREFIX) else ()
    headers = tuple(operator_header if header == OPERATOR_HEADER else header for header in HEADERS)
    return headers + DIRECTION_HEADERS[direction] + gpu + tiles + levels + (template,)


@functools.cache
def template_hash(template: str, operator_header: str = OPERATOR_HEADER) -> str:
    """sha256 over every file of one variant's program (``program_files``): with the other
    variants' of its direction, the kernel code of a cache record."""
    digest = hashlib.sha256()
    for name in program_files(template, operator_header):
        digest.update(name.encode() + b"\0" + read(name).encode() + b"\0")
    return digest.hexdigest()


def format_defines(defines: dict) -> str:
    lines = []
    for name, value in defines.items():
        if isinstance(value, bool):
            value = int(value)
        lines.append(f"#define {name} {value}")
    return "\n".join(lines) + "\n"


def render(template: str, defines: dict, operator_header: str) -> str:
    """The complete program text for one specialised kernel: defines, headers, the variant's file.
    ``operator_header`` has no default: the op's own (``Operation.operator_header``) must be named,
    since a program with another op's operator does not compile (``Variant.program`` renders a
    variant's program for a problem)."""
    return format_defines(defines) + "\n".join(read(name) for name in program_files(template, operator_header))


def render_files(files: tuple, defines: dict) -> str:
    """The program of ``defines`` and ``files`` (under ``kernels/``), in order: an op's own kernels
    that are no variant (GeM's input gradient, pool_tuner.gem)."""
    return format_defines(defines) + "\n".join(read(name) for name in files)


#: Kernel languages (by a backend's ``source_suffix``) in which one program can hold several
#: variants' kernels (``render_together``): CUDA C++, each variant in a namespace of its own.  OpenCL
#: C has no namespaces and every program defines the prelude's types and helpers, so there each
#: variant is a program of its own.
SHARED_PROGRAM_SUFFIXES = (".cu",)
_DEFINED = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)", re.MULTILINE)
_SYSTEM_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*<[^>\n]+>[ \t]*$", re.MULTILINE)


def together_name(kernel_name: str, position: int) -> str:
    """The name of the kernel of the ``position``-th program in ``render_together``'s program."""
    return f"{kernel_name}_{position}"


def render_together(programs: list, kernel_name: str) -> str:
    """One CUDA program holding the kernels of several rendered programs (``render``'s results, each
    with one kernel named ``kernel_name``): the ``i``-th program's kernel is renamed
    ``together_name(kernel_name, i)``, its types and helpers live in a namespace of their own, and
    the macros it defines are undefined before the next program, so each program reads exactly as
    it would alone.  System headers are included once, first, outside every namespace (their
    include guards make the programs' own ``#include`` lines empty).  Why: one compile of the
    whole program, instead of one per variant, for the first call of a measured dispatch
    (``pool_tuner.measured``)."""
    parts = list(dict.fromkeys(include for text in programs for include in _SYSTEM_INCLUDE.findall(text)))
    for position, text in enumerate(programs):
        name = together_name(kernel_name, position)
        macros = [kernel_name, *dict.fromkeys(_DEFINED.findall(text))]
        parts += [f"#define {kernel_name} {name}", f"namespace program_{position} {{", text, "}",
                  *(f"#undef {macro}" for macro in macros)]
    return "\n".join(parts) + "\n"
