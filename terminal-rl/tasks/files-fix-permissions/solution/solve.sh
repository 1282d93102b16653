#!/bin/bash
# Oracle: directories 755, files 644, then scripts (*.sh and bin/*) 755.
set -euo pipefail
cd /app/site
find . -type d -exec chmod 755 {} +
find . -type f -exec chmod 644 {} +
find . -type f -name '*.sh' -exec chmod 755 {} +
chmod 755 bin/*
