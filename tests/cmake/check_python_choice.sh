#!/usr/bin/env bash
# cmake/StrataPython.cmake picks the Python that has torch: STRATA_PYTHON when
# given, else python3 on PATH when it imports torch, else /usr/bin/python3.
# Fake interpreters on PATH stand in for a venv with and without torch.
#   check_python_choice.sh <strata source dir> <scratch dir>
set -euo pipefail
src=$1 work=$2
rm -rf "$work" && mkdir -p "$work/with-torch" "$work/without-torch" "$work/explicit"
# A python3 that "imports torch": exits 0 for `-c "import torch"`, 1 for anything else.
printf '#!/bin/sh\n[ "$1" = -c ] && [ "$2" = "import torch" ] && exit 0\nexit 1\n' > "$work/with-torch/python3"
printf '#!/bin/sh\nexit 1\n' > "$work/without-torch/python3"
printf '#!/bin/sh\nexit 1\n' > "$work/explicit/python-x"
chmod +x "$work"/*/python*
choose() {  # <PATH prefix> [extra cmake args]: prints the chosen Python
  local dir=$1; shift
  rm -rf "$work/build"
  PATH="$dir:$PATH" cmake -S "$src/tests/cmake/python_choice" -B "$work/build" \
    -DSTRATA_SOURCE_DIR="$src" "$@" 2>&1 | sed -n 's/^-- CHOSEN=//p'
}
fail() { echo "check_python_choice: $*"; exit 1; }
got=$(choose "$work/with-torch")
echo "python3 with torch on PATH -> $got"
[ "$got" = "$work/with-torch/python3" ] || fail "expected the PATH python3 that imports torch"
got=$(choose "$work/without-torch")
echo "python3 without torch on PATH -> $got"
if [ -x /usr/bin/python3 ]; then
  [ "$got" = /usr/bin/python3 ] || fail "expected /usr/bin/python3"
fi
got=$(choose "$work/with-torch" -DSTRATA_PYTHON="$work/explicit/python-x")
echo "-DSTRATA_PYTHON given -> $got"
[ "$got" = "$work/explicit/python-x" ] || fail "an explicit STRATA_PYTHON must win"
got=$(STRATA_PYTHON="$work/explicit/python-x" choose "$work/with-torch")
echo "STRATA_PYTHON in the environment -> $got"
[ "$got" = "$work/explicit/python-x" ] || fail "STRATA_PYTHON from the environment must win"
echo "check_python_choice: ok"
