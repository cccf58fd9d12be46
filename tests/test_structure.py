"""The layout's rules, read from the code's own imports (no module is run): no import cycle in
`raytool/` or `actors/`, counting the imports inside functions too (a lazy import that closes a
loop is still a loop), `raytool/` never imports Ray, and the rooms of `actors/` (actors, drivers,
benches) import only downward."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _modules() -> dict[str, Path]:
    out = {}
    for package in ("raytool", "actors"):
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project's modules `path` imports, anywhere in it (`from a import b` names a.b where that is a module)."""
    found = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in modules}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_in_raytool_or_actors():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert _cycles(graph) == [], "modules that import each other, directly or around a loop (lazy imports count)"


def test_the_cycle_check_finds_a_loop_through_a_lazy_import():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _room(module: str) -> int:
    """The floor of an `actors` module: 0 the actors and their shared plumbing, 1 the drivers, 2 the benches."""
    return {"drivers": 1, "benches": 2}.get(module.split(".")[1] if module.count(".") else "", 0)


def test_the_actors_rooms_import_only_downward():
    """actors/ (the actors) <- actors/drivers/ (what composes and runs them) <- actors/benches/."""
    modules = _modules()
    upward = sorted(f"{name} imports {other}" for name, path in modules.items() if name.startswith("actors.")
                    for other in _imports(path, modules) if other.startswith("actors.") and _room(other) > _room(name))
    assert upward == []
    assert _room("actors.agent_worker") == 0 and _room("actors.drivers.pipeline") == 1 and _room("actors.benches.trl") == 2


def test_raytool_never_imports_ray():
    modules = _modules()
    for name, path in modules.items():
        if not name.startswith("raytool"):
            continue
        imported = set()
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
        assert "ray" not in imported, f"{path.relative_to(REPO)} imports Ray: the Ray layer is actors/"


def _top_level(module: str, modules: dict[str, Path]) -> set[str]:
    tree = _tree(modules[module])
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def test_raytool_reaches_actors_only_through_named_entries():
    """`raytool/` imports no module of `actors/`: it names the functions it calls there
    ("actors.module:function", raytool.entry), and each such name is a function that exists."""
    modules = _modules()
    entries = set()
    for name, path in modules.items():
        if not name.startswith("raytool"):
            continue
        tree = _tree(path)
        imported = _imports(path, modules)
        assert not {m for m in imported if m.split(".")[0] == "actors"}, f"{path.relative_to(REPO)} imports actors/: name an entry instead"
        entries |= {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and re.fullmatch(r"(raytool|actors)(\.\w+)+:\w+", node.value)}
    assert any(e.startswith("actors.") for e in entries)  # the CLI's and the benches' entries were found
    for spec in sorted(entries):
        module, _, function = spec.partition(":")
        assert module in modules and function in _top_level(module, modules), f"entry {spec} names nothing"


def test_no_function_over_80_lines():
    """A function that long does several things: give each its name."""
    long = [f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in _modules().values() for node in ast.walk(_tree(path))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80]
    assert long == []
