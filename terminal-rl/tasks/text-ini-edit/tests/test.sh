#!/bin/bash
# Verifier: one point per required edit, one for every other line unchanged; all or a share.
mkdir -p /logs/verifier
python3 -I - <<'PY'
from pathlib import Path

checks = []
def check(name, ok):
    checks.append(bool(ok)); print("PASS" if ok else "FAIL", name)

try:
    got = Path("/app/config.ini").read_text().splitlines()
except OSError:
    got = []
exp = Path("/tests/expected.ini").read_text().splitlines()
def section(lines, name):
    out, inside = [], False
    for ln in lines:
        if ln.startswith("["):
            inside = ln.strip() == f"[{name}]"
        elif inside:
            out.append(ln)
    return out
check("server port 8080", "port = 8080" in section(got, "server"))
check("server debug enabled", "debug = true" in section(got, "server") and "#debug = false" not in got)
check("database host", "host = db.internal" in section(got, "database"))
check("other ports kept", "port = 5432" in section(got, "database") and "port = 9100" in section(got, "metrics"))
check("file otherwise unchanged", got == exp)
Path("/logs/verifier/reward.txt").write_text(f"{sum(checks) / len(checks):.4f}\n")
PY
