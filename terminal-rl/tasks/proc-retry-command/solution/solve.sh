#!/bin/bash
# Oracle: a loop over attempts that keeps the last status.
set -euo pipefail
cat > /app/retry.sh <<'SH'
#!/bin/bash
# retry.sh MAX DELAY COMMAND [ARGS...]: rerun COMMAND until it succeeds or MAX attempts are used.
max=$1; delay=$2; shift 2
status=1
for ((i = 1; i <= max; i++)); do
  "$@" && exit 0
  status=$?
  echo "attempt $i failed with status $status" >&2
  if ((i < max)); then sleep "$delay"; fi
done
exit "$status"
SH
chmod +x /app/retry.sh
