"""The packages the bugs are made in: a pinned list, fetched once into ``$CLAWRL_HOME``.

``packages.toml`` (in a method directory, e.g. ``swe-rl/``) names each package's sdist by version
and sha256, the source files the bugs may go in, the test paths that judge them and the
``PYTHONPATH`` its tests need. The sdist is looked up in PyPI's simple index (PEP 691 JSON, the
index pip reads) by its sha256 and downloaded from the URL listed there, then checked against the pinned sha256 before anything reads it; a mismatch deletes
the file and stops. (``pip download`` of an sdist prepares its metadata, which runs the package's
build backend and pulls unpinned build requirements such as setuptools_scm: the archive itself is
all we need, so it is fetched as a file.) Nothing is vendored in the repository.
"""
from __future__ import annotations

import json
import tarfile
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from clawrl.envs.base import EnvError
from clawrl.hashes import sha256_file
from clawrl.paths import data_dir

SIMPLE_INDEX = "https://pypi.org/simple/{name}/"
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
FETCH_TIMEOUT_S = 60


@dataclass(frozen=True)
class Package:
    """One pinned sdist and how its tests run (the fields of a ``[[package]]`` table)."""

    name: str
    version: str
    sha256: str
    shape: str  # what kind of library it is, for the README and the build log
    source: tuple[str, ...]  # files (relative to the sdist's root) the bugs go in
    tests: tuple[str, ...]  # test paths pytest runs; restored to the instance's own before judging
    pythonpath: tuple[str, ...] = (".",)
    test_timeout_s: float = 60.0  # a run of the suite past this is a failure (build, evaluation)

    @property
    def ref(self) -> dict:
        """The instance's local source reference (``clawrl_source``)."""
        return {"package": self.name, "version": self.version, "sha256": self.sha256,
                "pythonpath": list(self.pythonpath), "tests": list(self.tests), "test_timeout_s": self.test_timeout_s}


def read_packages(path: Path) -> list[Package]:
    """The packages of a ``packages.toml``; EnvError (one line) for a missing or malformed one."""
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise EnvError(f"{path}: cannot read the package list ({e})") from None
    out = []
    for n, row in enumerate(doc.get("package", []), 1):
        try:
            pkg = Package(name=row["name"], version=row["version"], sha256=row["sha256"].lower(),
                          shape=row.get("shape", ""), source=tuple(row["source"]), tests=tuple(row["tests"]),
                          pythonpath=tuple(row.get("pythonpath", ["."])),
                          test_timeout_s=float(row.get("test_timeout_s", 60.0)))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise EnvError(f"{path}: package {n} lacks a field or has a wrong one ({e})") from None
        if len(pkg.sha256) != 64 or not pkg.source or not pkg.tests:
            raise EnvError(f"{path}: package {pkg.name} needs a 64-hex sha256, source files and test paths")
        out.append(pkg)
    if not out:
        raise EnvError(f"{path}: no [[package]] tables")
    return out


def package_of(ref: dict) -> Package:
    """The Package an instance's ``clawrl_source`` names (enough of it to rebuild the testbed)."""
    try:
        return Package(name=ref["package"], version=ref["version"], sha256=ref["sha256"], shape="", source=(),
                       tests=tuple(ref["tests"]), pythonpath=tuple(ref.get("pythonpath", ["."])),
                       test_timeout_s=float(ref.get("test_timeout_s", 60.0)))
    except (KeyError, TypeError) as e:
        raise EnvError(f"clawrl_source lacks a field ({e})") from None


def cache_dir() -> Path:
    d = data_dir() / "swe-rl" / "sdists"
    d.mkdir(parents=True, exist_ok=True)
    return d


def sdist_path(pkg: Package) -> Path:
    """The package's sdist in the cache, fetched and checked first when it is not there yet."""
    target = cache_dir() / f"{pkg.name}-{pkg.version}-{pkg.sha256[:12]}.tar.gz"
    if target.is_file() and sha256_file(target) == pkg.sha256:
        return target
    url = _sdist_url(pkg)
    partial = target.with_suffix(".part")
    try:
        with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as r, open(partial, "wb") as f:
            while chunk := r.read(1 << 16):
                f.write(chunk)
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise EnvError(f"cannot download {pkg.name} {pkg.version} ({e})") from None
    got = sha256_file(partial)
    if got != pkg.sha256:
        partial.unlink()
        raise EnvError(f"{pkg.name} {pkg.version}: the sdist's sha256 is {got}, the pin says {pkg.sha256}")
    partial.replace(target)
    return target


def sdist_root(archive: Path) -> str:
    """The one top-level directory of an sdist (``name-version``)."""
    with tarfile.open(archive) as tar:
        tops = {m.name.split("/")[0] for m in tar.getmembers()}
    if len(tops) != 1:
        raise EnvError(f"{archive.name}: expected one top-level directory, found {sorted(tops)[:3]}")
    return tops.pop()


def _sdist_url(pkg: Package) -> str:
    request = urllib.request.Request(SIMPLE_INDEX.format(name=pkg.name), headers={"Accept": SIMPLE_JSON})
    try:
        with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_S) as r:
            index = json.load(r)
    except (OSError, ValueError) as e:
        raise EnvError(f"cannot look up {pkg.name} on PyPI ({e})") from None
    for f in index.get("files", []):
        if f.get("filename", "").endswith(".tar.gz") and f.get("hashes", {}).get("sha256") == pkg.sha256:
            return f["url"]
    raise EnvError(f"PyPI has no sdist of {pkg.name} {pkg.version} with sha256 {pkg.sha256}")


