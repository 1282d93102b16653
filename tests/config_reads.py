"""Which config fields a source tree reads, found by walking its AST (tests/test_config.py).

A read is an attribute load ``<owner>.<field>`` whose owner plausibly holds the field's section:
a chain through the sections (``cfg.train.lora``, ``self.cfg.judge.model``), a ``<section>_cfg``
name (``train_cfg``, ``self.engine_cfg``), or a name assigned one of these or annotated with the
section's class (``train = cfg.train``, ``self.train = train``, ``def f(train: TrainConfig)``,
``cfg = train_cfg or TrainConfig()``). The whole config is ``cfg`` or ``config``. Comments and
docstrings are not code; ``fields()``, ``asdict`` and ``getattr`` with a computed name are not
attribute loads, so none of them counts.
"""
from __future__ import annotations

import ast
import re
from dataclasses import fields, is_dataclass
from pathlib import Path

from clawrl.config import ClawrlConfig, _default, all_keys

ROOT_NAMES = {"cfg", "config"}
_SECTION_CFG_NAME = re.compile(r"_?(\w+?)_(?:cfg|config|conf)")


def _sections(cls=ClawrlConfig, prefix: str = "") -> dict[str, str]:
    """Dotted path of every section ('' for the whole config) -> its dataclass's name."""
    out = {prefix.rstrip("."): cls.__name__}
    for f in fields(cls):
        if is_dataclass(_default(f)):
            out.update(_sections(type(_default(f)), prefix + f.name + "."))
    return out


SECTIONS = _sections()
LEAVES = set(all_keys())
CLASS_SECTION = {name: path for path, name in SECTIONS.items()}
_by_last_name: dict[str, list[str]] = {}
for _path in SECTIONS:
    if _path:
        _by_last_name.setdefault(_path.split(".")[-1], []).append(_path)
# ``model_cfg`` names a section only where one section is called that (model and judge.model are not)
UNIQUE_SECTION = {name: paths[0] for name, paths in _by_last_name.items() if len(paths) == 1}


def _annotation_section(ann) -> str | None:
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            ann = ast.parse(ann.value, mode="eval").body
        except SyntaxError:
            return None
    for n in ast.walk(ann) if ann is not None else ():
        name = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else None
        if name in CLASS_SECTION:
            return CLASS_SECTION[name]
    return None


def section_of(expr: ast.expr, aliases: dict[str, str]) -> str | None:
    """The config section ``expr`` plausibly holds ('' for the whole config), or None."""
    if isinstance(expr, (ast.Name, ast.Attribute)):
        if ast.unparse(expr) in aliases:
            return aliases[ast.unparse(expr)]
        name = expr.id if isinstance(expr, ast.Name) else expr.attr
        if isinstance(expr, ast.Attribute):
            parent = section_of(expr.value, aliases)
            child = (f"{parent}.{name}" if parent else name) if parent is not None else None
            if child in SECTIONS:
                return child
        if name in ROOT_NAMES:
            return ""
        m = _SECTION_CFG_NAME.fullmatch(name)
        return UNIQUE_SECTION.get(m.group(1)) if m else None
    if isinstance(expr, ast.Call):  # TrainConfig()
        func = expr.func
        return CLASS_SECTION.get(func.id if isinstance(func, ast.Name) else getattr(func, "attr", None))
    if isinstance(expr, ast.BoolOp):  # train_cfg or TrainConfig()
        return next((s for s in (section_of(v, aliases) for v in expr.values) if s is not None), None)
    if isinstance(expr, ast.IfExp):
        body = section_of(expr.body, aliases)
        return body if body is not None else section_of(expr.orelse, aliases)
    return None


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Names and ``self.x`` attributes a module assigns a section, and arguments annotated with one."""
    aliases: dict[str, str] = {}
    for _ in range(3):  # an alias of an alias of an alias
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for a in n.args.posonlyargs + n.args.args + n.args.kwonlyargs:
                    if (s := _annotation_section(a.annotation)) is not None:
                        aliases.setdefault(a.arg, s)
            pairs = []
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    if isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple):
                        pairs += zip(t.elts, n.value.elts)
                    else:
                        pairs.append((t, n.value))
            elif isinstance(n, ast.AnnAssign):
                if (s := _annotation_section(n.annotation)) is not None:
                    aliases.setdefault(ast.unparse(n.target), s)
                if n.value is not None:
                    pairs.append((n.target, n.value))
            for target, value in pairs:
                if isinstance(target, (ast.Name, ast.Attribute)) and (s := section_of(value, aliases)) is not None:
                    aliases.setdefault(ast.unparse(target), s)
    return aliases


def reads_in_source(source: str, where: str = "<source>") -> dict[str, str]:
    """Config key (a leaf, e.g. ``train.lr``) -> the first place ``source`` reads it."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    found: dict[str, str] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
            s = section_of(n.value, aliases)
            key = (f"{s}.{n.attr}" if s else n.attr) if s is not None else None
            if key in LEAVES:
                found.setdefault(key, f"{where}:{n.lineno}")
    return found


def reads_in_tree(root: Path, skip: tuple[Path, ...] = ()) -> dict[str, str]:
    """Dotted config key -> the first file:line under ``root`` that reads it."""
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        if path not in skip:
            for key, where in reads_in_source(path.read_text(), str(path.relative_to(root.parent))).items():
                found.setdefault(key, where)
    return found
