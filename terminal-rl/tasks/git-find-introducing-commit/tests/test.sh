#!/bin/bash
# Verifier: the hash and author email of the "Refactor config loading" commit; the repo unchanged.
cd /app/repo 2>/dev/null || cd /app
mkdir -p /logs/verifier
# Only the repository's own config counts: no global or system config, no fsmonitor command.
export HOME=$(mktemp -d) GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_COUNT=2 GIT_CONFIG_KEY_0=safe.directory \
  GIT_CONFIG_VALUE_0='*' GIT_CONFIG_KEY_1=core.fsmonitor GIT_CONFIG_VALUE_1=false
if ! git -C /app/repo rev-parse -q --verify HEAD >/dev/null 2>&1; then
  echo "FAIL /app/repo is no longer a git repository with commits"
  echo 0 > /logs/verifier/reward.txt
  exit 0
fi
pass=0; total=0
check() {  # check NAME COMMAND...: one point when COMMAND succeeds
  total=$((total + 1))
  if "${@:2}" >/dev/null 2>&1; then pass=$((pass + 1)); echo "PASS $1"; else echo "FAIL $1"; fi
}
want=$(git log --format=%H --grep='^Refactor config loading$')
line1=$(sed -n 1p /app/answer.txt 2>/dev/null | tr -d '[:space:]')
line2=$(sed -n 2p /app/answer.txt 2>/dev/null | tr -d '[:space:]')
check "commit hash" test -n "$want" -a "$line1" = "$want"
check "author email" test "$line1" = "$want" -a "$line2" = ben@example.com
check "repository unchanged" test "$(git rev-list --count HEAD)" = 12 -a -z "$(git status --porcelain 2>&1)" -a -n "$line1"
awk -v p="$pass" -v t="$total" 'BEGIN { printf "%.4f\n", p / t }' > /logs/verifier/reward.txt
