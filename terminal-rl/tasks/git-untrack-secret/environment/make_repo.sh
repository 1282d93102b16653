#!/bin/bash
# Builds /app/repo where a .env with credentials was committed next to the code.
set -euo pipefail
export GIT_AUTHOR_DATE="2024-04-01T10:00:00Z" GIT_COMMITTER_DATE="2024-04-01T10:00:00Z"
mkdir -p /app/repo/config && cd /app/repo
git init -q -b main .
git config user.name "Dev One" && git config user.email dev1@example.com
printf 'import os\nKEY = os.environ.get("API_KEY")\n' > app.py
printf 'API_KEY=sk-live-91f0c2\nDB_PASSWORD=hunter2\n' > .env
printf 'API_KEY=\nDB_PASSWORD=\n' > .env.example
printf 'API_KEY=sk-test-local\n' > config/.env
git add -A && git commit -q -m "Initial commit"
