"""The package's layering, read from its source: the import graph has no circle, and no module
imports one above it (backends below everything that uses them, the cache below dispatch, the
tools -- bench, cli, compile_check -- above all).  Plus the one object that owns dispatch's memo
tables.

The graph counts every import a module executes, at module level or inside a function (a circle
through an import inside a function is still a circle: ``dispatch`` once imported the tuner that
way); imports under ``if TYPE_CHECKING:`` never execute and are left out.  Importing
``pool_tuner.a.b`` runs ``pool_tuner.a`` first, so it counts as importing both, except where
``pool_tuner.a`` is a package the importing module is in (it is running already).
"""

import ast
import re
from pathlib import Path

import pool_tuner
from pool_tuner import backends, dispatch
from pool_tuner.problem import Problem

PACKAGE = Path(pool_tuner.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(tree, module: str, is_package: bool, known: set) -> set:
    """The package's modules that ``module`` imports (executed imports only)."""
    found = set()

    ancestors = {".".join(module.split(".")[:end]) for end in range(1, module.count(".") + 1)}

    def add(name):
        if name in known:
            found.add(name)
        parts = name.split(".")
        # pool_tuner.a.b runs pool_tuner.a first -- unless that is a package this module is in,
        # which is running already (importing it by name still counts, above).
        for end in range(1, len(parts)):
            prefix = ".".join(parts[:end])
            if prefix in known and prefix not in ancestors:
                found.add(prefix)

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            submodules = [f"{stem}.{a.name}" for a in node.names if f"{stem}.{a.name}" in known]
            for name in submodules:  # `from . import dispatch` imports the submodule
                add(name)
            if len(submodules) < len(node.names) or stem not in ancestors:  # the package's own names
                add(stem)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(module)
    return found


def import_graph() -> dict:
    """``{module: set of package modules it imports}`` over pool_tuner/*.py and backends/*.py."""
    paths = sorted(PACKAGE.glob("*.py")) + sorted((PACKAGE / "backends").glob("*.py"))
    names = {_module_name(p): p for p in paths}
    return {name: _imported(ast.parse(path.read_text()), name, path.name == "__init__.py", set(names))
            for name, path in names.items()}


def find_circle(graph: dict) -> list | None:
    """One import circle as a list of modules (first == last), or None."""
    state = {}

    def walk(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                circle = walk(nxt, path + [nxt])
                if circle:
                    return circle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            circle = walk(start, [start])
            if circle:
                return circle
    return None


def test_the_graph_is_read_from_the_source():
    graph = import_graph()
    assert "pool_tuner.backends.opencl" in graph and "pool_tuner.backends.base" in graph
    assert "pool_tuner.dispatch" in graph["pool_tuner.tuner"]
    assert "pool_tuner.backends.base" in graph["pool_tuner.backends.opencl"]
    assert "pool_tuner.backends" in graph["pool_tuner.compile_check"]  # from .backends.cuda: the package runs first


def test_the_circle_finder_finds_circles():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    tree = ast.parse("def f():\n    from .tuner import tune\nif TYPE_CHECKING:\n    from .ops import x\n")
    assert _imported(tree, "pool_tuner.dispatch", False, {"pool_tuner.tuner", "pool_tuner.ops"}) == {"pool_tuner.tuner"}


def test_no_import_circles():
    assert find_circle(import_graph()) is None


#: Who may not import whom: module -> package modules it must not import (directly).
TOOLS = {"pool_tuner.bench", "pool_tuner.cli", "pool_tuner.compile_check"}
ABOVE_DISPATCH = {"pool_tuner.tuner", "pool_tuner.plans", "pool_tuner.ops", "pool_tuner.torch_cpu",
                  "pool_tuner.torch_cuda", "pool_tuner.torch", "pool_tuner.onnx", "pool_tuner"} | TOOLS
#: The front ends, above plans (which prepares every call) and below the package.
FRONT_ENDS = {"pool_tuner.ops", "pool_tuner.torch_cpu", "pool_tuner.torch_cuda", "pool_tuner.torch", "pool_tuner.onnx"}
FORBIDDEN = {
    # the kernel description layer knows nothing of devices, caches or dispatch; nor does the
    # PyTorch decomposition that ONNX export traces (below pool_tuner.torch and pool_tuner.onnx)
    **{f"pool_tuner.{m}": {"pool_tuner.backends", "pool_tuner.cache", "pool_tuner.dispatch"} | ABOVE_DISPATCH
       for m in ("problem", "windows", "shapes", "reference", "variants", "kernel_source", "version",
                 "decomposition", "memo")},
    "pool_tuner.backends": {"pool_tuner.cache", "pool_tuner.dispatch", "pool_tuner.variants"} | ABOVE_DISPATCH,
    "pool_tuner.cache": {"pool_tuner.backends", "pool_tuner.dispatch"} | ABOVE_DISPATCH,
    # how each backend's devices are tuned: below the tuner, which calls it, beside the cache
    "pool_tuner.device_tuning": {"pool_tuner.cache", "pool_tuner.dispatch"} | ABOVE_DISPATCH,
    "pool_tuner.dispatch": ABOVE_DISPATCH,
    "pool_tuner.tuner": {"pool_tuner.plans", "pool_tuner", *FRONT_ENDS} | TOOLS,
    "pool_tuner.plans": {"pool_tuner.tuner", "pool_tuner", *FRONT_ENDS} | TOOLS,
    "pool_tuner.ops": {"pool_tuner.torch_cpu", "pool_tuner.torch_cuda", "pool_tuner.torch", "pool_tuner.onnx",
                       "pool_tuner"} | TOOLS,
    # torch_cpu and torch_cuda are the CPU and CUDA halves of the torch glue: below pool_tuner.torch,
    # which calls them
    "pool_tuner.torch_cpu": {"pool_tuner.torch_cuda", "pool_tuner.torch", "pool_tuner.onnx", "pool_tuner"} | TOOLS,
    "pool_tuner.torch_cuda": {"pool_tuner.torch", "pool_tuner.onnx", "pool_tuner"} | TOOLS,
    # what timm's pooling layers are, read by pool_tuner.torch's replace_pooling: below it
    "pool_tuner.torch_timm": {"pool_tuner.torch", "pool_tuner.onnx", "pool_tuner"} | TOOLS,
    # the ONNX exporter swaps pool_tuner.torch's layers: above it
    "pool_tuner.torch": {"pool_tuner.onnx", "pool_tuner"} | TOOLS,
    "pool_tuner.onnx": {"pool_tuner"} | TOOLS,
}


def _rule_for(module: str) -> set:
    if module.startswith("pool_tuner.backends"):
        return FORBIDDEN["pool_tuner.backends"]
    return FORBIDDEN.get(module, set())


def test_no_module_imports_one_above_it():
    graph = import_graph()
    broken = {m: sorted(imported & _rule_for(m)) for m, imported in graph.items() if imported & _rule_for(m)}
    assert broken == {}


def _calls_and_attributes(module: str):
    path = PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")
    tree = ast.parse(path.read_text())
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Attribute, ast.Call, ast.Import, ast.ImportFrom))]


#: The modules that see devices only through the contract of backends.base.
CONTRACT_USERS = ("pool_tuner.ops", "pool_tuner.dispatch", "pool_tuner.tuner", "pool_tuner.bench", "pool_tuner.cli")
#: The backend modules and libraries, and their classes.
BACKEND_MODULES = {"pyopencl", "pycuda", "opencl", "cuda", "OpenCLDevice", "CudaDevice"}
#: Attributes only one backend has: OpenCL's platform index and device, PoCL's affinity, PyCUDA's
#: device and ordinal, an OpenCL event's profile, an OpenCL queue's finish.
BACKEND_ONLY_ATTRIBUTES = {"cl_device", "cu_device", "platform_index", "device_index", "is_pocl", "pocl_affinity",
                           "ordinal", "profile", "finish"}


def _identifiers(node) -> set:
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))}


def test_contract_users_name_nothing_of_one_backend():
    """No import of a backend module or library, no isinstance on a backend class, no attribute of
    one backend."""
    offences = []
    for module in CONTRACT_USERS:
        for node in _calls_and_attributes(module):
            where = f"{module}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Attribute) and (
                    node.attr in BACKEND_ONLY_ATTRIBUTES
                    or (node.attr in BACKEND_MODULES and _identifiers(node.value) == {"backends"})):
                offences.append(f"{where} .{node.attr}")
            elif isinstance(node, ast.Import):
                offences += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[0] in BACKEND_MODULES]
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[-1]} | {a.name for a in node.names}
                if names & BACKEND_MODULES:
                    offences.append(f"{where} from {node.module} import ...")
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass"):
                if len(node.args) == 2 and _identifiers(node.args[1]) & BACKEND_MODULES:
                    offences.append(f"{where} {ast.unparse(node)}")
    assert offences == []


# ---------------------------------------------------------------------- dispatch's one state object


def test_forget_clears_every_memo_table_the_built_kernels_included(user_cache):
    """Decisions, forced choices, built kernels and the open tuning cache belong to one
    Dispatcher; forget() clears them all (it once left the built kernels behind)."""
    device = backends.default_device()
    problem = Problem.create("adaptive_avg_pool2d", (2, 3, 10, 9), (4, 7))
    choice = dispatch.choose(problem, device)
    forced = dispatch.choose(problem, device, "thread_per_output")
    launch = dispatch.prepare(device, device.queue.context, problem, choice)
    table = dispatch.tuning_cache()
    assert dispatch.choose(problem, device) is choice and dispatch.choose(problem, device, "thread_per_output") is forced
    assert dispatch.prepare(device, device.queue.context, problem, choice) is launch  # memoised
    assert dispatch.tuning_cache() is table
    dispatch.forget()
    assert dispatch.choose(problem, device) is not choice
    assert dispatch.choose(problem, device, "thread_per_output") is not forced
    assert dispatch.prepare(device, device.queue.context, problem, choice) is not launch
    assert dispatch.tuning_cache() is not table
    # The module's functions are the one dispatcher's methods: nothing else holds state.
    for name in ("choose", "prepare", "forget", "tuning_cache"):
        assert getattr(dispatch, name).__self__ is dispatch.DISPATCHER
    state = {name for name, value in vars(dispatch).items()
             if isinstance(value, (dict, list, set)) and not name.startswith("__")}
    assert state == set()


def test_forgetting_one_problem_keeps_the_others(user_cache):
    device = backends.default_device()
    one = Problem.create("adaptive_avg_pool2d", (2, 3, 10, 9), (4, 7))
    other = Problem.create("adaptive_avg_pool2d", (2, 3, 10, 9), (2, 2))
    first, second = dispatch.choose(one, device), dispatch.choose(other, device)
    dispatch.forget(one, device)
    assert dispatch.choose(one, device) is not first and dispatch.choose(other, device) is second


# ---------------------------------------------------------------------- the op as one object

#: The names of the op kinds and directions: what only pool_tuner.operations may test for.
OP_WORDS = {"avg", "max", "avgmax", "forward", "backward"}
#: Pieces of the public function and custom-op names, which only pool_tuner.operations assembles.
OP_NAME_PIECES = {"_backward", "adaptive_", "_pool", "_pool_pyramid"}


def _strings(node) -> set:
    """The string constants ``node`` is, or holds as a tuple/list/set display."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {item.value for item in items if isinstance(item, ast.Constant) and isinstance(item.value, str)}


def _names_kind_or_direction(node) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.endswith(("kind", "direction"))


def _f_string_template(node: ast.JoinedStr) -> str:
    return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)


def op_tests_outside_the_op_object(source: str) -> list:
    """Where ``source`` tests an op kind or a direction by name (``kind == "avg"``, ``"max" in
    kinds``, ``level_kind == kind``) or assembles an op's name (``f"adaptive_{kind}_pool{n}d"``,
    ``op + "_backward"``): ``["line: code"]``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and all(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                 for op in node.ops):
            operands = [node.left, *node.comparators]
            if any(_strings(operand) & OP_WORDS for operand in operands) or (
                    all(_names_kind_or_direction(operand) for operand in operands)):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.JoinedStr) and re.search(r"(adaptive_|_pool|_pyramid)\{\}|\{\}(_backward|_pool)",
                                                           _f_string_template(node)):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and node.value in OP_NAME_PIECES:
            found.append(f"{node.lineno}: {node.value!r}")
    return found


def test_the_op_scan_finds_op_tests_and_op_names():
    """The scan below must be able to fail: each way an op was once tested or named is found."""
    offending = [
        'if kind == "avg": pass',
        'y = a if problem.direction != "forward" else b',
        'if "max" in layout.kinds: pass',
        'chosen = [k for k, level_kind in enumerate(kinds) if level_kind == kind]',
        'name = f"adaptive_{kind}_pool{ndim}d"',
        'name = f"{op}_backward"',
        'names = [op + suffix for suffix in ("", "_backward")]',
        'name = f"adaptive_{kind}_pool_pyramid{ndim}d"',
    ]
    for source in offending:
        assert op_tests_outside_the_op_object(source), source
    fine = ['if dtype.kind == "V": pass', 'directions = DIRECTION_OPTION[args.direction]',
            'pool = getattr(F, level.name)', 'message = f"got {kind!r}"']
    for source in fine:
        assert op_tests_outside_the_op_object(source) == [], source


def test_only_the_op_object_tests_ops_by_name():
    """Every module asks ``pool_tuner.operations``' objects (``Operation``, ``Direction``) what an
    op or a pass does instead of testing its name: a new op or direction is added there alone."""
    paths = sorted(PACKAGE.glob("*.py")) + sorted((PACKAGE / "backends").glob("*.py"))
    offences = {path.relative_to(PACKAGE).as_posix(): op_tests_outside_the_op_object(path.read_text())
                for path in paths if path.name != "operations.py"}
    assert {path: found for path, found in offences.items() if found} == {}
