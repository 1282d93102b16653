#!/bin/bash
# signal check: kills itself
echo "about to die" >&2
kill -TERM $$
echo unreachable
