"""The README's install commands, run as written in a fresh virtual environment (issue 40, item 6).

    python3 tests/readme_install.py VENV

creates VENV with ``python3 -m venv`` (nothing in it but pip) and runs each line of the README's
Install block with VENV's bin first on PATH, so ``pip`` is that venv's. ``.ci/run`` installs this
way and then runs the suite with VENV's python, and ``tests/test_readme.py`` reads the same lines
through ``install_commands``: what CI installs is what the README says, and the two cannot drift.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def install_commands(readme: str) -> list[str]:
    """The command lines of the first ```bash block under the README's ``## Install`` heading."""
    section = re.search(r"^## Install\n(.*?)(?=^## )", readme, re.S | re.M)
    block = section and re.search(r"```bash\n(.*?)```", section.group(1), re.S)
    if not block:
        raise ValueError("README.md has no ```bash block under '## Install'")
    return [line.strip() for line in block.group(1).splitlines() if line.strip() and not line.strip().startswith("#")]


def venv_env(venv: Path) -> dict:
    """The environment of a shell with ``venv`` activated (its bin first on PATH); pip quiet unless
    the caller set PIP_QUIET (its errors still show)."""
    return {"PIP_QUIET": "1", **os.environ, "VIRTUAL_ENV": str(venv),
            "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}


def install(venv: Path, readme: Path = ROOT / "README.md") -> float:
    """Create ``venv`` afresh and run the README's install lines in it, from the repo root; seconds taken."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    for line in install_commands(readme.read_text()):
        print(f"readme-install: {line}", flush=True)
        subprocess.run(["bash", "-eo", "pipefail", "-c", line], cwd=ROOT, env=venv_env(venv), check=True)
    return time.monotonic() - started


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 tests/readme_install.py VENV", file=sys.stderr)
        return 2
    try:
        seconds = install(Path(argv[0]).resolve())
    except subprocess.CalledProcessError as e:
        print(f"readme-install: {e.cmd[-1]!r} exited {e.returncode}", file=sys.stderr)
        return 1
    print(f"readme-install: the README's install lines ran in a fresh venv {argv[0]} in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
