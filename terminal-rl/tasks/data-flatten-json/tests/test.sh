#!/bin/bash
# Verifier: reads events.csv with the csv module; header, then each row as a dict.
mkdir -p /logs/verifier
python3 -I - <<'PY'
import csv
from pathlib import Path

checks = []
def check(name, ok):
    checks.append(bool(ok)); print("PASS" if ok else "FAIL", name)

header = ["amount", "id", "ok", "tags", "text", "type", "user.geo.city", "user.geo.country", "user.name"]
rows = [
    ["", "1", "true", "web|promo", "", "signup", "London", "UK", "ada"],
    ["19.5", "2", "false", "", "", "purchase", "", "US", "grace"],
    ["", "3", "", "mobile", 'said "hi"', "note", "", "", "alan, jr."],
    ["5", "4", "true", "", "", "purchase", "", "", "barbara"],
]
try:
    with open("/app/events.csv", newline="") as f:
        got = [r for r in csv.reader(f) if r]
except OSError:
    got = []
check(f"header {header}, got {got[:1]}", got[:1] == [header])
for i, want in enumerate(rows):
    have = got[i + 1] if len(got) > i + 1 else None
    check(f"row {i + 1}: {want}, got {have}", have == want)
check("no extra rows", len(got) == len(rows) + 1)
Path("/logs/verifier/reward.txt").write_text(f"{sum(checks) / len(checks):.4f}\n")
PY
