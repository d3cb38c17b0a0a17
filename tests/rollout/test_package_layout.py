"""The layout of gyre/rollout: the package map in its docstring names every module, and no two
of its modules import each other, directly or round a longer circle (imports inside functions
count; imports under ``TYPE_CHECKING`` do not)."""

import ast
from pathlib import Path

import gyre.rollout

ROOT = Path(gyre.rollout.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("gyre", "rollout", *path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``name`` imports anywhere in its body, but under TYPE_CHECKING."""
    found: set[str] = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    walk(other)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = ".".join(package[:len(package) - child.level + 1] + [child.module or ""]).strip(".") \
                    if child.level else child.module
                found.add(base)
                found.update(f"{base}.{a.name}" for a in child.names)
            walk(child)

    walk(ast.parse(path.read_text()))
    return (found & known) - {name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_sees_module_and_function_level_imports():
    graph = _graph()
    assert "gyre.rollout.client.messages" in graph["gyre.rollout.client.engine_client"]  # module level
    assert "gyre.rollout.client.engine_client" in graph["gyre.rollout.embedded.server"]  # inside a method
    assert "gyre.rollout.client.engine_client" not in graph["gyre.rollout.weights"]  # under TYPE_CHECKING


def test_a_circle_is_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_rollout_modules_import_each_other_in_a_circle():
    assert _cycles(_graph()) == []


def test_the_package_map_names_every_module():
    doc = gyre.rollout.__doc__
    missing = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        names = [f"``{d}/``" for d in rel.parts[:-1]]
        if rel.name != "__init__.py":
            names.append(f"``{rel.name}``")
        missing += [f"{rel}: {n}" for n in names if n not in doc]
    assert missing == []
