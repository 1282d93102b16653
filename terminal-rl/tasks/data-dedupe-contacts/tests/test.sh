#!/bin/bash
# Verifier: the kept record per person (offsets decide Ada and Katherine), the order, the bad line.
mkdir -p /logs/verifier
python3 -I - <<'PY'
import json
from pathlib import Path

checks = []
def check(name, ok):
    checks.append(bool(ok)); print("PASS" if ok else "FAIL", name)

exp = [
    {"name": "Ada Lovelace", "email": "ada@example.com", "phone": "111", "updated_at": "2024-03-01T10:00:00Z"},
    {"name": "Alan Turing", "email": "alan@example.com", "phone": "333", "updated_at": "2023-12-31T23:59:59Z"},
    {"name": "Grace M. Hopper", "email": "grace@example.com", "phone": "222-b", "updated_at": "2024-01-15T09:00:00Z"},
    {"name": "Katherine Johnson", "email": "kj@example.com", "phone": "444", "updated_at": "2024-02-02T02:02:02-05:00"},
]
try:
    got = [json.loads(l) for l in Path("/app/contacts_clean.jsonl").read_text().splitlines() if l.strip()]
except (OSError, ValueError) as e:
    print("cannot read contacts_clean.jsonl:", e)
    got = []
check("four people, sorted by email", [g.get("email") for g in got if isinstance(g, dict)] == [e["email"] for e in exp])
for want in exp:
    have = [g for g in got if isinstance(g, dict) and g.get("email") == want["email"]]
    check(f"{want['email']}: {want}, got {have}", have == [want])
try:
    bad = Path("/app/bad_lines.txt").read_text().split()
except OSError:
    bad = None
check("bad line reported", bad == ["7"])
Path("/logs/verifier/reward.txt").write_text(f"{sum(checks) / len(checks):.4f}\n")
PY
