"""``pool-tuner compile-check cuda``: what it enumerates, how it reports, and that it catches a
broken kernel.  The compiling tests need nvcc (no GPU) and skip with a reason without it; the
check's core tier runs in CI as its own step (.ci/run)."""

import io
import itertools
import re

import pytest

from pool_tuner import cli, compile_check, kernel_source
from pool_tuner.problem import DTYPES, LAYOUT_NAMES, OPS, Problem
from pool_tuner.variants import REGISTRY

try:
    NVCC = compile_check.find_nvcc()
except compile_check.NvccNotFoundError as exc:
    NVCC, NVCC_MISSING = None, str(exc)
else:
    NVCC_MISSING = ""
needs_nvcc = pytest.mark.skipif(NVCC is None, reason=f"nvcc is not installed ({NVCC_MISSING})")

SUMMARY = re.compile(r"^compiled (\d+) instantiations, (\d+) failed, (\d+) with spills$")


def run_check(**kwargs):
    out = io.StringIO()
    status = compile_check.run(out=out, **kwargs)
    text = out.getvalue()
    last = text.rstrip("\n").splitlines()[-1]
    match = SUMMARY.match(last)
    assert match, f"the last line is not the summary line: {last!r}"
    return status, text, tuple(int(g) for g in match.groups())


# ---------------------------------------------------------------------- enumeration (no nvcc)

def test_every_op_direction_dtype_layout_variant_is_enumerated():
    found, notes = compile_check.instantiations(archs=("sm_80",))
    seen = {}
    for inst in found:
        seen.setdefault((inst.op, inst.direction, inst.dtype, inst.layout, inst.variant), set()).update(
            inst.config_label.split("+"))
    expected = set()
    for (op, direction), table in REGISTRY.items():
        for dtype, layout, name in itertools.product(DTYPES, LAYOUT_NAMES[OPS[op][1]], table):
            try:
                Problem.create(op, (2, 3) + (8,) * OPS[op][1], 1, dtype, layout, direction)
            except (ValueError, TypeError):
                continue
            expected.add((op, direction, dtype, layout, name))
    missing = expected - set(seen)
    # A combination may only be missing when its variant has no legal configuration there
    # (channels_vector on channels-first layouts, plane_reduce on channels-last ones), and the run
    # says so.
    for op, direction, dtype, layout, name in missing:
        assert any(f"{direction} {name} on {layout}" in note and "no legal configuration" in note for note in notes), \
            (op, direction, dtype, layout, name)
    assert len(missing) < len(expected) // 3
    assert any(inst.variant == "plane_reduce" and inst.problem_label == "global-idx64" for inst in found)
    for key, labels in seen.items():
        assert {"default", "smallest", "largest"} <= labels, (key, labels)


def test_both_index_widths_and_uniform_windows_are_compiled():
    found, _ = compile_check.instantiations(archs=("sm_80",), ops=["adaptive_avg_pool2d"],
                                            directions=["forward"], dtypes=["float32"],
                                            variants=["thread_per_output"])
    by_problem = {inst.problem_label: inst.source for inst in found}
    assert "#define INDEX_64 0" in by_problem["nonuniform-idx32"]
    assert "#define UNIFORM_W 0" in by_problem["nonuniform-idx32"]
    assert "#define INDEX_64 1" in by_problem["uniform-idx64"]
    assert "#define UNIFORM_W 1" in by_problem["uniform-idx64"]
    # the largest point of the space, with row_lanes > 1, is legal on these problems and compiled
    assert any(dict(inst.params).get("row_lanes", 1) > 1 for inst in found)


def test_channel_runs_are_compiled_at_their_widest_legal_width():
    """The variants that take runs of neighbouring channels are compiled where their widest runs
    are legal (``WIDE_CHANNELS``): the three channels of ``PROBLEMS`` allow channels_gather runs of
    1 and 2 only, which left its 64-to-256-channel runs uncompiled (and spilling) until then."""
    found, _ = compile_check.instantiations(archs=("sm_80",), ops=["adaptive_avg_pool2d"], directions=["backward"],
                                            variants=["channels_gather"])
    widest = {}
    for inst in found:
        widest[inst.dtype] = max(widest.get(inst.dtype, 0), dict(inst.params)["channels_per_item"])
    assert widest == {"float32": 128, "float16": 128, "bfloat16": 128, "float64": 64}
    wide = [inst for inst in found if inst.problem_label.startswith("wide-")]
    assert {inst.layout for inst in wide} == {"NHWC"}
    assert all(f"#define N_CHANNELS {compile_check.WIDE_CHANNELS}" in inst.source for inst in wide)


def test_representative_configs_are_default_first_and_last_legal():
    variant = REGISTRY[("adaptive_avg_pool2d", "forward")]["thread_per_output"]
    problem = Problem.create("adaptive_avg_pool2d", (2, 3, 10, 61), (4, 7))
    configs = variant.representative_configurations(problem, compile_check.CUDA_LIMITS)
    assert configs["default"] == variant.check_config({}, problem, compile_check.CUDA_LIMITS)
    legal = variant.legal_configurations(problem, compile_check.CUDA_LIMITS)
    assert configs["smallest"] == legal[0] and configs["largest"] == legal[-1]


def test_coinciding_configs_are_one_with_their_labels_joined():
    variant = REGISTRY[("adaptive_avg_pool2d", "forward")]["thread_per_output"]
    problem = Problem.create("adaptive_avg_pool2d", (2, 3, 10, 61), (4, 7))
    smallest = variant.legal_configurations(problem, compile_check.CUDA_LIMITS)[0]
    shaped = type("SmallestByDefault", (type(variant),), {"default": smallest})()
    configs = shaped.representative_configurations(problem, compile_check.CUDA_LIMITS)
    assert configs["default+smallest"] == smallest and "default" not in configs and "smallest" not in configs
    assert len({tuple(sorted(c.items())) for c in configs.values()}) == len(configs)


def test_a_variant_shaped_for_cpus_is_compiled_for_gpus_but_never_chosen_there():
    """pyramid_channels keeps its lanes in private memory (a CPU's caches, a GPU's spilled
    registers): on a GPU neither tuning nor dispatch considers it, and a call naming it still
    runs, so the compile check compiles it -- on the ordinary problems, not the wide ones."""
    variant = REGISTRY[("adaptive_avg_pool_pyramid2d", "forward")]["pyramid_channels"]
    problem = Problem.create("adaptive_avg_pool_pyramid2d", (2, 32, 9, 9), [1, 3], layout="NHWC")
    assert variant.legal_configurations(problem, compile_check.CUDA_LIMITS) == []
    assert variant.representative_configurations(problem, compile_check.CUDA_LIMITS)
    found, _ = compile_check.instantiations(archs=("sm_80",), ops=("adaptive_avg_pool_pyramid1d",),
                                            variants=("pyramid_channels",))
    assert found and not any(inst.problem_label.startswith("wide-") for inst in found)
    found, _ = compile_check.instantiations(archs=("sm_80",), ops=("adaptive_avg_pool1d",), directions=("backward",),
                                            variants=("channels_gather",))
    assert any(inst.problem_label.startswith("wide-") for inst in found)


def test_ptxas_report_is_parsed_per_function():
    report = """ptxas info    : Compiling entry function 'pool_forward_pool_tuner_job1x' for 'sm_80'
ptxas info    : Function properties for pool_forward_pool_tuner_job1x
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'pool_forward_pool_tuner_job11x' for 'sm_80'
ptxas info    : Function properties for pool_forward_pool_tuner_job11x
    48 bytes stack frame, 24 bytes spill stores, 16 bytes spill loads
"""
    assert compile_check._function_spills(report) == {
        "pool_forward_pool_tuner_job1x": (0, 0),
        "pool_forward_pool_tuner_job11x": (24, 16),
    }


SPANS = [("pool_tuner_job0x", "pool_forward_pool_tuner_job0x", 3, 10),
         ("pool_tuner_job1x", "pool_forward_pool_tuner_job1x", 13, 20)]


def test_batch_diagnostics_are_attributed_to_their_instantiation():
    front_end = """kernel.cu(15): error #20: identifier "x" is undefined
      x = 1;
      ^

1 error detected in the compilation of "kernel.cu".
"""
    assert compile_check._attribute(front_end, SPANS) == {
        1: 'kernel.cu(3): error #20: identifier "x" is undefined\n      x = 1;\n      ^\n'
           "(diagnosed in a batch; line numbers are those of this instantiation's source)"}
    ptxas = """ptxas info    : Compiling entry function 'pool_forward_pool_tuner_job0x' for 'sm_80'
ptxas info    : Function properties for pool_forward_pool_tuner_job0x
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas error   : Entry function 'pool_forward_pool_tuner_job1x' uses too much shared data (0x10000 bytes, 0xc000 max)
ptxas fatal   : Ptx assembly aborted due to errors
"""
    blamed = compile_check._attribute(ptxas, SPANS)
    assert list(blamed) == [1] and "Entry function 'pool_forward' uses too much shared data" in blamed[1]
    # a diagnostic outside every instantiation (e.g. after unbalanced braces): no attribution
    assert compile_check._attribute("kernel.cu(25): error: expected a }\n", SPANS) is None


def test_missing_nvcc_is_a_one_line_error_with_exit_status_2(capsys):
    assert cli.main(["compile-check", "cuda", "--nvcc", "/nonexistent/bin/nvcc"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nvcc not found" in err


def test_bad_filters_are_rejected_before_compiling():
    with pytest.raises(ValueError, match="ops"):
        compile_check.run(ops=["adaptive_sum_pool2d"], nvcc="/nonexistent/bin/nvcc")
    with pytest.raises(ValueError, match="archs"):
        compile_check.run(archs=("80",), nvcc="/nonexistent/bin/nvcc")


def test_helper_programs_cover_every_dtype_and_leave_with_the_filters():
    found = compile_check.helper_programs(archs=("sm_80", "sm_90"))
    gem = ({f"gem_input_gradient_{ndim}d_{kind}" for ndim in (1, 2, 3) for kind in ("global", "windows", "group_planes")}
           | {f"gem_plane_gradient_{ndim}d" for ndim in (1, 2, 3)})
    assert {(h.program, h.dtype, h.arch) for h in found} == {
        (program, dtype, arch) for program in {"avgmax_join"} | gem for dtype in DTYPES for arch in ("sm_80", "sm_90")}
    assert all(f"KERNEL void {name}(" in h.source for h in found for name in h.kernel_names)
    assert len(compile_check.helper_programs(archs=("sm_80",), ops=["adaptive_gem_pool2d"], dtypes=["float16"])) == 4
    assert compile_check.helper_programs(archs=("sm_80",), ops=["adaptive_gem_pool2d"], directions=["forward"]) == []
    assert compile_check.helper_programs(archs=("sm_80",), variants=["thread_per_output"]) == []
    assert compile_check.helper_programs(archs=("sm_80",), ops=["adaptive_avg_pool2d"]) == []
    assert len(compile_check.helper_programs(archs=("sm_80",), ops=["adaptive_avgmax_pool2d"],
                                             dtypes=["float16"])) == 1


def test_core_tier_compiles_every_cell_once_and_every_dtype_and_arch_a_share():
    """The CI's tier: each op/direction/layout/variant/configuration/problem in one dtype on one
    architecture, rotating, so that every variant still meets every dtype and every architecture;
    float64 besides at every largest configuration."""
    found, _ = compile_check.instantiations(ops=[op for op in OPS if OPS[op].ndim == 1])  # every variant has a 1d op
    core = compile_check.core_selection(found)
    assert set(core) <= set(found) and len(core) < len(found) // 5
    assert {inst.variant for inst in found} == {name for table in REGISTRY.values() for name in table}

    def cell(inst):
        return inst.op, inst.direction, inst.layout, inst.variant, inst.config_label, inst.problem_label

    chosen, offered = {}, {}
    for inst in core:
        chosen.setdefault(cell(inst), []).append(inst)
    for inst in found:
        offered.setdefault(cell(inst), set()).add(inst.dtype)
    assert set(chosen) == set(offered)
    for key, members in chosen.items():
        assert len({inst.arch for inst in members}) == 1, key
        assert len([inst for inst in members if inst.dtype != "float64"]) <= 1, key
        if "largest" in key[4].split("+") and "float64" in offered[key]:
            assert "float64" in {inst.dtype for inst in members}, key
    for name in {inst.variant for inst in found}:
        mine = [inst for inst in core if inst.variant == name]
        assert {inst.dtype for inst in mine} == {inst.dtype for inst in found if inst.variant == name}, name
        assert {inst.arch for inst in mine} == set(compile_check.ARCHS), name


def test_an_unknown_tier_is_rejected_before_compiling():
    with pytest.raises(ValueError, match="tier must be one of"):
        compile_check.run(tier="quick", nvcc="/nonexistent/bin/nvcc")


# ---------------------------------------------------------------------- compiling (nvcc)

@needs_nvcc
def test_subset_compiles_without_warnings_or_spills():
    kwargs = dict(archs=("sm_80",), ops=["adaptive_max_pool2d"], dtypes=["float32", "bfloat16"])
    status, text, (n, failed, spills) = run_check(**kwargs)
    assert (failed, spills) == (0, 0), text
    assert status == 0
    assert n == len(compile_check.instantiations(**kwargs)[0]) > 0


@needs_nvcc
def test_helper_programs_compile_and_a_missing_kernel_fails():
    kwargs = dict(archs=("sm_80",), ops=["adaptive_avgmax_pool2d"], dtypes=["bfloat16"], directions=["forward"])
    status, text, (n, failed, spills) = run_check(**kwargs)
    assert (status, failed, spills) == (0, 0, 0), text
    assert n == len(compile_check.instantiations(**kwargs)[0]) + 1
    helper = compile_check.helper_programs(archs=("sm_80",), dtypes=["float32"])[0]
    broken = helper.source.replace("KERNEL void split_cat(", "DEVICE_FN void split_cat(")
    result = compile_check.compile_program(NVCC, broken, helper.arch, helper.kernel_names)
    assert not result.ok and "no entry function 'split_cat'" in result.output


#: Injected into every smem_tiled source: an error confined to one function (the batch's diagnostics
#: name the instantiation), and unbalanced braces (they spill into whatever follows, so the batch is
#: split until each instantiation is compiled alone).
BROKEN = {
    "error-in-a-function": "KERNEL void pool_tuner_broken(void) { pool_tuner_undefined = 1; }\n",
    "unbalanced-braces": "KERNEL void pool_tuner_broken( {\n",
}


@needs_nvcc
@pytest.mark.parametrize("breakage", sorted(BROKEN))
def test_a_broken_variant_is_reported_by_name_and_fails_the_run(monkeypatch, breakage):
    render = kernel_source.render

    def broken_render(template, defines, operator_header=kernel_source.OPERATOR_HEADER):
        source = render(template, defines, operator_header)
        if template == "forward/smem_tiled.c":
            source += BROKEN[breakage]
        return source

    monkeypatch.setattr(kernel_source, "render", broken_render)
    kwargs = dict(archs=("sm_80",), ops=["adaptive_avg_pool2d"], directions=["forward"], dtypes=["float32"],
                  variants=["thread_per_output", "smem_tiled"])
    status, text, (n, failed, spills) = run_check(**kwargs)
    todo = compile_check.instantiations(**kwargs)[0]
    broken = [i for i in todo if i.variant == "smem_tiled"]
    assert status != 0
    assert failed == len(broken) > 0 and n == len(todo) > failed  # the other variant still compiles
    for inst in broken:
        assert f"FAILED {inst.name}" in text
    assert "FAILED adaptive_avg_pool2d/forward/float32/NCHW/smem_tiled/default{" in text
    assert "FAILED adaptive_avg_pool2d/forward/float32/NCHW/thread_per_output" not in text
    first_error = text.split("FAILED", 1)[1]
    assert "error" in first_error
    if breakage == "error-in-a-function":
        # line numbers are those of the instantiation's own source
        line = broken[0].source.splitlines().index(BROKEN[breakage].strip()) + 1
        assert f'kernel.cu({line}): error' in first_error and "pool_tuner_undefined" in first_error


@needs_nvcc
def test_batched_and_single_compilation_agree():
    found, _ = compile_check.instantiations(archs=("sm_75",), ops=["adaptive_avg_pool3d"], directions=["forward"],
                                            dtypes=["float16"], variants=["block_per_row"])
    jobs = list(dict.fromkeys(compile_check.Job(i.arch, i.source, i.kernel_name) for i in found))[:3]
    batched = compile_check.compile_jobs(NVCC, jobs)
    single = [compile_check.compile_single(NVCC, job) for job in jobs]
    assert all(r.ok for r in batched + single)
    assert [(r.spill_stores, r.spill_loads) for r in batched] == [(r.spill_stores, r.spill_loads) for r in single]
