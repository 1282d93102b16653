#!/bin/bash
# Verifier: report.csv against the known statuses of the six checks.
mkdir -p /logs/verifier
python3 -I - <<'PY'
from pathlib import Path
exp = ["check,exit_code", "config,1", "count,42", "disk,0", "signal,143", "strict,1", "tools,127"]
try:
    got = [l.strip().replace(" ", "") for l in Path("/app/report.csv").read_text().splitlines() if l.strip()]
except OSError:
    got = []
print("expected", exp); print("got", got)
right = sum(1 for a, b in zip(exp[1:], got[1:]) if a == b) if got[:1] == exp[:1] else 0
reward = 1.0 if got == exp else 0.8 * right / (len(exp) - 1)
Path("/logs/verifier/reward.txt").write_text(f"{reward:.4f}\n")
PY
