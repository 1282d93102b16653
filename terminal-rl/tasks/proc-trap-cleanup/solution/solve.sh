#!/bin/bash
# Oracle: a worker whose TERM/HUP traps clean up and exit with 128+signal.
set -euo pipefail
cat > /app/worker.sh <<'SH'
#!/bin/bash
# worker.sh N: N ticks of 0.2 s; on SIGTERM/SIGHUP remove the pid file and report progress.
n=$1
ticks=0
stop() {
  rm -f /app/worker.pid
  echo "interrupted after $ticks ticks" > /app/worker.status
  exit "$1"
}
trap 'stop 143' TERM
trap 'stop 129' HUP
echo $$ > /app/worker.pid
: > /app/worker.out
for ((i = 1; i <= n; i++)); do
  echo "tick $i" >> /app/worker.out
  ticks=$i
  sleep 0.2
done
rm -f /app/worker.pid
echo done > /app/worker.status
exit 0
SH
chmod +x /app/worker.sh
