#!/bin/bash
# Oracle: parse to minutes, sort, sweep.
set -euo pipefail
cat > /app/busy.py <<'PY'
"""Merge meetings (HH:MM HH:MM per line) into busy blocks and total busy minutes."""
import re
import sys

TIME = re.compile(r"([01]\d|2[0-3]):([0-5]\d)")

def minutes(text):
    m = TIME.fullmatch(text)
    if not m:
        raise ValueError(text)
    return int(m.group(1)) * 60 + int(m.group(2))

def main(argv):
    meetings = []
    with open(argv[1]) as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            try:
                if len(parts) != 2:
                    raise ValueError(line)
                start, end = minutes(parts[0]), minutes(parts[1])
                if end <= start:
                    raise ValueError(line)
            except ValueError:
                print(f"line {n}: invalid", file=sys.stderr)
                return 1
            meetings.append((start, end))
    blocks = []
    for start, end in sorted(meetings):
        if blocks and start <= blocks[-1][1]:
            blocks[-1][1] = max(blocks[-1][1], end)
        else:
            blocks.append([start, end])
    for start, end in blocks:
        print(f"{start // 60:02d}:{start % 60:02d}-{end // 60:02d}:{end % 60:02d}")
    print(f"total {sum(end - start for start, end in blocks)}")
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv))
PY
