#!/bin/bash
# Oracle: unpack the outer and the inner archive, read the token, count the audit log's lines.
set -euo pipefail
cd /app
work=$(mktemp -d)
tar -xzf delivery.tar.gz -C "$work"
tar -xzf "$work/delivery/config.tar.gz" -C "$work"
sed -n 's/^token=//p' "$work/config/secret.conf" > token.txt
zcat "$work/delivery/audit.log.gz" | wc -l > audit_lines.txt
rm -rf "$work"
