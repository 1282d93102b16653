#!/bin/bash
# Oracle: git rm --cached the .env files, ignore the name everywhere, commit.
set -euo pipefail
cd /app/repo
git rm -q --cached .env config/.env
echo '.env' > .gitignore
git add .gitignore
git commit -q -m "Stop tracking .env files"
