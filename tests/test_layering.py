"""The layout's rules: the core names no vendor runtime, never imports the commands or the integrations,
has no import cycle, and no file grows past what a reader takes in at once."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "hwsync"
FORBIDDEN = re.compile(r"torch\.cuda|torch\.npu|torch_npu")
#: the parts of hwsync/ that are not the core: the core may not import them
OUTSIDE_CORE = ("hwsync.cli", "hwsync.integrations")
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(CORE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(path: Path, module: str) -> set[str]:
    """hwsync modules imported at module level (imports inside functions are lazy and do not cycle)."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
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


def test_no_import_cycle():
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        # a package's own __init__ re-exporting its submodules is not a cycle: Python loads them first
        graph[name] = {m for m in _imports(path, name) if m in modules and m != name
                       and not (path.name == "__init__.py" and m.startswith(name + "."))}
    assert not _cycles(graph), f"import cycles: {_cycles(graph)}"


def test_cycle_check_can_fail():
    assert _cycles({"a": {"b"}, "b": {"a"}})


def test_no_file_is_too_long():
    long = [f"{p.relative_to(ROOT)}: {n} lines"
            for p in sorted(list(CORE.rglob("*.py")) + list((ROOT / "backends").rglob("*.py")))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, f"files over {MAX_LINES} lines (split them by what they do):\n" + "\n".join(long)
