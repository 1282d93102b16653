"""SGLang 0.5.23's installed source, read without importing it (its io_struct imports torchvision,
which does not load beside the CPU torch): request classes and their fields, the HTTP server's
routes, and a few of SGLang's own functions compiled from their source text, so tests can run
SGLang's code for the weights-update group on the CPU."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

SPEC = importlib.util.find_spec("sglang")  # finds the package without importing it


def root() -> Path | None:
    return Path(SPEC.submodule_search_locations[0]) if SPEC is not None else None


def classes(path: Path) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}


def fields(cls_map: dict[str, ast.ClassDef], name: str) -> dict[str, ast.AnnAssign]:
    """A class's annotated fields, its module-local bases' included (msgspec Structs, dataclasses)."""
    cls, out = cls_map[name], {}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in cls_map:
            out.update(fields(cls_map, base.id))
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
    return out


def required(field_map: dict[str, ast.AnnAssign]) -> set[str]:
    """Fields without a default (``rid`` and ``http_worker_ipc`` default to None in BaseReq)."""
    return {f for f, a in field_map.items() if a.value is None}


def literal_values(ann: ast.AnnAssign) -> set[str]:
    return {n.value for n in ast.walk(ann.annotation) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def http_routes(path: Path) -> dict[str, str | None]:
    """Each POST route of SGLang's HTTP server and the request class its handler takes as the body
    (``obj: Annotated[Class, Body()]``), None when it takes none."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in node.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.args
                    and isinstance(dec.args[0], ast.Constant) and isinstance(dec.args[0].value, str)):
                continue
            methods = {"POST"} if dec.func.attr == "post" else set()
            for kw in dec.keywords:
                if kw.arg == "methods":
                    methods = {e.value for e in kw.value.elts}
            if "POST" not in methods:
                continue
            body = None
            for arg in node.args.args:
                ann = arg.annotation
                if (isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Annotated"):
                    first = ann.slice.elts[0]
                    if isinstance(first, ast.Name):
                        body = first.id
            out[dec.args[0].value] = body
    return out


def function(path: Path, name: str, namespace: dict, cls: str | None = None):
    """SGLang's own function (or method of ``cls``) ``name``, compiled from its source text in
    ``namespace`` (the module-level names it uses): SGLang's code, run without importing its module."""
    tree = ast.parse(path.read_text())
    scope = tree.body
    if cls is not None:
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    node = next(n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)
    node.decorator_list = []
    future = ast.ImportFrom(module="__future__", names=[ast.alias("annotations")], level=0)  # annotations stay text
    module = ast.fix_missing_locations(ast.Module(body=[future, node], type_ignores=[]))
    exec(compile(module, f"{path}:{name}", "exec"), namespace)
    return namespace[name]
