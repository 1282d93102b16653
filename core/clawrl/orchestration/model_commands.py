"""``clawrl model get|list|import``: install pretrained models by name (``clawrl.models``) and say
where they are. ``clawrl model build`` (the embedded tiny model) is ``clawrl.embedded_hybrid``'s.

Each command ends with one line on stdout; notes (a directory that failed its manifest and is
installed again) go to stderr; a failure is one line (``CliError``), exit 2.
"""
from __future__ import annotations

import sys
import time

from clawrl.embedded_hybrid import build_cli
from clawrl.models.catalog import KNOWN, installed_dir, installed_names
from clawrl.models.fetch import Installed, get_model, import_gguf
from clawrl.models.gguf_convert import directory_size, read_manifest


def _note(line: str) -> None:
    print(f"clawrl: {line}", file=sys.stderr, flush=True)


def _said(name: str, done: Installed, t0: float) -> str:
    size = directory_size(done.path) / 1e6
    if not done.installed:
        return f"{name}: {done.path} ({size:.1f} MB), already installed; its manifest's hashes match"
    return (f"{name}: installed in {done.path} ({size:.1f} MB) in {time.time() - t0:.0f} s; "
            f"serve it with model.path={name}")


def get_cli(args) -> int:
    t0 = time.time()
    print(_said(args.name, get_model(args.name, note=_note), t0), flush=True)
    return 0


def import_cli(args) -> int:
    t0 = time.time()
    print(_said(args.name, import_gguf(args.file, args.name, force=args.force, note=_note), t0), flush=True)
    return 0


def list_cli(args) -> int:
    """One line per model, known ones first: NAME<TAB>STATE<TAB>PATH<TAB>SIZE<TAB>WHAT."""
    for name in [*sorted(KNOWN), *(n for n in installed_names() if n not in KNOWN)]:
        path = installed_dir(name)
        what = KNOWN[name].summary if name in KNOWN else _imported_summary(path)
        if path is None:
            print(f"{name}\tnot fetched\t-\t-\t{what} (clawrl model get {name})")
        else:
            print(f"{name}\tfetched\t{path}\t{directory_size(path) / 1e6:.1f} MB\t{what}")
    return 0


def _imported_summary(path) -> str:
    source = (read_manifest(path) or {}).get("source", {})
    return f"imported from {source.get('gguf_file')} ({source.get('architecture')})"


def model_cli(args) -> int:
    return {"build": build_cli, "get": get_cli, "list": list_cli, "import": import_cli}[args.model_cmd](args)
