#!/bin/bash
# Oracle: the script, straight from the specification.
set -euo pipefail
cat > /app/textstats.py <<'PY'
"""Line, word and character counts of a text file, as one JSON line."""
import json
import sys

def main(argv):
    if len(argv) != 2:
        print("usage: textstats.py PATH", file=sys.stderr)
        return 2
    try:
        with open(argv[1], encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        print(f"textstats: no such file: {argv[1]}", file=sys.stderr)
        return 2
    words = text.split()
    longest = max(words, key=len) if words else None
    print(json.dumps({"lines": text.count("\n"), "words": len(words), "chars": len(text), "longest": longest}))
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv))
PY
