#!/bin/bash
# Oracle: find by mtime, move keeping the relative path, gzip in place.
set -euo pipefail
cd /app/logs
find . -type f -name '*.log' -mtime +30 -printf '%P\n' | while IFS= read -r f; do
  mkdir -p "/app/archive/$(dirname "$f")"
  mv "$f" "/app/archive/$f"
  gzip "/app/archive/$f"
done
