#!/bin/bash
# Verifier: the surviving files are exactly one per distinct content, and removed.txt lists the rest.
mkdir -p /logs/verifier
python3 -I - <<'PY'
from pathlib import Path

checks = []
def check(name, ok):
    checks.append(bool(ok)); print("PASS" if ok else "FAIL", name)

lib = Path("/app/library")
left = sorted(str(p.relative_to(lib)) for p in lib.rglob("*") if p.is_file())
keep = ["2023/budget-old.csv", "2023/report.txt", "2023/unique.txt", "misc/budget-draft.csv",
        "misc/notes.md", "misc/report-caps.txt"]
gone = ["2024/budget.csv", "2024/report-copy.txt", "misc/report (1).txt"]
kept = all(k in left for k in keep) and (lib / "2023/report.txt").read_bytes() == b"alpha report v1\n"
print("PASS" if kept else "FAIL", "every first-of-its-content file kept, intact")
# A deletion earns its point only while nothing that should stay is gone (deleting everything
# earns nothing); keeping is no point of its own (doing nothing keeps everything).
for g in gone:
    check(f"deleted {g}", g not in left and kept)
try:
    listed = Path("/app/removed.txt").read_text().splitlines()
except OSError:
    listed = None
check("removed.txt lists the deleted files in order", listed == gone)
Path("/logs/verifier/reward.txt").write_text(f"{sum(checks) / len(checks):.4f}\n")
PY
