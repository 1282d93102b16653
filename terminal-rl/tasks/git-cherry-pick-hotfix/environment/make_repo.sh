#!/bin/bash
# Builds /app/repo: v1.0 tagged at the second commit; main then gains a feature, a fix and metrics.
set -euo pipefail
export GIT_AUTHOR_DATE="2024-03-01T10:00:00Z" GIT_COMMITTER_DATE="2024-03-01T10:00:00Z"
mkdir -p /app/repo && cd /app/repo
git init -q -b main .
git config user.name "Dev One" && git config user.email dev1@example.com
printf 'def parse(text):\n    return text.split(",")\n' > parser.py
git add parser.py && git commit -q -m "Add parser"
printf 'VERSION = "1.0"\n' > version.py
git add version.py && git commit -q -m "Release 1.0"
git tag v1.0
printf 'def export(rows):\n    return "\\n".join(rows)\n' > export.py
git add export.py && git commit -q -m "Add export feature"
printf 'def parse(text):\n    if text is None:\n        return []\n    return text.split(",")\n' > parser.py
git commit -q -am "Fix null check in parser"
printf 'COUNTERS = {}\n' > metrics.py
git add metrics.py && git commit -q -m "Add metrics"
