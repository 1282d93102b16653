#!/bin/bash
# Oracle: recursive flatten, union of keys, csv.DictWriter.
set -euo pipefail
python3 - <<'PY'
import csv, json

def flat(obj, prefix=""):
    out = {}
    for k, v in obj.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, key + "."))
        elif v is None:
            out[key] = ""
        elif isinstance(v, bool):
            out[key] = "true" if v else "false"
        elif isinstance(v, list):
            out[key] = "|".join(str(x) for x in v)
        else:
            out[key] = str(v)
    return out

records = [flat(r) for r in json.load(open("/app/events.json"))]
columns = sorted({k for r in records for k in r})
with open("/app/events.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=columns, restval="")
    w.writeheader()
    w.writerows(records)
PY
