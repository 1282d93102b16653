#!/bin/bash
# Oracle: grep -o the address pattern, lower-case, sort unique.
set -euo pipefail
cd /app
grep -oE '[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}' messages.txt \
  | tr '[:upper:]' '[:lower:]' | LC_ALL=C sort -u > emails.txt
