"""Fleet tuning on a real local Ray cluster (docs/design.md, Fleet tuning): no mocks.

The cluster (``ray_cluster.LocalCluster``): a head node and a second node on 127.0.0.1 with
different PoCL thread counts, which makes them two device models: PoCL reports the thread count as
the device's compute units, part of its fingerprint.  The fault test adds a third node of the
head's model and kills its processes (SIGKILL, as if its machine died) while it tunes.  Budgets are tiny: one variant searched whole
on problems of a few hundred elements.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pool_tuner import cache as cache_mod
from pool_tuner import cli, fleet
from pool_tuner.problem import Problem

from ray_cluster import RAY_ENV, LocalCluster, node_env, resources_of

#: Every tuning here: one small variant, searched whole.
BUDGET = dict(variants=["thread_per_row"], strategy="brute_force")
PROBLEMS = [Problem.create("adaptive_avg_pool2d", (2, 3, 5, 7 + i), (3, 4), direction=direction)
            for i in range(3) for direction in ("forward", "backward")]
#: The PoCL thread count of each device model.
HEAD_THREADS, OTHER_THREADS = 1, 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    pytest.importorskip("ray", reason='fleet tuning needs Ray: pip install "pool-tuner[ray]"')
    if resources_of(HEAD_THREADS) == resources_of(OTHER_THREADS):
        pytest.skip("PoCL reports the same device for both thread counts: no second device model here")
    saved = {k: os.environ.get(k) for k in RAY_ENV}
    os.environ.update(RAY_ENV)
    cluster = LocalCluster(tmp_path_factory.mktemp("ray_cluster"))
    try:
        cluster.start(HEAD_THREADS, head=True)
        cluster.start(OTHER_THREADS)
        yield cluster
    finally:
        cluster.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def model_of(node) -> str:
    (resource,) = node.resources
    return resource[len(fleet.RESOURCE_PREFIX):]


def records(directory: Path) -> dict:
    return json.loads((directory / cache_mod.USER_FILE).read_text())["records"]


@pytest.fixture(scope="module")
def two_model_run(cluster, tmp_path_factory):
    """Every problem on every device model of the cluster, into a cache of its own."""
    cache_dir = tmp_path_factory.mktemp("two_models")
    report = fleet.tune_many(PROBLEMS, ray_address=cluster.address, progress=False,
                             tuning_cache=cache_mod.TuningCache(tmp_path_factory.mktemp("shipped"), cache_dir), **BUDGET)
    return report, records(cache_dir)


def test_every_device_model_tunes_every_problem_and_the_records_name_their_device(cluster, two_model_run):
    report, stored = two_model_run
    head, other = model_of(cluster.nodes[0]), model_of(cluster.nodes[1])
    assert set(report.models) == {head, other}
    assert all(o.tuned and o.stored and o.attempts == 1 for o in report.outcomes), report.summary()
    assert len(stored) == len(PROBLEMS) * 2
    for outcome in report.outcomes:
        record = stored[outcome.record["key"]]
        assert record == outcome.record  # the worker's record, as it sent it
        assert fleet.model_hash(record["device"]) == outcome.model
        assert f"dev={outcome.model}|" in record["key"]
        assert cache_mod.problem_of(record) == outcome.problem
    units = {o.model: stored[o.record["key"]]["device"]["compute_units"] for o in report.outcomes}
    assert units == {head: HEAD_THREADS, other: OTHER_THREADS}
    summary = report.summary()
    assert f"{len(PROBLEMS)} tuned, 0 retried, 0 failed" in summary and summary.count("[") == 2


def test_a_node_killed_mid_run_loses_no_problem(cluster, two_model_run, tmp_path):
    """A third node of the head's model joins; it is killed while it tunes (its worker process has
    the task's name as its title).  Every problem still ends in the cache, retried on the head, with records that
    match the undisturbed run's apart from timings."""
    head = model_of(cluster.nodes[0])
    doomed = cluster.start(HEAD_THREADS)
    assert model_of(doomed) == head
    cache_dir = tmp_path / "cache"

    killed_mid_task = []
    killer = threading.Thread(target=lambda: killed_mid_task.append(cluster.kill_once_it_tunes(doomed)))
    killer.start()
    try:
        report = fleet.tune_many(PROBLEMS, ray_address=cluster.address, device_filter=head, progress=False,
                                 tuning_cache=cache_mod.TuningCache(tmp_path / "shipped", cache_dir), **BUDGET)
    finally:
        killer.join()
    assert killed_mid_task == [True], f"the node was never killed while tuning: {report.summary()}"
    assert doomed.wait(timeout=10) is not None  # killed, not stopped after the run
    assert set(report.models) == {head} and len(report.models[head].nodes) == 2
    assert all(o.tuned for o in report.outcomes), report.summary()
    assert any(o.attempts > 1 for o in report.outcomes), f"the killed node was running no tuning: {report.summary()}"
    assert "0 failed" in report.summary() and "0 retried" not in report.summary()
    stored = records(cache_dir)
    assert len(stored) == len(PROBLEMS)
    undisturbed = {k: r for k, r in two_model_run[1].items() if f"dev={head}|" in k}
    assert set(stored) == set(undisturbed)
    for key, record in stored.items():
        assert fleet.timing_free(record) == fleet.timing_free(undisturbed[key]), key


def test_a_problem_that_fails_on_every_node_is_reported_with_its_error_and_not_retried(cluster, tmp_path):
    """plane_reduce pools whole planes only: no configuration of it can run a 3x4 output."""
    report = fleet.tune_many(PROBLEMS[:1], ray_address=cluster.address, variants=["plane_reduce"], progress=False,
                             tuning_cache=cache_mod.TuningCache(tmp_path / "shipped", tmp_path / "cache"))
    assert len(report.outcomes) == 2 and not any(o.tuned for o in report.outcomes)
    assert all(o.attempts == 1 and o.error.startswith("ValueError: variants: no variant can run adaptive_avg_pool2d")
               and "plane_reduce: only for global pooling" in o.error for o in report.outcomes), report.summary()
    summary = report.summary()
    assert "0 of 2 tunings done" in summary and summary.count("FAILED adaptive_avg_pool2d forward") == 2
    assert not (tmp_path / "cache" / cache_mod.USER_FILE).exists()


def test_without_an_address_a_local_cluster_of_this_machines_devices_tunes_and_is_shut_down(tmp_path):
    pytest.importorskip("ray", reason='fleet tuning needs Ray: pip install "pool-tuner[ray]"')
    import ray

    report = fleet.tune_many(PROBLEMS[:1], progress=False,
                             tuning_cache=cache_mod.TuningCache(tmp_path / "shipped", tmp_path / "cache"), **BUDGET)
    assert [o.tuned for o in report.outcomes] == [True] and not ray.is_initialized()
    assert {m.resource: sum(m.nodes.values()) for m in report.models.values()} == fleet.node_resources()
    assert len(records(tmp_path / "cache")) == 1


def test_a_connection_the_caller_made_is_used_and_left_open(cluster, tmp_path):
    import ray

    ray.init(address=cluster.address, log_to_driver=False)
    try:
        with pytest.raises(ValueError, match="connected to a Ray cluster already; pass ray_address=None"):
            fleet.tune_many(PROBLEMS[:1], ray_address=cluster.address, **BUDGET)
        report = fleet.tune_many(PROBLEMS[:1], device_filter=model_of(cluster.nodes[0]), progress=False,
                                 tuning_cache=cache_mod.TuningCache(tmp_path / "shipped", tmp_path / "cache"), **BUDGET)
        assert ray.is_initialized() and [o.tuned for o in report.outcomes] == [True]
    finally:
        ray.shutdown()


def test_a_device_filter_matching_no_model_names_the_models_before_any_work(cluster, tmp_path, capsys):
    code = cli.main(["tune", "--input", "2x3x5x7", "--output", "3x4", "--ray", cluster.address,
                     "--device-filter", "no-such-device", "--quiet"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_ERROR
    (line,) = err.strip().splitlines()[-1:]
    assert line.startswith("pool-tuner: error: --device-filter term 'no-such-device' matches no device model")
    assert model_of(cluster.nodes[0]) in line and model_of(cluster.nodes[1]) in line


def test_the_command_line_tunes_on_the_cluster_and_prints_the_summary(cluster, tmp_path):
    cache_dir = tmp_path / "cache"
    env = dict(node_env(HEAD_THREADS), POOL_TUNER_CACHE_DIR=str(cache_dir))
    proc = subprocess.run([sys.executable, "-m", "pool_tuner.cli", "tune", "--input", "2x3x5x7", "--output", "3x4",
                           "--direction", "forward", "--variants", "thread_per_row", "--strategy", "brute_force",
                           "--ray", cluster.address, "--device-filter", "cpu", "--quiet"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "fleet tuning: 2 of 2 tunings done" in proc.stdout
    assert len(records(cache_dir)) == 2


def test_ctrl_c_cancels_the_queued_tunings_and_keeps_the_finished(cluster, tmp_path):
    """SIGINT to the driver once its first record is stored: exit 130, one line saying what was
    kept, and the cache holds what finished."""
    cache_dir = tmp_path / "cache"
    env = dict(node_env(HEAD_THREADS), POOL_TUNER_CACHE_DIR=str(cache_dir))
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps([{"input": [2, 3, 5, 7 + i], "output": [3, 4]} for i in range(8)]))
    driver = subprocess.Popen([sys.executable, "-m", "pool_tuner.cli", "tune", "--shapes", str(shapes),
                               "--variants", "thread_per_row", "--strategy", "brute_force", "--ray", cluster.address,
                               "--device-filter", model_of(cluster.nodes[0]), "--quiet"],
                              env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (cache_dir / cache_mod.USER_FILE).exists() and time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.05)
    driver.send_signal(signal.SIGINT)
    out, err = driver.communicate(timeout=60)
    assert driver.returncode == cli.EXIT_INTERRUPTED, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("pool-tuner: interrupted: ") and "fleet tunings finished and kept in" in line, err
    kept = int(line.split("interrupted: ")[1].split(" of ")[0])
    assert 1 <= kept < 16 and len(records(cache_dir)) == kept
    assert "queued cancelled" in line and "running dropped" in line


# ---------------------------------------------------------------- without a cluster


def test_without_ray_the_option_says_how_to_install_it_before_any_work(capsys, monkeypatch, user_cache):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as where it is not installed
    code = cli.main(["tune", "--input", "2x3x5x7", "--output", "3x4", "--ray"])
    assert code == cli.EXIT_ERROR
    assert capsys.readouterr().err == ('pool-tuner: error: --ray needs Ray, which is not installed: '
                                       'pip install "pool-tuner[ray]"\n')
    with pytest.raises(RuntimeError, match=r'tune_many needs Ray.*pool-tuner\[ray\]'):
        fleet.tune_many(PROBLEMS)
    assert not (user_cache / cache_mod.USER_FILE).exists()


@pytest.mark.parametrize("argv, mentions", [
    (["--ray", "--device", "opencl:pocl:0"], "--device names a device of this machine"),
    (["--device-filter", "cpu"], "--device-filter and --max-retries need --ray"),
    (["--max-retries", "2"], "--device-filter and --max-retries need --ray"),
])
def test_fleet_options_are_checked_before_any_work(capsys, user_cache, argv, mentions):
    code = cli.main(["tune", "--input", "2x3x5x7", "--output", "3x4", *argv])
    assert code == cli.EXIT_ERROR
    assert mentions in capsys.readouterr().err


@pytest.mark.parametrize("call, error, mentions", [
    (lambda: fleet.tune_many([]), ValueError, "problems is empty"),
    (lambda: fleet.tune_many([("adaptive_avg_pool2d", (2, 3, 5, 7), (3, 4))]), TypeError, r"problems\[0\] must be"),
    (lambda: fleet.tune_many(PROBLEMS, max_retries=-1), ValueError, "max_retries must be an integer >= 0"),
    (lambda: fleet.tune_many(PROBLEMS, device_filter=""), ValueError, "device_filter must be"),
    (lambda: fleet.tune_many(PROBLEMS, ray_address=6379), TypeError, "ray_address must be"),
    (lambda: fleet.tune_many(PROBLEMS, variants=["no_such_variant"]), ValueError, "variants must be one of"),
])
def test_tune_many_refuses_bad_arguments_before_connecting(call, error, mentions):
    pytest.importorskip("ray", reason='fleet tuning needs Ray: pip install "pool-tuner[ray]"')
    import ray

    with pytest.raises(error, match=mentions):
        call()
    assert not ray.is_initialized()


def test_node_resources_name_every_device_model_of_the_machine():
    resources = fleet.node_resources()
    devices = fleet.fleet_devices()
    assert sum(resources.values()) == len(devices) and all(not d.info.is_simulator for d in devices)
    assert set(resources) == {fleet.RESOURCE_PREFIX + cache_mod.make_key(
        Problem.create("adaptive_avg_pool1d", (1, 1, 2), 1), d.info.fingerprint, "0" * 16).split("dev=")[1].split("|")[0]
        for d in devices}
