#!/bin/bash
# Verifier: summary.json against the expected aggregates (numbers within half a cent); one check
# per region, one for the months, one for the best month.
mkdir -p /logs/verifier
python3 -I - <<'PY'
import json
from pathlib import Path

checks = []
def check(name, ok):
    checks.append(bool(ok)); print("PASS" if ok else "FAIL", name)
def close(a, b):
    return isinstance(a, (int, float)) and not isinstance(a, bool) and abs(a - b) < 0.005

exp = json.loads(Path("/tests/expected.json").read_text())
try:
    got = json.loads(Path("/app/summary.json").read_text())
except (OSError, ValueError) as e:
    print("cannot read summary.json:", e)
    got = {}
got = got if isinstance(got, dict) else {}
regions = got.get("regions") if isinstance(got.get("regions"), dict) else {}
check("exactly the four normalised regions", sorted(regions) == sorted(exp["regions"]))
for name, want in exp["regions"].items():
    have = regions.get(name) if isinstance(regions.get(name), dict) else {}
    check(f"{name}: {want}, got {have}", close(have.get("revenue"), want["revenue"]) and have.get("units") == want["units"]
          and have.get("top_product") == want["top_product"])
months = got.get("months") if isinstance(got.get("months"), dict) else {}
check(f"months {exp['months']}, got {months}", sorted(months) == sorted(exp["months"])
      and all(close(months[m], v) for m, v in exp["months"].items()))
check("best month", got.get("best_month") == exp["best_month"])
Path("/logs/verifier/reward.txt").write_text(f"{sum(checks) / len(checks):.4f}\n")
PY
