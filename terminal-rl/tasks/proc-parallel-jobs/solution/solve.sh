#!/bin/bash
# Oracle: one background subshell per job, each writing its own .out and .rc, then wait.
set -euo pipefail
cat > /app/parallel.sh <<'SH'
#!/bin/bash
# parallel.sh: run /app/jobs/*.sh concurrently; collect each job's stdout and exit status.
mkdir -p /app/results
for job in /app/jobs/*.sh; do
  name=$(basename "$job" .sh)
  ( bash "$job" > "/app/results/$name.out" 2>/dev/null; echo $? > "/app/results/$name.rc" ) &
done
wait
ok=0; failed=0
for rc in /app/results/*.rc; do
  if [ "$(cat "$rc")" = 0 ]; then ok=$((ok + 1)); else failed=$((failed + 1)); fi
done
echo "ok=$ok failed=$failed"
[ "$failed" -eq 0 ]
SH
chmod +x /app/parallel.sh
