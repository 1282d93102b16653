#!/bin/bash
# Verifier: HEAD tracks no .env but keeps .env.example and .gitignore; files on disk; one new commit.
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
tracked=$(git ls-tree -r --name-only HEAD 2>/dev/null | tr '\n' ' ')
echo "tracked: $tracked"
check "no .env tracked" test "$tracked" = ".env.example .gitignore app.py "
check "one new commit" test "$(git rev-list --count HEAD)" = 2
check "secrets kept on disk" test "$(cat .env 2>/dev/null)" = $'API_KEY=sk-live-91f0c2\nDB_PASSWORD=hunter2' -a "$(cat config/.env 2>/dev/null)" = "API_KEY=sk-test-local"
check ".env ignored at the top" git check-ignore -q .env
check ".env ignored in subdirectories" git check-ignore -q config/.env
check "a new nested .env is ignored too" git check-ignore -q --no-index deep/dir/.env
check ".env.example not ignored" test "$(git check-ignore --no-index .env.example)" = ""
check "clean status" test "$(git rev-list --count HEAD)" = 2 -a -z "$(git status --porcelain 2>&1)"
awk -v p="$pass" -v t="$total" 'BEGIN { printf "%.4f\n", p / t }' > /logs/verifier/reward.txt
