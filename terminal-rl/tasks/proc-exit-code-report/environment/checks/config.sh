#!/bin/bash
# config check: missing key
grep -q "^mode=" /app/checks/app.conf
