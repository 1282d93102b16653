#!/bin/bash
# Oracle: count field 3 of lines whose field 2 is ERROR, then sort by count desc, name asc.
set -euo pipefail
cd /app
awk '$2 == "ERROR" { gsub(/[][]/, "", $3); n[$3]++ } END { for (m in n) print m, n[m] }' server.log \
  | LC_ALL=C sort -k2,2nr -k1,1 > errors.txt
