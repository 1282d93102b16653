#!/bin/bash
# Verifier: the exact set of names in /app/photos, each renamed file holding its own image.
cd /app/photos 2>/dev/null || cd /app
mkdir -p /logs/verifier
pass=0; total=0
check() {  # check NAME COMMAND...: one point when COMMAND succeeds
  total=$((total + 1))
  if "${@:2}" >/dev/null 2>&1; then pass=$((pass + 1)); echo "PASS $1"; else echo "FAIL $1"; fi
}
for n in 0001 0002 0003 0017 0045 0099 0120; do
  check "photo-$n.jpg" grep -qx "image $n" "/app/photos/photo-$n.jpg"
done
check "png untouched" grep -qx "image 7000" /app/photos/IMG_7000.png
check "notes untouched" grep -qx "shot list" /app/photos/notes.txt
expected="IMG_7000.png notes.txt photo-0001.jpg photo-0002.jpg photo-0003.jpg photo-0017.jpg photo-0045.jpg photo-0099.jpg photo-0120.jpg "
check "no other files" test "$(LC_ALL=C ls /app/photos | tr '\n' ' ')" = "$expected"
awk -v p="$pass" -v t="$total" 'BEGIN { printf "%.4f\n", p / t }' > /logs/verifier/reward.txt
