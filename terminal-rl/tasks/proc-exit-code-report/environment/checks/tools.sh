#!/bin/bash
# syntax check: a missing command
not_a_real_command_xyz --version
