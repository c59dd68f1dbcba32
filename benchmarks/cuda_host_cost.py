"""Host time per warm call of ``pool_tuner.torch`` on its eager CUDA path, without a GPU.

CPU tensors stand in for CUDA tensors. Every driver call goes through ctypes into
``tests/data/stub_libcuda.c``, built here with the C compiler. The stub records a launch and
returns, so each call pays what a GPU call pays on the host (signature, lookup, allocation,
argument slots, the ctypes launch), but nothing for the kernel or the driver's own work.

Timed in the same process, in alternating loops:

* ``pool_tuner``: ``pool_tuner.torch.AdaptiveAvgPool2d`` on its eager CUDA path;
* ``torch.nn``: PyTorch's own layer on the same CPU tensor (its CPU kernel included, so the ratio
  is a yardstick, not the GPU's);
* ``bare``: the plan's prepared launch alone.

Each is timed forward, and for a training call (forward plus ``backward``).

Prints one JSON line: per case, the median microseconds per call over the rounds. Run it for two
trees in alternation to compare them on a shared machine; only a GPU gives the real figures
(``cuda_call_overhead.py``).

    PYTHONPATH=TREE python benchmarks/cuda_host_cost.py [--shape 2x16x14x14] [--calls 2000] [--rounds 15]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

TESTS = pathlib.Path(__file__).resolve().parent.parent / "tests"


def stub_library(directory: pathlib.Path):
    """``tests/data/stub_libcuda.c`` built into ``directory`` and loaded with libcuda's signatures."""
    from pool_tuner.backends import cuda_driver

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        sys.exit("cuda_host_cost: needs a C compiler (cc or gcc) to build tests/data/stub_libcuda.c")
    library = directory / "libstubcuda.so"
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(TESTS / "data" / "stub_libcuda.c")],
                   check=True)
    return cuda_driver.declare_signatures(ctypes.CDLL(str(library)))


def install(lib) -> None:
    """pool_tuner's CUDA path on the stub: one fake device (tests/cuda_fakes.py), the compiler stubbed,
    CPU tensors sent down the eager CUDA path, PyTorch's current stream the legacy default."""
    sys.path.insert(0, str(TESTS))
    from cuda_fakes import fake_cuda_device

    from pool_tuner import dispatch, torch_cuda
    from pool_tuner import torch as ptt
    from pool_tuner.backends import cuda, cuda_driver

    device = fake_cuda_device()
    cuda_driver.library = lambda: lib
    cuda.list_devices = lambda: (device,)
    cuda._compile = lambda source, arch: b"cubin:" + source.encode()
    torch_cuda.current_raw_stream = lambda index: 0
    ptt._eager_cpu_pool = ptt._eager_cuda_pool
    cuda_driver.primary_context.cache_clear()
    cuda.forget_builds()
    dispatch.forget()


def per_call_us(call, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) * 1e6 / calls


def cases(shape: tuple) -> dict:
    """name -> call of no arguments (see the module docstring)."""
    from pool_tuner import torch as ptt
    from pool_tuner import torch_cuda

    x = torch.rand(shape)
    x_grad = x.clone().requires_grad_()
    ours, theirs = ptt.AdaptiveAvgPool2d(1), torch.nn.AdaptiveAvgPool2d(1)
    grad = torch.rand(theirs(x).shape)
    ours(x_grad).backward(grad)
    forward = torch_cuda.plan_op("adaptive_avg_pool2d", "forward", [x], (1, 1), "")  # the layer's kernel
    out = ours(x)
    launch, pointers = forward.prepared_launch(), (x.data_ptr(), out.data_ptr())
    return {"pool_tuner forward": lambda: ours(x), "torch.nn forward": lambda: theirs(x),
            "bare forward": lambda: launch(0, *pointers),
            "pool_tuner training": lambda: ours(x_grad).backward(grad),
            "torch.nn training": lambda: theirs(x_grad).backward(grad)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="2x16x14x14", help="the NCHW input, pooled to 1x1")
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed loop")
    parser.add_argument("--rounds", type=int, default=15, help="timed loops of each case")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.autograd.set_multithreading_enabled(False)  # the backward on this thread, as the CPU's
    with tempfile.TemporaryDirectory() as directory:
        lib = stub_library(pathlib.Path(directory))
        ctypes.c_int.in_dll(lib, "n_pointers").value = 2
        lib.cuCtxSetCurrent(None)
        install(lib)
        calls = cases(tuple(int(n) for n in args.shape.split("x")))
        for call in calls.values():
            call()
        times = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                times[name].append(per_call_us(call, args.calls))
        lib.cuCtxSetCurrent(None)
    print(json.dumps({"shape": args.shape, "calls": args.calls, "rounds": args.rounds,
                      "us_per_call": {name: round(statistics.median(t), 3) for name, t in times.items()}}))


if __name__ == "__main__":
    main()
