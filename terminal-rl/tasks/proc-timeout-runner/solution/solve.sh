#!/bin/bash
# Oracle: coreutils timeout does the SIGTERM-then-SIGKILL part; the script adds the log line.
set -euo pipefail
cat > /app/run_with_timeout.sh <<'SH'
#!/bin/bash
# run_with_timeout.sh SECONDS COMMAND [ARGS...]: exit status of COMMAND, or 124 when it ran too long.
secs=$1; shift
timeout -k 1 "$secs" "$@"
status=$?
if [ "$status" -eq 137 ]; then status=124; fi
echo "$status $*" >> /app/runs.log
exit "$status"
SH
chmod +x /app/run_with_timeout.sh
