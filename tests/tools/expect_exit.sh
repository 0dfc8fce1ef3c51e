#!/usr/bin/env bash
# Runs a command and checks its exit code and that its output (stdout and
# stderr) matches an extended regex; prints the output either way.
#   expect_exit.sh <exit code> <regex> <command> [args...]
set -uo pipefail
want=$1 regex=$2
shift 2
out=$("$@" 2>&1)
rc=$?
echo "$out"
echo "expect_exit: exit code $rc"
[ "$rc" = "$want" ] || { echo "expect_exit: wanted exit code $want"; exit 1; }
grep -Eq -- "$regex" <<<"$out" || { echo "expect_exit: output does not match /$regex/"; exit 1; }
echo "expect_exit: ok"
