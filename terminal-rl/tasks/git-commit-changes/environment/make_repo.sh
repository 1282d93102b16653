#!/bin/bash
# Builds /app/repo: two commits, then uncommitted work (an edit, a new file, a deletion, a temp file).
set -euo pipefail
export GIT_AUTHOR_DATE="2024-01-01T10:00:00Z" GIT_COMMITTER_DATE="2024-01-01T10:00:00Z"
mkdir -p /app/repo/src && cd /app/repo
git init -q -b main .
git config user.name "Dev One" && git config user.email dev1@example.com
printf 'def main():\n    print("v1")\n' > src/app.py
printf 'old notes\n' > old.txt
printf '# Repo\n' > README.md
git add -A && git commit -q -m "Initial commit"
printf '# Repo\nA demo.\n' > README.md
git commit -q -am "Describe the repo"
printf 'from util import shout\n\ndef main():\n    print(shout("v2"))\n' > src/app.py
printf 'def shout(s):\n    return s.upper()\n' > src/util.py
rm old.txt
printf 'scratch\n' > debug.tmp
printf 'more scratch\n' > src/cache.tmp
