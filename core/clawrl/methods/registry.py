"""Which class ``cfg.method`` names: a built-in method, or a class loaded from a file.

``method=rl|opd|combine`` are the built-in methods; ``method=dir/file.py:ClassName`` loads ``ClassName``
from that file (``clawrl.plugins``: relative to the working directory, or absolute), which must
subclass ``clawrl.methods.base.Method`` -- usually one of the built-in ones, to change one thing. Every
process that needs the method (the learner, the torch trainer, each megatron trainer rank) builds it
from the config this way. A bad name, a missing file or class, or a class that is no ``Method`` is a
one-line ``ConfigError``.
"""
from __future__ import annotations

from clawrl.config import ClawrlConfig
from clawrl.methods.base import Method
from clawrl.methods.combine import Combine
from clawrl.methods.opd.method import OnPolicyDistillation
from clawrl.methods.rl import BinaryRL
from clawrl.plugins import plugin_class

METHODS: dict[str, type[Method]] = {"rl": BinaryRL, "opd": OnPolicyDistillation, "combine": Combine}


def method_class(spec: str) -> type[Method]:
    """The class ``spec`` names (module docstring); raises ``ConfigError`` in one line."""
    return plugin_class("method", spec, Method, METHODS)


def load_method(cfg: ClawrlConfig) -> Method:
    """The method ``cfg.method`` names, built from ``cfg``."""
    return method_class(cfg.method)(cfg)


def check_method(spec: str) -> None:
    """Refuse a method that cannot be loaded, in one line, before anything starts."""
    method_class(spec)
