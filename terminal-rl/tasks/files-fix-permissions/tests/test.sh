#!/bin/bash
# Verifier: the exact mode of every path under /app/site, and that the files are intact.
cd /app
mkdir -p /logs/verifier
pass=0; total=0
check() {  # check NAME COMMAND...: one point when COMMAND succeeds
  total=$((total + 1))
  if "${@:2}" >/dev/null 2>&1; then pass=$((pass + 1)); echo "PASS $1"; else echo "FAIL $1"; fi
}
mode_is() { test "$(stat -c %a "/app/site/$1")" = "$2"; }
while read -r path mode; do
  check "$path is $mode" mode_is "$path" "$mode"
done <<'LIST'
. 755
bin 755
css 755
docs 755
docs/old 755
index.html 644
css/main.css 644
docs/guide.md 644
docs/old/notes.txt 644
deploy.sh 755
docs/old/migrate.sh 755
bin/tool 755
bin/sync 755
LIST
check "contents intact" grep -q 'echo migrate' /app/site/docs/old/migrate.sh
check "nothing added or removed" test "$(find /app/site | wc -l)" = 13
awk -v p="$pass" -v t="$total" 'BEGIN { printf "%.4f\n", p / t }' > /logs/verifier/reward.txt
