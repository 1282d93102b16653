#!/bin/bash
# Verifier: the token and the audit log's line count, read from the agent's two answer files.
cd /app
mkdir -p /logs/verifier
pass=0; total=0
check() {  # check NAME COMMAND...: one point when COMMAND succeeds
  total=$((total + 1))
  if "${@:2}" >/dev/null 2>&1; then pass=$((pass + 1)); echo "PASS $1"; else echo "FAIL $1"; fi
}
check "token" test "$(tr -d '[:space:]' < /app/token.txt)" = "k7Q2-fennel-4481"
check "audit lines" test "$(tr -d '[:space:]' < /app/audit_lines.txt)" = "37"
awk -v p="$pass" -v t="$total" 'BEGIN { printf "%.4f\n", p / t }' > /logs/verifier/reward.txt
