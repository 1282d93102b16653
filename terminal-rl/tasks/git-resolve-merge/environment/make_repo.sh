#!/bin/bash
# Builds /app/repo: main and feature both edit the same lines of settings.py (a conflict) and each
# adds one storage module of its own.
set -euo pipefail
export GIT_AUTHOR_DATE="2024-06-01T10:00:00Z" GIT_COMMITTER_DATE="2024-06-01T10:00:00Z"
mkdir -p /app/repo && cd /app/repo
git init -q -b main .
git config user.name "Dev One" && git config user.email dev1@example.com
printf '# settings\nTIMEOUT = 30\nRETRIES = 3\nBACKENDS = ["local"]\n' > settings.py
git add -A && git commit -q -m "Add settings"
git checkout -q -b feature
printf '# settings\nTIMEOUT = 30\nRETRIES = 5\nBACKENDS = ["local", "gcs"]\n' > settings.py
printf 'def upload(blob):\n    return "gcs"\n' > gcs.py
git add -A && git commit -q -m "Add GCS backend, more retries"
git checkout -q main
printf '# settings\nTIMEOUT = 45\nRETRIES = 3\nBACKENDS = ["local", "s3"]\n' > settings.py
printf 'def upload(blob):\n    return "s3"\n' > s3.py
git add -A && git commit -q -m "Add S3 backend, longer timeout"
