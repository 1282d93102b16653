#!/bin/bash
# Verifier: branch shape (one commit on v1.0), its tree (fix, no feature), the tag, and main untouched.
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
b=refs/heads/hotfix-1.0.1
check "branch exists" git rev-parse -q --verify "$b"
check "branch is one commit on v1.0" test -n "$(git rev-parse -q --verify "$b")" -a "$(git rev-parse -q --verify "$b~1")" = "$(git rev-parse 'v1.0^{commit}')"
check "fix applied" git grep -q 'if text is None' "$b" -- parser.py
check "no other new work" test "$(git ls-tree --name-only "$b" 2>/dev/null | tr '\n' ' ')" = "parser.py version.py "
tip=$(git rev-parse -q --verify "$b")
check "v1.0.1 tags the branch tip" test -n "$tip" -a "$(git rev-parse -q --verify 'v1.0.1^{commit}')" = "$tip"
check "main untouched" test "$(git log --format=%s main | tr '\n' '|')" = "Add metrics|Fix null check in parser|Add export feature|Release 1.0|Add parser|"
awk -v p="$pass" -v t="$total" 'BEGIN { printf "%.4f\n", p / t }' > /logs/verifier/reward.txt
