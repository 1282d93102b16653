#!/bin/bash
# Oracle: aggregate paid orders in exact decimal arithmetic, left-join onto the customers.
set -euo pipefail
python3 - <<'PY'
import csv
from decimal import Decimal
with open("/app/customers.csv", newline="") as f:
    customers = {int(r["id"]): r["name"] for r in csv.DictReader(f)}
agg = {c: [0, Decimal(0)] for c in customers}
with open("/app/orders.csv", newline="") as f:
    for r in csv.DictReader(f):
        c = int(r["customer_id"])
        if r["status"] == "paid" and c in agg:
            agg[c][0] += 1
            agg[c][1] += Decimal(r["amount"])
with open("/app/spend.csv", "w", newline="") as f:
    w = csv.writer(f, lineterminator="\n")
    w.writerow(["customer_id", "name", "paid_orders", "total"])
    for c, (n, total) in sorted(agg.items(), key=lambda kv: (-kv[1][1], kv[0])):
        w.writerow([c, customers[c], n, f"{total:.2f}"])
PY
