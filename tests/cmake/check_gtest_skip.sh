#!/usr/bin/env bash
# Builds tests/cmake/gtest_skip with this CMake and runs its ctest: the
# generated *_tests.cmake files must load (CMake 4 broke on a property value
# ending in "]"), the passing test must pass and the GTEST_SKIP one must be
# reported as skipped, not passed or failed.
#   check_gtest_skip.sh <strata source dir> <scratch dir> [generator]
set -euo pipefail
src=$1 work=$2 gen=${3:-Ninja}
rm -rf "$work" && mkdir -p "$work"
echo "cmake: $(cmake --version | head -1)"
cmake -S "$src/tests/cmake/gtest_skip" -B "$work" -G "$gen" -DSTRATA_SOURCE_DIR="$src" \
  -DCMAKE_BUILD_TYPE=Release > "$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
cmake --build "$work" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
set +e
out=$(ctest --test-dir "$work" 2>&1)
rc=$?
set -e
echo "$out"
fail() { echo "check_gtest_skip: $*"; exit 1; }
[ $rc = 0 ] || fail "ctest exited $rc"
grep -q "Error\|Syntax" <<<"$out" && fail "ctest reported an error loading the tests"
grep -Eq "SkipCheck\.Passes .*Passed" <<<"$out" || fail "SkipCheck.Passes is not reported as passed"
grep -Eq "SkipCheck\.Skips .*Skipped" <<<"$out" || fail "SkipCheck.Skips is not reported as skipped"
grep -q "out of 2$" <<<"$out" || fail "ctest did not load both tests"
echo "check_gtest_skip: ok"
