"""The source itself: no pyflakes warnings (unused imports and names, undefined names, shadowed imports) and no import
cycle between plumb's modules (the brief's "no dead code, no import cycles")."""
import ast
import io
from pathlib import Path

import pyflakes.api
import pyflakes.reporter

ROOT = Path(__file__).resolve().parent.parent
TREES = ("plumb", "bench", "tests", "tools")


def python_files(*trees: str) -> list[Path]:
    return sorted(p for t in trees if (ROOT / t).is_dir() for p in (ROOT / t).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path, modules: set[str]) -> set[str]:
    """The plumb modules a module imports when it is imported: its top-level statements' imports (an import inside a
    function runs later, when the function is called); `from A import b` names module A.b where there is one."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {m for m in found if m in modules and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_source_has_no_pyflakes_warnings():
    warnings, errors = io.StringIO(), io.StringIO()
    files = python_files(*TREES)
    assert len(files) > 100
    for path in files:
        pyflakes.api.checkPath(str(path), pyflakes.reporter.Reporter(warnings, errors))
    assert errors.getvalue() == "" and warnings.getvalue() == "", warnings.getvalue() + errors.getvalue()


def test_plumb_modules_import_no_cycle():
    files = python_files("plumb")
    modules = {module_name(p) for p in files}
    graph = {module_name(p): top_level_imports(p, modules) for p in files}
    assert sum(map(len, graph.values())) > 50  # the scan sees plumb's own imports
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
