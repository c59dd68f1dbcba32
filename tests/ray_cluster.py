"""A Ray cluster of real nodes on this machine, for tests/test_fleet.py and
benchmarks/fleet_tuning.py: each node a ``ray start --block`` process (a process group of its own)
on 127.0.0.1 with its own environment -- PoCL's thread count, which PoCL reports as the device's
compute units, so nodes of different counts are different device models -- and optionally pinned
to CPUs with ``taskset``.  Nodes are stopped, or killed as if their machine died, by the ids of
their processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).with_name("ray")
#: Ray without token authentication: every node listens on this machine only.
RAY_ENV = {"RAY_AUTH_MODE": "disabled"}
#: How long a node may take to start on a loaded machine.
START_TIMEOUT_S = 90


def node_env(threads: int, extra: dict | None = None) -> dict:
    """The environment of a node (and of a driver or tuner meant to see the same device): PoCL with
    ``threads`` worker threads, pool_tuner from this checkout, and ``extra``."""
    env = dict(os.environ, **RAY_ENV, POCL_MAX_PTHREAD_COUNT=str(threads), **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def resources_of(threads: int) -> dict:
    """What ``pool-tuner devices --ray-resources`` prints on a node with this PoCL thread count."""
    out = subprocess.run([sys.executable, "-m", "pool_tuner.cli", "devices", "--ray-resources"], env=node_env(threads),
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return json.loads(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    """Ray nodes on this machine; ``start`` the head first."""

    def __init__(self, directory: Path, env: dict | None = None):
        self.directory = Path(directory)
        #: Set in every node's environment besides ``node_env``'s.
        self.env = env
        #: Ray's session files: a short path, as its sockets' paths must stay within 107 bytes.
        self.ray_dir = Path(tempfile.mkdtemp(prefix="ptray_", dir="/tmp"))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes = []

    def start(self, threads: int, head: bool = False, cpus: str | None = None) -> subprocess.Popen:
        """A node whose device is PoCL with ``threads`` threads, pinned to ``cpus`` (taskset's list)
        if given; returns once Ray says it runs.  The node's ``resources`` attribute is what it offers."""
        resources = resources_of(threads)
        log = self.directory / f"node{len(self.nodes)}.log"
        command = [str(RAY), "start", "--block", "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
                   "--resources", json.dumps(resources), "--disable-usage-stats"]
        command += (["--head", "--port", str(self.port), "--include-dashboard", "false",
                     "--temp-dir", str(self.ray_dir)] if head else ["--address", self.address])
        if cpus is not None:
            command = ["taskset", "-c", cpus] + command
        with open(log, "w") as out:
            node = subprocess.Popen(command, env=node_env(threads, self.env), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        node.resources = resources
        self.nodes.append(node)
        deadline = time.monotonic() + START_TIMEOUT_S
        while "Ray runtime started" not in log.read_text():
            if node.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start failed:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        return node

    @staticmethod
    def processes(node: subprocess.Popen) -> dict:
        """``{pid: title}`` of ``node``'s processes: ``ray start`` and its descendants (Ray's
        workers run in sessions of their own, so the node's process group does not hold them)."""
        parents, titles = {}, {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                titles[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes()
            except (OSError, IndexError, ValueError):
                continue
        found, frontier = {}, [node.pid]
        while frontier:
            pid = frontier.pop()
            found[pid] = titles.get(pid, b"")
            frontier += [child for child, parent in parents.items() if parent == pid and child not in found]
        return found

    def tuning_in(self, node: subprocess.Popen) -> bool:
        """Whether ``node`` runs a fleet tuning (Ray titles a worker with the name of its task)."""
        return any(title.startswith(b"ray::pool_tuner tune on") for title in self.processes(node).values())

    def kill(self, node: subprocess.Popen, sig=signal.SIGKILL) -> None:
        """``sig`` to every process of ``node`` (SIGKILL: as if its machine died)."""
        for pid in self.processes(node):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def kill_once_it_tunes(self, node: subprocess.Popen, timeout: float = 120) -> bool:
        """Wait until ``node`` tunes, then kill it a moment into the task (past its start, which the
        fleet's ledger counts) if the task still runs then -- a small problem can finish within that
        moment, and killing an idle node tests nothing: then wait for its next task.  Returns whether
        it was killed mid-task (False: it was killed at ``timeout`` without one)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.tuning_in(node):
                time.sleep(0.3)
                if self.tuning_in(node):
                    self.kill(node)
                    return True
            time.sleep(0.05)
        self.kill(node)
        return False

    def stop(self) -> None:
        for node in reversed(self.nodes):
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGTERM)  # ray start stops its node
        deadline = time.monotonic() + 10
        for node in reversed(self.nodes):
            try:
                node.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            self.kill(node)  # whatever is left of it
            node.wait()
        shutil.rmtree(self.ray_dir, ignore_errors=True)
