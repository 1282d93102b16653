#!/bin/bash
# Verifier: the total line and the three ranked IP lines, a quarter of the reward each.
mkdir -p /logs/verifier
python3 -I - <<'PY'
from pathlib import Path
exp = ["total 90", "10.0.0.7 16", "172.16.0.4 12", "10.0.1.3 11"]
try:
    got = [" ".join(l.split()) for l in Path("/app/report.txt").read_text().splitlines() if l.strip()]
except OSError:
    got = []
print("expected", exp); print("got", got)
right = sum(1 for a, b in zip(exp, got) if a == b)
reward = right / len(exp) if len(got) == len(exp) else 0.8 * right / len(exp)
Path("/logs/verifier/reward.txt").write_text(f"{reward:.4f}\n")
PY
