"""Plug-ins by name or by path: what ``method=`` and ``env.name=`` accept.

A value is either a built-in name or ``dir/file.py:ClassName``: the file (relative to the working
directory, or absolute) is executed once per process as a module of its own, and the class must
subclass the seam's base class. Every process that needs the plug-in (the learner, the torch
trainer, each megatron rank) builds it from the config this way, so a plug-in is never pickled or
sent anywhere. A bad name, a missing file or class, a class of the wrong kind, or a file that fails
to import is a one-line ``ConfigError`` naming the key.
"""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

from clawrl.config import ConfigError


def plugin_class(key: str, spec: str, base: type, builtins: dict[str, type]) -> type:
    """The class ``spec`` names for config key ``key``: a name in ``builtins`` or a file path."""
    if spec in builtins:
        return builtins[spec]
    path, _, name = spec.rpartition(":")
    if spec.endswith(".py"):
        raise ConfigError(f"{key}={spec}: name the class in the file too, as {spec}:ClassName")
    if not path.endswith(".py") or not name.isidentifier():
        raise ConfigError(f"unknown {key} '{spec}'; choose one of {', '.join(builtins)}, or dir/file.py:ClassName")
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ConfigError(f"{key}={spec}: no such file {file}")
    cls = getattr(_load(file, key, spec), name, None)
    if cls is None:
        raise ConfigError(f"{key}={spec}: {file.name} defines no '{name}'")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(f"{key}={spec}: '{name}' is not a {base.__module__}.{base.__name__}")
    if inspect.isabstract(cls):
        raise ConfigError(f"{key}={spec}: '{name}' leaves {', '.join(sorted(cls.__abstractmethods__))} unimplemented")
    return cls


def _load(file: Path, key: str, spec: str) -> ModuleType:
    """Execute ``file`` as a module of its own (once per process, keyed by its absolute path)."""
    name = f"clawrl_plugin_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look classes up by module name
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        detail = (str(e).splitlines() or [""])[0]
        raise ConfigError(f"{key}={spec}: importing {file} failed: {type(e).__name__}: {detail}") from None
    return module
