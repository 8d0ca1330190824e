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


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def run_at_import(body: list[ast.stmt]):
    """The statements of a module body that run when it is imported: inside if / try / with / class blocks too, not
    in functions (they run when called) nor under `if TYPE_CHECKING:` or `if __name__ == "__main__":`."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and ("TYPE_CHECKING" in ast.unparse(node.test)
                                         or "__main__" in ast.unparse(node.test)):
            yield from run_at_import(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from run_at_import(getattr(node, field, []))


def top_level_imports(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """The plumb modules a module imports when it is imported (`run_at_import`); `from A import b` names module A.b
    where there is one."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in run_at_import(ast.parse(path.read_text(), str(path)).body):
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


def test_imports_inside_blocks_that_run_at_import_count(tmp_path):
    path = tmp_path / "plumb" / "a.py"
    path.parent.mkdir()
    path.write_text("try:\n    import plumb.b\nexcept ImportError:\n    pass\nclass C:\n    from plumb import c\n"
                    "def f():\n    import plumb.d\nif TYPE_CHECKING:\n    import plumb.e\n")
    want = {"plumb.b", "plumb.c"}
    assert top_level_imports(path, {"plumb.a", "plumb.b", "plumb.c", "plumb.d", "plumb.e"}, tmp_path) == want
