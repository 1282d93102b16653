#!/bin/bash
# Oracle: csv.DictReader, typed fields, sorted by id.
set -euo pipefail
python3 - <<'PY'
import csv, json
with open("/app/users.csv", newline="") as f:
    rows = list(csv.DictReader(f))
out = [{
    "id": int(r["id"]),
    "name": r["name"],
    "email": r["email"],
    "age": int(r["age"]) if r["age"].strip() else None,
    "active": r["active"].strip().lower() in ("true", "yes", "1"),
    "tags": [t for t in r["tags"].split(";") if t],
} for r in rows]
with open("/app/users.json", "w") as f:
    json.dump(sorted(out, key=lambda u: u["id"]), f, indent=2)
PY
