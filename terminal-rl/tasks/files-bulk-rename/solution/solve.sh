#!/bin/bash
# Oracle: parse the number out of each IMG_<n>.jp(e)g name (any case) and rename to photo-%04d.jpg.
set -euo pipefail
cd /app/photos
shopt -s nocaseglob nullglob
for f in img_*.jpg img_*.jpeg; do
  n=${f#*_}; n=${n%.*}
  mv -- "$f" "$(printf 'photo-%04d.jpg' "$((10#$n))")"
done
