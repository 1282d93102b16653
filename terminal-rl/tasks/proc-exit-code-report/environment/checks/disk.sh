#!/bin/bash
# disk check
echo "disk ok"
