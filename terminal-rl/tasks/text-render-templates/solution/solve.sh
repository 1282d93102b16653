#!/bin/bash
# Oracle: a small Python renderer (regex substitution with a function, so values are literal).
set -euo pipefail
mkdir -p /app/out
python3 - <<'PY'
import re
from pathlib import Path
env = {}
for line in Path("/app/vars.env").read_text().splitlines():
    if line.strip() and not line.lstrip().startswith("#"):
        k, _, v = line.partition("=")
        env[k.strip()] = v
missing = set()
def sub(m):
    if m.group(1) in env:
        return env[m.group(1)]
    missing.add(m.group(1))
    return m.group(0)
for t in sorted(Path("/app/templates").glob("*.tmpl")):
    Path("/app/out", t.name[:-5]).write_text(re.sub(r"\{\{([A-Z_][A-Z0-9_]*)\}\}", sub, t.read_text()))
Path("/app/out/missing.txt").write_text("".join(f"{n}\n" for n in sorted(missing)))
PY
