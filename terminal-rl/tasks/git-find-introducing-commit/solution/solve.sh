#!/bin/bash
# Oracle: the pickaxe (-S) lists commits that change the string's count; the oldest one added it.
set -euo pipefail
cd /app/repo
git log -S LEGACY_MODE --reverse --format='%H%n%ae' | sed -n 1,2p > /app/answer.txt
