#!/bin/bash
# Verifier: errors.txt matches the per-module ERROR counts line by line (a share of lines right).
mkdir -p /logs/verifier
expected=$'cache 12\ndb 8\napi 6\nauth 6\nmailer 4'
got=$(sed 's/[[:space:]]*$//' /app/errors.txt 2>/dev/null)
echo "expected:"; echo "$expected"; echo "got:"; echo "$got"
python3 -I - "$expected" "$got" <<'PY'
import sys
exp, got = sys.argv[1].splitlines(), sys.argv[2].splitlines()
right = sum(1 for i, line in enumerate(exp) if i < len(got) and got[i] == line)
reward = 1.0 if got == exp else 0.8 * right / len(exp)
open("/logs/verifier/reward.txt", "w").write(f"{reward:.4f}\n")
PY
