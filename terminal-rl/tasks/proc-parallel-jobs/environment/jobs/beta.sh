#!/bin/bash
sleep 1
echo "beta: checksum ok"
echo "beta warning" >&2
