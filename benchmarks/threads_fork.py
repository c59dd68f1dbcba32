"""Whether pool_tuner gives right answers from many threads at once, and in a forked child.

Not a timing: a checker of two things users do with a library on a CPU.

* Threads (``stress``): 8 threads (``--threads``), the interpreter switching between them every
  10 microseconds (``sys.setswitchinterval(1e-5)``) so that any unguarded step of the call path
  can be interleaved, each call ``--calls`` times: pool_tuner's numpy API, or the
  ``pool_tuner.torch`` modules (instances shared by all threads, as a model's layers are), avg and
  max, on inputs of their own (so a result that went to the wrong caller is caught) and on shapes
  of three kinds: called before the threads start, first called by every thread at once, and first
  called by one thread alone while the others run.  Every result is compared with PyTorch's
  ``torch.nn.functional`` on the same input, computed beforehand in one thread (avg: ``allclose``;
  max: equal).  Counted: wrong results, exceptions, and runs that crashed (a signal such as
  SIGSEGV) or hung -- each run is a process of its own with a time limit, so a crash is counted,
  not fatal.
* Fork (``fork``): a process uses pool_tuner (numpy API or torch module: device, queue, built
  kernels, memory pool), then forks; the child calls it on a shape the parent used and on a new one
  (the torch child first sets PyTorch to one thread, as DataLoader's workers do: PyTorch's own
  thread pool hangs a forked child's calls otherwise, pool_tuner or not).
  The parent waits ``--fork-timeout`` seconds; each step of the child is ``correct``, ``wrong``,
  ``error`` (an exception), or the child ``crashed`` or ``hung`` there.

Exits 1 when anything was wrong, raised, crashed or hung, so it can gate a change.

    python benchmarks/threads_fork.py [--runs 3] [--threads 8] [--calls 500] [--fork-timeout 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback

import numpy as np

import common

APIS = common.APIS
#: Shapes called once before the threads start, and shapes every thread calls first at once.
WARMED = [((2, 8, 9, 9), (4, 4)), ((1, 16, 7, 7), (1, 1))]
SHARED_NEW = [((3, 5, 10, 13), (3, 5)), ((2, 6, 11, 8), (4, 3))]
#: Each thread's own new shape: channels ``OWN_CHANNELS + thread``.
OWN_CHANNELS = 7
OWN_SHAPE = (1, None, 12, 10)
OWN_OUTPUT = (5, 4)


def _pools(api: str):
    """``{"avg": f, "max": f}``: one call of the API under test on a numpy array, returning numpy."""
    if api == "torch":
        import torch

        import pool_tuner.torch as ptt

        modules = {}  # (kind, output size) -> module, made before any thread starts

        def pool(kind):
            return lambda x, out: modules[(kind, out)](torch.from_numpy(x)).numpy()

        def prepare(outputs):
            for out in outputs:
                modules[("avg", out)] = ptt.AdaptiveAvgPool2d(out)
                modules[("max", out)] = ptt.AdaptiveMaxPool2d(out)

        return {"avg": pool("avg"), "max": pool("max")}, prepare
    import pool_tuner as pt

    return {"avg": pt.adaptive_avg_pool2d, "max": pt.adaptive_max_pool2d}, lambda outputs: None


def _expected(kind: str, x, out):
    import torch

    fn = torch.nn.functional.adaptive_avg_pool2d if kind == "avg" else torch.nn.functional.adaptive_max_pool2d
    return fn(torch.from_numpy(x), out).numpy()


def _agrees(kind: str, got, expected) -> bool:
    if got.shape != expected.shape:
        return False
    return bool(np.allclose(got, expected, rtol=1e-5, atol=1e-6) if kind == "avg" else np.array_equal(got, expected))


def stress_child(args) -> dict:
    """One stress run (a process of its own); returns counts."""
    pools, prepare = _pools(args.api)
    rng = np.random.default_rng()
    own = [((OWN_SHAPE[0], OWN_CHANNELS + t) + OWN_SHAPE[2:], OWN_OUTPUT) for t in range(args.threads)]
    prepare({out for _, out in WARMED + SHARED_NEW + own})
    work = []  # per thread: [(label, kind, x, out, expected)]
    for t in range(args.threads):
        cases = []
        for shape, out in WARMED + SHARED_NEW + [own[t]]:
            x = rng.standard_normal(shape, dtype=np.float32)
            cases += [(f"{kind} {'x'.join(map(str, shape))}->{'x'.join(map(str, out))}", kind, x, out,
                       _expected(kind, x, out)) for kind in ("avg", "max")]
        work.append(cases)
    for shape, out in WARMED:
        for kind in ("avg", "max"):
            pools[kind](rng.standard_normal(shape, dtype=np.float32), out)
    counts = {"calls": 0, "wrong": 0, "errors": 0}
    wrong_by_case = {}
    messages = []
    lock = threading.Lock()
    start = threading.Barrier(args.threads)

    def worker(cases):
        calls = wrong = errors = 0
        start.wait()
        for i in range(args.calls):
            label, kind, x, out, expected = cases[i % len(cases)]
            try:
                if not _agrees(kind, pools[kind](x, out), expected):
                    wrong += 1
                    with lock:
                        wrong_by_case[label] = wrong_by_case.get(label, 0) + 1
            except Exception:  # counted: an exception from a correct call is a failure like a wrong result
                errors += 1
                with lock:
                    if len(messages) < 5:
                        messages.append(traceback.format_exc(limit=3))
            calls += 1
        with lock:
            counts["calls"] += calls
            counts["wrong"] += wrong
            counts["errors"] += errors

    sys.setswitchinterval(1e-5)
    threads = [threading.Thread(target=worker, args=(cases,)) for cases in work]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return dict(counts, seconds=time.perf_counter() - began, wrong_by_case=wrong_by_case, first_errors=messages)


def fork_child(args) -> dict:
    """Use the API, fork, and follow the child's steps through a pipe."""
    pools, prepare = _pools(args.api)
    rng = np.random.default_rng()
    used, new = WARMED[0], SHARED_NEW[0]
    prepare({used[1], new[1]})
    for kind in ("avg", "max"):
        pools[kind](rng.standard_normal(used[0], dtype=np.float32), used[1])
    steps = [(f"{kind} {label}", kind, rng.standard_normal(shape, dtype=np.float32), out)
             for label, (shape, out) in (("used shape", used), ("new shape", new)) for kind in ("avg", "max")]
    steps = [(name, kind, x, out, _expected(kind, x, out)) for name, kind, x, out in steps]
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the forked child: report each step as it ends, then leave without cleanup
        os.close(read_end)
        if args.api == "torch":
            # As DataLoader's workers do: PyTorch's own OpenMP thread pool is not fork-safe (after
            # the parent used it, torch.nn.functional.adaptive_avg_pool2d alone hangs in a child).
            import torch

            torch.set_num_threads(1)
        status = 0
        for name, kind, x, out, expected in steps:
            try:
                outcome = "correct" if _agrees(kind, pools[kind](x, out), expected) else "wrong"
            except Exception as error:
                outcome = f"error: {type(error).__name__}: {error}"
            status |= outcome != "correct"
            os.write(write_end, (json.dumps([name, outcome]) + "\n").encode())
        os._exit(status)
    os.close(write_end)
    deadline = time.monotonic() + args.fork_timeout
    buffer, ended = b"", None
    while ended is None and time.monotonic() < deadline:
        ready, _, _ = select.select([read_end], [], [], 0.1)
        if ready:
            buffer += os.read(read_end, 65536)
        done_pid, status = os.waitpid(pid, os.WNOHANG)
        if done_pid:
            ended = status
    if ended is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    while True:  # what the child wrote before it ended or was killed
        ready, _, _ = select.select([read_end], [], [], 0)
        chunk = os.read(read_end, 65536) if ready else b""
        if not chunk:
            break
        buffer += chunk
    reported = dict(json.loads(line) for line in buffer.decode().splitlines())
    ending = ("hung" if ended is None else
              f"crashed ({signal.Signals(os.WTERMSIG(ended)).name})" if os.WIFSIGNALED(ended) else
              f"exited (status {os.WEXITSTATUS(ended)}) without a report")
    outcomes = {}
    for name, *_ in steps:
        if name in reported:
            outcomes[name] = reported[name]
        else:  # the step the child was in when it crashed or hung, and the ones it never reached
            outcomes[name] = ending if name == steps[len(reported)][0] else "not reached"
    return {"outcomes": outcomes}


def run(args, scenario: str, api: str, timeout: float) -> dict:
    """A child process for one scenario: its report, or how it ended (crash, hang, failure)."""
    command = [sys.executable, __file__, "--child", scenario, "--api", api, "--threads", str(args.threads),
               "--calls", str(args.calls), "--fork-timeout", str(args.fork_timeout)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ended": "hung", "timeout_s": timeout}
    if done.returncode < 0:
        return {"ended": f"crashed ({signal.Signals(-done.returncode).name})", "stderr": done.stderr[-2000:]}
    if done.returncode != 0:
        return {"ended": f"failed (exit {done.returncode})", "stderr": done.stderr[-2000:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]), ended="finished")


def main():
    parser = common.parser(__doc__)
    parser.add_argument("--api", default=",".join(APIS), help="comma-separated, of numpy, torch (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=3, help="stress runs per API (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=8, help="threads per stress run (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=500, help="calls per thread (default: %(default)s)")
    parser.add_argument("--stress-timeout", type=float, default=120.0,
                        help="seconds before a stress run counts as hung (default: %(default)s)")
    parser.add_argument("--fork-timeout", type=float, default=30.0,
                        help="seconds the forked child gets (default: %(default)s)")
    parser.add_argument("--child", choices=("stress", "fork"), help=argparse.SUPPRESS)
    common.add_output_argument(parser)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(stress_child(args) if args.child == "stress" else fork_child(args)))
        return
    apis = args.api.split(",")
    if set(apis) - set(APIS):
        parser.error(f"--api takes {', '.join(APIS)}")
    info = common.circumstances()
    print(common.describe_circumstances(info))
    print(f"stress: {args.threads} threads x {args.calls} calls, switch interval 1e-5 s, {args.runs} runs per API")
    failed = False
    stress_rows, fork_rows, results = [], [], {"stress": {}, "fork": {}}
    for api in apis:
        runs = [run(args, "stress", api, args.stress_timeout) for _ in range(args.runs)]
        results["stress"][api] = runs
        finished = [r for r in runs if r["ended"] == "finished"]
        endings = [r["ended"] for r in runs if r["ended"] != "finished"]
        calls, wrong, errors = (sum(r[k] for r in finished) for k in ("calls", "wrong", "errors"))
        failed |= bool(wrong or errors or endings)
        stress_rows.append([api, f"{len(finished)}/{len(runs)}", calls, wrong, errors, "; ".join(endings) or "-",
                            f"{np.median([r['seconds'] for r in finished]):.1f}" if finished else "-"])
        for r in runs:
            if r.get("wrong_by_case"):
                print(f"\n{api} stress, wrong results by call: {r['wrong_by_case']}")
            for message in r.get("first_errors", [])[:1] + [r.get("stderr", "")]:
                if message.strip():
                    print(f"\n{api} stress, {r['ended']}:\n{message.rstrip()}")
        fork = run(args, "fork", api, args.fork_timeout + 120)
        results["fork"][api] = fork
        outcomes = fork.get("outcomes", {})
        failed |= fork["ended"] != "finished" or any(v != "correct" for v in outcomes.values())
        fork_rows += [[api, step, outcome] for step, outcome in outcomes.items()] or [[api, "(parent)", fork["ended"]]]
    print("\nThreads")
    print(common.format_table(["api", "runs finished", "calls", "wrong", "exceptions", "crashed/hung runs",
                               "s per run"], stress_rows))
    print("\nFork: the child's calls after the parent used pool_tuner")
    print(common.format_table(["api", "step in the child", "outcome"], fork_rows))
    print(f"\n{'FAILED' if failed else 'passed'}: wrong results, exceptions, crashes and hangs count as failures")
    common.write_json(args.out, {"benchmark": "threads_fork", "circumstances": common.record_end(info),
                                 "threads": args.threads, "calls": args.calls, "results": results, "failed": failed})
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
