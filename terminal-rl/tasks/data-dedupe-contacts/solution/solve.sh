#!/bin/bash
# Oracle: parse each line, normalise the email, keep the latest by aware datetime.
set -euo pipefail
python3 - <<'PY'
import json
from datetime import datetime
best, bad = {}, []
with open("/app/contacts.jsonl") as f:
    for n, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            bad.append(n)
            continue
        rec["email"] = rec["email"].strip().lower()
        when = datetime.fromisoformat(rec["updated_at"].replace("Z", "+00:00"))
        if rec["email"] not in best or when > best[rec["email"]][0]:
            best[rec["email"]] = (when, rec)
with open("/app/contacts_clean.jsonl", "w") as f:
    for email in sorted(best):
        f.write(json.dumps(best[email][1]) + "\n")
with open("/app/bad_lines.txt", "w") as f:
    f.write("".join(f"{n}\n" for n in bad))
PY
