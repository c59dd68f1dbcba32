"""``pool-tuner compile-check cuda``: nvcc compiles every CUDA kernel instantiation, warning- and spill-free.

No GPU is needed: every instantiation is compiled to a cubin with ``nvcc -cubin -arch=<sm>
--Werror all-warnings -Xptxas -v`` and ptxas's resource report is read for local-memory spills
(docs/design.md, Quality bars: every CUDA instantiation compiles for sm_75 to sm_90, no local-memory spills).

What is compiled, for each target architecture -- all of it read from the tables, so new ops,
directions, dtypes, layouts and variants are covered as soon as they are registered:

* every (op, direction) of ``variants.REGISTRY``,
* every dtype of ``problem.DTYPES``,
* every layout name of ``problem.LAYOUT_NAMES`` for the op's rank that ``Problem.create`` accepts,
* every variant of the op,
* its default configuration and the smallest and largest point of its search space (the first and
  the last configuration of ``variant.configurations()`` that ``check_config`` accepts under CUDA's
  limits, ``CUDA_LIMITS``: ``Variant.representative_configurations``) -- for a variant shaped for
  CPUs alone too, as a call naming it can run it on a GPU,
* on two problems per rank (``PROBLEMS``): one with non-divisible, overlapping windows and 32-bit
  indexing, and one with uniform windows (the ``UNIFORM_*`` path) and so many planes that it needs
  64-bit indexing (nothing is allocated: it is only compiled).  Both have windows at least 8 wide
  along W, so that the largest ``row_lanes`` is legal and compiled.  A variant with no legal
  configuration on either (global pooling only) gets global pooling in both widths instead
  (``GLOBAL_PROBLEMS``).  A variant that takes runs of neighbouring channels
  (``channels_per_item``) and that dispatch may choose on a GPU (``Variant.device_types``) also
  gets its channels-last problems again with ``WIDE_CHANNELS`` channels, where its widest runs are
  legal: the registers a GPU would really give them.  ``pyramid_channels``, shaped for CPUs, keeps
  its lanes in private memory and spills there in float64; a GPU runs it only when a call names it.

And the helper programs outside the variant tables (``helper_programs``: avgmax's join kernels),
whole, per dtype and architecture; they count as instantiations in the summary.

Speed: most of one nvcc run is spent parsing CUDA's headers, so instantiations are compiled in
batches: one translation unit holds up to ``BATCH_SIZE`` of them, each in a namespace of its own
with its kernel renamed and its macros ``#undef``-ed after it; ptxas reports each kernel under its
own name.  When a batch fails, the instantiations its diagnostics point at (by line, or by kernel
name for ptxas) fail with those diagnostics, renumbered to the lines of their own source, and the
others are compiled again as a batch; diagnostics that point at no single instantiation (unbalanced
braces spilling into what follows, say) split the batch in halves instead, down to instantiations
compiled alone from their plain source.  Identical sources (per architecture) are compiled once.

Tiers, as the test suite's: the ``exhaustive`` tier (the default) compiles all of the above; the
``core`` tier, which the CI runs, compiles each op/direction/layout/variant/configuration/problem
once, in one dtype for one architecture, both rotating from one to the next, float64 besides at
every largest configuration, and every helper program: about a ninth of the instantiations, with
every dtype and architecture compiling a share of every variant (``core_selection``).

The last line printed is exactly ``compiled N instantiations, F failed, S with spills``; ``run``
returns 0 only when F and S are 0.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import re
import subprocess
import sys
import tempfile
import time

try:  # CPU time of the nvcc runs, where the platform reports it
    import resource
except ImportError:  # pragma: no cover - not on POSIX
    resource = None

from .operations import BACKWARD
from .problem import DTYPES, INT32_LIMIT, LAYOUT_NAMES, OPS, Problem
from .backends.base import DeviceLimits
from .backends.cuda import NvccNotFoundError, find_nvcc
from .variants import REGISTRY

#: Architectures compiled by default: Turing, Ampere, Hopper.
ARCHS = ("sm_75", "sm_80", "sm_90")
#: The limits legal configurations are chosen under: 1024 threads and 48 KiB of static shared
#: memory per block hold on every architecture from sm_50 on.
CUDA_LIMITS = DeviceLimits(max_work_group_size=1024, local_mem_size=48 * 1024, device_type="gpu")
#: Per rank: (label, input shape, output size, needs 64-bit indexing).  The 64-bit problems get
#: their batch axis grown past 2^31 elements (``_index_64_shape``); the shape here is their plane.
PROBLEMS = {
    1: (("nonuniform-idx32", (2, 3, 61), (7,), False),
        ("uniform-idx64", (2, 3, 64), (8,), True)),
    2: (("nonuniform-idx32", (2, 3, 10, 61), (4, 7), False),
        ("uniform-idx64", (2, 3, 8, 64), (4, 8), True)),
    3: (("nonuniform-idx32", (2, 3, 5, 10, 61), (3, 4, 7), False),
        ("uniform-idx64", (2, 3, 6, 8, 64), (3, 4, 8), True)),
}
#: Per rank, global pooling in both index widths: compiled for the variants that have no legal
#: configuration on ``PROBLEMS`` (plane_reduce runs global pooling only).  64 channels, so that
#: runs of neighbouring channels (global_channels' ``channels_per_item``) of every width are legal
#: and their partials' registers are compiled.
GLOBAL_PROBLEMS = {
    1: (("global-idx32", (2, 64, 300), (1,), False), ("global-idx64", (2, 64, 300), (1,), True)),
    2: (("global-idx32", (2, 64, 17, 19), (1, 1), False), ("global-idx64", (2, 64, 17, 19), (1, 1), True)),
    3: (("global-idx32", (2, 64, 3, 7, 13), (1, 1, 1), False), ("global-idx64", (2, 64, 3, 7, 13), (1, 1, 1), True)),
}
#: Per rank, the problems of the pyramids (pool_tuner.pyramid): PSPNet's levels on non-divisible
#: planes, SPP's with 64-bit indexing; and avgmax's.
PYRAMID_PROBLEMS = {
    1: (("pyramid-idx32", (2, 3, 61), [1, 2, 3, 6], False), ("pyramid-idx64", (2, 3, 64), [1, 2, 4], True)),
    2: (("pyramid-idx32", (2, 3, 10, 61), [1, 2, 3, 6], False), ("pyramid-idx64", (2, 3, 13, 13), [1, 2, 4], True)),
    3: (("pyramid-idx32", (2, 3, 5, 10, 61), [1, 2, (2, 3, 4)], False),
        ("pyramid-idx64", (2, 3, 6, 8, 64), [1, 2, 4], True)),
}
AVGMAX_PROBLEMS = {2: (("avgmax-idx32", (2, 3, 7, 9), (2, 3), False), ("avgmax-idx64", (2, 3, 7, 7), (1, 1), True))}
#: The channels of the wide-channel problems: a single-level variant that takes runs of neighbouring
#: channels in channels-last memory (a ``channels_per_item`` parameter) is compiled on ``PROBLEMS``
#: again with this many channels (``with_channels``), so that every run width of its search space is
#: legal and its registers are compiled; the three channels above keep the grids that end inside a
#: work-group.
WIDE_CHANNELS = 256
#: nvcc flags of every compilation (the architecture and file names are added per job).
NVCC_FLAGS = ("-cubin", "--Werror", "all-warnings", "-Xptxas", "-v")
#: Instantiations per nvcc run (1: every instantiation compiled alone, from its plain source).
BATCH_SIZE = 32
#: Seconds one nvcc run may take before it counts as failed.
NVCC_TIMEOUT_S = 600
#: Lines of compiler output shown per failure.
ERROR_LINES = 12
SUMMARY = "compiled {n} instantiations, {failed} failed, {spills} with spills"
#: The check's tiers, as the test suite's: ``exhaustive`` compiles every instantiation for every
#: architecture; ``core`` (the CI's) a rotating share of them (``core_selection``) and every helper
#: program.
TIERS = ("exhaustive", "core")

_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_FUNCTION = re.compile(r"Function properties for (\S+)")
_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)", re.M)
_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include\b.*$", re.M)


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
    problem_label: str
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


def _index_64_shape(input_shape: tuple) -> tuple:
    """``input_shape`` with its batch axis grown until the element count needs 64-bit offsets."""
    per_batch = math.prod(input_shape[1:])
    return (INT32_LIMIT // per_batch + 1,) + tuple(input_shape[1:])


def problems_for(op: str, direction: str, dtype: str, layout: str, table=PROBLEMS) -> list:
    """``[(label, Problem)]`` of ``table`` for one op/direction/dtype/layout; empty if
    ``Problem.create`` rejects the combination.  Raises ``ValueError`` if a problem does not get the
    index width it is for."""
    found = []
    for label, shape, output_size, wide in table[OPS[op].ndim]:
        try:
            problem = Problem.create(op, _index_64_shape(shape) if wide else shape, output_size, dtype,
                                     layout, direction)
        except (ValueError, TypeError):
            return []
        if problem.index_64 != wide:
            raise ValueError(f"compile_check: problem {problem.input_shape} -> {problem.output_shape} was meant "
                             f"for {64 if wide else 32}-bit indexing")
        found.append((label, problem))
    return found


def with_channels(table: dict, channels: int) -> dict:
    """``table``'s problems with ``channels`` channels, labelled ``wide-<label>``."""
    return {rank: tuple((f"wide-{label}", (shape[0], channels) + tuple(shape[2:]), output_size, wide)
                        for label, shape, output_size, wide in problems)
            for rank, problems in table.items()}


def _configurations(variant, problem: Problem) -> list:
    """``[(label, params)]``: the variant's representative configurations under CUDA's limits
    (``Variant.representative_configurations``: as a call naming it could run them)."""
    return list(variant.representative_configurations(problem, CUDA_LIMITS).items())


def instantiations(archs=ARCHS, ops=None, dtypes=None, variants=None, directions=None):
    """Every instantiation to compile, and notes on what was skipped: combinations that
    ``Problem.create`` rejects, variants with no legal configuration for a problem."""
    found, rejected, no_config = [], [], {}
    for (op, direction), table in REGISTRY.items():
        if (ops is not None and op not in ops) or (directions is not None and direction not in directions):
            continue
        for dtype in DTYPES:
            if dtypes is not None and dtype not in dtypes:
                continue
            operation = OPS[op]
            own = PYRAMID_PROBLEMS if operation.pyramid else AVGMAX_PROBLEMS if operation.multi_level else PROBLEMS
            for layout in LAYOUT_NAMES[operation.ndim]:
                problems = problems_for(op, direction, dtype, layout, own)
                if not problems:
                    rejected.append(f"{op}/{direction}/{dtype}/{layout}")
                    continue
                for name, variant in table.items():
                    if variants is not None and name not in variants:
                        continue
                    picks = [(label, problem, _configurations(variant, problem)) for label, problem in problems]
                    if not any(configs for _, _, configs in picks):
                        picks = [(label, problem, _configurations(variant, problem))
                                 for label, problem in problems_for(op, direction, dtype, layout, GLOBAL_PROBLEMS)]
                    if "channels_per_item" in variant.search_space and "gpu" in variant.device_types:
                        wide = [(label, problem, _configurations(variant, problem))
                                for label, problem in problems_for(op, direction, dtype, layout,
                                                                   with_channels(own, WIDE_CHANNELS))
                                if problem.channels_last]
                        picks += [pick for pick in wide if pick[2]]
                    for problem_label, problem, configs in picks:
                        if not configs:
                            try:
                                variant.check_config({}, problem, CUDA_LIMITS, forced=True)
                                reason = "no legal point in the search space"
                            except ValueError as exc:
                                reason = str(exc)
                            entry = no_config.setdefault((direction, name, layout), [0, reason])
                            entry[0] += 1
                        for config_label, params in configs:
                            second = variant.second_pass(params, problem)
                            passes = [(config_label, {})] + ([(f"{config_label}/second-pass", second[2])]
                                                             if second is not None else [])
                            for pass_label, pass_defines in passes:
                                source = variant.program(params, problem, pass_defines)
                                for arch in archs:
                                    found.append(Instantiation(
                                        op, direction, dtype, layout, name, pass_label,
                                        tuple(sorted(params.items())), problem_label, arch,
                                        variant.kernel_name, source))
    notes = [f"skipped (rejected by Problem.create): {', '.join(rejected)}"] if rejected else []
    for (direction, name, layout), (count, reason) in no_config.items():
        notes.append(f"skipped {direction} {name} on {layout} ({count} op/dtype/problem combinations): "
                     f"no legal configuration ({reason})")
    return found, notes


def core_selection(found: list) -> list:
    """The core tier's share of ``found`` (``instantiations``' list, every architecture): each
    op/direction/layout/variant/configuration/problem once, in one of its dtypes on one of the
    architectures, the dtype and the architecture rotating from one of a variant's cells to the
    next (at once: three architectures and four dtypes meet in every pairing within twelve cells),
    so that every dtype and every architecture compiles a share of every variant; and besides, float64 at
    every ``largest`` configuration, on the cell's architecture: the most registers a variant asks
    for, where spills show first."""
    archs = list(dict.fromkeys(inst.arch for inst in found))
    cells: dict = {}
    for inst in found:
        cell = (inst.op, inst.direction, inst.layout, inst.variant, inst.config_label, inst.problem_label)
        cells.setdefault(cell, []).append(inst)
    chosen, seen_of_variant = [], {}
    for (_, _, _, variant, _, _), members in cells.items():
        k = seen_of_variant[variant] = seen_of_variant.get(variant, -1) + 1  # the variant's k-th cell
        dtypes = [dtype for dtype in DTYPES if any(inst.dtype == dtype for inst in members)]
        arch = archs[(k + k // len(archs)) % len(archs)]  # skewed: not always the same for a variant's k-th configuration
        keep = {dtypes[k % len(dtypes)]}
        if "largest" in members[0].config_label.split("+") and "float64" in dtypes:
            keep.add("float64")
        chosen += [inst for inst in members if inst.dtype in keep and inst.arch == arch]
    return chosen


@dataclasses.dataclass(frozen=True)
class HelperProgram:
    """A program outside the variant tables, compiled whole for one dtype and architecture:
    avgmax's join kernels (pool_tuner.avgmax), which run after its forward and before its
    backward on device arrays."""

    program: str
    dtype: str
    arch: str
    kernel_names: tuple
    source: str = dataclasses.field(repr=False, compare=False)

    @property
    def name(self) -> str:
        return f"{self.program}/{self.dtype}/{self.arch}"


def helper_programs(archs=ARCHS, ops=None, dtypes=None, variants=None, directions=None) -> list:
    """The helper programs to compile, per dtype and architecture: avgmax's join kernels, and GeM's
    input-gradient kernel (pool_tuner.gem) of a global and a windowed problem of each rank, unless
    the filters leave those ops out (a ``variants`` filter names variants only)."""
    from . import avgmax, gem

    if variants is not None:
        return []
    chosen = [dtype for dtype in DTYPES if dtypes is None or dtype in dtypes]
    found = []
    if ops is None or avgmax.OP in ops:
        found += [HelperProgram("avgmax_join", dtype, arch, avgmax.KERNELS, avgmax.program(dtype, avgmax.JOIN_BLOCK))
                  for dtype in chosen for arch in archs]
    if directions is None or BACKWARD.name in directions:
        for label, problem, form in gem.helper_problems(ops, chosen):
            found += [HelperProgram(label, problem.dtype, arch, (form.kernel,), gem.input_gradient_program(problem, form))
                      for arch in archs]
    return found


# ---------------------------------------------------------------------- compiling

@dataclasses.dataclass(frozen=True)
class Job:
    """One distinct source to compile for one architecture."""

    arch: str
    source: str
    kernel_name: str


def _batch_source(jobs: list) -> tuple[str, list]:
    """One translation unit holding every job's source, and per job ``(tag, renamed kernel, first
    line, last line)``: where its source lies in the unit (1-based lines)."""
    includes = []
    for job in jobs:
        for line in _INCLUDE.findall(job.source):
            if line.strip() not in includes:
                includes.append(line.strip())
    lines, spans = list(includes), []
    for k, job in enumerate(jobs):
        tag = f"pool_tuner_job{k}x"  # unique substring: "job1x" is not in "job11x"
        renamed = f"{job.kernel_name}_{tag}"
        lines += [f"#define {job.kernel_name} {renamed}", f"namespace {tag} {{"]
        first = len(lines) + 1
        lines += job.source.split("\n")
        spans.append((tag, renamed, first, len(lines)))
        macros = sorted(set(_DEFINE.findall(job.source)) | {job.kernel_name})
        lines += ["}"] + [f"#undef {m}" for m in macros]
    return "\n".join(lines) + "\n", spans


_DIAGNOSTIC = re.compile(r"^kernel\.cu\((\d+)\): ")
_TAG = re.compile(r"pool_tuner_job(\d+)x")
_NOISE = re.compile(r"^(\d+ errors? detected in the compilation|Remark: The warnings can be suppressed|"
                    r"ptxas fatal\s*: Ptx assembly aborted|ptxas info\s*:|\s+\d+ bytes stack frame|\s*$)")


def _attribute(output: str, spans: list) -> dict | None:
    """A failed batch's diagnostics by job: ``{job index: message}`` with the line numbers of the
    job's own source, or None when some error line cannot be attributed to one job."""
    blocks, current = [], None
    for line in output.splitlines():
        if _NOISE.match(line):  # before the tag test: ptxas's info lines name every kernel
            current = None
            continue
        header = _DIAGNOSTIC.match(line)
        if header or _TAG.search(line):
            current = None
        if header:
            number = int(header.group(1))
            owner = next((k for k, (_, _, a, b) in enumerate(spans) if a <= number <= b), None)
            if owner is None:
                return None
            current = [owner, [f"kernel.cu({number - spans[owner][2] + 1}): {line[header.end():]}"]]
            blocks.append(current)
        elif _TAG.search(line):
            blocks.append([int(_TAG.search(line).group(1)), [re.sub(r"_?pool_tuner_job\d+x", "", line)]])
        elif current is not None:
            current[1].append(line)
        else:
            return None
    messages: dict = {}
    for owner, text in blocks:
        messages.setdefault(owner, []).extend(text)
    return {k: "\n".join(text) + "\n(diagnosed in a batch; line numbers are those of this instantiation's source)"
            for k, text in messages.items()}


def _nvcc(nvcc: str, source: str, arch: str) -> tuple[int | None, str]:
    with tempfile.TemporaryDirectory(prefix="pool_tuner_nvcc_") as tmp:
        src, cubin = os.path.join(tmp, "kernel.cu"), os.path.join(tmp, "kernel.cubin")
        with open(src, "w") as f:
            f.write(source)
        command = [nvcc, *NVCC_FLAGS, f"-arch={arch}", "-o", cubin, src]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=NVCC_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return None, f"nvcc did not finish in {NVCC_TIMEOUT_S} s"
        except OSError as exc:
            return None, f"nvcc could not be run: {exc}"
    output = (proc.stdout + proc.stderr).replace(src, "kernel.cu")
    return proc.returncode, output or f"nvcc exited with status {proc.returncode}"


def _function_spills(output: str) -> dict:
    """ptxas -v report -> {function name: (spill stores, spill loads)}."""
    spills, current = {}, None
    for line in output.splitlines():
        match = _FUNCTION.search(line)
        if match:
            current = match.group(1)
            continue
        match = _SPILLS.search(line)
        if match and current is not None:
            spills[current] = (int(match.group(1)), int(match.group(2)))
            current = None
    return spills


def compile_single(nvcc: str, job: Job) -> Result:
    """Compile one plain source; fail on any warning, on a missing entry function or spill report."""
    return compile_program(nvcc, job.source, job.arch, (job.kernel_name,))


def compile_program(nvcc: str, source: str, arch: str, kernel_names: tuple) -> Result:
    """Compile ``source`` alone; fail on any warning, or where one of ``kernel_names`` has no entry
    function or spill report."""
    status, output = _nvcc(nvcc, source, arch)
    if status != 0:
        return Result(False, output)
    spills = _function_spills(output)
    for name in kernel_names:
        if f"Compiling entry function '{name}'" not in output:
            return Result(False, f"no entry function '{name}' was compiled (does the kernel file define it?)\n{output}")
        if name not in spills:
            return Result(False, f"no spill report for '{name}' in ptxas's output\n{output}")
    return Result(True, output, sum(s for s, _ in spills.values()), sum(l for _, l in spills.values()))


def compile_jobs(nvcc: str, jobs: list) -> list:
    """Results of ``jobs`` (all for one architecture), compiled as one batch.  When the batch fails,
    the jobs its diagnostics point at fail with those diagnostics and the others are compiled again
    as a batch; diagnostics that point at no single job split the batch in halves instead."""
    if len(jobs) == 1:
        return [compile_single(nvcc, jobs[0])]
    source, spans = _batch_source(jobs)
    status, output = _nvcc(nvcc, source, jobs[0].arch)
    if status is None:  # nvcc timed out or could not run: splitting would only repeat that
        return [Result(False, output) for _ in jobs]
    spills = _function_spills(output) if status == 0 else {}
    if status == 0 and all(renamed in spills for _, renamed, _, _ in spans):
        results = []
        for tag, _, _, _ in spans:
            mine = [s for name, s in spills.items() if tag in name]
            results.append(Result(True, f"(compiled in a batch of {len(jobs)})",
                                  sum(s for s, _ in mine), sum(l for _, l in mine)))
        return results
    blamed = _attribute(output, spans) if status else None
    if blamed:
        rest = [job for k, job in enumerate(jobs) if k not in blamed]
        rest_results = iter(compile_jobs(nvcc, rest) if rest else [])
        return [Result(False, blamed[k]) if k in blamed else next(rest_results) for k in range(len(jobs))]
    half = len(jobs) // 2
    return compile_jobs(nvcc, jobs[:half]) + compile_jobs(nvcc, jobs[half:])


def run(archs=ARCHS, *, ops=None, directions=None, dtypes=None, variants=None, tier: str = "exhaustive",
        jobs: int = 2, batch_size: int = BATCH_SIZE, nvcc: str | None = None, out=None) -> int:
    """Compile every instantiation of ``tier`` (see the module docstring); print failures and spills
    by name and the summary line.  Returns 0 when nothing failed or spilled, else 1; raises
    ``NvccNotFoundError`` (a ``RuntimeError``) when no nvcc can be found and
    ``ValueError``/``TypeError`` for bad filters."""
    out = out or sys.stdout
    archs = (archs,) if isinstance(archs, str) else tuple(archs)
    for arch in archs:
        if not isinstance(arch, str) or not re.fullmatch(r"sm_\d+[af]?", arch):
            raise ValueError(f"archs must be names like sm_80, got {arch!r}")
    _check_filter("ops", ops, sorted({op for op, _ in REGISTRY}))
    _check_filter("directions", directions, sorted({d for _, d in REGISTRY}))
    _check_filter("dtypes", dtypes, sorted(DTYPES))
    _check_filter("variants", variants, sorted({n for t in REGISTRY.values() for n in t}))
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {list(TIERS)}, got {tier!r}")
    for name, value in (("jobs", jobs), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    nvcc = find_nvcc(nvcc)
    start = time.perf_counter()
    cpu_start = _children_cpu_s()
    todo, notes = instantiations(archs, ops, dtypes, variants, directions)
    if tier == "core":
        todo = core_selection(todo)
    distinct = list(dict.fromkeys(Job(i.arch, i.source, i.kernel_name) for i in todo))
    helpers = helper_programs(archs, ops, dtypes, variants, directions)
    print(f"compile-check cuda ({tier} tier): {len(todo)} instantiations ({len(distinct)} distinct sources) and "
          f"{len(helpers)} helper programs for "
          f"{', '.join(archs)} with {nvcc} ({nvcc_version(nvcc)}); {jobs} jobs, batches of {batch_size}",
          file=out, flush=True)
    for note in notes:
        print(f"note: {note}", file=out)
    batches = []
    for arch in archs:
        mine = [job for job in distinct if job.arch == arch]
        batches += [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for batch, batch_results in zip(batches, pool.map(lambda b: compile_jobs(nvcc, b), batches)):
            results.update(zip(batch, batch_results))
        results.update(zip(helpers, pool.map(lambda h: compile_program(nvcc, h.source, h.arch, h.kernel_names),
                                             helpers)))
    failed = spilled = 0
    for inst in todo + helpers:
        result = results[inst if isinstance(inst, HelperProgram) else Job(inst.arch, inst.source, inst.kernel_name)]
        if not result.ok:
            failed += 1
            print(f"FAILED {inst.name}", file=out)
            for line in result.output.strip().splitlines()[:ERROR_LINES]:
                print(f"    {line}", file=out)
        elif result.spills:
            spilled += 1
            print(f"SPILLS {inst.name}: {result.spill_stores} bytes spill stores, "
                  f"{result.spill_loads} bytes spill loads", file=out)
    cpu = "" if cpu_start is None else f", {_children_cpu_s() - cpu_start:.1f} s CPU in nvcc"
    print(f"time: {time.perf_counter() - start:.1f} s wall{cpu}", file=out)
    print(SUMMARY.format(n=len(todo) + len(helpers), failed=failed, spills=spilled), file=out, flush=True)
    return 0 if failed == 0 and spilled == 0 else 1


def _children_cpu_s() -> float | None:
    if resource is None:
        return None
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


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
