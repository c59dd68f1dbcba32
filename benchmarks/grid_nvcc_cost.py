"""What nvcc costs a measured GPU grid (``dispatch_grid.py --measure``), without a GPU: nvcc on one
program of N configurations against one configuration's program, and how many kernels each
problem of a grid file builds -- the inputs of the grid's time estimate (docs/benchmarks.md, "The
GPU grid measured within a lease").

The configurations are a grid problem's neighbourhood (``measured.neighbourhoods``) on a stand-in
GPU of the given compute capability (its limits: 1024 threads a block, 48 KiB of shared memory),
rendered as ``dispatch.DISPATCHER.shared_program`` renders them; each size is compiled
``--repeat`` times, the sizes interleaved, medians printed.

    python benchmarks/grid_nvcc_cost.py                       # the first problem of gpu_grid.json, sm_90
    python benchmarks/grid_nvcc_cost.py --sizes 1,8,32 --repeat 5 --problem 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import dispatch_grid

from pool_tuner import dispatch, measured
from pool_tuner.backends import cuda, cuda_compile


def stand_in_gpu(compute_capability: tuple) -> cuda.CudaDevice:
    """A ``CudaDevice`` made from given properties (nothing runs on it: it decides legality)."""
    properties = cuda.CudaProperties(name="stand-in GPU", compute_capability=compute_capability, multiprocessors=132,
                                     max_threads_per_block=1024, max_shared_memory_per_block=48 * 1024,
                                     total_memory=80 * 2**30, driver_version=13000)
    return cuda.CudaDevice(0, properties)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid-file", default=str(dispatch_grid.GRID_DIR / "gpu_grid.json"))
    parser.add_argument("--problem", type=int, default=0, help="which problem of the grid file (its order there)")
    parser.add_argument("--sizes", default="1,4,16,all", help="configurations per program, comma-separated")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--arch", default="9.0", help="compute capability of the stand-in GPU")
    args = parser.parse_args(argv)
    device = stand_in_gpu(tuple(int(part) for part in args.arch.split(".")))
    entries = dispatch_grid.grid_from_file(Path(args.grid_file))
    counts = [len(measured.neighbourhoods(dispatch_grid.problem_of(entry), device)) for entry in entries]
    print(f"{args.grid_file}: {len(entries)} problems, {sum(counts)} configurations (median {statistics.median(counts)}, "
          f"at most {max(counts)} a problem)")
    problem = dispatch_grid.problem_of(entries[args.problem])
    choices = measured.neighbourhoods(problem, device)
    sizes = [len(choices) if size == "all" else min(int(size), len(choices)) for size in args.sizes.split(",")]
    nvcc = cuda.find_nvcc()
    times = {size: [] for size in sizes}
    for _ in range(args.repeat):
        for size in sizes:
            source = dispatch.DISPATCHER.shared_program(device, problem, choices[:size])
            started = time.perf_counter()
            cuda_compile.compile_source(source, device.arch, nvcc)
            times[size].append(time.perf_counter() - started)
    print(f"{problem} on {device.arch}, nvcc seconds (median of {args.repeat}):")
    for size in sizes:
        print(f"  {size:3d} configurations in one program: {statistics.median(times[size]):.2f} s "
              f"(runs {', '.join(f'{t:.2f}' for t in times[size])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
