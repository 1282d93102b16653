#!/bin/bash
# Verifier: each old log is in the archive, gzipped, with its content; recent logs and other files
# stay (a condition, not points: doing nothing keeps them).
cd /app
mkdir -p /logs/verifier
pass=0; total=0
check() {  # check NAME COMMAND...: one point when COMMAND succeeds
  total=$((total + 1))
  if "${@:2}" >/dev/null 2>&1; then pass=$((pass + 1)); echo "PASS $1"; else echo "FAIL $1"; fi
}
for n in app-2023-01 web/access-2023-01 db/slow-2022-12; do
  check "$n moved to the archive and gzipped" test "$(gzip -dc "/app/archive/$n.log.gz" 2>/dev/null)" = "old $n"$'\n'"line two" \
    -a ! -e "/app/logs/$n.log" -a ! -e "/app/archive/$n.log"
done
kept=yes
for n in app web/access web/error db/slow; do
  [ "$(cat "/app/logs/$n.log" 2>/dev/null)" = "recent $n" ] || { echo "FAIL recent $n.log kept"; kept=no; }
done
[ "$(cat /app/logs/db/week-old.log 2>/dev/null)" = borderline ] || { echo "FAIL week-old.log kept"; kept=no; }
[ "$(cat /app/logs/web/README.txt 2>/dev/null)" = "old notes" ] || { echo "FAIL README.txt kept"; kept=no; }
[ -z "$(find /app/archive -type f ! -name '*.log.gz' 2>/dev/null)" ] || { echo "FAIL stray files in the archive"; kept=no; }
echo "recent logs and other files kept: $kept"
awk -v p="$pass" -v t="$total" -v ok="$kept" 'BEGIN { printf "%.4f\n", p / t * (ok == "yes" ? 1 : 0.5) }' \
  > /logs/verifier/reward.txt
