#!/bin/bash
# Builds /app/repo: five commits; the third one ("Change tax rate to 25%") is the bad one.
set -euo pipefail
export GIT_AUTHOR_DATE="2024-02-01T10:00:00Z" GIT_COMMITTER_DATE="2024-02-01T10:00:00Z"
mkdir -p /app/repo && cd /app/repo
git init -q -b main .
git config user.name "Dev One" && git config user.email dev1@example.com
cat > tax.py <<'PY'
"""Tax helpers."""

RATE = 0.20


def tax(amount):
    return round(amount * RATE, 2)




def describe():
    return "flat tax"
PY
git add tax.py && git commit -q -m "Add tax module"
printf 'from tax import tax\n\nprint(tax(100))\n' > main.py
git add main.py && git commit -q -m "Add entry point"
sed -i 's/^RATE = 0.20$/RATE = 0.25/' tax.py
git commit -q -am "Change tax rate to 25%"
printf 'def invoice(amount):\n    return {"amount": amount}\n' > invoice.py
git add invoice.py && git commit -q -m "Add invoices"
sed -i 's/return "flat tax"/return "flat tax, rounded to cents"/' tax.py
git commit -q -am "Clarify tax description"
