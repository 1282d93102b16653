#!/bin/bash
# Verifier: one new commit with the right message and tree on top of the old history; clean status.
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
check "message" test "$(git log -1 --format=%s)" = "Add util module"
check "exactly one new commit on the old history" test "$(git log --format=%s HEAD~1 2>/dev/null | tr '\n' '|')" = "Describe the repo|Initial commit|"
check "on main" test "$(git rev-parse --abbrev-ref HEAD)" = main
check "util.py committed" test "$(git show HEAD:src/util.py 2>/dev/null)" = $'def shout(s):\n    return s.upper()'
check "app.py edit committed" git grep -q 'shout("v2")' HEAD -- src/app.py
check "old.txt deletion committed" test -z "$(git ls-tree -r --name-only HEAD -- old.txt)"
check "no tmp file tracked" test -z "$(git ls-tree -r --name-only HEAD | grep '\.tmp$')"
check ".gitignore committed and ignores tmp" git check-ignore -q --no-index src/cache.tmp
check "gitignore is tracked" test -n "$(git ls-tree --name-only HEAD -- .gitignore)"
check "tmp files kept on disk" test -f debug.tmp -a -f src/cache.tmp
check "clean status" test -z "$(git status --porcelain 2>&1)"
awk -v p="$pass" -v t="$total" 'BEGIN { printf "%.4f\n", p / t }' > /logs/verifier/reward.txt
