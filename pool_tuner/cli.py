"""The ``pool-tuner`` command line: devices, tune, cache, explain, bench.

Every subcommand has ``--help``; any error is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import warnings
from pathlib import Path

from . import backends, cache, dispatch, fleet, kernel_source, presets
from .ops import explain
from .tuner import DEFAULT_TIME_LIMIT, check_search_options, check_tunable, tune
from .problem import DIRECTIONS, OPS, Problem
from .variants import get_variant, variants_for
from .version import __version__

EXIT_ERROR = 2
#: Exit status after Ctrl-C, as shells report a process ended by SIGINT (128 + 2).
EXIT_INTERRUPTED = 130
OP_NAMES = sorted(OPS)
#: ``tune``'s and ``explain``'s op where ``--op`` is not given.
DEFAULT_OP = "adaptive_avg_pool2d"
#: The library's names of the arguments that options set, as messages from below the CLI begin with them.
LIBRARY_NAMES = {"input_shape": "--input", "output_size": "--output", "dtype": "--dtype", "layout": "--layout"}
#: The same for ``fleet.tune_many``'s arguments (``tune --ray``).
FLEET_NAMES = {"device_filter": "--device-filter", "max_retries": "--max-retries", "ray_address": "--ray"}
#: ``--direction``'s values and the directions each runs: one of them, or ``both``.
DIRECTION_OPTION = {**{direction: (direction,) for direction in DIRECTIONS}, "both": DIRECTIONS}


#: The library's argument names that are no English words: named as options wherever they stand.
_IDENTIFIERS = ("input_shape", "output_size")


@contextlib.contextmanager
def _in_option_terms(names=LIBRARY_NAMES):
    """A ``TypeError``/``ValueError`` of the library raised in the block, in the terms of the
    command line (``names``: the library's argument names and the options that set them): the
    argument a message begins with (``dtype must be ...``, ``device must be ...``) and the names
    that are no words (``check output_size``) wherever they stand, named as the options."""
    try:
        yield
    except (TypeError, ValueError) as exc:
        names = {**names, "device": "--device"}
        text = re.sub(r"^(" + "|".join(map(re.escape, names)) + r")\b", lambda m: names[m.group(1)], str(exc))
        text = re.sub(r"\b(" + "|".join(n for n in _IDENTIFIERS if n in names) + r")\b", lambda m: names[m.group(1)],
                      text)
        raise (ValueError if isinstance(exc, ValueError) else TypeError)(text) from None


def _problem(op, shape, out, dtype, layout, direction, names=LIBRARY_NAMES) -> Problem:
    """``Problem.create`` with its errors in the terms of the command line (``_in_option_terms``;
    ``names``: ``shape_names`` for a shape of ``--shapes`` or ``--preset``)."""
    with _in_option_terms(names):
        return Problem.create(op, shape, out, dtype, layout, direction=direction)


def shape_names(args, i: int) -> dict:
    """``LIBRARY_NAMES`` for the ``i``-th shape that ``_shapes_from_args`` read: its input and
    output come from ``--input``/``--output``, from ``--shapes`` entry ``i`` or from ``--preset``."""
    if args.shapes is not None:
        return {**LIBRARY_NAMES, "input_shape": f"--shapes entry {i} input", "output_size": f"--shapes entry {i} output"}
    if args.preset is not None:
        return {**LIBRARY_NAMES, "input_shape": f"--preset {args.preset}", "output_size": f"--preset {args.preset}"}
    return LIBRARY_NAMES


def _check_positive(value, name: str) -> None:
    """Counts and sizes of the command line (``--repeat``) are positive integers."""
    if value is not None and value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}")


#: What an --output looks like, for messages.
OUTPUT_FORM = ("an output size such as 1x1, 56xNone (None keeps that size) or 7 (every pooled axis); for a pyramid op "
               "a comma-separated list of levels such as 1,2,3,6 or 1x1,2x2")


def parse_shape(text: str, name: str, output: bool | None = None) -> tuple:
    """``32x2048x7x7`` -> (32, 2048, 7, 7); output sizes (``output``, default: ``name`` is ``--output``)
    may hold ``None`` entries (``56xNone``), and a single number applies to every pooled axis
    (``--output 1``)."""
    output = name == "--output" if output is None else output
    entries = []
    for token in str(text).lower().split("x"):
        if token == "none" and output:
            entries.append(None)
            continue
        try:
            entries.append(int(token))
        except ValueError:
            form = OUTPUT_FORM if output else "an input shape such as 32x2048x7x7 (integers joined by 'x')"
            raise ValueError(f"{name} must be {form}, got {text!r}") from None
    check_sizes(entries, name, text, output=output)
    if output and len(entries) == 1 and entries[0] is not None:
        return entries[0]
    return tuple(entries)


def parse_output(text: str, op: str, name: str = "--output"):
    """An ``--output`` for ``op``: ``parse_shape``'s output size, or for a pyramid op a list of
    levels, comma-separated (``1,2,3,6``, ``1x1,2x2``)."""
    if not OPS[op].pyramid:
        if "," in str(text):
            raise ValueError(f"{name} {text!r} is a list of levels, which only the pyramid ops take "
                             f"(--op {', '.join(n for n in OP_NAMES if OPS[n].pyramid)}); {op} takes one output size "
                             f"such as 1x1")
        return parse_shape(text, name)
    return [parse_shape(level, name) for level in str(text).split(",")]


def check_sizes(entries, name: str, given, output: bool) -> None:
    """Input sizes must be >= 0 (0: an empty batch or channel axis, as the API allows; the library
    refuses a pooled axis of 0), output sizes (``output``) >= 0 (0: an empty output) or None (keep
    that size), checked here so that the message names the command-line option rather than the
    library argument."""
    if output:
        if any(e is not None and (not isinstance(e, int) or e < 0) for e in entries):
            raise ValueError(f"{name} sizes must be integers >= 0 or None (e.g. 1x1 or 56xNone), got {given!r}")
    elif any(not isinstance(e, int) or e < 0 for e in entries):
        raise ValueError(f"{name} sizes must be integers >= 0 (e.g. 32x2048x7x7), got {given!r}")


#: The largest ``--shapes`` file read: far more entries than anyone tunes in one run.
MAX_SHAPES_FILE_BYTES = 16 * 2**20


def _shapes_from_args(args) -> list:
    """``tune``'s shapes: ``(op, input shape, output size)`` of ``--input``/``--output`` (with
    ``--op``), of a ``--preset`` (whose layers name their ops) or of a ``--shapes`` file."""
    chosen = [a for a in ("input", "preset", "shapes") if getattr(args, a) is not None]
    if len(chosen) != 1:
        raise ValueError("give exactly one of --input/--output, --preset or --shapes")
    if args.output is not None and args.input is None:
        raise ValueError(f"--output goes with --input; --{chosen[0]} gives the output sizes")
    if args.preset is not None:
        if args.op is not None:
            raise ValueError("--op goes with --input/--output or --shapes; a --preset's layers name their own ops")
        return presets.preset_shapes(args.preset, "--preset")
    if args.shapes is not None:
        entries = _read_shapes_file(args.shapes)
        if not isinstance(entries, list) or not entries:
            raise ValueError(f'--shapes file {args.shapes} must hold a non-empty JSON list of '
                             f'{{"op": ..., "input": [...], "output": [...]}}')
        return [_shapes_entry(entry, i, args.op or DEFAULT_OP) for i, entry in enumerate(entries)]
    if args.output is None:
        raise ValueError("--input needs --output (e.g. --output 1x1)")
    op = args.op or DEFAULT_OP
    return [(op, parse_shape(args.input, "--input"), parse_output(args.output, op))]


def _read_shapes_file(name: str):
    """The JSON of ``--shapes`` file ``name``, refused by name where it is no regular file (a FIFO
    would block the command for good, a device such as /dev/zero never end), is larger than
    ``MAX_SHAPES_FILE_BYTES``, unreadable, not UTF-8 or not JSON (``cache.read_regular_file``, as
    the cache's own files are read)."""
    try:
        return json.loads(cache.read_regular_file(Path(name), MAX_SHAPES_FILE_BYTES).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--shapes {name}: {exc}") from None


def _shapes_entry(entry, i: int, op: str) -> tuple:
    """One ``--shapes`` entry as ``(op, input shape, output size)``: ``input`` and ``output`` take
    what ``--input`` and ``--output`` take, as JSON lists (``[2, 4, 30]``, ``[7, null]``), numbers
    (an output for every axis) or the options' text (``"2x4x30"``)."""
    name = f"--shapes entry {i}"
    if not isinstance(entry, dict) or "input" not in entry or "output" not in entry:
        raise ValueError(f'{name} must be an object with "input" and "output" (and optionally "op"), got {entry!r}')
    unknown = sorted(set(entry) - {"op", "input", "output"})
    if unknown:  # a "dtype" or "layout" here would otherwise be dropped and float32 tuned in silence
        raise ValueError(f'{name} has unknown keys {unknown}: an entry takes "input", "output" and "op" (--dtype and '
                         f'--layout apply to every entry)')
    sizes = []
    for field, output in (("input", False), ("output", True)):
        value = entry[field]
        if isinstance(value, str):
            value = parse_shape(value, f"{name} {field}", output)
        elif isinstance(value, int) and not isinstance(value, bool) and output:
            check_sizes([value], f"{name} output", value, output=True)
        elif isinstance(value, list):
            check_sizes(value, f"{name} {field}", value, output=output)
            value = tuple(value)
        else:
            raise ValueError(f"{name} {field} must be a list of sizes{', a number' if output else ''} or text "
                             f"like {'1x1' if output else '2x4x30'}, got {value!r}")
        sizes.append(value)
    return entry.get("op", op), sizes[0], sizes[1]


def cmd_devices(args) -> int:
    if args.ray_resources:  # for `ray start --resources "$(pool-tuner devices --ray-resources)"`
        print(json.dumps(fleet.node_resources()))
        return 0
    default = backends.default_device()
    devices = backends.all_devices()
    width = max(len(d.info.id) for d in devices)
    for device in devices:
        marks = ["default"] if device is default else []
        if device.info.is_simulator:
            marks.append("simulator, never chosen by default")
        suffix = f"  ({', '.join(marks)})" if marks else ""
        print(f"{device.info.id:{width}s}  {device.info.name}  [{device.info.platform_name}]{suffix}")
    for note in dict.fromkeys(d.info.runtime_note for d in devices if d.info.runtime_note):
        print(note)
    return 0


def _format_ms(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def cmd_tune(args) -> int:
    from tqdm import tqdm

    if args.ray is not None:
        if args.device is not None:
            raise ValueError("--device names a device of this machine; with --ray the cluster's devices tune "
                             "(choose among them with --device-filter)")
        fleet.require_ray("--ray")
    elif args.device_filter is not None or args.max_retries is not None:
        raise ValueError("--device-filter and --max-retries need --ray (fleet tuning on a Ray cluster)")
    check_search_options(args.strategy, args.max_fevals, args.time_limit,
                         names=("--strategy", "--max-fevals", "--time-limit"))
    shapes = _shapes_from_args(args)
    device = None if args.ray is not None else backends.resolve_device(args.device, "--device")
    directions = DIRECTION_OPTION[args.direction]
    jobs = []
    for i, (op, shape, out) in enumerate(shapes):
        for direction in directions:
            if not variants_for(op, direction):  # a pass that runs its op's own kernel (GeM's backward)
                what = f"{op} {direction} runs its own kernel ({OPS[op].backward_kernel}) in one configuration"
                if len(directions) == 1:  # asked for that pass alone
                    raise ValueError(f"--direction {args.direction}: {what}: nothing to tune")
                print(f"{what}: nothing to tune there, skipped", file=sys.stderr)
                continue
            jobs.append((op, shape, out, direction, shape_names(args, i)))
    variant_names = args.variants.split(",") if args.variants else None
    problems = {}  # every argument checked before any tuning starts
    for op, shape, out, direction, names in jobs:
        problem = _problem(op, shape, out, args.dtype, args.layout, direction, names)
        if problem.is_empty:
            raise ValueError(f"{names['output_size']} {out!r} gives an empty output {problem.output_shape} for "
                             f"{names['input_shape']} {'x'.join(map(str, shape))}: nothing to tune")
        for name in variant_names or ():
            get_variant(op, name, direction, argument="--variants")
        if device is not None:  # on Ray each worker's own device checks it
            table = variants_for(op, direction)
            check_tunable(problem, device, [table[name] for name in variant_names or table],
                          names=(names["input_shape"], names["output_size"], "--variants"))
        # one job per problem: e.g. coord_attention's 56xNone and Nonex56 on 56x56 inputs
        problems.setdefault(problem, (op, shape, out, direction))
    jobs = list(problems.values())
    if args.ray is not None:
        return _tune_on_ray(args, list(problems), variant_names)
    steps = sum(len(variant_names or variants_for(op, d)) for op, _, _, d in jobs)
    failed = finished = cut_short = 0
    try:
        with tqdm(total=steps, desc="tuning", unit="variant", disable=args.quiet, file=sys.stderr) as bar:
            for op, shape, out, direction in jobs:
                bar.set_postfix_str(f"{op} {direction} {'x'.join(map(str, shape))}")
                result = tune(op, shape, out, args.dtype, args.layout, device, direction=direction,
                              variants=variant_names, strategy=args.strategy, max_fevals=args.max_fevals,
                              time_limit=args.time_limit, progress=lambda _name: bar.update(1))
                bar.clear()
                print(_result_table(result))
                failed += sum(len(v.failures) for v in result.variants)
                cut_short += sum(v.cut_short for v in result.variants)
                finished += 1
    except KeyboardInterrupt as stop:  # what was kept, for main's one line
        kept = f"{finished} of {len(jobs)} tuning jobs finished and kept in {dispatch.tuning_cache().path()}"
        raise KeyboardInterrupt(f"{kept}; {stop}" if str(stop) else kept) from None
    print(f"cache: {dispatch.tuning_cache().path()}")
    if failed:
        print(f"{failed} configurations failed to compile, launch or verify and were skipped (see the cache records)")
    if cut_short:
        print(f"{cut_short} variant searches were cut short by the time limit before their budget of configurations "
              f"(--time-limit, default {DEFAULT_TIME_LIMIT:g} s per variant)")
    return 0


def _tune_on_ray(args, problems: list, variant_names) -> int:
    """``tune --ray``: the problems on the devices of a Ray cluster (``fleet.tune_many``); the run's
    summary on stdout, and exit status 2 where a tuning failed."""
    max_retries = fleet.DEFAULT_MAX_RETRIES if args.max_retries is None else args.max_retries
    try:
        report = fleet.tune_many(problems, ray_address=None if args.ray == "local" else args.ray,
                                 device_filter=args.device_filter, variants=variant_names, strategy=args.strategy,
                                 max_fevals=args.max_fevals, time_limit=args.time_limit, max_retries=max_retries,
                                 progress=not args.quiet)
    except (TypeError, ValueError) as exc:  # in the terms of the command line
        pattern = r"^(" + "|".join(map(re.escape, FLEET_NAMES)) + r")\b"
        raise type(exc)(re.sub(pattern, lambda m: FLEET_NAMES[m.group(1)], str(exc))) from None
    print(report.summary())
    failed = sum(not o.tuned for o in report.outcomes)
    if failed:
        raise RuntimeError(f"{failed} of {len(report.outcomes)} fleet tunings failed (see the summary above)")
    return 0


def _result_table(result) -> str:
    p = result.problem
    lines = [f"\n{p.op} {p.direction} {p.dtype} {p.layout} {'x'.join(map(str, p.input_shape))} -> {'x'.join(map(str, p.output_shape))}"
             f"  on {result.device}  ({result.seconds:.1f} s)",
             f"  {'variant':20s} {'kernel ms':>10s} {'evaluated':>9s} {'failed':>6s}  params"]
    for v in result.variants:
        if v.not_applicable:
            lines.append(f"  {v.variant:20s} {'-':>10s}  not applicable: {v.not_applicable}")
            continue
        mark = "  <- winner" if v.variant == result.best_variant else ""
        mark += "  (search cut short by the time limit)" if v.cut_short else ""
        lines.append(f"  {v.variant:20s} {_format_ms(v.best_time_ms):>10s} {v.evaluated:9d} {len(v.failures):6d}"
                     f"  {v.best_params if v.best_params else 'none ran correctly'}{mark}")
    lines.append("  kernel ms: the kernel alone (median of its launches, timed by OpenCL events); a library call "
                 "adds its dispatch and any host transfers")
    default = f"the default {result.default_variant} {result.default_params} ({result.default_time_ms:.4f} ms)"
    if result.kept_default:
        verdict = f"{default} is the best configuration found: kept"
    elif result.speedup_over_default >= 1:
        verdict = f"tuned: {result.speedup_over_default:.2f}x faster than {default}"
    else:  # the default's variant was not among those searched (--variants)
        verdict = (f"tuned among the variants asked for: {1 / result.speedup_over_default:.2f}x slower than {default}, "
                   f"whose variant was not searched")
    lines.append(f"  {verdict}" + ("" if result.stored else f"  (NOT stored: {result.not_stored})"))
    return "\n".join(lines)


def cmd_cache(args) -> int:
    if args.action != "merge" and (args.files or args.into is not None):
        extra = args.files + ([f"--into {args.into}"] if args.into is not None else [])
        raise ValueError(f"cache {args.action} takes no files or --into, got {' '.join(extra)!r}")
    table = dispatch.tuning_cache()
    if args.action == "path":
        print(f"user cache:    {table.path()}")
        print(f"shipped cache: {kernel_source.shipped_cache_dir()}")
    elif args.action == "show":
        def order(record):  # a shape's forward and backward records side by side
            p = record["problem"]
            return p["op"], p["dtype"], p["layout"], p["input_shape"], p["output_shape"], p["direction"]

        device = backends.resolve_device(args.device, "--device")
        records = sorted(table.records().values(), key=order)
        tiers = [dispatch.record_tier(r, device) for r in records]
        if records:
            print(f"{'op':20s} {'pass':8s} {'dtype':8s} {'layout':6s} {'input':>18s}    {'output':16s} {'variant':18s}"
                  f" {'kernel ms':>12s}  {'class':11s} {'applies':12s}  params  [device, version]")
        for r, tier in zip(records, tiers):
            p, best = r["problem"], r["best"]
            print(f"{p['op']:20s} {p['direction']:8s} {p['dtype']:8s} {p['layout']:6s}"
                  f" {'x'.join(map(str, p['input_shape'])):>18s} -> {'x'.join(map(str, p['output_shape'])):<16s}"
                  f" {best['variant']:18s} {best['time_ms']:9.4f} ms  {cache.problem_of(r).problem_class:11s}"
                  f" {tier:12s}  {json.dumps(best['params'])}"
                  f"  [{r['device'].get('name', '?')}, {r['device'].get('version', '?')}]" + _partial_note(r))
        print(_applies_summary(tiers, device))
        print(f"{len(records)} records (user cache {table.path()}, shipped {kernel_source.shipped_cache_dir()})")
    elif args.action == "clear":
        table.clear()
        print(f"cleared {table.path()}")
    elif args.action == "merge":
        if not args.files:
            raise ValueError("cache merge needs at least one cache file to merge")
        sources = [Path(f) for f in args.files]
        if args.into:
            count = cache.merge_files(sources, Path(args.into))
            print(f"merged {count} records into {args.into}")
        else:
            count = table.merge(sources)
            print(f"merged {count} records into {table.path()}")
    return 0


def _applies_summary(tiers: list, device) -> str:
    """``cache show``'s count of the records by how they apply to ``device`` (``dispatch.record_tier``)."""
    applying = sum(tier in cache.TIERS for tier in tiers)
    by_tier = ", ".join(f"{tiers.count(tier)} {words}" for tier, words in cache.TIERS.items())
    others = ", ".join(f"{tiers.count(reason)} {words}" for reason, words in NOT_APPLYING.items())
    return f"{len(tiers)} records, {applying} apply to {device.info.describe()}: {by_tier}; not applying: {others}"


#: ``cache show``'s words for the records that apply to no problem on the device (``dispatch.record_tier``).
NOT_APPLYING = {"other device": "other devices", "stale": "stale (kernel code changed)",
                "illegal": "not legal on this device"}


def _partial_note(record) -> str:
    """What an interrupted tuning's record covered (nothing for a full tuning)."""
    if not cache.is_partial(record):
        return ""
    partial = record["partial"]
    cut = partial.get("variant_interrupted")
    return (f"  PARTIAL (tuning interrupted): {len(partial.get('variants_searched', []))} variants searched"
            + (f", {cut} cut short" if cut else "")
            + f", {len(partial.get('variants_not_searched', []))} not searched")


def cmd_explain(args) -> int:
    shape, out = parse_shape(args.input, "--input"), parse_output(args.output, args.op)
    _problem(args.op, shape, out, args.dtype, args.layout, args.direction)
    with _in_option_terms():
        info = explain(args.op, shape, out, args.dtype, args.layout, args.device, direction=args.direction)
    print(json.dumps(info, indent=2))
    return 0


def cmd_bench(args) -> int:
    from . import bench

    names = args.preset.split(",") if args.preset is not None else None
    bench.suite(names, "--preset")  # validates the names before any work
    _check_positive(args.repeat, "--repeat")
    _check_positive(args.torch_threads, "--torch-threads")
    _check_positive(args.stream_mib, "--stream-mib")
    out = Path(args.out) if args.out is not None else default_bench_dir()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {args.out}: cannot create the directory ({exc.strerror or exc})") from None
    if not os.access(out, os.W_OK):
        raise ValueError(f"--out {args.out}: the directory is not writable")
    directions = DIRECTION_OPTION[args.direction]
    with _in_option_terms({**LIBRARY_NAMES, "input_shape": "--preset", "output_size": "--preset"}):
        report = bench.run(names, directions, args.device, args.repeat, args.torch_threads,
                           progress=None if args.quiet else _print_bench_row, tune_untuned=args.tune_untuned,
                           dtype=args.dtype, rows_path=out / bench.ROWS_FILE,
                           **({} if args.stream_mib is None else {"stream_bytes": args.stream_mib * 2**20}))
    print(bench.format_table(report))
    if bench.load_warning(report):
        warnings.warn(bench.load_warning(report))
    json_path, png_path = bench.save(report, out)
    print(f"wrote {json_path}" + (f" and {png_path}" if png_path else " (no plot: matplotlib not installed)"))
    return 0


def _print_bench_row(row) -> None:
    """A line on stderr for each problem as soon as it is measured."""
    shape = "x".join(map(str, row.input_shape)) + "->" + "x".join(map(str, row.output_shape))
    print(f"  {row.name} {shape} {row.direction}: pool_tuner {row.tuned_ms:.4f} ms, PyTorch {row.torch_ms:.4f} ms "
          f"({row.torch_ms / row.tuned_ms:.2f}x)", file=sys.stderr, flush=True)


def default_bench_dir() -> Path:
    """Where ``bench`` writes by default: the user's data directory for pool-tuner (a clone's
    tracked files stay untouched)."""
    import platformdirs

    return Path(platformdirs.user_data_dir("pool-tuner")) / "bench"


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line too, like every other error of the command."""

    def error(self, message):
        self.exit(EXIT_ERROR, f"pool-tuner: error: {message} (see {self.prog} --help)\n")


def cmd_compile_check(args) -> int:
    from . import compile_check

    return compile_check.run(args.arch or compile_check.ARCHS, ops=args.op, directions=args.direction,
                             dtypes=args.dtype, variants=args.variant, tier=args.tier, jobs=args.jobs,
                             batch_size=args.batch_size, nvcc=args.nvcc)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pool-tuner", description="Autotuned adaptive pooling kernels.")
    parser.add_argument("--version", action="version", version=f"pool-tuner {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("devices", help="list the devices pool_tuner can use")
    p.add_argument("--ray-resources", action="store_true",
                   help="print this machine's devices as Ray custom resources, for a node of a fleet: "
                        "ray start ... --resources \"$(pool-tuner devices --ray-resources)\"")
    p.set_defaults(run=cmd_devices)

    p = sub.add_parser("tune", help="tune shapes on a device and store the winners in the cache")
    p.add_argument("--op", choices=OP_NAMES, metavar="OP",
                   help=f"the op of --input/--output, or of --shapes entries that name none: {', '.join(OP_NAMES)} "
                        f"(default {DEFAULT_OP})")
    p.add_argument("--input", help="input shape, sizes joined by 'x', e.g. 32x2048x7x7 (batch and channels may be 0)")
    p.add_argument("--output", help=f"output size: {OUTPUT_FORM}")
    p.add_argument("--preset", help=f"model-layer preset: {', '.join(sorted(presets.PRESETS) + sorted(presets.FUSED_PRESETS))} "
                                    f"or all (the single-level ones)")
    p.add_argument("--shapes", help='JSON file: [{"op": ..., "input": [...], "output": [...]}, ...]')
    p.add_argument("--dtype", default="float32", help="float32 (default), float64, float16 or bfloat16")
    p.add_argument("--layout", help="memory layout, e.g. NCHW (default, contiguous) or NHWC (channels-last)")
    p.add_argument("--direction", choices=list(DIRECTION_OPTION), default="both",
                   help="which passes to tune (default both)")
    p.add_argument("--device", help="device id (see `pool-tuner devices`)")
    p.add_argument("--variants", help="comma-separated variants to tune (default all)")
    p.add_argument("--strategy", help="Kernel Tuner strategy (default brute_force for small spaces, else random_sample)")
    p.add_argument("--max-fevals", type=int, help="configurations per variant for sampling strategies")
    p.add_argument("--time-limit", type=float, help="seconds per variant for sampling strategies")
    p.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="tune on the devices of a Ray cluster: ADDRESS is 'auto' (the cluster started on this "
                        "machine) or host:port; without ADDRESS a local cluster of this machine's devices "
                        '(needs pip install "pool-tuner[ray]")')
    p.add_argument("--device-filter", metavar="TERMS",
                   help="with --ray: the device models to tune on, comma-separated fingerprint hashes, device "
                        "types (cpu, gpu) or parts of device names (default every model in the cluster)")
    p.add_argument("--max-retries", type=int, metavar="N",
                   help=f"with --ray: how often a task whose node died is run again on another node with the same "
                        f"device model (default {fleet.DEFAULT_MAX_RETRIES})")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_tune)

    p = sub.add_parser("cache", help="inspect or maintain the tuning cache")
    p.add_argument("action", choices=["show", "path", "clear", "merge"],
                   help="show: list the records and whether each applies to the device; path: where the caches "
                        "are; clear: delete the user cache; "
                        "merge: fold other cache files in")
    p.add_argument("files", nargs="*", help="for merge: cache files (records.json) to merge")
    p.add_argument("--into", help="for merge: destination file (default: the user cache)")
    p.add_argument("--device", help="for show: the device the records are matched against (default: the default "
                                    "device)")
    p.set_defaults(run=cmd_cache)

    p = sub.add_parser("bench", help="benchmark the suite against PyTorch and the copy-bandwidth floor",
                       description='Benchmark the suite against PyTorch and the copy-bandwidth floor. Needs PyTorch '
                                   '(pip install "pool-tuner[bench]"), which it times beside pool_tuner.')
    p.add_argument("--preset", help="comma-separated presets, 'untuned' for shapes no preset tunes "
                                    "(default: every preset and the untuned shapes)")
    p.add_argument("--direction", choices=list(DIRECTION_OPTION), default="both",
                   help="which passes to benchmark (default both)")
    p.add_argument("--device", help="device id (see `pool-tuner devices`)")
    p.add_argument("--dtype", default="float32", help="element type of every shape: float32 (default), float16 or "
                                                       "float64")
    p.add_argument("--repeat", type=int, default=15, help="interleaved rounds of timed loops per shape (medians reported)")
    p.add_argument("--torch-threads", type=int, help="torch.set_num_threads for the PyTorch side")
    p.add_argument("--stream-mib", type=int,
                   help="MiB of each bandwidth stream's buffers (default: enough to measure memory, not caches; a "
                        "small one makes a quick check, whose floors are a cache's)")
    p.add_argument("--out", help=f"directory for bench.json and bench.png, and bench_rows.jsonl, each problem's row "
                                 f"as soon as it is measured (default {default_bench_dir()}, outside any clone)")
    p.add_argument("--quiet", action="store_true", help="no per-shape progress lines on stderr")
    p.add_argument("--tune-untuned", action="store_true",
                   help="also tune each untuned shape in the run (not stored) and time its winner beside dispatch's "
                        "choice: how close the default rules and nearest records come to tuning")
    p.set_defaults(run=cmd_bench)

    p = sub.add_parser("explain", help="show which kernel a call would dispatch to, and why")
    p.add_argument("--op", default=DEFAULT_OP, choices=OP_NAMES, metavar="OP",
                   help=f"the op: {', '.join(OP_NAMES)} (default adaptive_avg_pool2d)")
    p.add_argument("--input", required=True, help="input shape, sizes joined by 'x', e.g. 32x2048x7x7 (batch and channels may be 0)")
    p.add_argument("--output", required=True, help=f"output size: {OUTPUT_FORM}")
    p.add_argument("--dtype", default="float32", help="float32 (default), float64, float16 or bfloat16")
    p.add_argument("--layout", help="memory layout, e.g. NCHW (default, contiguous) or NHWC (channels-last)")
    p.add_argument("--direction", choices=["forward", "backward"], default="forward",
                   help="which pass to explain (default forward)")
    p.add_argument("--device", help="device id (see `pool-tuner devices`; default: the default device)")
    p.set_defaults(run=cmd_explain)

    p = sub.add_parser("compile-check", help="compile every kernel instantiation with nvcc (no GPU needed): "
                                             "no warnings, no local-memory spills")
    p.add_argument("backend", choices=["cuda"], help="the backend whose kernels to compile")
    p.add_argument("--arch", action="append", help="target architecture, repeatable (default sm_75, sm_80, sm_90)")
    p.add_argument("--op", action="append", choices=OP_NAMES, metavar="OP",
                   help=f"only this op ({', '.join(OP_NAMES)}), repeatable (default every op)")
    p.add_argument("--direction", action="append", help="only this direction (forward/backward), repeatable")
    p.add_argument("--dtype", action="append", help="only this dtype, repeatable (default every dtype)")
    p.add_argument("--variant", action="append", help="only this variant, repeatable (default every variant)")
    p.add_argument("--tier", choices=["exhaustive", "core"], default="exhaustive",
                   help="exhaustive (default): every instantiation for every architecture; core (the CI's): "
                        "each op/direction/layout/variant/configuration/problem once, in a rotating dtype and "
                        "architecture, float64 at the largest configurations, and the helper programs")
    p.add_argument("--jobs", type=int, default=2, help="parallel nvcc runs (default 2)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="instantiations per nvcc run (default 32; 1 compiles each alone)")
    p.add_argument("--nvcc", help="nvcc to use (default: PATH, $CUDA_HOME, /usr/local/cuda, pip nvidia-cuda-nvcc)")
    p.set_defaults(run=cmd_compile_check)
    return parser


def _print_warning(message, category, filename, lineno, file=None, line=None):
    """A warning as one line, like the command's errors: what happened, not where in pool_tuner's
    source it was raised (``warnings.showwarning`` while the command runs).  Through tqdm, so that an
    active progress bar is redrawn below it instead of being broken."""
    from tqdm import tqdm

    tqdm.write(f"pool-tuner: warning: {message}", file=sys.stderr)


def _attach_dash_values(argv: list) -> list:
    """``--output -3x3`` as ``--output=-3x3``: argparse takes a value that begins with '-' (other than
    a plain negative number) for an option and stops with "expected one argument"; attached, the
    value reaches the option's own check and its message."""
    joined, i = [], 0
    while i < len(argv):
        token = argv[i]
        if (token.startswith("--") and "=" not in token and i + 1 < len(argv)
                and re.match(r"-(\d|\.|nan|inf)", argv[i + 1], re.IGNORECASE)):
            joined.append(f"{token}={argv[i + 1]}")
            i += 2
        else:
            joined.append(token)
            i += 1
    return joined


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(_attach_dash_values(argv))
    with warnings.catch_warnings():
        warnings.showwarning = _print_warning
        try:
            return args.run(args)
        except (ValueError, TypeError, OSError, RuntimeError) as exc:
            print(f"pool-tuner: error: {exc}", file=sys.stderr)
            return EXIT_ERROR
        except KeyboardInterrupt as stop:  # Ctrl-C: one line saying what was kept, no traceback
            print("pool-tuner: interrupted" + (f": {stop}" if str(stop) else ""), file=sys.stderr)
            return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
