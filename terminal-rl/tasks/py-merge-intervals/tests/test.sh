#!/bin/bash
# Verifier: runs busy.py on new schedules (nesting, touching, unsorted, single) and on bad lines.
mkdir -p /logs/verifier
python3 -I - <<'PY'
import subprocess, tempfile
from pathlib import Path

checks = []
def check(name, ok):
    checks.append(bool(ok)); print("PASS" if ok else "FAIL", name)

d = Path(tempfile.mkdtemp())
def run(text):
    f = d / "in.txt"
    f.write_text(text)
    try:
        p = subprocess.run(["python3", "/app/busy.py", str(f)], capture_output=True, text=True, timeout=10)
        return p.returncode, p.stdout.strip(), p.stderr.strip()
    except subprocess.TimeoutExpired:
        return None, "", ""

check("example", run("09:00 10:30\n10:00 11:00\n13:00 14:00\n14:00 14:30\n08:15 08:45\n")[:2]
      == (0, "08:15-08:45\n09:00-11:00\n13:00-14:30\ntotal 240"))
check("nested and unsorted", run("12:00 18:00\n\n13:00 14:00\n07:05 07:10\n17:59 18:01\n")[:2]
      == (0, "07:05-07:10\n12:00-18:01\ntotal 366"))
check("single meeting", run("23:00 23:59\n")[:2] == (0, "23:00-23:59\ntotal 59"))
check("gap of one minute", run("10:00 10:30\n10:31 11:00\n")[:2] == (0, "10:00-10:30\n10:31-11:00\ntotal 59"))
for text, n in [("09:00 10:00\n10:00 09:30\n", 2), ("09:00 10:00\n\n9:00 10:00\n", 3),
                ("09:00 24:00\n", 1), ("09:00\n", 1), ("10:00 10:00\n", 1)]:
    rc, out, err = run(text)
    check(f"invalid line {n} in {text!r}", Path("/app/busy.py").is_file() and (rc, out, err) == (1, "", f"line {n}: invalid"))
Path("/logs/verifier/reward.txt").write_text(f"{sum(checks) / len(checks):.4f}\n")
PY
