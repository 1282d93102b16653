#!/bin/bash
# Nightly report: extract the order lines from a source file, keep the large ones, save a summary.
# Usage: report.sh SOURCE OUTPUT
src=$1
out=$2
grep '^order' "$src" | awk -F, '$3 > 100 { print $2 }' | sort > "$out"
echo "report written to $out"
