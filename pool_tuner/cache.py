"""The tuning cache: the best configuration found for each (problem, device, kernel code).

Cache identity lives here: ``kernel_hash`` (the kernel code of an op and direction) and
``cache_key`` (problem, device fingerprint and kernel hash; ``make_key`` builds the text).

This is pool_tuner's own cache, not Kernel Tuner's cache file: Kernel Tuner's file knows nothing of
kernel sources and has no locking.  Each record is one JSON object, keyed by ``make_key``; a cache
file (``records.json``) is ``{"schema": SCHEMA_VERSION, "records": {key: record, ...}}``.

Two places hold records: a read-only database shipped in the package (every ``*.json`` file of its
directory) and the user's cache file, which overlays it (for the same key the user's record wins).
Both are read once, lazily, into an in-memory table; lookups never touch the file system again.

Records travel: a record keeps its device's whole fingerprint, and ``device_tier`` says how that
device relates to another -- the same device (``exact``), the same model under another driver or
compiler target (``model``), the same family (``family``) -- so that dispatch can use records tuned
elsewhere (design.md, Tuning cache).  ``TuningCache.matches`` hands dispatch the records of a
problem's op, direction, dtype, layout and rank, for the current kernel code, that apply to a
device, each with its tier.

Failure policy: a tuning run must never be lost to, or crash on, a cache problem.  A corrupt or
truncated file, a file of another schema version, malformed records or an unreadable path give a
``CacheWarning`` and a cache miss for what could not be read.  ``store`` keeps the record in memory
when the user directory cannot be written.  The explicit maintenance operations (``clear``,
``merge``, ``merge_files``) raise ``OSError`` instead, because their caller asked for exactly that
file operation and must learn that it did not happen.

Writers take a file lock, re-read the file and replace it atomically, so concurrent tuners neither
corrupt the file nor drop each other's records, and a writer killed mid-write leaves the old file.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import stat
import tempfile
import threading
import time
import types
import warnings
from pathlib import Path

import filelock
import platformdirs

from . import kernel_source
from .problem import Problem, check_op
from .variants import layout_of, variants_for
from .version import __version__

SCHEMA_VERSION = 1
USER_FILE = "records.json"
#: Seconds a writer waits for another process's lock.  Writers hold it for milliseconds, so a lock
#: held this long belongs to a stuck process; giving up (with a warning) beats hanging a tuner.
LOCK_TIMEOUT_S = 60
#: Fields every record carries, with their JSON types; ``problem`` and ``best`` are checked further.
RECORD_FIELDS = {"key": str, "problem": dict, "device": dict, "kernel_hash": str, "best": dict}
#: Fields a record may carry (``make_record`` and the tuner write them): their types, and those in words.
OPTIONAL_FIELDS = {"runners_up": (list, "an array"), "default": (dict, "an object"), "failures": (list, "an array"),
                   "versions": (dict, "an object"), "date": (str, "a string"),
                   "tuning_seconds": ((int, float), "a number"), "partial": ((dict, type(None)), "an object or null"),
                   "verified": (int, "an integer"), "measured": (dict, "an object")}
#: The fields of a record's ``problem``: four names and two shapes.
PROBLEM_NAMES = ("op", "direction", "dtype", "layout")
PROBLEM_SHAPES = ("input_shape", "output_shape")
#: At most this many malformed records are named in one warning.
MAX_NAMED = 5
#: Compiler options of every build (part of the kernel hash in cache keys).
BUILD_OPTIONS = ""
#: How a record's device relates to the device at hand, best first (``device_tier``), with the
#: words ``cache show`` uses for each.
TIERS = {
    "exact": "exact device",
    "model": "same model (other driver/target)",
    "family": "same family",
}
#: Where a record comes from, in the order that breaks ties between equally good records: the
#: user's own tuning before the shipped database.
ORIGINS = ("user", "shipped")


class CacheWarning(UserWarning):
    """A cache file or record could not be used (or written); the lookup is a miss."""


def default_user_dir() -> Path:
    """``$POOL_TUNER_CACHE_DIR`` if set, else the platform's per-user cache directory."""
    configured = os.environ.get("POOL_TUNER_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    return Path(platformdirs.user_cache_dir("pool_tuner"))


def _fingerprint_hash(device_fingerprint: dict) -> str:
    """Short sha256 of the fingerprint's canonical JSON (sorted keys, so dict order is irrelevant)."""
    canonical = json.dumps(device_fingerprint, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def make_key(problem, device_fingerprint: dict, kernel_hash: str) -> str:
    """The cache key: readable, and different whenever the problem, the device or the kernel code is.

    e.g. ``v1|adaptive_avg_pool2d|forward|float32|NCHW|32x2048x7x7|32x2048x1x1|opencl|dev=..|src=..``.
    The device enters as a hash of its whole fingerprint, so a key names exactly one device (a
    driver update gives new keys; ``device_tier`` still relates the old records to the device);
    ``kernel_hash`` is the sha256 of the kernel templates and build options, of which the first 16
    hex digits are kept.
    """
    if "backend" not in device_fingerprint:
        raise ValueError(f"device fingerprint has no 'backend' field: {device_fingerprint!r}")
    return "|".join([
        f"v{SCHEMA_VERSION}",
        problem.op,
        problem.direction,
        problem.dtype,
        problem.layout,
        _shape_text(problem.input_shape),
        _shape_text(problem.output_shape),
        str(device_fingerprint["backend"]),
        f"dev={_fingerprint_hash(device_fingerprint)}",
        f"src={kernel_hash[:16]}",
    ])


def device_type(device_fingerprint: dict) -> str:
    """The kind of device a fingerprint names, in the default rules' words (``variants.DEVICE_TYPES``):
    ``cpu`` where an OpenCL fingerprint says so, ``gpu`` for every other (CUDA's have no ``type``)."""
    return "cpu" if device_fingerprint.get("type") == "cpu" else "gpu"


def kernel_hash(problem, device_type: str) -> str:
    """sha256 over the build options and the templates of every variant of the problem's op and
    direction that is legal on devices of ``device_type`` (``Variant.device_types``) and for the
    problem's memory layout (``Variant.layouts``): any change to the kernel code that a tuning there
    could have chosen makes the records tuned on the old code misses, and a variant shaped for GPUs
    alone, or for channels-last memory alone, leaves the hash of the CPU, or channels-first,
    records alone."""
    layout = layout_of(problem)
    templates = sorted({v.template for v in variants_for(problem.op, problem.direction).values()
                        if device_type in v.device_types and layout in v.layouts})
    digest = hashlib.sha256(BUILD_OPTIONS.encode())
    for template in templates:
        digest.update(kernel_source.template_hash(template, problem.operation.operator_header).encode())
    return digest.hexdigest()


def record_kernel_hash(problem, device_fingerprint: dict) -> str:
    """The kernel hash that a record of ``problem`` tuned on the device of ``device_fingerprint``
    has when it was tuned on the current kernel code."""
    return kernel_hash(problem, device_type(device_fingerprint))


def cache_key(problem, device) -> str:
    """The key of ``problem`` tuned on ``device`` with the current kernel code."""
    return make_key(problem, device.info.fingerprint, record_kernel_hash(problem, device.info.fingerprint))


def _shape_text(shape) -> str:
    return "x".join(str(int(n)) for n in shape)


def _opencl_levels(fingerprint: dict) -> dict:
    """An OpenCL fingerprint's model and family.

    Model: the OpenCL implementation (platform), vendor, device name and compute units -- the
    hardware under another driver version or compiler target (PoCL's ``version``).  Family:
    platform, vendor and device type -- other hardware of that vendor's kind under the same
    implementation.  The platform is in both because another implementation on the same hardware
    is another compiler altogether, not another version of one."""
    def level(*fields):
        values = tuple(fingerprint.get(field) for field in fields)
        return None if None in values else values

    return {"model": level("platform", "vendor", "name", "compute_units"),
            "family": level("platform", "vendor", "type")}


def _cuda_levels(fingerprint: dict) -> dict:
    """A CUDA fingerprint's model and family.  Model: name, compute capability and
    multiprocessors -- the GPU under another driver.  Family: the major architecture (the first
    number of the compute capability), whose GPUs share a memory system and instruction set
    generation."""
    capability = fingerprint.get("compute_capability")
    model = tuple(fingerprint.get(field) for field in ("name", "compute_capability", "multiprocessors"))
    return {"model": None if None in model else model,
            "family": None if not isinstance(capability, str) else capability.split(".")[0]}


#: Per backend (a fingerprint's ``backend`` field), what of its fingerprints makes the same device
#: model and the same family: ``{"model": ..., "family": ...}`` of hashable values, None where the
#: fingerprint lacks a field that decides one (records made before the field existed), which then
#: matches nothing.  A new backend adds its rule here; one without a rule has only exact matches.
FINGERPRINT_LEVELS = {"opencl": _opencl_levels, "cuda": _cuda_levels}


def device_tier(fingerprint: dict, device) -> str | None:
    """How the device of ``fingerprint`` (a record's) relates to ``device``: ``"exact"`` (the same
    fingerprint), ``"model"`` (the same model: another driver or compiler target), ``"family"``
    (the same family), or None (nothing in common that a tuning would carry over).

    What makes a model and a family is the backend's (``FINGERPRINT_LEVELS``); a fingerprint of
    another backend never matches.  Every tier still needs the record's configuration to be legal
    here, which dispatch checks.
    """
    mine = device.info.fingerprint
    if fingerprint == mine:
        return "exact"
    levels = FINGERPRINT_LEVELS.get(mine.get("backend"))
    if levels is None or fingerprint.get("backend") != mine.get("backend"):
        return None
    theirs, ours = levels(fingerprint), levels(mine)
    for tier in ("model", "family"):
        if theirs[tier] is not None and theirs[tier] == ours[tier]:
            return tier
    return None


def problem_of(record: dict) -> Problem:
    """The problem a record was tuned for, checked as a call's arguments are (``Problem.create``):
    raises ``ValueError``/``TypeError`` for one that no call could make."""
    p = record["problem"]
    input_shape, output_shape = tuple(p["input_shape"]), tuple(p["output_shape"])
    operation = check_op(p["op"], p["direction"])
    problem = Problem.create(p["op"], input_shape, operation.output_size_of(input_shape, output_shape), p["dtype"],
                             p["layout"], direction=p["direction"])
    if problem.output_shape != output_shape:
        raise ValueError(f"output shape {list(output_shape)} does not keep the input's batch sizes")
    return problem


def make_record(
    problem, device_fingerprint: dict, kernel_hash: str, best: dict, runners_up: list, extra: dict | None = None
) -> dict:
    """A cache record: the winner (``{"variant", "params", "time_ms"}``), the runners-up, and enough
    context (problem, device, versions, date) to tell later where and how it was tuned.

    ``extra`` adds fields; it may not replace the ones above, which the cache relies on.
    """
    record = {
        "key": make_key(problem, device_fingerprint, kernel_hash),
        "problem": {
            "op": problem.op,
            "direction": problem.direction,
            "dtype": problem.dtype,
            "layout": problem.layout,
            "input_shape": [int(n) for n in problem.input_shape],
            "output_shape": [int(n) for n in problem.output_shape],
        },
        "device": dict(device_fingerprint),
        "kernel_hash": kernel_hash,
        "best": dict(best),
        "runners_up": [dict(entry) for entry in runners_up],
        "versions": _versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    clashes = sorted(set(extra or {}) & set(record))
    if clashes:
        raise ValueError(f"extra fields {clashes} would replace the record's own fields")
    record.update(extra or {})
    return record


def _versions() -> dict:
    try:
        kernel_tuner_version = importlib.metadata.version("kernel_tuner")
    except importlib.metadata.PackageNotFoundError:
        kernel_tuner_version = "not installed"
    return {"pool_tuner": __version__, "kernel_tuner": kernel_tuner_version, "python": platform.python_version()}


def _record_problem(key, record) -> str | None:
    """What makes ``record`` (stored under ``key``) unusable, or None if it is well-formed.

    The one check of a record's fields -- types, the contents of ``partial`` and ``measured``, no
    NaN or infinity anywhere -- used when loading, merging and storing, so that dispatch and
    ``cache show`` can rely on these fields without guarding every access and every record kept
    can be written back.
    """
    if not isinstance(record, dict):
        return f"is a {type(record).__name__}, not an object"
    for field, kind in RECORD_FIELDS.items():
        if not isinstance(record.get(field), kind):
            return f"has no {field!r} {kind.__name__}"
    if record["key"] != key:
        return f"is stored under a different key than its 'key' field {record['key']!r}"
    for field, (kind, words) in OPTIONAL_FIELDS.items():
        if field in record and (isinstance(record[field], bool) or not isinstance(record[field], kind)):
            return f"has a {field!r} field that is not {words}"
    problem = record["problem"]
    for field in PROBLEM_NAMES:
        if not isinstance(problem.get(field), str):
            return f"has a 'problem' whose {field!r} is not a string"
    for field in PROBLEM_SHAPES:
        shape = problem.get(field)
        if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                  for n in shape):
            return f"has a 'problem' whose {field!r} is not a list of non-negative integers: {shape!r}"
    if record.get("verified", 0) < 0:
        return f"has a negative 'verified' count {record['verified']!r}"
    if is_partial(record):
        partial_problem = _partial_problem(record["partial"])
        if partial_problem is not None:
            return f"has a 'partial' field whose {partial_problem}"
    if "measured" in record:
        if is_partial(record):
            return "is both a measured dispatch and a partial tuning"
        measured_problem = _measured_problem(record["measured"])
        if measured_problem is not None:
            return f"has a 'measured' field whose {measured_problem}"
    try:
        own_key = make_key(types.SimpleNamespace(**record["problem"]), record["device"], record["kernel_hash"])
    except (TypeError, ValueError, AttributeError):
        return "has a 'problem' or 'device' field that does not describe a problem and a device"
    if own_key != key:
        return "has a key that does not match its own problem, device and kernel hash"
    try:
        problem_of(record)
    except (TypeError, ValueError) as exc:
        return f"has a 'problem' that no call could make ({exc})"
    entries = [("best", record["best"], False)] + [("runners_up", entry, True) for entry in record.get("runners_up", [])]
    if "default" in record:  # an interrupted tuning did not time the default
        entries.append(("default", record["default"], True))
    for field, entry, may_be_untimed in entries:
        entry_problem = _entry_problem(entry, may_be_untimed)
        if entry_problem is not None:
            return f"has a {field!r} entry that {entry_problem}"
    for failure in record.get("failures", []):
        if not isinstance(failure, dict) or not isinstance(failure.get("error"), str):
            return f"has a 'failures' entry without an 'error' string: {failure!r}"
    return _non_finite_problem(record)


def _non_finite_problem(record: dict) -> str | None:
    """Where ``record`` holds a NaN or an infinity (which Python's JSON reads, ``NaN``, ``Infinity``,
    ``1e999``, but the cache never writes: a record holding one would make every later write of its
    file fail), or None.  Walked without recursion, so that no nesting the JSON reader took can
    overflow the stack here."""
    pending = [((field,), value) for field, value in record.items()]
    while pending:
        path, value = pending.pop()
        if isinstance(value, float) and not math.isfinite(value):
            where = "".join(f"[{step!r}]" for step in path[1:])
            return f"has a non-finite number {value!r} in its {path[0]!r} field{' at ' + where if where else ''}"
        if isinstance(value, dict):
            pending += [(path + (k,), v) for k, v in value.items()]
        elif isinstance(value, list):
            pending += [(path + (i,), v) for i, v in enumerate(value)]
    return None


def _is_strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _partial_problem(partial: dict) -> str | None:
    """What is wrong with an interrupted tuning's ``"partial"`` field (``tuner._keep_partial``
    writes it), or None: the variants it searched whole (required), those it did not search, the
    one cut short (or null), and how it was timed."""
    if not _is_strings(partial.get("variants_searched")):
        return f"'variants_searched' is not a list of variant names: {partial.get('variants_searched')!r}"
    if "variants_not_searched" in partial and not _is_strings(partial["variants_not_searched"]):
        return f"'variants_not_searched' is not a list of variant names: {partial['variants_not_searched']!r}"
    if not isinstance(partial.get("variant_interrupted"), (str, type(None))):
        return f"'variant_interrupted' is neither a variant name nor null: {partial['variant_interrupted']!r}"
    if not isinstance(partial.get("timing", ""), str):
        return f"'timing' is not a string: {partial['timing']!r}"
    return None


def _is_seconds(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def _measured_problem(measured: dict) -> str | None:
    """What is wrong with a measured dispatch's ``"measured"`` field (``measured._Stages.record``
    writes it), or None: each stage's rounds (required; a single count in records of the first
    measured dispatch, which had one stage), the seconds spent building and in all."""
    rounds = measured.get("rounds")
    counts = rounds if isinstance(rounds, list) else [rounds]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        return f"'rounds' is not a list of non-negative integers (or one): {rounds!r}"
    for field in ("build_seconds", "seconds"):
        if field in measured and not _is_seconds(measured[field]):
            return f"{field!r} is not a non-negative number of seconds: {measured[field]!r}"
    return None


def _entry_problem(entry, may_be_untimed: bool) -> str | None:
    """What makes a configuration entry (``best``, a runner-up, the default) unusable, or None."""
    if not isinstance(entry, dict) or not isinstance(entry.get("variant"), str):
        return "has no 'variant' string"
    params = entry.get("params")
    if not isinstance(params, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in params.values()):
        return f"has no 'params' object of integers: {params!r}"
    time_ms = entry.get("time_ms")
    if time_ms is None and may_be_untimed:
        return None
    if isinstance(time_ms, bool) or not isinstance(time_ms, (int, float)) or not math.isfinite(time_ms):
        return f"has a 'time_ms' that is not a finite number: {time_ms!r}"
    return None


def _read(path: Path) -> tuple[dict, list[str]]:
    """The well-formed records of one cache file, and a description of each thing wrong with it.

    Content problems are returned, not raised, so each caller decides what they mean (a miss when
    loading, a file to set aside when rewriting).  ``OSError`` (missing, unreadable, not a regular
    file) propagates.
    """
    try:
        data = json.loads(read_regular_file(path))
    except ValueError as exc:  # also UnicodeDecodeError
        return {}, [f"not valid JSON ({exc})"]
    except RecursionError:
        return {}, ["not a cache file: its JSON is nested too deeply to read"]
    if not isinstance(data, dict):
        return {}, [f"top level is a {type(data).__name__}, not an object"]
    if data.get("schema") != SCHEMA_VERSION:
        return {}, [f"schema {data.get('schema')!r} is not the supported schema {SCHEMA_VERSION}"]
    if not isinstance(data.get("records"), dict):
        return {}, ["has no 'records' object"]
    records, problems = {}, []
    for key, record in data["records"].items():
        problem = _record_problem(key, record)
        if problem is None:
            records[key] = record
        else:
            problems.append(f"record {key!r} {problem}")
    return records, problems


def read_regular_file(path: Path, max_bytes: int | None = None) -> bytes:
    """The bytes of ``path``, which must be a regular file (a link to one is followed) of at most
    ``max_bytes`` bytes: a FIFO would block the first call for ever and a device such as
    ``/dev/zero`` never ends, so anything else raises ``OSError``.  Opened without blocking, so that
    a FIFO is refused rather than waited on, and checked on the opened file, so that what is read
    is what was checked.  The cache's files and the CLI's ``--shapes`` file are read here."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:  # checked before os.fdopen, which refuses a directory naming the descriptor's number, not the path
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise OSError(f"{path} is {_file_kind(status.st_mode)}, not a regular file")
        if max_bytes is not None and status.st_size > max_bytes:
            raise OSError(f"{path} is {status.st_size} bytes, more than the {max_bytes} such a file may hold")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as file:
        return file.read()


def _file_kind(mode: int) -> str:
    """What a file that is not a regular one is, in words."""
    for test, words in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                        (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "a special file"


def _describe(problems: list[str]) -> str:
    named = "; ".join(problems[:MAX_NAMED])
    return named + (f"; and {len(problems) - MAX_NAMED} more" if len(problems) > MAX_NAMED else "")


def _load_file(path: Path) -> dict:
    """Records of one file for the in-memory table: whatever cannot be read is a warning and a miss."""
    try:
        records, problems = _read(path)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        warnings.warn(f"pool_tuner tuning cache {path} cannot be read ({exc}); ignoring it", CacheWarning)
        return {}
    if problems:
        warnings.warn(f"pool_tuner tuning cache {path}: {_describe(problems)}; ignored (cache miss)", CacheWarning)
    return records


def _lock(path: Path) -> filelock.FileLock:
    """The lock of cache file ``path`` (a file beside it).  Raises ``OSError`` at once where the
    lock file cannot be made at all (a read-only or another user's directory): filelock would try
    again for the whole ``LOCK_TIMEOUT_S``, as if another process held the lock."""
    lock_path = path.with_name(path.name + ".lock")
    os.close(os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644))
    return filelock.FileLock(lock_path, timeout=LOCK_TIMEOUT_S)


def is_partial(record: dict) -> bool:
    """Whether ``record`` holds an interrupted tuning: the best configuration measured before Ctrl-C,
    with a ``"partial"`` field saying what was covered (see ``tuner``)."""
    return record.get("partial") is not None


def is_measured(record: dict) -> bool:
    """Whether ``record`` holds a measured dispatch (``POOL_TUNER_BENCHMARK``, ``pool_tuner.measured``):
    the variants' rule configurations and their neighbourhood timed on the problem, no tuning
    search.  It decides its own problem on its own device only, ranks below any tuning of that
    problem, and a tuning replaces it."""
    return "measured" in record


def verified(record: dict) -> tuple[int, int]:
    """How much a record's tuning verified: the variants with a verified winner (its best and
    runners-up), then the configurations that ran and verified (``"verified"``, 0 where a record
    predates the field)."""
    return 1 + len(record.get("runners_up", [])), record.get("verified", 0)


def replaces(new: dict, old: dict | None, faster_only: bool) -> bool:
    """Whether ``new`` takes the place of ``old``, a record of the same key: a tuning (full or
    partial) always replaces a measured dispatch and is never replaced by one; a full tuning always
    replaces a partial one and is never replaced by one; a tuning that verified less (``verified``:
    fewer variants, or as many and fewer configurations -- a search cut short, a budget of nothing)
    never replaces one that verified more; otherwise ``new`` wins if it is faster or, without
    ``faster_only``, always."""
    if old is None:
        return True
    if is_measured(new) != is_measured(old):
        return is_measured(old)
    if is_partial(new) != is_partial(old):
        return is_partial(old)
    if verified(new) < verified(old):
        return False
    return not faster_only or new["best"]["time_ms"] < old["best"]["time_ms"]


def _update_file(path: Path, incoming: dict, faster_only: bool) -> tuple[dict, int]:
    """Insert ``incoming`` records into cache file ``path``; return its new records and how many of
    them were added or replaced.  With ``faster_only`` an existing record is replaced only by a faster
    one; otherwise incoming records always win.

    The file is re-read under the lock rather than rewritten from an in-memory copy: other processes
    may have stored records since this one loaded, and writing the stale copy would drop them.  A
    damaged file (corrupt, foreign schema, malformed records) is moved aside, not overwritten, so
    nothing is destroyed; the fresh file keeps its readable records.  Raises ``OSError`` (including
    ``filelock.Timeout``) when the file cannot be locked, read or written.
    """
    _make_directory(path)
    if os.path.isdir(path):  # said before a lock file is left beside it
        raise IsADirectoryError(f"{path} is a directory, not a regular file")
    with _lock(path):
        _remove_stale_temporaries(path)
        try:
            records, problems = _read(path)
        except FileNotFoundError:
            records, problems = {}, []
        if problems:
            stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
            aside = path.with_name(f"{path.name}.corrupt-{stamp}")
            os.replace(path, aside)
            warnings.warn(
                f"pool_tuner tuning cache {path}: {_describe(problems)}; moved it to {aside} and wrote a "
                f"fresh file keeping its {len(records)} readable record(s)",
                CacheWarning,
            )
        changed = 0
        for key, record in incoming.items():
            if replaces(record, records.get(key), faster_only):
                records[key] = record
                changed += 1
        _write_atomic(path, records)
    return records, changed


def _make_directory(path: Path) -> None:
    """Make the directory of cache file ``path`` if it is missing.  Raises ``OSError`` naming the
    path and what is wrong: where an existing file stands in the way, that file (``mkdir`` would
    only say "File exists")."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        blocking = next((p for p in (path.parent, *path.parent.parents)
                         if os.path.lexists(p) and not os.path.isdir(p)), None)
        if blocking is not None:
            raise NotADirectoryError(f"cannot make the directory of {path}: {blocking} is a file, not a directory") \
                from None
        raise OSError(f"cannot make the directory of {path} ({exc.strerror or exc})") from None


def _write_atomic(path: Path, records: dict) -> None:
    """Write the file so that readers only ever see the old or the new contents, never a mix.

    The new contents go to a temporary file in the same directory (so the rename stays on one file
    system and is atomic), are fsynced so the rename cannot reach the disk before the data, and then
    replace the old file with ``os.replace``.  A writer killed at any point leaves the old file
    intact and at worst a stray ``*.tmp`` file, which loading ignores.
    """
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644  # not mkstemp's private 0o600
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump({"schema": SCHEMA_VERSION, "records": records}, out, indent=1, sort_keys=True, allow_nan=False)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _remove_stale_temporaries(path: Path) -> None:
    """Delete the temporary files of writers killed mid-write (``_write_atomic``).  Called under the
    lock, where no writer is at work; only files older than the lock timeout go, so that a writer
    that took the lock by some other means is not robbed of its file."""
    cutoff = time.time() - LOCK_TIMEOUT_S
    for tmp in path.parent.glob(f"{path.name}.*.tmp"):
        try:
            if tmp.lstat().st_mtime < cutoff:
                tmp.unlink()
        except OSError:  # gone already, or not ours to remove: it stays
            pass


def _merge(sources: list, destination: Path) -> tuple[dict, int]:
    """Fold the records of ``sources`` (the fastest per key) into ``destination``."""
    incoming = {}
    for source in sources:
        source = Path(source)
        records, problems = _read(source)
        if problems and not records:  # asked to merge a file of which nothing can be merged: say so
            raise ValueError(f"{source} holds no record that can be merged: {_describe(problems)}")
        if problems:
            warnings.warn(f"pool_tuner tuning cache {source}: {_describe(problems)}; not merged", CacheWarning)
        for key, record in records.items():
            if replaces(record, incoming.get(key), faster_only=True):
                incoming[key] = record
    return _update_file(destination, incoming, faster_only=True)


def merge_files(sources: list, destination) -> int:
    """Merge cache files (e.g. tuned on other machines) into ``destination``, keeping the faster
    record for equal keys (a full tuning over a partial one); return how many records were added or replaced.

    Unusable records of a source are skipped with a ``CacheWarning``; a source with nothing usable
    raises ``ValueError`` before anything is written; a source or destination that cannot be read or
    written raises ``OSError``.
    """
    return _merge(sources, Path(destination))[1]


def _normalised(record: dict) -> dict:
    """A checked, detached copy of ``record`` exactly as it will read back from the file.

    Checking before any file is touched makes a bad record the caller's error (``ValueError`` or
    ``TypeError``), instead of a file that warns on every later load; the JSON round trip turns
    tuples into lists and stops later changes to the caller's objects from leaking into the cache.
    """
    problem = _record_problem(record.get("key") if isinstance(record, dict) else None, record)
    if problem is not None:
        raise ValueError(f"cannot store a malformed tuning record: it {problem}")
    return json.loads(json.dumps(record, allow_nan=False))


@dataclasses.dataclass(frozen=True)
class Match:
    """A record that applies to a device: the record, the problem it was tuned for, where it comes
    from (one of ``ORIGINS``) and how its device relates to the device (one of ``TIERS``)."""

    record: dict
    problem: Problem
    origin: str
    tier: str


def _group(problem: Problem) -> tuple:
    """What a record must share with a problem to be considered for it at all."""
    return problem.op, problem.direction, problem.dtype, problem.layout, len(problem.input_shape)


class TuningCache:
    """The shipped database overlaid by the user's cache file, as one in-memory table.

    The table is read on first use and then kept: ``lookup`` and ``matches`` are on dispatch's
    path and never touch the file system again (``reload`` re-reads on request).  The table is
    returned, not copied; treat it as read-only and change it through ``store``.

    ``matches`` reads an index built from the table on first use and dropped whenever the table
    changes: records grouped by op, direction, dtype, layout and rank, and within a group by device
    fingerprint, so that a problem's first call compares its device with each distinct fingerprint
    of its group once, not with every record of the cache.  A change makes a
    new table (under a lock) instead of changing the one readers may be iterating in other threads
    (dispatch's nearest-shape search while a tuning stores its record).
    """

    def __init__(self, shipped_dir: Path, user_dir: Path | None = None):
        self.shipped_dir = Path(shipped_dir)
        self.user_dir = default_user_dir() if user_dir is None else Path(user_dir)
        self._records = None
        self._user_keys: set = set()
        self._index = None
        self._lock = threading.RLock()

    def path(self) -> Path:
        """The user's cache file."""
        return self.user_dir / USER_FILE

    def records(self) -> dict:
        records = self._records
        if records is None:
            with self._lock:
                if self._records is None:
                    self.reload()
                records = self._records
        return records

    def reload(self) -> None:
        """Re-read the shipped files (in name order, later files winning) and then the user file."""
        table = {}
        for path in self._shipped_files():
            table.update(_load_file(path))
        user = _load_file(self.path())
        table.update(user)
        with self._lock:
            self._records, self._user_keys, self._index = table, set(user), None

    def _add_user_records(self, records: dict) -> None:
        """Replace the table by one with the user's ``records`` added (see the class docstring)."""
        with self._lock:
            self._records = {**self.records(), **records}
            self._user_keys = self._user_keys | set(records)
            self._index = None

    def _shipped_files(self) -> list:
        try:
            return sorted(p for p in self.shipped_dir.iterdir() if p.suffix == ".json")
        except FileNotFoundError:
            return []
        except OSError as exc:
            warnings.warn(
                f"pool_tuner shipped tuning cache {self.shipped_dir} cannot be read ({exc}); ignoring it", CacheWarning
            )
            return []

    def lookup(self, key: str) -> dict | None:
        return self.records().get(key)

    def origin(self, key: str) -> str:
        """Where the record under ``key`` comes from: ``"user"`` (the user file, or stored in this
        process) or ``"shipped"``."""
        return "user" if key in self._user_keys else "shipped"

    def matches(self, problem: Problem, device) -> list:
        """Every record of ``problem``'s op, direction, dtype, layout and rank, tuned on the current
        kernel code, whose device applies to ``device`` (``device_tier``): ``Match``es, in no
        particular order (dispatch ranks them)."""
        if self._index is None:
            self._index = self._build_index()
        found = []
        for fingerprint, entries in self._index.get(_group(problem), {}).values():
            tier = device_tier(fingerprint, device)
            if tier is not None:
                code = record_kernel_hash(problem, fingerprint)
                found += [Match(record, tuned, self.origin(record["key"]), tier)
                          for record, tuned in entries if record["kernel_hash"] == code]
        return found

    def _build_index(self) -> dict:
        """``{group: {fingerprint hash: (fingerprint, [(record, problem), ...])}}`` of the table."""
        index: dict = {}
        for record in self.records().values():
            tuned = problem_of(record)  # loading made sure it can be made
            by_device = index.setdefault(_group(tuned), {})
            entry = by_device.setdefault(_fingerprint_hash(record["device"]), (record["device"], []))
            entry[1].append((record, tuned))
        return index

    def store(self, record: dict) -> bool:
        """Add ``record`` to the user file and the in-memory table, unless the record of its key there
        is worth more (``replaces``: a full tuning, or one that verified more).

        Never raises for the file system: a tuning run's result is worth keeping even when the cache
        directory is read-only, so then it is kept in memory only, with a ``CacheWarning``.  Records
        stored meanwhile by other processes are picked up into the table as a side effect.  A record
        that loading would reject (or that is not JSON) raises ``ValueError``/``TypeError`` first.
        Returns whether the record reached the file.
        """
        record = _normalised(record)
        self.records()  # loaded before the write, so that what loading warns of is the file as it was
        try:
            written, changed = _update_file(self.path(), {record["key"]: record}, faster_only=False)
        except OSError as exc:
            warnings.warn(
                f"cannot write the pool_tuner tuning cache {self.path()} ({exc}); keeping the record "
                f"{record['key']!r} in memory only",
                CacheWarning,
                stacklevel=2,
            )
            if replaces(record, self.records().get(record["key"]), faster_only=False):
                self._add_user_records({record["key"]: record})
            return False
        self._add_user_records(written)
        return changed > 0

    def clear(self) -> None:
        """Delete the user file; shipped records are unaffected.  Under the lock, so that it cannot
        fall between a concurrent writer's read and replace.  Raises ``OSError`` if it cannot."""
        path = self.path()
        if path.parent.is_dir():
            with _lock(path):
                path.unlink(missing_ok=True)
        with self._lock:
            self._records = None

    def merge(self, sources: list) -> int:
        """Merge cache files into the user file (see ``merge_files``); return the records added or replaced."""
        written, changed = _merge(sources, self.path())
        self._add_user_records(written)
        return changed
