"""What the benchmark scripts share: interleaved rounds of ``pool_tuner.bench``'s loops, their
spread, the run's circumstances, tables and JSON.

Every timing is ``pool_tuner.bench.time_loop``: a loop of calls back to back, one wait at the end,
as an application calls.  The candidates of one comparison run in a fresh random order every
round, so a slow spell of a shared machine hits all of them; a comparison's ratio is taken both
from the medians and round by round (paired), whose spread says how far to trust it.  The
machine's load average is recorded before and after, because other work on it moves every number.
"""

from __future__ import annotations

import argparse

import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

import pool_tuner
from pool_tuner import bench
from pool_tuner.bench import Candidate
from pool_tuner.problem import LAYOUT_NAMES

@dataclasses.dataclass
class Timings:
    """Milliseconds per call of each candidate, one entry per round, and the calls of each loop."""

    ms: dict
    calls: dict

    def median(self, name: str) -> float:
        return float(np.median(self.ms[name]))

    def summary(self, name: str, scale: float = 1.0) -> dict:
        """``spread`` of ``name``'s times per call (milliseconds times ``scale``: 1e3 for
        microseconds), its calls per loop and every round's time."""
        values = [v * scale for v in self.ms[name]]
        return dict(spread(values), calls_per_loop=self.calls[name], rounds=values)

    def ratio(self, numerator: str, denominator: str) -> dict:
        """``numerator``'s time over ``denominator``'s: of the medians, and the spread of the
        round-by-round ratios (both loops of a round ran within moments of each other)."""
        paired = [a / b for a, b in zip(self.ms[numerator], self.ms[denominator])]
        return dict(spread(paired), of_medians=self.median(numerator) / self.median(denominator))


def device_input(device, x: np.ndarray, layout: str):
    """``x`` (logical channels-first) as an array of ``device`` in ``layout``'s memory order: for a
    channels-last layout, the channels-last memory seen with channels-first byte strides (the
    backend's ``strided_view``), as a library would hand pool_tuner such an array."""
    if layout == LAYOUT_NAMES[x.ndim - 2][0]:
        return device.to_device(x, device.queue)
    memory = device.to_device(np.ascontiguousarray(np.moveaxis(x, 1, -1)), device.queue)
    strides = np.moveaxis(np.empty(memory.shape, x.dtype), -1, 1).strides
    return device.arrays.strided_view(memory, x.shape, strides)


def spread(values) -> dict:
    """Median, quartiles and extremes of ``values``."""
    q1, median, q3 = np.percentile(values, [25, 50, 75])
    return {"median": float(median), "q1": float(q1), "q3": float(q3), "min": float(np.min(values)),
            "max": float(np.max(values)), "n": len(values)}


def calls_for(candidate: Candidate, loop_s: float, min_calls: int = 1, max_calls: int = 100_000) -> int:
    """Calls per loop so that one loop of ``candidate`` lasts about ``loop_s``: loops of 1, 2, 4, ...
    calls until one lasts a quarter of that, whose time per call sets the count (a loop of two
    calls misjudges calls of a few microseconds, or a queue that fills faster than it drains).
    Each count is timed twice and the faster taken, so that one stall of a busy machine does not
    stop the doubling early.  ``pool_tuner.bench.calls_per_loop`` does this for its fixed 50 ms
    loops of at least three calls; whole models need longer loops of fewer calls."""
    calls = 1
    while True:
        per_call_s = min(bench.time_loop(candidate, calls) for _ in range(2)) * 1e-3
        if per_call_s * calls >= loop_s / 4 or calls >= max_calls:
            break
        calls *= 2
    return int(min(max_calls, max(min_calls, round(loop_s / max(per_call_s, 1e-9)))))


def interleave(candidates: dict, rounds: int, loop_s: float, rng, min_calls: int = 1, warmup: int = 2) -> Timings:
    """Time every candidate of ``candidates`` (name -> Candidate) in ``rounds`` rounds of one loop
    each, the candidates in a fresh random order every round, after ``warmup`` calls of each
    (builds, first touches, allocator pools) and choosing each one's calls per loop."""
    names = list(candidates)
    for name in names:
        bench.time_loop(candidates[name], warmup)
    calls = {name: calls_for(candidates[name], loop_s, min_calls) for name in names}
    ms = {name: [] for name in names}
    for _ in range(rounds):
        for i in rng.permutation(len(names)):
            name = names[i]
            ms[name].append(bench.time_loop(candidates[name], calls[name]))
    return Timings(ms, calls)


def _git_commit(directory: Path) -> str | None:
    """The commit of the checkout holding ``directory``, with ``+dirty`` for uncommitted changes
    (None outside git)."""
    try:
        commit = subprocess.run(["git", "-C", str(directory), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(directory), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+dirty" if dirty else "")


def circumstances(torch=None, device=None) -> dict:
    """What a reader needs to judge the numbers: when, where, which pool_tuner (its files and commit:
    the scripts time whichever pool_tuner the interpreter imports), torch's threads, the device,
    PoCL's settings and the machine's load."""
    from pool_tuner import kernel_source

    source = Path(pool_tuner.__file__).resolve().parent
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "pool_tuner": {"version": pool_tuner.__version__, "path": str(source), "commit": _git_commit(source),
                       "kernels": str(kernel_source.kernel_dir())},
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("POCL_", "POOL_TUNER_", "OMP_"))},
        "load_average": list(os.getloadavg()),
    }
    if torch is not None:
        info["torch"] = {"version": torch.__version__, "threads": torch.get_num_threads(),
                         "interop_threads": torch.get_num_interop_threads()}
    if device is not None:
        info["device"] = device.info.describe()
        info["runtime_note"] = device.info.runtime_note
    return info


def record_end(info: dict) -> dict:
    """Add the load average at the end of the run to ``circumstances``' ``info``."""
    info["load_average_after"] = list(os.getloadavg())
    return info


def describe_circumstances(info: dict) -> str:
    """``circumstances`` as two lines for the top of a table."""
    pt = info["pool_tuner"]
    lines = [f"{info['date']}  {info['host']}  {info['cpus']} CPUs  python {info['python']}  "
             f"load average {' '.join(f'{v:.2f}' for v in info['load_average'])}",
             f"pool_tuner {pt['version']} from {pt['path']} (commit {pt['commit'] or 'unknown'}), kernels {pt['kernels']}"]
    extra = []
    if "torch" in info:
        t = info["torch"]
        extra.append(f"torch {t['version']}, {t['threads']} threads ({t['interop_threads']} inter-op)")
    if "device" in info:
        extra.append(f"device {info['device']}")
    if info.get("runtime_note"):
        extra.append(info["runtime_note"])
    if extra:
        lines.append("; ".join(extra))
    return "\n".join(lines)


def format_table(headers: list, rows: list) -> str:
    """Rows of cells under ``headers``; the first column left-aligned, the others right-aligned."""
    cells = [list(map(str, headers))] + [list(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for k, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt_spread(s: dict, scale: float = 1.0, digits: int = 1) -> str:
    """``median (q1-q3)`` of a ``spread``, times ``scale``."""
    return f"{s['median'] * scale:.{digits}f} ({s['q1'] * scale:.{digits}f}-{s['q3'] * scale:.{digits}f})"


#: The APIs the call-path scripts time: pool_tuner's numpy functions and its torch modules.
APIS = ("numpy", "torch")


def parser(doc: str) -> argparse.ArgumentParser:
    """A script's argument parser: its docstring's first paragraph as the description, the rest
    as the epilog of ``--help``."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog="\n\n".join(doc.split("\n\n")[1:]))


def choices(parser, text: str, allowed: tuple, option: str) -> list:
    """The comma-separated ``text`` of ``option``, each entry one of ``allowed`` (else a usage error)."""
    chosen = text.split(",")
    if set(chosen) - set(allowed):
        parser.error(f"{option} takes {', '.join(allowed)}")
    return chosen


def pocl_cache_states(parser, text: str, allowed: tuple) -> list:
    """``--pocl-cache``'s states in order, a cold run always before a ``disk`` one: the disk state
    loads what the cold run compiled."""
    states = choices(parser, text, allowed, "--pocl-cache")
    if "disk" in states and "cold" not in states:
        states.insert(states.index("disk"), "cold")
    return states


def add_output_argument(parser) -> None:
    parser.add_argument("--out", type=Path, help="also write the results as JSON to this file")


def finish(info: dict, report: dict, path: Path | None) -> int:
    """End a script's run: the load average at its end (printed and in ``info``), the report
    written to ``path`` (``write_json``); returns the exit status."""
    record_end(info)
    print(f"\nload average after: {' '.join(f'{v:.2f}' for v in info['load_average_after'])}")
    write_json(path, report)
    return 0


def write_json(path: Path | None, report: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
        print(f"\nwrote {path}", file=sys.stderr)
