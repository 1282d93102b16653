#!/bin/bash
# Oracle: split on non-letters, lower-case, drop stop words, count, sort, keep ten.
set -euo pipefail
cd /app
tr -cs 'A-Za-z' '\n' < book.txt | tr 'A-Z' 'a-z' | grep -v '^$' | grep -vxFf stopwords.txt \
  | sort | uniq -c | awk '{ print $2, $1 }' | LC_ALL=C sort -k2,2nr -k1,1 | head -n 10 > top10.txt
