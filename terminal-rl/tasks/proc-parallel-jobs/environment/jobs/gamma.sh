#!/bin/bash
sleep 1
echo "gamma: failed"
exit 5
