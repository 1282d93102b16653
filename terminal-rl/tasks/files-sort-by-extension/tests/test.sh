#!/bin/bash
# Verifier: every original file sits in sorted/<ext>/ with its content intact, and the inbox is empty.
cd /app
mkdir -p /logs/verifier
pass=0; total=0
check() {  # check NAME COMMAND...: one point when COMMAND succeeds
  total=$((total + 1))
  if "${@:2}" >/dev/null 2>&1; then pass=$((pass + 1)); echo "PASS $1"; else echo "FAIL $1"; fi
}
exp=/tests/expected
while read -r ext name; do
  check "$name in $ext" cmp "$exp/$name" "/app/sorted/$ext/$name"
done <<'LIST'
pdf report.PDF
txt notes.txt
txt todo.TXT
jpg photo.jpg
jpg holiday.JPG
gz archive.tar.gz
noext Makefile
noext README
csv data.csv
sh script.sh
LIST
check "inbox is empty, all ten files sorted" test -z "$(ls -A /app/inbox 2>/dev/null)" -a "$(find /app/sorted -type f 2>/dev/null | wc -l)" = 10
check "no stray directories" test "$(ls /app/sorted 2>/dev/null | tr '\n' ' ')" = "csv gz jpg noext pdf sh txt "
awk -v p="$pass" -v t="$total" 'BEGIN { printf "%.4f\n", p / t }' > /logs/verifier/reward.txt
