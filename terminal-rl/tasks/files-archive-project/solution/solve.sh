#!/bin/bash
# Oracle: tar from /app so that members start with project/, excluding logs and bytecode caches.
set -euo pipefail
cd /app
tar --exclude='*.log' --exclude='__pycache__' -czf backup.tar.gz project
