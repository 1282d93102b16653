#!/bin/bash
# Verifier: one commit added on the unchanged old history; the rate is back to 0.20, later work kept.
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
old="Clarify tax description|Add invoices|Change tax rate to 25%|Add entry point|Add tax module|"
check "old history kept, one commit on top" test "$(git log --format=%s HEAD~1 2>/dev/null | tr '\n' '|')" = "$old"
check "rate reverted in HEAD" git grep -q '^RATE = 0.20$' HEAD -- tax.py
later_kept() { git grep -q 'flat tax, rounded to cents' HEAD -- tax.py && git cat-file -e HEAD:invoice.py; }
check "later work kept in the new commit" test "$(git rev-list --count HEAD)" = 6 -a "$(later_kept && echo y)" = y
check "HEAD changes only the rate" test "$(git diff HEAD~1 HEAD 2>/dev/null | grep '^[-+][^-+]' | tr '\n' '|')" = "-RATE = 0.25|+RATE = 0.20|"
check "clean working tree after the new commit" test "$(git rev-list --count HEAD)" = 6 -a -z "$(git status --porcelain 2>&1)"
awk -v p="$pass" -v t="$total" 'BEGIN { printf "%.4f\n", p / t }' > /logs/verifier/reward.txt
