#!/bin/bash
# Verifier: merge commit parents, the resolved settings.py (by value and by exact text), both new
# files, main checked out, nothing left over.
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
old_main=$(git log --all --format=%H --grep='^Add S3 backend, longer timeout$')
feat=$(git rev-parse -q --verify refs/heads/feature)
check "main is a merge of old main and feature" test -n "$old_main" -a "$(git rev-list --parents -n 1 main | cut -d' ' -f2-)" = "$old_main $feat"
settings=$(git show main:settings.py 2>/dev/null)
check "TIMEOUT from main" grep -qx 'TIMEOUT = 45' <<<"$settings"
check "RETRIES from feature" grep -qx 'RETRIES = 5' <<<"$settings"
check "all three backends" grep -qx 'BACKENDS = \["local", "s3", "gcs"\]' <<<"$settings"
check "exact resolved file, no markers" test "$settings" = $'# settings\nTIMEOUT = 45\nRETRIES = 5\nBACKENDS = ["local", "s3", "gcs"]'
check "both new files merged" test "$(git ls-tree --name-only main 2>/dev/null | tr '\n' ' ')" = "gcs.py s3.py settings.py "
check "main checked out, clean, merge concluded" test "$(git symbolic-ref -q --short HEAD)" = main -a -z "$(git status --porcelain 2>&1)" -a ! -e .git/MERGE_HEAD
awk -v p="$pass" -v t="$total" 'BEGIN { printf "%.4f\n", p / t }' > /logs/verifier/reward.txt
