#!/bin/bash
# count check
n=$(grep -c . /app/checks/app.conf)
exit $(( n * 21 ))
