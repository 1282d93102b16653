#!/bin/bash
# Oracle: a corrected stats.py.
set -euo pipefail
cat > /app/stats.py <<'PY'
"""Summary statistics of numbers read from standard input."""
import sys


class BadInput(Exception):
    pass


def read_numbers(stream):
    numbers = []
    for n, raw in enumerate(stream, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            numbers.append(float(line))
        except ValueError:
            raise BadInput(f"bad line {n}: {line}") from None
    return numbers


def mean(xs):
    return sum(xs) / len(xs)


def median(xs):
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def mode(xs):
    counts = {}
    for x in xs:
        counts[x] = counts.get(x, 0) + 1
    best = max(counts.values())
    return min(x for x in counts if counts[x] == best)


def main():
    try:
        xs = read_numbers(sys.stdin)
    except BadInput as e:
        print(e, file=sys.stderr)
        return 1
    if not xs:
        print("no data", file=sys.stderr)
        return 1
    print(f"count {len(xs)}")
    print(f"mean {mean(xs):.2f}")
    print(f"median {median(xs):.2f}")
    print(f"mode {mode(xs):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
PY
