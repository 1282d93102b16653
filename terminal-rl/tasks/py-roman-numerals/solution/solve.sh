#!/bin/bash
# Oracle: greedy conversion; validity of S is "converting back gives S".
set -euo pipefail
cat > /app/roman.py <<'PY'
"""Convert between integers (1-3999) and standard-form Roman numerals."""
import sys

VALUES = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
          (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]

def to_roman(n):
    out = []
    for value, numeral in VALUES:
        count, n = divmod(n, value)
        out.append(numeral * count)
    return "".join(out)

def from_roman(s):
    """Parse greedily, then accept only the canonical spelling of the value."""
    total, i = 0, 0
    for value, numeral in VALUES:
        while s.startswith(numeral, i):
            total += value
            i += len(numeral)
    if not s or i != len(s) or not 1 <= total <= 3999 or to_roman(total) != s:
        raise ValueError(f"not a standard Roman numeral: {s!r}")
    return total

def main(argv):
    try:
        if len(argv) != 3 or argv[1] not in ("to", "from"):
            raise ValueError("usage: roman.py to N | from S")
        if argv[1] == "to":
            n = int(argv[2])
            if not 1 <= n <= 3999:
                raise ValueError(f"out of range: {n}")
            print(to_roman(n))
        else:
            print(from_roman(argv[2]))
    except ValueError as e:
        print(f"roman: {e}", file=sys.stderr)
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv))
PY
