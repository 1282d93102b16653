#!/bin/bash
# Verifier: parses users.json and compares it with the expected records, one check per record.
mkdir -p /logs/verifier
python3 -I - <<'PY'
import json
from pathlib import Path

checks = []
def check(name, ok):
    checks.append(bool(ok)); print("PASS" if ok else "FAIL", name)

exp = [
    {"id": 1, "name": "Grace Hopper", "email": "grace@example.com", "age": 85, "active": False, "tags": ["navy", "cobol"]},
    {"id": 2, "name": "Barbara Liskov", "email": "barbara@example.com", "age": 84, "active": False, "tags": ["types", "clu"]},
    {"id": 3, "name": "Lovelace, Ada", "email": "ada@example.com", "age": 36, "active": True, "tags": ["math", "poetry"]},
    {"id": 7, "name": 'Linus "the kernel" Torvalds', "email": "linus@example.com", "age": None, "active": True, "tags": ["kernel"]},
    {"id": 12, "name": "Alan Turing", "email": "alan@example.com", "age": 41, "active": True, "tags": []},
]
try:
    got = json.loads(Path("/app/users.json").read_text())
except (OSError, ValueError) as e:
    print("cannot read users.json:", e)
    got = None
check("a list of 5 objects", isinstance(got, list) and len(got) == 5)
for i, want in enumerate(exp):
    have = got[i] if isinstance(got, list) and i < len(got) else None
    check(f"record {i}: {want}, got {have}", have == want and all(type(have[k]) is type(want[k]) for k in want))
Path("/logs/verifier/reward.txt").write_text(f"{sum(checks) / len(checks):.4f}\n")
PY
