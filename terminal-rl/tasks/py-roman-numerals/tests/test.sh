#!/bin/bash
# Verifier: conversions both ways (subtractive forms in every place) and the refusals.
mkdir -p /logs/verifier
python3 -I - <<'PY'
import subprocess
from pathlib import Path

checks = []
def check(name, ok):
    checks.append(bool(ok)); print("PASS" if ok else "FAIL", name)

def run(*args):
    try:
        p = subprocess.run(["python3", "/app/roman.py", *args], capture_output=True, text=True, timeout=10)
        return p.returncode, p.stdout.strip(), p.stderr.strip()
    except subprocess.TimeoutExpired:
        return None, "", ""

for n, s in [(4, "IV"), (14, "XIV"), (49, "XLIX"), (444, "CDXLIV"), (1994, "MCMXCIV"), (3999, "MMMCMXCIX")]:
    check(f"to {n} = {s}", run("to", str(n))[:2] == (0, s))
    check(f"from {s} = {n}", run("from", s)[:2] == (0, str(n)))
for bad in [("to", "0"), ("to", "4000"), ("from", "IIII"), ("from", "VX"), ("from", "iv"), ("from", "MMMM"),
            ("from", "IC"), ("half", "3")]:
    rc, out, err = run(*bad)
    check(f"refuses {bad}", Path("/app/roman.py").is_file() and rc == 1 and out == "" and err and "Traceback" not in err)
Path("/logs/verifier/reward.txt").write_text(f"{sum(checks) / len(checks):.4f}\n")
PY
