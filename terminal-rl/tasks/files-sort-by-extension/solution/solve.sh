#!/bin/bash
# Oracle: move each inbox file into sorted/<lower-cased last extension>/ (noext when there is no dot).
set -euo pipefail
cd /app
for f in inbox/*; do
  name=$(basename "$f")
  if [[ "$name" == *.* ]]; then ext=${name##*.}; ext=${ext,,}; else ext=noext; fi
  mkdir -p "sorted/$ext"
  mv "$f" "sorted/$ext/$name"
done
