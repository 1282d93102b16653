#!/bin/bash
# Oracle: find the commit by its subject and git revert it.
set -euo pipefail
cd /app/repo
bad=$(git log --format=%H --grep='^Change tax rate to 25%$')
git revert --no-edit "$bad"
