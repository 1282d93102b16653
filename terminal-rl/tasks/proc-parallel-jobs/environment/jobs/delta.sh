#!/bin/bash
sleep 1
printf "delta: line1\ndelta: line2\n"
