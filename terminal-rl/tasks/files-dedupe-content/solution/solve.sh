#!/bin/bash
# Oracle: hash every file; within each hash group (paths in C order) delete all but the first.
set -euo pipefail
cd /app/library
export LC_ALL=C
find . -type f -printf '%P\n' | sort | while IFS= read -r p; do
  printf '%s\t%s\n' "$(sha256sum < "$p" | cut -d' ' -f1)" "$p"
done | awk -F'\t' 'seen[$1]++ { print $2 }' | sort > /app/removed.txt
while IFS= read -r p; do rm -- "$p"; done < /app/removed.txt
