#!/bin/bash
# Oracle: the status is field 9 when splitting on blanks; count 5xx per IP.
set -euo pipefail
cd /app
awk '$9 ~ /^5[0-9][0-9]$/ { n[$1]++; total++ } END { print "total", total; for (ip in n) print ip, n[ip] | "LC_ALL=C sort -k2,2nr -k1,1 | head -n 3" }' access.log > report.txt
