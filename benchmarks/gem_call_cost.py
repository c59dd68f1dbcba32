"""GeM's per-call host cost with a ``p`` that changes on every call (a learnt exponent in
training), on a tiny input where the kernel's own time is small: the numpy API
(``pool_tuner.adaptive_gem_pool2d(x, 1, p)``) and ``pool_tuner.torch.adaptive_gem_pool2d`` with a
one-element ``p`` tensor, each in a hot loop, forward only, plus the same call with the default
``p`` as the floor.  ``--fake-cuda``: instead, the host side of a CUDA call alone -- the plan's
``run`` with this call's scalars, on the fake driver of ``tests/cuda_fakes.py`` with its
``cuLaunchKernel`` a no-op (no GPU: what preparing the launch costs, not the launch).  Prints one
JSON line: per case, the median microseconds per call of each round.  Run it for two trees in
alternation (``--rounds`` each) to compare them on a shared machine.

    PYTHONPATH=TREE python benchmarks/gem_call_cost.py [--shape 1x8x4x4] [--calls 2000] [--rounds 5] [--fake-cuda]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import numpy as np
import torch

import pool_tuner as pt
import pool_tuner.torch as ptt


def per_call_us(call, calls: int) -> float:
    """Median over blocks of 100 calls of the microseconds per call."""
    blocks = []
    for _ in range(calls // 100):
        start = time.perf_counter()
        for _ in range(100):
            call()
        blocks.append((time.perf_counter() - start) * 1e4)
    return statistics.median(blocks)


def fake_cuda_cases(t: torch.Tensor, varying_p) -> dict:
    """The plan's ``run`` of a GeM forward on the fake CUDA driver (CPU tensors stand in for CUDA
    ones), with a new ``p`` each call and with the plan's own scalars."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
    import cuda_fakes
    from pool_tuner import torch_cuda
    from pool_tuner.backends import cuda

    driver, device = cuda_fakes.FakeDriver(), cuda_fakes.fake_cuda_device()
    driver.set_current(cuda_fakes.PRIMARY_CONTEXT)
    driver.cuLaunchKernel = lambda *arguments: 0  # the launch itself is not what is measured
    cuda.cuda_driver.library = lambda: driver
    cuda.list_devices = lambda: (device,)
    cuda._compile = lambda source, arch: b"cubin:" + source.encode()
    found = torch_cuda.plan_op("adaptive_gem_pool2d", "forward", [t], (1, 1), "")
    allocate = lambda result, fill: torch.empty(result.shape)  # noqa: E731
    address = torch.Tensor.data_ptr

    def varying():
        found.run([t], allocate, address, 0, found.problem.with_arguments({"p": varying_p(), "eps": 1e-6}))

    def default():
        found.run([t], allocate, address, 0)

    return {"fake cuda run, p varies": varying, "fake cuda run, default p": default}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1x8x4x4")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fake-cuda", action="store_true", help="the host side of a CUDA call, on the fake driver")
    args = parser.parse_args()
    shape = tuple(int(n) for n in args.shape.split("x"))
    x = np.random.default_rng(0).random(shape, dtype=np.float32) + 0.5
    t = torch.from_numpy(x.copy())
    steps = iter(range(10**9))

    def varying_p():
        return 2.0 + (next(steps) % 97) * 0.01

    p_tensor = torch.tensor([3.0])

    def torch_varying():
        p_tensor.fill_(varying_p())
        return ptt.adaptive_gem_pool2d(t, 1, p_tensor)

    cases = fake_cuda_cases(t, varying_p) if args.fake_cuda else {
        "numpy, p varies": lambda: pt.adaptive_gem_pool2d(x, 1, varying_p()),
        "numpy, default p": lambda: pt.adaptive_gem_pool2d(x, 1),
        "torch, p varies": torch_varying,
        "torch, default p": lambda: ptt.adaptive_gem_pool2d(t, 1),
    }
    for call in cases.values():  # plans made, kernels built
        for _ in range(200):
            call()
    results = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, call in cases.items():
            results[name].append(round(per_call_us(call, args.calls), 2))
    print(json.dumps(results))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
