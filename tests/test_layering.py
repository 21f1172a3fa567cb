"""The layout's rules: the core names no vendor runtime, never imports the commands or the integrations,
has no import cycle, backends import hwsync only through its backend door, and no file grows past what a
reader takes in at once."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "hwsync"
FORBIDDEN = re.compile(r"torch\.cuda|torch\.npu|torch_npu")
#: the parts of hwsync/ that are not the core: the core may not import them
OUTSIDE_CORE = ("hwsync.cli", "hwsync.integrations")
MAX_LINES = 500
#: the backend door: the one hwsync module a backend imports, and only the names in its __all__
DOOR = "hwsync.backend"
#: the backends' packages: the in-tree distributions and the test plugins (each a backend; not build/ copies)
BACKEND_PACKAGES = ("backends/*/hwsync_*", "tests/plugins/*/hwsync_*")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(CORE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _import_nodes(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that runs: at module level or inside a function (a lazy import still makes
    one module need another, and two that need each other are a cycle); not those under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            else:
                visit(child)

    visit(tree)
    return found


def _imports(path: Path, module: str, source: str | None = None) -> set[str]:
    """hwsync modules that `module` (the file at `path`, or `source`) imports, lazily or not."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in _import_nodes(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {name for name in found if name.startswith("hwsync")}


def _is_core(module: str) -> bool:
    return not module.startswith(OUTSIDE_CORE)


def test_core_names_no_vendor_runtime():
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in sorted(CORE.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if FORBIDDEN.search(line)]
    assert not hits, "vendor runtime named in the core (move it to a backend):\n" + "\n".join(hits)


def test_the_check_can_fail():
    assert FORBIDDEN.search("x = torch.cuda.mem_get_info()") and FORBIDDEN.search("import torch_npu")


def test_core_never_imports_cli_or_integrations():
    modules = _modules()
    bad = [f"{name} imports {imported}" for name, path in modules.items() if _is_core(name)
           for imported in sorted(_imports(path, name)) if imported.startswith(OUTSIDE_CORE)]
    assert not bad, "the core must not import the commands or the integrations:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def _graph(modules: dict[str, Path], sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    graph = {}
    for name, path in modules.items():
        imported = _imports(path, name, (sources or {}).get(name))
        # a package's own __init__ re-exporting its submodules is not a cycle: Python loads them first
        graph[name] = {m for m in imported if m in modules and m != name
                       and not (path.name == "__init__.py" and m.startswith(name + "."))}
    return graph


def test_no_import_cycle():
    """No two modules of hwsync/ (the core, the commands, the integrations) need each other, even lazily."""
    cycles = _cycles(_graph(_modules()))
    assert not cycles, "import cycles (move what both sides need into a third module):\n" + \
        "\n".join(" -> ".join(c) for c in cycles)


def test_cycle_check_can_fail():
    assert _cycles({"a": {"b"}, "b": {"a"}})
    # a function-level import closes a cycle too; one under TYPE_CHECKING does not
    modules = {"hwsync.a": Path("a.py"), "hwsync.b": Path("b.py")}
    lazy = {"hwsync.a": "from hwsync.b import f\n",
            "hwsync.b": "def g():\n    from hwsync.a import h\n    return h\n"}
    assert _cycles(_graph(modules, lazy)) == [["hwsync.a", "hwsync.b", "hwsync.a"]]
    typing_only = {**lazy, "hwsync.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import hwsync.a\n"}
    assert not _cycles(_graph(modules, typing_only))


def test_no_file_is_too_long():
    long = [f"{p.relative_to(ROOT)}: {n} lines"
            for p in sorted(list(CORE.rglob("*.py")) + list((ROOT / "backends").rglob("*.py")))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"files over {MAX_LINES} lines (split them by what they do):\n" + "\n".join(long)


def _door_names() -> set[str]:
    """The names in the door's `__all__`, read from its source."""
    for node in ast.parse((CORE / "backend" / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("hwsync/backend/__init__.py has no `__all__ = [...]`: the door's names are its contract")


def _is_hwsync(module: str) -> bool:
    return module == "hwsync" or module.startswith("hwsync.")


def _past_the_door(source: str, door: set[str]) -> list[str]:
    """Each import of hwsync in `source` other than `from hwsync.backend import <a name in its __all__>`: at
    module level, inside a function, under TYPE_CHECKING, or through importlib.import_module / __import__."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            bad += [f"{node.lineno}: import {a.name}" for a in node.names if _is_hwsync(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level and _is_hwsync(node.module or ""):
            outside = [a.name for a in node.names if node.module != DOOR or a.name not in door]
            if outside:
                bad.append(f"{node.lineno}: from {node.module} import {', '.join(outside)}")
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and _is_hwsync(node.args[0].value)
              and ast.unparse(node.func).rpartition(".")[2] in ("import_module", "__import__")):
            bad.append(f"{node.lineno}: {ast.unparse(node)}")
    return bad


def _backend_files() -> list[Path]:
    return sorted(f for pattern in BACKEND_PACKAGES for package in ROOT.glob(pattern) if package.is_dir()
                  for f in package.rglob("*.py"))


def test_backends_import_hwsync_only_through_the_door():
    """A backend's contract is the door's list of names: the core may move a module without breaking one."""
    files = _backend_files()
    assert {f.relative_to(ROOT).parts[:2] for f in files} >= {
        ("backends", "cpu"), ("backends", "cuda"), ("backends", "npu"), ("tests", "plugins")}
    door = _door_names()
    bad = [f"{f.relative_to(ROOT)}:{hit}" for f in files for hit in _past_the_door(f.read_text(), door)]
    assert not bad, (f"backends import hwsync past its door (import those names `from {DOOR} import ...`, adding "
                     "them to its __all__ where missing):\n" + "\n".join(bad))


def test_the_door_check_can_fail():
    door = {"Backend", "Device"}
    assert not _past_the_door("from hwsync.backend import Backend, Device\nimport hwsync_cpu\n", door)
    assert _past_the_door("from hwsync.backend.interfaces import Backend\n", door)
    assert _past_the_door("from hwsync.backend import communicator\n", door)  # a module, not a door name
    assert _past_the_door("import hwsync\n", door)
    assert _past_the_door("def f():\n    from hwsync.errors import HwsyncError\n", door)  # lazy
    assert _past_the_door("if TYPE_CHECKING:\n    from hwsync.sync.spec import TensorSpec\n", door)
    assert _past_the_door("import importlib\nimportlib.import_module('hwsync.control.nic')\n", door)


def test_every_door_name_resolves():
    import hwsync.backend

    assert set(hwsync.backend.__all__) == _door_names()
    missing = [name for name in hwsync.backend.__all__ if not hasattr(hwsync.backend, name)]
    assert not missing, f"hwsync.backend lists names it does not define: {missing}"
