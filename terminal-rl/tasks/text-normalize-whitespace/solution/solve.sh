#!/bin/bash
# Oracle: strip CR and trailing blanks per line with sed, then make sure a final newline exists.
set -euo pipefail
find /app/docs -type f -name '*.txt' | while IFS= read -r f; do
  sed -i -e 's/\r$//' -e 's/[[:blank:]]*$//' "$f"
  if [ -n "$(tail -c1 "$f")" ]; then printf '\n' >> "$f"; fi
done
