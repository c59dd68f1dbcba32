"""The tuning cache: persistence, overlay, damage tolerance, atomic and concurrent writes, merging."""

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import filelock
import platformdirs
import pytest

from pool_tuner import cache
from pool_tuner.cache import CacheWarning, TuningCache, make_key, make_record, merge_files
from pool_tuner.problem import Problem

REPO = Path(__file__).resolve().parents[1]
FP = {"backend": "opencl", "name": "Fake GPU", "vendor": "Acme", "driver": "1.2.3", "compute_units": 64}
KERNEL_HASH = "0123456789abcdef" + "f" * 48


#: A device reporting ``FP``, whose tiers are OpenCL's (``cache.device_tier``).
FAKE_DEVICE = types.SimpleNamespace(info=types.SimpleNamespace(fingerprint=FP))


def problem(width=8):
    return Problem("adaptive_avg_pool2d", "forward", "float32", "NCHW", (2, 3, 8, width), (2, 3, 4, 4))


def record(width=8, time_ms=1.0, variant="thread_per_output", kernel_hash=KERNEL_HASH):
    best = {"variant": variant, "params": {"block_size": 128}, "time_ms": time_ms}
    runners_up = [{"variant": "block_per_row", "params": {"block_size": 64}, "time_ms": time_ms * 2}]
    return make_record(problem(width), FP, kernel_hash, best, runners_up)


def write_file(path, records, schema=cache.SCHEMA_VERSION):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema": schema, "records": {r["key"]: r for r in records}}))


def fresh(tmp_path, user="user"):
    return TuningCache(tmp_path / "shipped", tmp_path / user)


@contextlib.contextmanager
def no_warnings():
    """Turn any warning inside the block into an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# ---------------------------------------------------------------- keys and records


def test_make_key_format():
    dev = hashlib.sha256(json.dumps(FP, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]
    assert make_key(problem(), FP, KERNEL_HASH) == (
        f"v1|adaptive_avg_pool2d|forward|float32|NCHW|2x3x8x8|2x3x4x4|opencl|dev={dev}|src=0123456789abcdef"
    )
    # canonical JSON: the fingerprint's key order does not matter
    assert make_key(problem(), dict(reversed(list(FP.items()))), KERNEL_HASH) == make_key(problem(), FP, KERNEL_HASH)


def test_make_key_changes_with_kernel_hash_fingerprint_and_shape():
    base = make_key(problem(), FP, KERNEL_HASH)
    assert make_key(problem(), FP, "1" + KERNEL_HASH[1:]) != base
    for field in FP:
        changed = dict(FP, **{field: FP[field] + 1 if isinstance(FP[field], int) else FP[field] + "x"})
        assert make_key(problem(), changed, KERNEL_HASH) != base, field
    assert make_key(problem(width=9), FP, KERNEL_HASH) != base
    other_out = Problem("adaptive_avg_pool2d", "forward", "float32", "NCHW", (2, 3, 8, 8), (2, 3, 4, 2))
    assert make_key(other_out, FP, KERNEL_HASH) != base


def test_make_record_fields():
    best = {"variant": "v", "params": {}, "time_ms": 0.5}
    rec = make_record(problem(), FP, KERNEL_HASH, best, [], extra={"note": "x"})
    assert rec["key"] == make_key(problem(), FP, KERNEL_HASH)
    assert rec["problem"]["input_shape"] == [2, 3, 8, 8] and rec["problem"]["op"] == "adaptive_avg_pool2d"
    assert rec["device"] == FP and rec["kernel_hash"] == KERNEL_HASH and rec["note"] == "x"
    assert rec["best"]["time_ms"] == 0.5 and rec["runners_up"] == []
    assert rec["versions"]["pool_tuner"] == __import__("pool_tuner").__version__
    assert {"kernel_tuner", "python"} <= set(rec["versions"])
    assert rec["date"].endswith("+00:00")
    with pytest.raises(ValueError, match="key"):
        make_record(problem(), FP, KERNEL_HASH, best, [], extra={"key": "k"})


# ---------------------------------------------------------------- persistence and overlay


def test_store_then_fresh_instance_finds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("POOL_TUNER_CACHE_DIR", str(tmp_path / "env-dir"))
    rec = record()
    with no_warnings():
        TuningCache(tmp_path / "shipped").store(rec)
    assert (tmp_path / "env-dir" / "records.json").is_file()
    found = TuningCache(tmp_path / "shipped").lookup(rec["key"])
    assert found == json.loads(json.dumps(rec))
    assert TuningCache(tmp_path / "shipped").lookup(record(width=9)["key"]) is None


def test_default_user_dir_without_env(monkeypatch):
    monkeypatch.delenv("POOL_TUNER_CACHE_DIR", raising=False)
    assert cache.default_user_dir() == Path(platformdirs.user_cache_dir("pool_tuner"))


def test_user_overlays_shipped(tmp_path):
    only_shipped, overridden, other_file = record(width=8), record(width=9, time_ms=5.0), record(width=10)
    write_file(tmp_path / "shipped" / "a.json", [only_shipped, overridden])
    write_file(tmp_path / "shipped" / "b.json", [other_file])
    user_version = record(width=9, time_ms=2.0, variant="block_per_row")
    fresh(tmp_path).store(user_version)

    c = fresh(tmp_path)
    assert c.lookup(overridden["key"])["best"]["variant"] == "block_per_row"
    assert c.lookup(only_shipped["key"])["best"] == only_shipped["best"]
    assert c.lookup(other_file["key"]) is not None
    assert [c.origin(r["key"]) for r in (only_shipped, overridden, other_file)] == ["shipped", "user", "shipped"]


def test_loaded_once_then_no_file_system(tmp_path, monkeypatch):
    rec = record()
    write_file(tmp_path / "user" / "records.json", [rec])
    c = fresh(tmp_path)
    (tmp_path / "user" / "records.json").write_text("not json")  # lazy: nothing was read yet
    with pytest.warns(CacheWarning):
        assert c.lookup(rec["key"]) is None

    write_file(tmp_path / "user" / "records.json", [rec])
    c.reload()
    assert c.lookup(rec["key"]) is not None

    # the hot path answers from memory: the files may be gone, and no reader may run
    shutil.rmtree(tmp_path / "user")

    def forbidden(*args, **kwargs):
        raise AssertionError("cache file read on the hot path")

    monkeypatch.setattr(cache, "_read", forbidden)
    monkeypatch.setattr(cache, "_load_file", forbidden)
    monkeypatch.setattr(cache, "kernel_hash", lambda problem_, device_type_: KERNEL_HASH)
    assert c.lookup(rec["key"])["key"] == rec["key"]
    assert [m.record["key"] for m in c.matches(problem(), FAKE_DEVICE)] == [rec["key"]]


# ---------------------------------------------------------------- damaged files


DAMAGE = {  # name: (file contents from the valid text and records, expected reason)
    "truncated": (lambda text, recs: text[: len(text) // 2].encode(), "not valid JSON"),
    "not utf-8": (lambda text, recs: b"\xff\xfe garbage", "not valid JSON"),
    "top-level list": (lambda text, recs: b"[1, 2]", "top level is a list"),
    "no schema": (lambda text, recs: json.dumps({"records": recs}).encode(), "schema None"),
    "foreign schema": (lambda text, recs: json.dumps({"schema": 2, "records": recs}).encode(), "schema 2 "),
    "records not an object": (
        lambda text, recs: json.dumps({"schema": 1, "records": list(recs.values())}).encode(),
        "no 'records' object",
    ),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_file_is_warning_and_miss(tmp_path, damage):
    rec = record()
    path = tmp_path / "user" / "records.json"
    write_file(path, [rec])
    make_contents, reason = DAMAGE[damage]
    path.write_bytes(make_contents(path.read_text(), {rec["key"]: rec}))
    with pytest.warns(CacheWarning, match=reason) as caught:
        assert fresh(tmp_path).lookup(rec["key"]) is None
    assert len(caught) == 1 and str(path) in str(caught[0].message)


def test_store_sets_corrupt_file_aside(tmp_path):
    old, new = record(width=8), record(width=9)
    path = tmp_path / "user" / "records.json"
    write_file(path, [old])
    truncated = path.read_bytes()[:-25]
    path.write_bytes(truncated)

    c = fresh(tmp_path)
    with pytest.warns(CacheWarning, match="not valid JSON"):
        assert c.lookup(old["key"]) is None
    with pytest.warns(CacheWarning, match="moved it to"):
        c.store(new)
    asides = list(path.parent.glob("records.json.corrupt-*"))
    assert len(asides) == 1 and asides[0].read_bytes() == truncated
    with no_warnings():
        reloaded = fresh(tmp_path)
        assert reloaded.lookup(new["key"]) is not None and reloaded.lookup(old["key"]) is None
    assert c.lookup(new["key"]) is not None


def test_malformed_records_are_skipped(tmp_path):
    good, good2 = record(width=8), record(width=9)
    no_best = {k: v for k, v in record(width=10).items() if k != "best"}
    untimed = record(width=11)
    untimed["best"] = {"variant": "v", "params": {}}
    # a problem no call could make (its output drops a batch size): dispatch's tiers and classes read
    # every record's problem, so loading checks it
    batchless_output = make_record(Problem("adaptive_avg_pool2d", "forward", "float32", "NCHW", (2, 3, 8, 14),
                                           (3, 4, 4)), FP, KERNEL_HASH, {"variant": "v", "params": {}, "time_ms": 1.0}, [])
    bad = {
        "not-a-dict": [1, 2],
        no_best["key"]: no_best,
        "wrong-key": record(width=12),
        untimed["key"]: untimed,
        batchless_output["key"]: batchless_output,
    }
    path = tmp_path / "user" / "records.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"schema": 1, "records": {good["key"]: good, good2["key"]: good2, **bad}}))

    c = fresh(tmp_path)
    with pytest.warns(CacheWarning, match="not-a-dict") as caught:
        table = c.records()
    message = str(caught[0].message)
    assert "'best'" in message and "wrong-key" in message and "time_ms" in message
    assert "2x3x8x14" in message and "that no call could make" in message
    assert set(table) == {good["key"], good2["key"]}

    # rewriting keeps the readable records and sets the original aside
    with pytest.warns(CacheWarning, match="keeping its 2 readable"):
        c.store(record(width=13))
    assert len(list(path.parent.glob("records.json.corrupt-*"))) == 1
    assert len(json.loads(path.read_text())["records"]) == 3


def test_store_rejects_malformed_record(tmp_path):
    rec = record()
    rec["best"]["time_ms"] = float("nan")
    with pytest.raises(ValueError, match="time_ms"):
        fresh(tmp_path).store(rec)
    assert not (tmp_path / "user").exists()


def test_unreadable_paths_are_warning_and_miss(tmp_path):
    rec = record()
    (tmp_path / "user" / "records.json").mkdir(parents=True)  # reading it fails with IsADirectoryError
    (tmp_path / "shipped").write_text("a file, not a directory")
    c = fresh(tmp_path)
    with pytest.warns(CacheWarning) as caught:
        assert c.lookup(rec["key"]) is None
    messages = " ".join(str(w.message) for w in caught)
    assert "cannot be read" in messages and str(tmp_path / "shipped") in messages
    with pytest.warns(CacheWarning, match="in memory only"):
        c.store(rec)
    assert c.lookup(rec["key"]) is not None


def test_unwritable_directory_keeps_record_in_memory(tmp_path):
    rec = record()
    user_dir = tmp_path / "read-only"
    user_dir.mkdir(mode=0o500)
    if os.geteuid() == 0 or os.access(user_dir, os.W_OK):  # root ignores permission bits:
        (tmp_path / "plain-file").write_text("")  # make mkdir fail instead
        user_dir = tmp_path / "plain-file" / "cache"
    c = TuningCache(tmp_path / "shipped", user_dir)
    try:
        with pytest.warns(CacheWarning) as caught:  # as root, loading warns too (not a directory)
            c.store(rec)
    finally:
        (tmp_path / "read-only").chmod(0o700)
    assert any("in memory only" in str(w.message) for w in caught)
    assert c.lookup(rec["key"])["best"] == rec["best"]
    assert not (user_dir / "records.json").exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, a directory nobody can write in")
def test_a_directory_where_no_file_can_be_made_warns_at_once(tmp_path):
    """A cache directory that exists but takes no new file (read-only, another user's; /proc/self
    here, which root cannot write either) is a warning now, not after filelock's whole timeout of
    trying to make its lock file as if another process held the lock (60 s per store)."""
    import time

    rec = record()
    c = TuningCache(tmp_path / "shipped", Path("/proc/self"))
    started = time.monotonic()
    with pytest.warns(CacheWarning, match="in memory only"):
        c.store(rec)
    assert time.monotonic() - started < cache.LOCK_TIMEOUT_S / 4
    assert c.lookup(rec["key"])["best"] == rec["best"]


# ---------------------------------------------------------------- atomic and concurrent writes

CHILD_PRELUDE = """
import sys, time
from pathlib import Path
from pool_tuner.cache import TuningCache, make_record
from pool_tuner.problem import Problem
FP = {fp!r}
def record(width, time_ms=1.0):
    p = Problem("adaptive_avg_pool2d", "forward", "float32", "NCHW", (2, 3, 8, width), (2, 3, 4, 4))
    return make_record(p, FP, {kh!r}, {{"variant": "v", "params": {{}}, "time_ms": time_ms}}, [])
""".format(fp=FP, kh=KERNEL_HASH)

HANGING_WRITER = CHILD_PRELUDE + """
import os
def hang(src, dst):
    Path(sys.argv[2] + ".tmp").write_text(src)
    os.rename(sys.argv[2] + ".tmp", sys.argv[2])  # the parent sees the marker complete or not at all
    time.sleep(600)
os.replace = hang
TuningCache(Path(sys.argv[1]) / "shipped", Path(sys.argv[1]) / "user").store(record(99))
"""

BATCH_WRITER = CHILD_PRELUDE + """
root, first = Path(sys.argv[1]), int(sys.argv[2])
(root / f"ready-{first}").write_text("")
while not (root / "go").exists():
    time.sleep(0.001)
c = TuningCache(root / "shipped", root / "user")
for width in range(first, first + 20):
    c.store(record(width))
"""


def spawn(script, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], env=env, stderr=subprocess.PIPE)


def wait_for(paths, process_list, timeout=30):
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        for proc in process_list:
            if proc.poll() is not None and proc.returncode != 0:
                raise AssertionError(proc.stderr.read().decode())
        assert time.monotonic() < deadline, "child processes did not get ready"
        time.sleep(0.01)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_writer_killed_mid_write_leaves_old_file(tmp_path):
    old = [record(width=8), record(width=9)]
    path = tmp_path / "user" / "records.json"
    write_file(path, old)
    before = path.read_bytes()

    marker = tmp_path / "about-to-replace"
    writer = spawn(HANGING_WRITER, tmp_path, marker)
    try:
        wait_for([marker], [writer])
    finally:
        writer.kill()  # SIGKILL
        writer.wait()
    assert writer.returncode == -signal.SIGKILL

    temp = Path(marker.read_text())
    assert temp.parent == path.parent and len(json.loads(temp.read_text())["records"]) == 3  # it was mid-write
    assert path.read_bytes() == before
    with no_warnings():
        c = fresh(tmp_path)
        assert all(c.lookup(r["key"]) for r in old)
    # the dead writer's lock is gone: the next writer gets it at once
    with filelock.FileLock(str(path) + ".lock", timeout=2):
        pass
    with no_warnings():
        c.store(record(width=10))
    assert len(fresh(tmp_path).records()) == 3


def test_concurrent_writers_keep_all_records(tmp_path):
    writers = [spawn(BATCH_WRITER, tmp_path, first) for first in (100, 200)]
    try:
        wait_for([tmp_path / "ready-100", tmp_path / "ready-200"], writers)
        (tmp_path / "go").write_text("")
        for w in writers:
            assert w.wait(timeout=60) == 0, w.stderr.read().decode()
    finally:
        for w in writers:
            w.kill()
    with no_warnings():
        table = fresh(tmp_path).records()
    widths = sorted(r["problem"]["input_shape"][-1] for r in table.values())
    assert widths == list(range(100, 120)) + list(range(200, 220))


# ---------------------------------------------------------------- merge and clear


def test_merge_keeps_faster_and_adds_new(tmp_path):
    dest = fresh(tmp_path)
    dest.store(record(width=8, time_ms=3.0, variant="dest"))   # beaten by the source
    dest.store(record(width=9, time_ms=4.0, variant="dest"))   # beats the source
    source = tmp_path / "other" / "records.json"
    write_file(source, [record(width=8, time_ms=2.0, variant="src"), record(width=9, time_ms=9.0, variant="src"),
                        record(width=10, time_ms=1.0, variant="src")])

    assert dest.merge([source]) == 2
    for c in (dest, fresh(tmp_path)):
        assert [c.lookup(record(width=w)["key"])["best"]["variant"] for w in (8, 9, 10)] == ["src", "dest", "src"]
    assert dest.merge([source]) == 0  # idempotent


def test_merge_files_into_new_destination(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    write_file(a, [record(width=8, time_ms=5.0, variant="a"), record(width=9)])
    write_file(b, [record(width=8, time_ms=1.0, variant="b"), record(width=10)])
    into = tmp_path / "new" / "dir" / "merged.json"
    assert merge_files([a, b], into) == 3
    merged = json.loads(into.read_text())
    assert merged["schema"] == cache.SCHEMA_VERSION
    assert merged["records"][record(width=8)["key"]]["best"]["variant"] == "b"
    assert set(merged["records"]) == {record(width=w)["key"] for w in (8, 9, 10)}
    with pytest.raises(OSError):
        merge_files([tmp_path / "missing.json"], into)


def test_clear_removes_user_records_only(tmp_path):
    shipped = record(width=8, variant="shipped")
    write_file(tmp_path / "shipped" / "db.json", [shipped])
    c = fresh(tmp_path)
    c.store(record(width=8, variant="user"))
    c.store(record(width=9))
    assert c.lookup(shipped["key"])["best"]["variant"] == "user"

    c.clear()
    assert not c.path().exists()
    for view in (c, fresh(tmp_path)):
        assert view.lookup(shipped["key"])["best"]["variant"] == "shipped"
        assert view.lookup(record(width=9)["key"]) is None
    assert (tmp_path / "shipped" / "db.json").exists()


# ---------------------------------------------------------------- partial records (interrupted tunings)


def partial(record_, **covered):
    return dict(record_, partial=covered or {"variants_searched": ["thread_per_output"]})


def test_a_partial_record_never_replaces_a_full_one_and_a_full_one_always_replaces_a_partial(tmp_path):
    table = fresh(tmp_path)
    full = record(time_ms=1.0)
    assert not cache.is_partial(full) and cache.is_partial(partial(full))
    table.store(full)
    table.store(partial(record(time_ms=0.5)))  # faster, but interrupted: the full tuning stays
    for reader in (table, fresh(tmp_path)):
        assert not cache.is_partial(reader.lookup(full["key"]))
        assert reader.lookup(full["key"])["best"]["time_ms"] == 1.0
    other = record(width=9)
    table.store(partial(other))
    table.store(partial(record(width=9, time_ms=3.0)))  # a newer partial replaces an older partial
    assert table.lookup(other["key"])["best"]["time_ms"] == 3.0
    table.store(record(width=9, time_ms=2.0))  # slower than the partial, but a full tuning
    for reader in (table, fresh(tmp_path)):
        assert not cache.is_partial(reader.lookup(other["key"]))


def test_merge_prefers_a_full_record_to_a_faster_partial_one(tmp_path):
    write_file(tmp_path / "a.json", [record(time_ms=1.0)])
    write_file(tmp_path / "b.json", [partial(record(time_ms=0.1))])
    destination = tmp_path / "merged.json"
    assert merge_files([tmp_path / "b.json", tmp_path / "a.json"], destination) == 1
    merge_files([tmp_path / "b.json"], destination)
    (kept,) = json.loads(destination.read_text())["records"].values()
    assert not cache.is_partial(kept) and kept["best"]["time_ms"] == 1.0


def test_a_partial_field_that_is_not_an_object_is_malformed(tmp_path):
    bad = dict(record(), partial="yes")
    write_file(tmp_path / "user" / cache.USER_FILE, [bad])
    with pytest.warns(CacheWarning, match="'partial' field that is not an object"):
        assert fresh(tmp_path).lookup(bad["key"]) is None


# ---------------------------------------------------------------- what a record is worth; hostile files


def test_a_record_that_verified_less_never_replaces_one_that_verified_more(tmp_path):
    """A tuning cut short (a negative time limit: every variant failed but one) must not replace the
    full tuning stored moments before; one that verified as much or more does."""
    c = fresh(tmp_path)
    full = make_record(problem(), FP, KERNEL_HASH, {"variant": "a", "params": {"x": 1}, "time_ms": 2.0},
                       [{"variant": "b", "params": {"x": 2}, "time_ms": 3.0}], extra={"verified": 40})
    poor = make_record(problem(), FP, KERNEL_HASH, {"variant": "b", "params": {"x": 2}, "time_ms": 1.0}, [],
                       extra={"verified": 1})
    fewer_configs = dict(full, verified=39)
    assert c.store(full)
    assert not c.store(poor) and not c.store(fewer_configs)
    assert fresh(tmp_path).lookup(full["key"])["verified"] == 40
    assert c.lookup(full["key"])["verified"] == 40
    better = dict(full, verified=41, best=dict(full["best"], time_ms=5.0))
    assert c.store(better)
    assert fresh(tmp_path).lookup(full["key"])["verified"] == 41
    # merging follows the same rule
    source = tmp_path / "other.json"
    write_file(source, [dict(poor, best=dict(poor["best"], time_ms=0.5))])
    assert merge_files([source], c.path()) == 0


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "link-to-device", "deep-json"])
def test_special_files_and_pathological_json_are_a_warning_and_a_miss(tmp_path, kind):
    """Never a hang (a FIFO, /dev/zero) or a crash (RecursionError): loading warns and misses, store
    keeps its record in memory, tune's store path included."""
    path = tmp_path / "user" / cache.USER_FILE
    path.parent.mkdir()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        os.symlink("/dev/null", path)  # a character device (and readable as empty, without the check)
    elif kind == "directory":
        path.mkdir()
    elif kind == "link-to-device":
        os.symlink("/dev/zero", path)
    else:
        path.write_text("[" * 100_000)
    c = fresh(tmp_path)
    with pytest.warns(CacheWarning):
        assert c.lookup(record()["key"]) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c.store(record())
    assert any(issubclass(w.category, CacheWarning) for w in caught)
    assert c.lookup(record()["key"]) is not None


@pytest.mark.parametrize("field,value", [
    ("problem", {"input_shape": ["2", "3", "8", "8"]}),
    ("problem", {"output_shape": [2, 3, 4, True]}),
    ("problem", {"dtype": 32}),
    ("best", {"params": {"block_size": "128"}}),
    ("runners_up", [{"variant": "b", "params": {}, "time_ms": "fast"}]),
    ("default", {"variant": 3}),
    ("failures", [{"params": None}]),
    ("versions", "0.1"),
    ("date", 2026),
    ("tuning_seconds", "a minute"),
    ("verified", -1),
    ("verified", 2.5),
    ("tuning_seconds", float("nan")),
    ("partial", {"variants_searched": 5, "variants_not_searched": 7}),
    ("partial", {}),
    ("partial", {"variants_searched": ["a"], "variants_not_searched": "b"}),
    ("partial", {"variants_searched": ["a"], "variant_interrupted": 3}),
    ("partial", {"variants_searched": ["a"], "timing": None}),
    ("measured", {"rounds": "x", "seconds": None}),
    ("measured", {"seconds": 1.0}),
    ("measured", {"rounds": [3, True]}),
    ("measured", {"rounds": [3], "seconds": None}),
    ("measured", {"rounds": [3], "build_seconds": -1.0}),
])
def test_every_field_is_type_checked_on_load_and_merge(tmp_path, field, value):
    """e.g. an input_shape of strings made the key (int("2") == 2) and passed, and then every
    nearest-shape call of its family raised TypeError."""
    bad = record()
    merge = field in ("problem", "best") and isinstance(value, dict)  # one sub-field spoilt
    bad[field] = dict(bad[field], **value) if merge else value
    write_file(tmp_path / "user" / cache.USER_FILE, [bad])
    with pytest.warns(CacheWarning, match=repr(field)):
        assert fresh(tmp_path).lookup(bad["key"]) is None
    source = tmp_path / "source.json"
    write_file(source, [bad, record(width=9)])
    with pytest.warns(CacheWarning, match="not merged"):
        assert merge_files([source], tmp_path / "merged.json") == 1


@pytest.mark.parametrize("rounds", [[3, 0], 5], ids=["per-stage", "one-count"])
def test_a_measured_field_of_either_form_loads_without_warning(tmp_path, rounds):
    """A measured dispatch's record counts its rounds per stage; records of the first measured
    dispatch, which had one stage, hold a single count -- user caches that must still load."""
    good = dict(record(), measured={"rounds": rounds, "build_seconds": 0.5, "seconds": 1.5})
    write_file(tmp_path / "user" / cache.USER_FILE, [good])
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        assert fresh(tmp_path).lookup(good["key"]) is not None


def test_stale_temporary_files_are_removed_by_the_next_writer(tmp_path):
    """A writer killed mid-write leaves records.json.*.tmp; the next writer removes those older than
    the lock timeout, and leaves younger ones."""
    c = fresh(tmp_path)
    c.store(record(width=8))
    stale, young = c.path().with_name("records.json.abc.tmp"), c.path().with_name("records.json.def.tmp")
    for tmp in (stale, young):
        tmp.write_text("{")
    old = time.time() - cache.LOCK_TIMEOUT_S - 5
    os.utime(stale, (old, old))
    c.store(record(width=9))
    assert not stale.exists() and young.exists()


def strict_json(path):
    """The JSON of ``path``, refusing the NaN and Infinity that Python's reader takes."""
    def refuse(constant):
        raise AssertionError(f"{path} holds {constant}")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.mark.parametrize("where", ["tuning_seconds", "device", "versions", "runner-up", "extra field", "huge"])
def test_a_non_finite_number_anywhere_in_a_record_is_a_miss_and_never_breaks_a_write(tmp_path, where):
    """Python's JSON reader takes NaN and Infinity, which the cache never writes (its writer refuses
    them): a record that held one was loaded, and every later store and merge of that file raised
    ValueError instead of setting the record aside."""
    bad, good = record(width=8), record(width=9)
    if where == "tuning_seconds":
        bad["tuning_seconds"] = float("nan")
    elif where == "device":  # still its own key: the key hashes the whole fingerprint
        bad["device"] = dict(FP, clock=float("inf"))
        bad["key"] = make_key(problem(), bad["device"], KERNEL_HASH)
    elif where == "versions":
        bad["versions"] = dict(bad["versions"], pool_tuner=float("-inf"))
    elif where == "runner-up":
        bad["runners_up"][0]["spread"] = float("nan")
    elif where == "extra field":
        bad["notes"] = {"samples": [1.0, float("nan")]}
    else:  # 1e999 in the file, which reads as infinity
        bad["tuning_seconds"] = 12.5
    path = tmp_path / "user" / cache.USER_FILE
    write_file(path, [bad, good])
    if where == "huge":
        path.write_text(path.read_text().replace("12.5", "1e999"))
    c = fresh(tmp_path)
    with pytest.warns(CacheWarning, match="non-finite number"):
        assert c.lookup(bad["key"]) is None
    assert c.lookup(good["key"]) is not None
    with pytest.warns(CacheWarning, match="moved it to"):
        assert c.store(record(width=10))
    assert set(strict_json(path)["records"]) == {good["key"], record(width=10)["key"]}
    with no_warnings():
        assert c.store(record(width=11))

    source = tmp_path / "source.json"
    write_file(source, [bad, good])
    if where == "huge":
        source.write_text(source.read_text().replace("12.5", "1e999"))
    with pytest.warns(CacheWarning, match="non-finite number.*not merged"):
        assert merge_files([source], tmp_path / "merged.json") == 1
    assert set(strict_json(tmp_path / "merged.json")["records"]) == {good["key"]}
