#!/bin/bash
# Verifier: spend.csv row by row against the expected join; full credit only for the exact table.
mkdir -p /logs/verifier
python3 -I - <<'PY'
from pathlib import Path
exp = Path("/tests/expected.csv").read_text().splitlines()
try:
    got = [l.strip() for l in Path("/app/spend.csv").read_text().splitlines() if l.strip()]
except OSError:
    got = []
print("expected", exp); print("got", got)
right = sum(1 for a, b in zip(exp[1:], got[1:]) if a == b) if got[:1] == exp[:1] else 0
reward = 1.0 if got == exp else 0.8 * right / (len(exp) - 1)
Path("/logs/verifier/reward.txt").write_text(f"{reward:.4f}\n")
PY
