#!/bin/bash
sleep 1
echo "alpha: 3 files"
