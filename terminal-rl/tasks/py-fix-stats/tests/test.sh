#!/bin/bash
# Verifier: feeds inputs that hit each bug (even median, mode ties, blanks, comments, empty input,
# a bad line) and compares output, errors and exit status.
mkdir -p /logs/verifier
python3 -I - <<'PY'
import subprocess
from pathlib import Path

checks = []
def check(name, ok):
    checks.append(bool(ok)); print("PASS" if ok else "FAIL", name)

def run(text):
    try:
        p = subprocess.run(["python3", "/app/stats.py"], input=text, capture_output=True, text=True, timeout=10)
        return p.returncode, p.stdout.strip(), p.stderr.strip()
    except subprocess.TimeoutExpired:
        return None, "", ""

check("odd count", run("3\n1\n2\n")[:2] == (0, "count 3\nmean 2.00\nmedian 2.00\nmode 1.00"))
check("even median", run("4\n1\n3\n2\n")[:2] == (0, "count 4\nmean 2.50\nmedian 2.50\nmode 1.00"))
check("mode tie takes the smallest", run("5\n9\n9\n5\n7\n")[:2] == (0, "count 5\nmean 7.00\nmedian 7.00\nmode 5.00"))
check("blank and comment lines", run("# header\n\n 2\n   \n  # note\n4.5\n")[:2] == (0, "count 2\nmean 3.25\nmedian 3.25\nmode 2.00"))
check("negative and decimals", run("-1.5\n2.25\n-1.5\n10\n")[:2] == (0, "count 4\nmean 2.31\nmedian 0.38\nmode -1.50"))
check("no data", run("# nothing\n\n") == (1, "", "no data"))
check("empty input", run("") == (1, "", "no data"))
check("bad line", run("1\n\n  two \n3\n") == (1, "", "bad line 3: two"))
Path("/logs/verifier/reward.txt").write_text(f"{sum(checks) / len(checks):.4f}\n")
PY
