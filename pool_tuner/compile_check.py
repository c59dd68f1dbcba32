"""``pool-tuner compile-check cuda``: nvcc compiles every CUDA kernel instantiation, warning- and spill-free.

No GPU is needed: every instantiation is compiled to a cubin with ``nvcc -cubin -arch=<sm>
--Werror all-warnings -Xptxas -v`` and ptxas's resource report is read for local-memory spills
(DESIGN section 8: "nvcc compiles every CUDA instantiation (sm_75 to sm_90), no local-memory spills").

What is compiled, for each target architecture -- all of it read from the tables, so new ops,
directions, dtypes, layouts and variants are covered as soon as they are registered:

* every (op, direction) of ``variants.REGISTRY``,
* every dtype of ``problem.DTYPES``,
* every layout name of ``problem.LAYOUT_NAMES`` for the op's rank that ``Problem.create`` accepts
  (the ones it rejects are not implemented and are listed as skipped),
* every variant of the op,
* its default configuration and the smallest and largest point of its search space (the first and
  the last configuration of ``variant.configurations()`` that ``check_config`` accepts under CUDA's
  limits, ``CUDA_LIMITS``),
* on a small problem with non-divisible, overlapping windows (32-bit indexing) and the same problem
  with so many planes that it needs 64-bit indexing (nothing is allocated: it is only compiled).

Identical sources (per architecture) are compiled once.  The last line printed is exactly
``compiled N instantiations, F failed, S with spills``; the exit status is 0 only when F and S are 0.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from . import kernel_source
from .problem import DTYPES, INT32_LIMIT, LAYOUT_NAMES, OPS, Problem
from .variants import REGISTRY, DeviceLimits

#: Architectures compiled by default: Turing, Ampere, Hopper.
ARCHS = ("sm_75", "sm_80", "sm_90")
#: The limits legal configurations are chosen under: 1024 threads and 48 KiB of static shared
#: memory per block hold on every architecture from sm_50 on.
CUDA_LIMITS = DeviceLimits(max_work_group_size=1024, local_mem_size=48 * 1024)
#: Representative problems per rank: (input shape, output size) with non-divisible, overlapping
#: windows along every pooled axis and more than one plane.
SMALL_PROBLEMS = {
    1: ((2, 3, 10), (7,)),
    2: ((2, 3, 10, 9), (4, 7)),
    3: ((2, 3, 5, 10, 9), (3, 4, 7)),
}
#: nvcc flags of every compilation (the architecture and file names are added per job).
NVCC_FLAGS = ("-cubin", "--Werror", "all-warnings", "-Xptxas", "-v")
#: Seconds one nvcc run may take before it counts as failed.
NVCC_TIMEOUT_S = 300
#: Lines of compiler output shown per failure.
ERROR_LINES = 12
SUMMARY = "compiled {n} instantiations, {failed} failed, {spills} with spills"

_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


class NvccNotFoundError(RuntimeError):
    pass


# ---------------------------------------------------------------------- finding nvcc

def find_nvcc(nvcc: str | None = None) -> str:
    """Path of the nvcc to use: ``nvcc`` if given (a name on PATH or a path), else ``nvcc`` on PATH,
    else ``$CUDA_HOME``/``$CUDA_PATH``/``/usr/local/cuda`` ``bin/nvcc``, else the one of the PyPI
    package ``nvidia-cuda-nvcc``.  Raises ``NvccNotFoundError`` with a one-line message."""
    if nvcc is not None:
        found = shutil.which(nvcc)
        if found is None:
            raise NvccNotFoundError(f"nvcc not found: {nvcc!r} is not an executable file or a command on PATH")
        return found
    found = shutil.which("nvcc")
    if found:
        return found
    roots = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")] + ["/usr/local/cuda"]
    candidates = [os.path.join(r, "bin", "nvcc") for r in roots if r]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += sorted(glob.glob(os.path.join(root, "*", "bin", "nvcc")))
    for candidate in candidates:
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise NvccNotFoundError(
        "nvcc not found: put the CUDA toolkit's bin/ on PATH, set CUDA_HOME, or `pip install nvidia-cuda-nvcc`"
    )


def nvcc_version(nvcc: str) -> str:
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown version"
    release = re.search(r"release [\w.]+, V[\w.]+", text)
    return release.group(0) if release else "unknown version"


# ---------------------------------------------------------------------- what to compile

@dataclasses.dataclass(frozen=True)
class Instantiation:
    """One kernel to compile: which op/dtype/layout/variant/configuration/problem, for which arch."""

    op: str
    direction: str
    dtype: str
    layout: str
    variant: str
    config_label: str  # "default", "smallest", "largest" or several joined by "+"
    params: tuple  # sorted (name, value) pairs
    problem_label: str  # "idx32" or "idx64"
    arch: str
    kernel_name: str
    source: str = dataclasses.field(repr=False, compare=False)

    @property
    def name(self) -> str:
        params = ",".join(f"{k}={v}" for k, v in self.params)
        return (f"{self.op}/{self.direction}/{self.dtype}/{self.layout}/{self.variant}/"
                f"{self.config_label}{{{params}}}/{self.problem_label}/{self.arch}")


@dataclasses.dataclass
class Result:
    ok: bool
    output: str
    spill_stores: int = 0
    spill_loads: int = 0

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def _index_64_shape(input_shape: tuple, ndim: int) -> tuple:
    """``input_shape`` with its batch axis grown until the element count needs 64-bit offsets."""
    per_batch = math.prod(input_shape[1:])
    return (INT32_LIMIT // per_batch + 1,) + tuple(input_shape[1:])


def problems_for(op: str, direction: str, dtype: str, layout: str, index_64: bool = True) -> list:
    """``[(label, Problem)]`` for one op/direction/dtype/layout; empty if the layout is rejected.
    Raises ``ValueError`` if the 64-bit problem does not actually select 64-bit indexing."""
    ndim = OPS[op][1]
    shape, output_size = SMALL_PROBLEMS[ndim]
    try:
        problems = [("idx32", Problem.create(op, shape, output_size, dtype, layout, direction))]
    except (ValueError, TypeError):
        return []
    if problems[0][1].index_64:
        raise ValueError(f"compile_check: the small {ndim}d problem {shape} unexpectedly needs 64-bit indexing")
    if index_64:
        big = Problem.create(op, _index_64_shape(shape, ndim), output_size, dtype, layout, direction)
        if not big.index_64:
            raise ValueError(f"compile_check: problem {big.input_shape} does not select 64-bit indexing")
        problems.append(("idx64", big))
    return problems


def representative_configs(variant, problem: Problem, limits: DeviceLimits = CUDA_LIMITS) -> list:
    """``[(label, params)]``: the default, the first and the last legal configuration, merged when
    they coincide (labels joined by ``+``)."""
    def legal(config):
        try:
            return variant.check_config(config, problem, limits)
        except (ValueError, TypeError):
            return None

    picks = [("default", legal({}))]
    first = last = None
    for config in variant.configurations():
        params = legal(config)
        if params is not None:
            first = first or params
            last = params
    picks += [("smallest", first), ("largest", last)]
    merged: dict = {}
    for label, params in picks:
        if params is not None:
            key = tuple(sorted(params.items()))
            merged[key] = f"{merged[key]}+{label}" if key in merged else label
    return [(label, dict(key)) for key, label in merged.items()]


def instantiations(archs=ARCHS, ops=None, dtypes=None, variants=None, index_64: bool = True):
    """Every instantiation to compile, and the notes about what was skipped (layouts rejected by
    ``Problem.create``, variants with no legal configuration)."""
    found, notes = [], []
    for (op, direction), table in REGISTRY.items():
        if ops is not None and op not in ops:
            continue
        ndim = OPS[op][1]
        for dtype in DTYPES:
            if dtypes is not None and dtype not in dtypes:
                continue
            for layout in LAYOUT_NAMES[ndim]:
                problems = problems_for(op, direction, dtype, layout, index_64)
                if not problems:
                    notes.append(f"skipped {op}/{direction}/{dtype}/{layout}: not accepted by Problem.create")
                    continue
                for name, variant in table.items():
                    if variants is not None and name not in variants:
                        continue
                    for problem_label, problem in problems:
                        configs = representative_configs(variant, problem)
                        if not configs:
                            notes.append(f"skipped {op}/{direction}/{dtype}/{layout}/{name}/{problem_label}: "
                                         "no legal configuration")
                        for config_label, params in configs:
                            source = kernel_source.render(variant.template, variant.defines(params, problem))
                            for arch in archs:
                                found.append(Instantiation(
                                    op, direction, dtype, layout, name, config_label,
                                    tuple(sorted(params.items())), problem_label, arch,
                                    variant.kernel_name, source))
    return found, notes


# ---------------------------------------------------------------------- compiling

def compile_source(nvcc: str, source: str, arch: str, kernel_name: str) -> Result:
    """Compile one source for one architecture; fail on any warning, on a missing entry function,
    and report ptxas's spill counts."""
    with tempfile.TemporaryDirectory(prefix="pool_tuner_nvcc_") as tmp:
        src, cubin = os.path.join(tmp, "kernel.cu"), os.path.join(tmp, "kernel.cubin")
        with open(src, "w") as f:
            f.write(source)
        command = [nvcc, *NVCC_FLAGS, f"-arch={arch}", "-o", cubin, src]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=NVCC_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return Result(False, f"nvcc did not finish in {NVCC_TIMEOUT_S} s")
        except OSError as exc:
            return Result(False, f"nvcc could not be run: {exc}")
    output = (proc.stdout + proc.stderr).replace(src, "kernel.cu")
    if proc.returncode != 0:
        return Result(False, output or f"nvcc exited with status {proc.returncode}")
    if f"Compiling entry function '{kernel_name}'" not in output:
        return Result(False, f"no entry function '{kernel_name}' was compiled (is the variant's #if block "
                             f"selected?)\n{output}")
    spills = [tuple(map(int, m)) for m in _SPILLS.findall(output)]
    if not spills:
        return Result(False, f"no spill report in ptxas's output\n{output}")
    return Result(True, output, sum(s for s, _ in spills), sum(l for _, l in spills))


def run(archs=ARCHS, *, ops=None, dtypes=None, variants=None, index_64: bool = True, jobs: int = 2,
        nvcc: str | None = None, out=None) -> int:
    """Compile every instantiation (see the module docstring); print failures and spills by name and
    the summary line.  Returns 0 when nothing failed or spilled, else 1; raises ``NvccNotFoundError``
    (a ``RuntimeError``) when no nvcc can be found and ``ValueError`` for unknown filters."""
    out = out or sys.stdout
    _check_filter("ops", ops, sorted({op for op, _ in REGISTRY}))
    _check_filter("dtypes", dtypes, sorted(DTYPES))
    _check_filter("variants", variants, sorted({n for t in REGISTRY.values() for n in t}))
    archs = tuple(archs)
    for arch in archs:
        if not re.fullmatch(r"sm_\d+[af]?", arch):
            raise ValueError(f"archs must look like sm_80, got {arch!r}")
    nvcc = find_nvcc(nvcc)
    start = time.perf_counter()
    todo, notes = instantiations(archs, ops, dtypes, variants, index_64)
    jobs_by_key = {}
    for inst in todo:
        jobs_by_key.setdefault((inst.arch, inst.source, inst.kernel_name), None)
    print(f"compile-check cuda: {len(todo)} instantiations ({len(jobs_by_key)} distinct sources) for "
          f"{', '.join(archs)} with {nvcc} ({nvcc_version(nvcc)}), {jobs} jobs", file=out, flush=True)
    for note in notes:
        print(f"note: {note}", file=out)
    keys = list(jobs_by_key)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = dict(zip(keys, pool.map(lambda k: compile_source(nvcc, k[1], k[0], k[2]), keys)))
    failed = spilled = 0
    for inst in todo:
        result = results[(inst.arch, inst.source, inst.kernel_name)]
        if not result.ok:
            failed += 1
            print(f"FAILED {inst.name}", file=out)
            for line in result.output.strip().splitlines()[:ERROR_LINES]:
                print(f"    {line}", file=out)
        elif result.spills:
            spilled += 1
            print(f"SPILLS {inst.name}: {result.spill_stores} bytes spill stores, "
                  f"{result.spill_loads} bytes spill loads", file=out)
    print(f"time: {time.perf_counter() - start:.1f} s", file=out)
    print(SUMMARY.format(n=len(todo), failed=failed, spills=spilled), file=out, flush=True)
    return 0 if failed == 0 and spilled == 0 else 1


def _check_filter(name: str, chosen, allowed: list) -> None:
    if chosen is None:
        return
    if isinstance(chosen, str) or not all(isinstance(c, str) for c in chosen):
        raise TypeError(f"{name} must be a list of names from {allowed}, got {chosen!r}")
    unknown = sorted(set(chosen) - set(allowed))
    if unknown:
        raise ValueError(f"{name} has unknown entries {unknown}; allowed: {allowed}")


if __name__ == "__main__":  # python -m pool_tuner.compile_check
    try:
        sys.exit(run())
    except (NvccNotFoundError, ValueError, TypeError) as exc:
        print(f"pool-tuner: error: {exc}", file=sys.stderr)
        sys.exit(2)
