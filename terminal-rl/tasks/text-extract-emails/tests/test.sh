#!/bin/bash
# Verifier: emails.txt equals the expected list; otherwise credit for the share of right addresses
# minus wrong ones.
mkdir -p /logs/verifier
python3 -I - <<'PY'
from pathlib import Path
exp = Path("/tests/expected.txt").read_text().split()
try:
    got = Path("/app/emails.txt").read_text().split()
except OSError:
    got = []
print("expected", exp); print("got", got)
if got == exp:
    reward = 1.0
else:
    right = len(set(got) & set(exp)); wrong = len(set(got) - set(exp))
    reward = max(0.0, 0.8 * (right - wrong) / len(exp))
Path("/logs/verifier/reward.txt").write_text(f"{reward:.4f}\n")
PY
