#!/bin/bash
# Oracle: section-scoped sed edits (address ranges from a section header to the next header).
set -euo pipefail
cd /app
sed -i -e '/^\[server\]/,/^\[/{s/^port = .*/port = 8080/;s/^#debug = false$/debug = true/}' \
       -e '/^\[database\]/,/^\[/{s/^host = .*/host = db.internal/}' config.ini
