#!/bin/bash
# Oracle: branch from the tag, cherry-pick the fix found by subject, tag the result.
set -euo pipefail
cd /app/repo
fix=$(git log main --format=%H --grep='^Fix null check in parser$')
git checkout -q -b hotfix-1.0.1 v1.0
git cherry-pick "$fix" >/dev/null
git tag v1.0.1
