#!/bin/bash
# Oracle: ignore *.tmp, stage everything (git add -A honours the new .gitignore), commit.
set -euo pipefail
cd /app/repo
echo '*.tmp' > .gitignore
git add -A
git commit -q -m "Add util module"
