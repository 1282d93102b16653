#!/bin/bash
# Oracle: merge, write the resolved file, conclude the merge.
set -uo pipefail
cd /app/repo
git checkout -q main
git merge --no-edit feature >/dev/null 2>&1 || true
printf '# settings\nTIMEOUT = 45\nRETRIES = 5\nBACKENDS = ["local", "s3", "gcs"]\n' > settings.py
git add settings.py
git commit -q --no-edit
