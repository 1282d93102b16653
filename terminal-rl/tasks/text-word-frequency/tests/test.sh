#!/bin/bash
# Verifier: top10.txt equals the expected ranking; a share of correct lines otherwise.
mkdir -p /logs/verifier
python3 -I - <<'PY'
from pathlib import Path
exp = Path("/tests/expected.txt").read_text().splitlines()
try:
    got = [" ".join(l.split()) for l in Path("/app/top10.txt").read_text().splitlines() if l.strip()]
except OSError:
    got = []
print("expected", exp); print("got", got)
right = sum(1 for a, b in zip(exp, got) if a == b)
reward = 1.0 if got == exp else 0.8 * right / len(exp)
Path("/logs/verifier/reward.txt").write_text(f"{reward:.4f}\n")
PY
