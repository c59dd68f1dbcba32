"""Whether the programs that the shipped tuning records stand for are the same, token for token, on
two kernel trees: the evidence on which a record's kernel hash may be re-stamped after an edit of
the kernel files that leaves its programs as they were.

A record's kernel hash (``cache.kernel_hash``) is the sha256 of the files of every variant that its
device could have chosen for its problem's op, direction and layout, so any edit of those files --
even one that changes no program of the record's op, such as a macro that expands to nothing
outside GeM -- makes the record a miss.  What a record measured is the programs built from those
files.  This script renders them and fingerprints what the compiler reads:

* the programs: for every shipped record (``tuning_cache/*.json``), every variant that its kernel
  hash covers and that is legal for its problem (``Variant.refusal``), each with its representative
  configurations (``Variant.representative_configurations``: default, smallest, largest, the last
  of two passes) and with the record's own best, default and runner-up configurations where they
  are that variant's, each pass of each (``Variant.second_pass``), rendered by ``Variant.program``,
  as every build renders them;
* the fingerprint: each program run through the C preprocessor (``cpp -P``, comments dropped) in
  both flavours the prelude has -- OpenCL C (``__OPENCL_VERSION__`` defined) and CUDA
  (``__CUDACC__`` defined, its system ``#include`` lines kept as text, since they are not here to
  read) -- and its tokens, whitespace dropped, hashed.  Equal fingerprints are equal programs
  token for token.

Each tree is fingerprinted by the tree's own ``pool_tuner`` (its own defines, search spaces and
legality), so the script is run once per tree, with ``PYTHONPATH`` naming it::

    git archive 4cbb3cc | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base python benchmarks/program_identity.py fingerprint --out /tmp/base.json
    PYTHONPATH=$PWD python benchmarks/program_identity.py fingerprint --out /tmp/head.json
    PYTHONPATH=$PWD python benchmarks/program_identity.py restamp /tmp/base.json /tmp/head.json

``restamp`` gives each shipped record whose every program has the same fingerprint on both trees
the kernel hash (and key) of the current tree, leaves every other record as it is and names it, and
writes the current tree's fingerprints of the records to ``SHIPPED_PROGRAMS``, from which
``tests/test_shipped_cache.py`` checks that the programs of the shipped records are still the ones
they measured.  A record tuned afresh gets its fingerprint the same way (``fingerprint --out
benchmarks/shipped_programs.json`` once the tree's records are current).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The fingerprints of the shipped records' programs (``fingerprint``'s output for the current tree).
SHIPPED_PROGRAMS = ROOT / "benchmarks" / "shipped_programs.json"
#: The preprocessor's defines of each flavour of the prelude (kernels/prelude.h).
FLAVOURS = {"opencl": ("-D__OPENCL_VERSION__=120",), "cuda": ("-D__CUDACC__",)}
#: The launch limits the legality of configurations is judged under: a CUDA GPU's (the same on every
#: architecture since compute capability 2.0) and PoCL's on a CPU.
LIMITS = {"gpu": dict(max_work_group_size=1024, local_mem_size=48 * 1024),
          "cpu": dict(max_work_group_size=4096, local_mem_size=1024 * 1024)}
_DEFINED = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)", re.MULTILINE)
_BOUNDARY = "__program_boundary__"
_SYSTEM_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*(<[^>\n]+>)[ \t]*$", re.MULTILINE)
_TOKEN = re.compile(r"""[A-Za-z_]\w*|\.?\d(?:[eEpP][+-]|[\w.])*|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'"""
                    r"""|->|\+\+|--|<<=?|>>=?|[<>!=]=|&&|\|\||[-+*/%&|^]=|##?|\S""")


def preprocessor() -> str | None:
    """The C preprocessor: ``cpp``, else ``gcc``/``clang`` (with ``-E``); None where none is here."""
    for name in ("cpp", "gcc", "clang"):
        if shutil.which(name):
            return name
    return None


def preprocessed_tokens(programs: list, flavour: str) -> list:
    """The tokens of each of ``programs`` as the compiler of ``flavour`` reads them after
    preprocessing.  One preprocessor run reads them all, one after another, each followed by a
    boundary token and by ``#undef`` lines for every macro it defines, so that each is read as it
    would be alone (kernel_source.render_together's way)."""
    tool = preprocessor()
    if tool is None:
        raise RuntimeError("no C preprocessor (cpp, gcc or clang) on PATH")
    parts = []
    for program in programs:
        parts.append(_SYSTEM_INCLUDE.sub(lambda m: f"__system_include__ {m.group(1)}", program))
        parts.append(f"\n{_BOUNDARY}\n")
        parts += [f"#undef {name}\n" for name in dict.fromkeys(_DEFINED.findall(program))]
    command = [tool] + ([] if tool == "cpp" else ["-E"]) + ["-P", "-x", "c", "-undef", "-nostdinc",
                                                          *FLAVOURS[flavour], "-"]
    done = subprocess.run(command, input="".join(parts), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
    result, current = [], []
    for token in _TOKEN.findall(done.stdout):
        if token == _BOUNDARY:
            result.append(current)
            current = []
        else:
            current.append(token)
    assert len(result) == len(programs) and not current, "a program swallowed its boundary"
    return result


def digests(programs: list) -> list:
    """The fingerprint of each of ``programs``: sha256 over its preprocessed tokens in every flavour."""
    hashes = [hashlib.sha256() for _ in programs]
    for flavour in FLAVOURS:
        for h, program_tokens in zip(hashes, preprocessed_tokens(programs, flavour)):
            h.update(flavour.encode() + b"\0" + "\n".join(program_tokens).encode() + b"\0")
    return [h.hexdigest() for h in hashes]


def shipped_records() -> dict:
    """key -> record of every file of the shipped database, as written."""
    records = {}
    for path in sorted((ROOT / "tuning_cache").glob("*.json")):
        records.update(json.loads(path.read_text())["records"])
    return records


def record_programs(record: dict) -> dict:
    """label -> rendered program of every program that ``record``'s kernel hash stands for (module
    docstring), labelled ``variant params [pass]``."""
    from pool_tuner import cache
    from pool_tuner.backends.base import DeviceLimits
    from pool_tuner.problem import Problem
    from pool_tuner.variants import variants_for

    p = record["problem"]
    problem = Problem(p["op"], p["direction"], p["dtype"], p["layout"], tuple(p["input_shape"]),
                      tuple(p["output_shape"]))
    kind = cache.device_type(record["device"])
    limits = DeviceLimits(device_type=kind, **LIMITS[kind])
    layout = cache.layout_of(problem)
    own = [record["best"], *([record["default"]] if "default" in record else []), *record.get("runners_up", [])]
    programs = {}
    for variant in variants_for(problem.op, problem.direction).values():
        if kind not in variant.device_types or layout not in variant.layouts:
            continue  # outside the kernel hash
        configs = list(variant.representative_configurations(problem, limits).values())
        configs += [entry["params"] for entry in own if entry["variant"] == variant.name]
        for params in configs:
            label = f"{variant.name} {json.dumps(params, sort_keys=True)}"
            programs[label] = variant.program(params, problem)
            second = variant.second_pass(params, problem)
            if second is not None:
                programs[label + " second pass"] = variant.program(params, problem, second[2])
    return programs


def fingerprint(records: dict) -> dict:
    """key -> {label: fingerprint} for every record of ``records`` (identical programs, as the same
    problem on two CPU models has, are preprocessed once)."""
    programs = {key: record_programs(record) for key, record in sorted(records.items())}
    unique = list(dict.fromkeys(text for labelled in programs.values() for text in labelled.values()))
    fingerprints = dict(zip(unique, digests(unique)))
    return {key: {label: fingerprints[text] for label, text in labelled.items()} for key, labelled in programs.items()}


def differences(base: dict, head: dict) -> dict:
    """key -> the labels whose fingerprints differ (or that only one side has), for every record of
    ``base`` whose programs are not all the same on ``head``."""
    changed = {}
    for key, programs in base.items():
        other = head.get(key, {})
        labels = sorted(label for label in set(programs) | set(other) if programs.get(label) != other.get(label))
        if labels:
            changed[key] = labels
    return changed


def restamp(base: dict, head: dict) -> tuple[list, dict]:
    """Give every shipped record whose programs are the same on both trees the current kernel hash
    and key, in its own file; return (re-stamped keys, {left key: differing labels})."""
    from pool_tuner import cache
    from pool_tuner.problem import Problem

    changed = differences(base, head)
    done = []
    for path in sorted((ROOT / "tuning_cache").glob("*.json")):
        data = json.loads(path.read_text())
        records = {}
        for key, record in data["records"].items():
            if key in changed or key not in base:
                records[key] = record
                continue
            p = record["problem"]
            problem = Problem(p["op"], p["direction"], p["dtype"], p["layout"], tuple(p["input_shape"]),
                              tuple(p["output_shape"]))
            code = cache.record_kernel_hash(problem, record["device"])
            new_key = cache.make_key(problem, record["device"], code)
            records[new_key] = {**record, "kernel_hash": code, "key": new_key}
            done.append(new_key)
        data["records"] = dict(sorted(records.items()))
        path.write_text(json.dumps(data, indent=1, sort_keys=True))
    return done, changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    out = commands.add_parser("fingerprint", help="fingerprint the shipped records' programs of the tree on PYTHONPATH")
    out.add_argument("--out", type=Path, required=True)
    stamp = commands.add_parser("restamp", help="re-stamp the records whose programs are the same on both trees")
    stamp.add_argument("base", type=Path, help="fingerprints of the tree the records were tuned on")
    stamp.add_argument("head", type=Path, help="fingerprints of the current tree")
    args = parser.parse_args(argv)
    if args.command == "fingerprint":
        args.out.write_text(json.dumps(fingerprint(shipped_records()), indent=1, sort_keys=True) + "\n")
        return 0
    base, head = json.loads(args.base.read_text()), json.loads(args.head.read_text())
    done, changed = restamp(base, head)
    current = fingerprint(shipped_records())
    SHIPPED_PROGRAMS.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
    print(f"re-stamped {len(done)} records; left {len(changed)} whose programs changed:")
    for key, labels in changed.items():
        print(f"  {key}: {', '.join(labels)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
