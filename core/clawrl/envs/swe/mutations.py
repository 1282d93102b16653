"""Procedural bugs, SWE-smith style: one small AST mutation of one site of a module's source.

Each kind is a mistake people make: a comparison flipped (``<`` for ``>=``), an off-by-one in a
``range`` argument or a slice bound, a condition inverted (``if not x``), a statement removed,
two arguments swapped, a constant changed. A mutation rewrites only the source text of the node
it changes (``ast.unparse`` of that node, on its own line span), so the bug's diff is one or two
lines, as a real one would be, and not a reformatting of the whole file.

Sites are listed in source order and are pure functions of the text, so the same source and the
same seed pick the same bugs (``clawrl.envs.swe.build``).
"""
from __future__ import annotations

import ast
import copy
from dataclasses import dataclass

KINDS = ("compare_flip", "off_by_one", "condition_invert", "statement_remove", "args_swap", "constant_change")
_FLIPPED = {ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Eq: ast.NotEq,
            ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}


@dataclass(frozen=True)
class Site:
    """One place a mutation of ``kind`` applies: the node's span (1-based lines, 0-based columns)
    and the text that replaces it (``None``: the statement's lines are deleted)."""

    kind: str
    line: int
    col: int
    end_line: int
    end_col: int
    replacement: str | None

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.line}:{self.col}"


def sites(source: str) -> list[Site]:
    """Every mutation this module's source allows, in source order; [] for a file that does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    docstrings = _docstrings(tree)
    found: list[Site] = []
    for node in ast.walk(tree):
        if id(node) in docstrings or not hasattr(node, "lineno"):
            continue
        found += _node_sites(node)
    found = [s for s in found if s.line == s.end_line or s.replacement is None]  # one-line edits only
    return sorted(set(found), key=lambda s: (s.line, s.col, s.kind, s.end_col, s.replacement or ""))


def apply(source: str, site: Site) -> str:
    """``source`` with ``site`` mutated; ValueError when the result does not compile or is unchanged."""
    lines = source.splitlines(keepends=True)
    if site.replacement is None:
        new = "".join(lines[:site.line - 1] + lines[site.end_line:])
    else:
        row = lines[site.line - 1]
        head, tail = _byte_cut(row, site.col), _byte_cut(row, site.end_col, tail=True)
        new = "".join(lines[:site.line - 1] + [head + site.replacement + tail] + lines[site.line:])
    if new == source:
        raise ValueError("the mutation changes nothing")
    compile(new, "<mutant>", "exec")
    return new


def _byte_cut(row: str, col: int, tail: bool = False) -> str:
    """ast's columns count utf-8 bytes: the part of ``row`` before (or from) byte ``col``."""
    raw = row.encode()
    return raw[col:].decode() if tail else raw[:col].decode()


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first))
                out.add(id(first.value))
    return out


def _site(kind: str, node: ast.AST, replacement: ast.AST | str | None) -> Site:
    text = replacement if isinstance(replacement, str) or replacement is None else ast.unparse(replacement)
    return Site(kind, node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, text)


def _node_sites(node: ast.AST) -> list[Site]:
    out: list[Site] = []
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _FLIPPED:
        flipped = copy.deepcopy(node)
        flipped.ops = [_FLIPPED[type(node.ops[0])]()]
        out.append(_site("compare_flip", node, flipped))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
        for arg in node.args:
            out += _plus_minus_one(arg)
    if isinstance(node, ast.Slice):
        for bound in (node.lower, node.upper):
            if bound is not None and hasattr(bound, "lineno"):
                out += _plus_minus_one(bound)
    if isinstance(node, (ast.If, ast.While, ast.IfExp)) and hasattr(node.test, "lineno"):
        test = node.test
        inverted = test.operand if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) else \
            ast.UnaryOp(ast.Not(), copy.deepcopy(test))
        out.append(_site("condition_invert", test, inverted))
    for body in _bodies(node):
        if len(body) < 2:
            continue  # removing a block's only statement would need a pass in its place
        for stmt in body:
            if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.Expr, ast.Return, ast.Raise, ast.AnnAssign)) \
                    and stmt.lineno == stmt.end_lineno and not _is_docstring(stmt):
                out.append(_site("statement_remove", stmt, None))
    if isinstance(node, ast.Call) and len(node.args) >= 2 and not any(isinstance(a, ast.Starred) for a in node.args[:2]):
        a, b = node.args[0], node.args[1]
        if ast.dump(a) != ast.dump(b):
            swapped = copy.deepcopy(node)
            swapped.args[0], swapped.args[1] = swapped.args[1], swapped.args[0]
            out.append(_site("args_swap", node, swapped))
    if isinstance(node, ast.Constant) and not isinstance(node.value, str) and node.value is not None \
            and not isinstance(node.value, (bytes, complex)) and node.value is not Ellipsis:
        value = node.value
        changed = (not value) if isinstance(value, bool) else (value + 1 if value in (0, -1) else value - 1
                                                                if isinstance(value, int) else value * 2 or 1.0)
        out.append(_site("constant_change", node, ast.Constant(changed)))
    return out


def _plus_minus_one(expr: ast.expr) -> list[Site]:
    if isinstance(expr, ast.Constant) and isinstance(expr.value, int) and not isinstance(expr.value, bool):
        return [_site("off_by_one", expr, ast.Constant(expr.value + 1))] + \
            ([_site("off_by_one", expr, ast.Constant(expr.value - 1))] if expr.value > 0 else [])
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.USub) and isinstance(expr.operand, ast.Constant):
        return []  # -1 and friends: the constant change covers them
    return [_site("off_by_one", expr, ast.BinOp(copy.deepcopy(expr), op, ast.Constant(1)))
            for op in (ast.Add(), ast.Sub())]


def _bodies(node: ast.AST) -> list[list[ast.stmt]]:
    return [getattr(node, f) for f in ("body", "orelse", "finalbody")
            if isinstance(getattr(node, f, None), list) and getattr(node, f) and isinstance(getattr(node, f)[0], ast.stmt)]


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)
