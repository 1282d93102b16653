#!/bin/bash
# Builds /app/repo: twelve commits by three authors; LEGACY_MODE first appears in "Refactor config
# loading", and later commits (one of them naming it in its subject) touch it again.
set -euo pipefail
mkdir -p /app/repo/src /app/repo/docs && cd /app/repo
git init -q -b main .
git config user.name "Dev One" && git config user.email dev1@example.com
n=0
commit() {  # commit AUTHOR_EMAIL SUBJECT
  n=$((n + 1))
  export GIT_AUTHOR_DATE="2024-05-$(printf %02d $n)T09:00:00Z" GIT_COMMITTER_DATE="2024-05-$(printf %02d $n)T09:00:00Z"
  git add -A && git -c user.email="$1" -c user.name="${1%%@*}" commit -q -m "$2"
}
printf 'DEBUG = False\n' > src/config.py;                         commit ana@example.com "Initial config"
printf 'def load():\n    return {}\n' > src/loader.py;             commit ben@example.com "Add loader"
printf '# Docs\n' > docs/index.md;                                commit ana@example.com "Start docs"
printf 'DEBUG = False\nTIMEOUT = 30\n' > src/config.py;           commit chloe@example.com "Add timeout"
printf 'DEBUG = False\nTIMEOUT = 30\nLEGACY_MODE = True\n' > src/config.py
printf 'from config import *\n\ndef load():\n    return {"debug": DEBUG}\n' > src/loader.py
                                                                   commit ben@example.com "Refactor config loading"
printf 'def helper():\n    pass\n' > src/helper.py;               commit chloe@example.com "Add helper"
printf '# Docs\n\nSet LEGACY_MODE to keep the old parser.\n' > docs/index.md
                                                                   commit ana@example.com "Document LEGACY_MODE"
sed -i 's/LEGACY_MODE = True/LEGACY_MODE = False/' src/config.py; commit chloe@example.com "Turn LEGACY_MODE off by default"
printf 'def helper():\n    return 1\n' > src/helper.py;            commit ben@example.com "Fix helper"
printf 'from config import *\n\ndef load():\n    return {"debug": DEBUG, "legacy": LEGACY_MODE}\n' > src/loader.py
                                                                   commit ana@example.com "Expose legacy flag"
printf 'DEBUG = False\nTIMEOUT = 60\nLEGACY_MODE = False\n' > src/config.py; commit chloe@example.com "Raise timeout"
printf '# Docs\n\nSet LEGACY_MODE to keep the old parser.\nSee config.py.\n' > docs/index.md
                                                                   commit ben@example.com "Link config from docs"
