#!/bin/bash
# Verifier: backup.tar.gz is a gzip tar whose project/ members are exactly the non-log, non-cache files.
mkdir -p /logs/verifier
python3 -I - <<'PY'
import gzip, tarfile
from pathlib import Path

checks = []
def check(name, ok):
    checks.append(bool(ok)); print("PASS" if ok else "FAIL", name)

wanted = {"project/README.md", "project/src/app/main.py", "project/src/app/__init__.py",
          "project/docs/usage.txt", "project/docs/changelog.txt"}
members = {}
try:
    with open("/app/backup.tar.gz", "rb") as f:
        is_gzip = f.read(2) == b"\x1f\x8b"
    with tarfile.open("/app/backup.tar.gz", "r:gz") as tar:
        for m in tar.getmembers():
            if m.isfile():
                members[m.name.removeprefix("./")] = tar.extractfile(m).read()
except (OSError, tarfile.TarError) as e:
    is_gzip = False
    print("cannot read archive:", e)
check("archive is gzip", is_gzip)
for name in sorted(wanted):
    src = Path("/app") / name
    check(f"{name} archived intact", name in members and src.exists() and members[name] == src.read_bytes())
check("no .log files", members and not any(n.endswith(".log") for n in members))
check("no __pycache__", members and not any("__pycache__" in n for n in members))
check("nothing outside project/", members and all(n.startswith("project/") for n in members))
check("project left in place", Path("/app/project/logs/run.log").exists()
      and Path("/app/project/src/app/__pycache__/main.cpython-311.pyc").exists())
Path("/logs/verifier/reward.txt").write_text(f"{sum(checks) / len(checks):.4f}\n")
PY
