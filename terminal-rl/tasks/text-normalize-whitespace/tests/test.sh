#!/bin/bash
# Verifier: exact bytes of each .txt file after normalisation; the non-.txt files byte-identical.
mkdir -p /logs/verifier
python3 -I - <<'PY'
from pathlib import Path

checks = []
def check(name, ok):
    checks.append(bool(ok)); print("PASS" if ok else "FAIL", name)
def read(p):
    try:
        return Path("/app/docs", p).read_bytes()
    except OSError:
        return None
check("readme.txt", read("readme.txt") == b"Title\n\nFirst line\nsecond line\n")
check("short.txt", read("short.txt") == b"no newline at end\n")
check("sub/mixed.txt", read("sub/mixed.txt") == b"ok line\nwith trailing spaces\n  indented stays\n")
# Other files are not a point to earn (doing nothing leaves them right) but a condition: changing
# them halves the reward.
untouched = read("keep.csv") == b"keep\r\nthis   \r\n" and read("blob.bin") == b"\x00\x01\r\n\xff  \r\n"
print("PASS" if untouched else "FAIL", "non-.txt files untouched")
reward = sum(checks) / len(checks) * (1.0 if untouched else 0.5)
Path("/logs/verifier/reward.txt").write_text(f"{reward:.4f}\n")
PY
