#!/bin/bash
# Verifier: runs the agent's script on fresh inputs (ASCII, Unicode, ties, empty, no final newline,
# a missing file) and compares the parsed JSON.
mkdir -p /logs/verifier
python3 -I - <<'PY'
import json, subprocess, tempfile
from pathlib import Path

checks = []
def check(name, ok):
    checks.append(bool(ok)); print("PASS" if ok else "FAIL", name)

def run(path):
    try:
        p = subprocess.run(["python3", "/app/textstats.py", str(path)], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return None, None
    try:
        return p.returncode, json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return p.returncode, None

d = Path(tempfile.mkdtemp())
cases = {
    "sample": ("hello world\nsecond line here\n", {"lines": 2, "words": 5, "chars": 29, "longest": "second"}),
    "unicode": ("naïve café\nżółć\n", {"lines": 2, "words": 3, "chars": 16, "longest": "naïve"}),
    "ties": ("abc de fgh\tij\n\n  klm", {"lines": 2, "words": 5, "chars": 20, "longest": "abc"}),
    "empty": ("", {"lines": 0, "words": 0, "chars": 0, "longest": None}),
    "spaces": ("   \n\t\n", {"lines": 2, "words": 0, "chars": 6, "longest": None}),
}
for name, (text, want) in cases.items():
    (d / name).write_text(text, encoding="utf-8")
    rc, got = run(d / name)
    check(f"{name}: {want}, got {got}", rc == 0 and got == want)
p = subprocess.run(["python3", "/app/textstats.py", str(d / "missing")], capture_output=True, text=True, timeout=10)
check("missing file: status 2 and a message", Path("/app/textstats.py").is_file() and p.returncode == 2 and p.stderr.strip() and "Traceback" not in p.stderr)
Path("/logs/verifier/reward.txt").write_text(f"{sum(checks) / len(checks):.4f}\n")
PY
