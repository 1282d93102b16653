#!/bin/bash
# Oracle: run every check and collect $? into the CSV.
cd /app
{
  echo "check,exit_code"
  for f in $(ls checks/*.sh | LC_ALL=C sort); do
    bash "$f" >/dev/null 2>&1
    rc=$?
    echo "$(basename "$f" .sh),$rc"
  done
} > report.csv
