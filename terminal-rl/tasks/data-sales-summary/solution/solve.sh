#!/bin/bash
# Oracle: group with exact decimals, round at the end.
set -euo pipefail
python3 - <<'PY'
import csv, json
from collections import defaultdict
from decimal import Decimal
rev, units, months = defaultdict(Decimal), defaultdict(int), defaultdict(Decimal)
by_product = defaultdict(lambda: defaultdict(Decimal))
with open("/app/sales.csv", newline="") as f:
    for r in csv.DictReader(f):
        region = r["region"].strip().capitalize()
        amount = int(r["units"]) * Decimal(r["unit_price"])
        rev[region] += amount
        units[region] += int(r["units"])
        by_product[region][r["product"]] += amount
        months[r["date"][:7]] += amount
summary = {
    "regions": {g: {"revenue": float(round(rev[g], 2)), "units": units[g],
                    "top_product": max(by_product[g], key=by_product[g].get)} for g in sorted(rev)},
    "months": {m: float(round(months[m], 2)) for m in sorted(months)},
    "best_month": max(months, key=months.get),
}
with open("/app/summary.json", "w") as f:
    json.dump(summary, f, indent=2)
PY
