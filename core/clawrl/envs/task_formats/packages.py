"""Package installs in a Dockerfile's RUN lines that the host already satisfies.

Nearly every real task's Dockerfile starts with ``apt-get update && apt-get install -y ...`` or
``pip install ...``. In the sandbox, without network (and without root over the host's package
database), such a line always fails, even when the host already has every package it names. So
before a RUN line runs, each of its commands that only installs what the host already has
(``apt-get update``/``install``/``clean``, ``rm -rf /var/lib/apt/lists/*``, ``pip install`` of
distributions already present in a version the requirement accepts) is replaced by ``true``;
the rest of the line, separators included, is left exactly as written. A package the host lacks
keeps its command, which then fails and refuses the task naming the line, as it should.

Only lines whose top level is a plain sequence (``&&``, ``;``, newlines) are rewritten: with
``||`` or ``&`` a dropped command could change what runs, so those lines run as written.
"""
from __future__ import annotations

import importlib.metadata
import re
import shlex
import subprocess
from functools import lru_cache
from typing import Optional

try:  # optional: without it, pip lines are never judged satisfied (they run as written)
    from packaging.requirements import InvalidRequirement, Requirement
except ImportError:  # pragma: no cover - packaging ships with pip/setuptools environments
    Requirement = None

_APT = {"apt-get", "apt", "aptitude"}
_APT_NOOPS = {"update", "clean", "autoclean", "autoremove"}
_APT_VALUE_FLAGS = {"-o", "-c", "-t", "--target-release", "--option", "--config-file"}
_PIP_VALUE_FLAGS = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links", "--trusted-host", "--timeout",
                    "--retries", "--cache-dir", "--progress-bar", "--python", "--platform"}
_PIP_UNSUPPORTED = {"-r", "--requirement", "-c", "--constraint", "-e", "--editable", "-t", "--target", "--prefix",
                    "--root", "--user", "-U", "--upgrade", "--force-reinstall"}
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def drop_satisfied(command: str) -> tuple[str, list[str]]:
    """``command`` with each host-satisfied install command replaced by ``true``, and the
    commands replaced. Unchanged (and nothing replaced) when the line is not a plain sequence."""
    pieces = _split_top_level(command)
    if pieces is None:
        return command, []
    out, dropped = [], []
    for piece, sep in pieces:
        if piece.strip() and _satisfied(piece.strip()):
            lead = piece[: len(piece) - len(piece.lstrip())]
            trail = piece[len(piece.rstrip()):]
            out.append(f"{lead}true{trail}{sep}")
            dropped.append(" ".join(piece.split()))
        else:
            out.append(piece + sep)
    return "".join(out), dropped


def missing_packages(command: str) -> list[str]:
    """The packages ``command``'s apt-get/pip install commands name that the host lacks (for the
    refusal's message: what the task would have to fetch)."""
    pieces = _split_top_level(command) or [(command, "")]
    missing: list[str] = []
    for piece, _ in pieces:
        try:
            words = shlex.split(piece)
        except ValueError:
            continue
        while words and (_ASSIGNMENT.match(words[0]) or words[0] == "sudo"):
            words = words[1:]
        if not words:
            continue
        tool = words[0].rsplit("/", 1)[-1]
        if tool in _APT and "install" in words:
            names = [w for w in words[words.index("install") + 1:] if not w.startswith("-")]
            missing += [n for n in names if re.fullmatch(r"[a-z0-9][a-z0-9+.:=~-]*", n) and not _deb_installed(n)]
        elif (re.fullmatch(r"pip3?(\.\d+)?", tool) or tool == "uv" or words[1:3] == ["-m", "pip"]) and "install" in words:
            specs = [w for w in words[words.index("install") + 1:] if not w.startswith("-")]
            missing += [w for w in specs if Requirement is not None and not _dist_satisfied(w)]
    return list(dict.fromkeys(missing))


def _split_top_level(command: str) -> Optional[list[tuple[str, str]]]:
    """(command, separator after it) pairs split at top-level ``&&``, ``;`` and newlines; None when
    the line has top-level ``||``, ``&`` or anything this split cannot follow (heredocs, subshells
    spanning separators, unclosed quotes)."""
    pieces: list[tuple[str, str]] = []
    start = i = 0
    quote = ""
    depth = 0
    while i < len(command):
        c = command[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 2
                continue
            if c == quote:
                quote = ""
        elif c == "\\":
            i += 2
            continue
        elif c in "'\"":
            quote = c
        elif c in "({":
            depth += 1
        elif c in ")}":
            depth -= 1
        elif command.startswith("<<", i):
            return None
        elif depth == 0 and command.startswith("&&", i):
            pieces.append((command[start:i], "&&"))
            i += 2
            start = i
            continue
        elif depth == 0 and command.startswith("||", i):
            return None
        elif depth == 0 and c == "&":
            return None
        elif depth == 0 and c in ";\n":
            pieces.append((command[start:i], c))
            start = i + 1
        i += 1
    if quote or depth:
        return None
    pieces.append((command[start:], ""))
    return pieces


def _satisfied(piece: str) -> bool:
    try:
        words = shlex.split(piece)
    except ValueError:
        return False
    # a redirect, pipe or variable leaves a word no package or requirement is named, so such a
    # command is never judged satisfied; command substitution could hide anything
    if not words or "`" in piece or "$(" in piece:
        return False
    while words and _ASSIGNMENT.match(words[0]):  # DEBIAN_FRONTEND=noninteractive apt-get ...
        words = words[1:]
    if words[:1] == ["sudo"]:
        words = words[1:]
    if not words:
        return False
    tool = words[0].rsplit("/", 1)[-1]
    if tool in _APT:
        return _apt_satisfied(words[1:])
    if tool == "rm":
        targets = [w for w in words[1:] if not w.startswith("-")]
        return bool(targets) and all(t.startswith(("/var/lib/apt/lists", "/var/cache/apt")) for t in targets)
    if re.fullmatch(r"pip3?(\.\d+)?", tool):
        return _pip_satisfied(words[1:])
    if re.fullmatch(r"python3?(\.\d+)?", tool) and words[1:3] == ["-m", "pip"]:
        return _pip_satisfied(words[3:])
    if tool == "uv" and words[1:2] == ["pip"]:
        return _pip_satisfied(words[2:])
    return False


def _apt_satisfied(args: list[str]) -> bool:
    packages, sub = [], None
    i = 0
    while i < len(args):
        a = args[i]
        if a in _APT_VALUE_FLAGS:
            i += 2
            continue
        if a.startswith("-"):
            i += 1
            continue
        if sub is None:
            sub = a
        else:
            packages.append(a)
        i += 1
    if sub in _APT_NOOPS:
        return True
    return sub == "install" and bool(packages) and all(_deb_installed(p) for p in packages)


def _deb_installed(spec: str) -> bool:
    name, _, version = spec.partition("=")
    name = name.split(":", 1)[0]
    installed = _host_deb_version(name)
    return installed is not None and (not version or installed == version)


@lru_cache(maxsize=None)
def _host_deb_version(name: str) -> Optional[str]:
    """The host's installed version of Debian package ``name``, or None."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9+.-]*", name):
        return None
    try:
        r = subprocess.run(["dpkg-query", "-W", "-f=${db:Status-Status} ${Version}", name],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    status, _, version = r.stdout.partition(" ")
    return version if r.returncode == 0 and status == "installed" else None


def _pip_satisfied(args: list[str]) -> bool:
    if Requirement is None or not args or args[0] != "install":
        return False
    specs = []
    i = 1
    while i < len(args):
        a = args[i]
        flag = a.split("=", 1)[0]
        if flag in _PIP_UNSUPPORTED:
            return False
        if flag in _PIP_VALUE_FLAGS:
            i += 1 if "=" in a else 2
            continue
        if a.startswith("-"):
            i += 1
            continue
        specs.append(a)
        i += 1
    return bool(specs) and all(_dist_satisfied(s) for s in specs)


def _dist_satisfied(spec: str) -> bool:
    try:
        req = Requirement(spec)
    except InvalidRequirement:
        return False  # a path, a URL, a wheel file: not something installed
    if req.url or req.marker is not None:
        return False
    try:
        version = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return req.specifier.contains(version, prereleases=True)
