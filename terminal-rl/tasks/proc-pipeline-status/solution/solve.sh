#!/bin/bash
# Oracle: read PIPESTATUS right after the pipeline; grep's "no match" (1) is not a failure.
set -euo pipefail
cat > /app/report.sh <<'SH'
#!/bin/bash
# Nightly report: extract the order lines from a source file, keep the large ones, save a summary.
# Usage: report.sh SOURCE OUTPUT
src=$1
out=$2
grep '^order' "$src" | awk -F, '$3 > 100 { print $2 }' | sort > "$out"
status=("${PIPESTATUS[@]}")
for i in "${!status[@]}"; do
  s=${status[$i]}
  if [ "$s" -ne 0 ] && ! { [ "$i" -eq 0 ] && [ "$s" -eq 1 ]; }; then
    echo "pipeline failed: stage $((i + 1)) exited with $s" >&2
    exit "$s"
  fi
done
echo "report written to $out"
SH
chmod +x /app/report.sh
