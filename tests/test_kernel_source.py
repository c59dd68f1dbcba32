"""Kernel sources: one file per variant over shared headers, the op only in the operator header,
the hash that identifies a record's kernel code, and the package data that installs them all."""

import configparser
import re
import shutil
from pathlib import Path

import pytest

import pool_tuner as pt
from pool_tuner import backends, cache, kernel_source
from pool_tuner.problem import Problem
from pool_tuner.variants import REGISTRY, layout_of

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
VARIANT_FILES = sorted(str(p.relative_to(KERNELS)) for d in ("forward", "backward") for p in (KERNELS / d).glob("*"))


def test_every_variant_has_its_own_kernel_file_and_every_file_is_a_variant():
    templates = {variant.template for table in REGISTRY.values() for variant in table.values()}
    assert templates == set(VARIANT_FILES)
    for (_, direction), table in REGISTRY.items():
        for name, variant in table.items():
            assert variant.template == f"{direction}/{name}.c"
            assert f"KERNEL void {variant.kernel_name}(" in kernel_source.read(variant.template)


def test_only_the_operator_header_names_an_op():
    """Variant bodies and the shared headers go through the operator: no POOL_AVG/POOL_MAX outside
    operators.h, no variant switches, and the few operator-kind conditions in variant files are
    guards that refuse a kind (#error), not alternative bodies."""
    names_an_op = [str(p.relative_to(KERNELS)) for p in KERNELS.rglob("*")
                   if p.is_file() and re.search(r"POOL_(AVG|MAX)", p.read_text())]
    assert names_an_op == ["operators.h"]
    for name in VARIANT_FILES + ["reduction.h", "gradients.h", "windows.h", "tiles.h", "prelude.h"]:
        lines = (KERNELS / name).read_text().splitlines()
        assert not any("VARIANT_" in line for line in lines), name
        if name in VARIANT_FILES:
            for k, line in enumerate(lines):
                if line.startswith("#if") and "OP_SELECTS" in line:
                    assert lines[k + 1].startswith("#error"), f"{name}:{k + 1} branches on the op kind"


def test_program_files():
    assert kernel_source.program_files("forward/thread_per_output.c") == (
        "prelude.h", "windows.h", "operators.h", "reduction.h", "forward/thread_per_output.c")
    assert kernel_source.program_files("backward/smem_tiled.c") == (
        "prelude.h", "windows.h", "operators.h", "gradients.h", "tiles.h", "backward/smem_tiled.c")
    for bad in ("pool_forward.c", "sideways/thread_per_output.c", "forward/thread_per_output.h"):
        with pytest.raises(ValueError, match="template must be"):
            kernel_source.program_files(bad)


@pytest.fixture
def kernel_copy(tmp_path, monkeypatch):
    """A private copy of kernels/ that the package reads (the memoised reads and hashes cleared)."""
    copy = tmp_path / "kernels"
    shutil.copytree(KERNELS, copy)
    monkeypatch.setattr(kernel_source, "kernel_dir", lambda: copy)
    for memo in (kernel_source.read, kernel_source.template_hash):
        memo.cache_clear()
    yield copy
    for memo in (kernel_source.read, kernel_source.template_hash):
        memo.cache_clear()


PROBLEM_SHAPE = ((2, 3, 10, 9), (4, 7))
KINDS = ("cpu", "gpu")
LAYOUTS = ("NCHW", "NHWC")


def _src(op, direction, device_type, layout="NCHW"):
    """The kernel hash of a small problem's records tuned on a device of ``device_type``."""
    return cache.kernel_hash(Problem.create(op, *PROBLEM_SHAPE, layout=layout, direction=direction), device_type)


def test_the_cache_key_of_the_device_at_hand_has_its_kinds_kernel_hash():
    explained = pt.explain("adaptive_avg_pool2d", *PROBLEM_SHAPE)
    kind = backends.default_device().info.limits.device_type
    assert explained["cache_key"].rsplit("|src=", 1)[1] == _src("adaptive_avg_pool2d", "forward", kind)[:16]


def test_the_cache_key_covers_every_file_of_its_directions_programs(kernel_copy):
    """Editing any header or any variant file of a direction makes that direction's records stale
    (a record ranks every variant of its direction) on the kinds of device and in the memory
    layouts where a variant built from the file is legal (Variant.device_types, Variant.layouts);
    the other direction's keys stay, and so do the keys of the kinds of device and layouts where no
    such variant is legal (a GPU-only variant's file leaves the CPU records alone, a channels-last
    variant's file the channels-first records)."""
    ops = ("adaptive_avg_pool2d", "adaptive_max_pool2d")
    cases = [(op, d, kind, layout) for op in ops for d in ("forward", "backward") for kind in KINDS
             for layout in LAYOUTS]
    before = {case: _src(*case) for case in cases}
    files = sorted({name for table in REGISTRY.values() for v in table.values()
                    for name in kernel_source.program_files(v.template)})
    assert {"tiles.h", "reduction.h", "gradients.h", "gpu.h", "forward/global_blocks.c",
            "backward/channels_gather.c"} <= set(files)
    gpu_only = {v.template for table in REGISTRY.values() for v in table.values() if "cpu" not in v.device_types}
    assert "forward/global_blocks.c" in gpu_only
    for name in files:
        path = kernel_copy / name
        original = path.read_text()
        path.write_text(original + "/* edited */\n")
        kernel_source.read.cache_clear()
        kernel_source.template_hash.cache_clear()
        for (op, direction, kind, layout) in cases:
            used = any(name in kernel_source.program_files(v.template)
                       for v in REGISTRY[(op, direction)].values()
                       if kind in v.device_types and layout_of(Problem.create(op, *PROBLEM_SHAPE, layout=layout))
                       in v.layouts)
            assert (_src(op, direction, kind, layout) != before[(op, direction, kind, layout)]) == used, (
                name, op, direction, kind, layout)
        path.write_text(original)


def test_package_data_installs_every_kernel_file():
    """setup.cfg's package data must reach the variant files in kernels/forward and kernels/backward
    (a pattern of a data package does not descend into subdirectories by itself)."""
    config = configparser.ConfigParser()
    config.read(KERNELS.parent / "setup.cfg")
    patterns = [p.strip() for p in config["options.package_data"]["pool_tuner.kernels"].split(",")]
    installed = {str(p.relative_to(KERNELS)) for pattern in patterns for p in KERNELS.glob(pattern)}
    every = {str(p.relative_to(KERNELS)) for p in KERNELS.rglob("*") if p.is_file()}
    assert installed == every


def test_gpu_h_is_in_exactly_the_gpu_only_variants_programs():
    """gpu.h, the GPU-only variants' prelude, is in the program of every variant legal on GPUs
    alone and of no other: a variant a CPU could run never includes it."""
    variants = [v for table in REGISTRY.values() for v in table.values()]
    including = {v.name for v in variants if "gpu.h" in kernel_source.program_files(v.template)}
    assert including == {v.name for v in variants if v.device_types == ("gpu",)} == set(kernel_source.GPU_VARIANTS)


@pytest.mark.parametrize("edited", ["forward/global_blocks.c", "gpu.h"])
def test_a_cpu_records_hash_ignores_the_gpu_only_variant_and_a_gpu_records_follows_it(kernel_copy, edited):
    """global_blocks is legal on GPUs only: editing it or its prelude gpu.h leaves the hash of
    records tuned on a CPU (the shipped PoCL records) as it was and changes that of records tuned
    on a GPU."""
    from cuda_fakes import fake_cuda_device

    problem = Problem.create("adaptive_avg_pool2d", (8, 2048, 7, 7), 1)
    cpu = backends.resolve_device("opencl:pocl:0").info.fingerprint
    gpu = fake_cuda_device().info.fingerprint
    assert (cache.device_type(cpu), cache.device_type(gpu)) == ("cpu", "gpu")
    before = {kind: cache.record_kernel_hash(problem, fingerprint)
              for kind, fingerprint in (("cpu", cpu), ("gpu", gpu))}
    path = kernel_copy / edited
    path.write_text(path.read_text() + "/* edited */\n")
    kernel_source.read.cache_clear()
    kernel_source.template_hash.cache_clear()
    assert cache.record_kernel_hash(problem, cpu) == before["cpu"]
    assert cache.record_kernel_hash(problem, gpu) != before["gpu"]


def test_a_channels_first_records_hash_ignores_the_channels_last_variant_and_a_channels_last_records_follows_it(
        kernel_copy):
    """channels_gather is legal for channels-last problems only (Variant.layouts): editing it leaves
    the hash of every channels-first record (every shipped record is channels-first) as it was, on
    either kind of device, and changes that of channels-last backward records."""
    assert REGISTRY[("adaptive_avg_pool2d", "backward")]["channels_gather"].layouts == ("channels_last",)
    cases = [("adaptive_avg_pool1d", "NCL"), ("adaptive_avg_pool1d", "NLC"), ("adaptive_max_pool2d", "NCHW"),
             ("adaptive_max_pool2d", "NHWC"), ("adaptive_avg_pool3d", "NCDHW"), ("adaptive_avg_pool3d", "NDHWC")]
    problems = {(op, layout): Problem.create(op, (2, 8) + (9,) * int(op[-2]), 4, layout=layout, direction="backward")
                for op, layout in cases}
    before = {(key, kind): cache.kernel_hash(problem, kind) for key, problem in problems.items() for kind in KINDS}
    path = kernel_copy / "backward" / "channels_gather.c"
    path.write_text(path.read_text() + "/* edited */\n")
    kernel_source.read.cache_clear()
    kernel_source.template_hash.cache_clear()
    for (key, kind), hashed in before.items():
        channels_last = problems[key].channels_last
        assert (cache.kernel_hash(problems[key], kind) != hashed) == channels_last, (key, kind)


@pytest.mark.parametrize("op,direction,name,spatial,size", [
    ("adaptive_avg_pool2d", "forward", "thread_per_output", (14, 14), 1),
    ("adaptive_max_pool2d", "forward", "thread_per_output", (17, 13), (4, 4)),
    ("adaptive_avg_pool2d", "backward", "thread_per_input", (9, 9), (4, 4)),
    ("adaptive_avg_pool_pyramid2d", "forward", "pyramid_cells", (12, 12), [1, 2, 3])])
def test_channels_first_problems_that_differ_only_in_channels_share_one_program(op, direction, name, spatial, size):
    """Channels-first addressing never divides by the channel count, so it is no define there and
    a model's squeeze-excitation blocks at one resolution (72 and 120 channels at 28x28) build one
    program; channels-last addressing divides by it, so there it is one."""
    variant = REGISTRY[(op, direction)][name]
    programs = {}
    for layout in ("NCHW", "NHWC"):
        problems = [Problem.create(op, (2, channels) + spatial, size, "float32", layout, direction)
                    for channels in (72, 120)]
        params = variant.check_config({}, problems[0], backends.default_device().info.limits, forced=True)
        programs[layout] = {variant.program(params, problem) for problem in problems}
    assert len(programs["NCHW"]) == 1
    assert len(programs["NHWC"]) == 2
