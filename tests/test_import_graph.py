"""The house has no import loop: dependencies among core/clawrl modules point one way.

Every import counts, including those inside function bodies (which Python runs late, and which
once hid a 26-module loop) and literal ``importlib.import_module`` / ``__import__`` calls. A
package's ``__init__`` counts as a module of its own, so re-exporting through it is an edge too.
And importing ``a.b.c`` first runs ``a/__init__`` and ``a/b/__init__``: an import is also an edge to
each package above its target that the importer is not itself inside (those have started already).
A loop through such an ``__init__`` fails at run time for whichever module is imported first.
"""
from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "core"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in CORE.rglob("*.py"):
        parts = list(path.relative_to(CORE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _imported_names(tree: ast.AST, package: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            names.add(node.args[0].value)
    return names


def _packages_above(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def edges(importer: str, imported: set[str], modules: set[str]) -> set[str]:
    """The modules ``importer`` runs by importing ``imported`` (core modules): each one, and each
    package ``__init__`` above it that ``importer`` is not inside."""
    inside = set(_packages_above(importer))
    out = set()
    for target in imported:
        out.add(target)
        out.update(p for p in _packages_above(target) if p in modules and p not in inside)
    out.discard(importer)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the core modules it imports (the longest existing prefix of each imported name)."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = {resolve(n) for n in _imported_names(ast.parse(path.read_text()), package) if n.startswith("clawrl")}
        graph[name] = edges(name, {d for d in deps if d}, set(mods))
    return graph


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_loop_finder_finds_a_loop_hidden_in_a_function_body():
    tree = ast.parse("def f():\n    from clawrl.b import x\n    importlib.import_module('clawrl.c')\n")
    assert _imported_names(tree, "clawrl") >= {"clawrl.b", "clawrl.b.x", "clawrl.c"}
    assert loops({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert loops({"a": {"b"}, "b": set()}) == []


def test_importing_a_submodule_runs_the_init_of_each_package_above_it_first():
    modules = {"clawrl", "clawrl.m", "clawrl.m.base", "clawrl.t", "clawrl.t.batching"}
    assert edges("clawrl.m.base", {"clawrl.t.batching"}, modules) == {"clawrl.t.batching", "clawrl.t"}
    # a module's own packages have started before it runs: no edge back to them
    assert edges("clawrl.t.batching", {"clawrl.t"}, modules) == {"clawrl.t"}
    assert edges("clawrl.m", {"clawrl.m.base"}, modules) == {"clawrl.m.base"}


def test_core_modules_form_no_import_loop():
    graph = import_graph()
    assert len(graph) > 50  # the walk really saw the package
    assert loops(graph) == []
