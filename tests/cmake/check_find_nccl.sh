#!/usr/bin/env bash
# FindNCCL finds the NCCL of the Python environment that has torch: a fake
# `nvidia-nccl-cu13` wheel (nvidia/nccl/include/nccl.h, nvidia/nccl/lib/
# libnccl.so.2 and no libnccl.so) on that Python's path.
#   check_find_nccl.sh <strata source dir> <scratch dir> <python>
set -euo pipefail
src=$1 work=$2 python=$3
rm -rf "$work" && mkdir -p "$work/site/nvidia/nccl/include" "$work/site/nvidia/nccl/lib"
printf '#define NCCL_MAJOR 2\n#define NCCL_MINOR 99\n#define NCCL_PATCH 7\n' \
  > "$work/site/nvidia/nccl/include/nccl.h"
: > "$work/site/nvidia/nccl/lib/libnccl.so.2"
out=$(PYTHONPATH="$work/site" cmake -S "$src/tests/cmake/find_nccl" -B "$work/build" \
  -DSTRATA_SOURCE_DIR="$src" -DSTRATA_PYTHON="$python" 2>&1) || { echo "$out"; exit 1; }
echo "$out" | grep "NCCL"
lib=$(sed -n 's/^-- NCCL_LIBRARY=//p' <<<"$out")
inc=$(sed -n 's/^-- NCCL_INCLUDE_DIR=//p' <<<"$out")
[ "$lib" = "$work/site/nvidia/nccl/lib/libnccl.so.2" ] || { echo "check_find_nccl: found $lib, not the wheel's"; exit 1; }
[ "$inc" = "$work/site/nvidia/nccl/include" ] || { echo "check_find_nccl: header from $inc, not the wheel's"; exit 1; }
grep -q "NCCL_VERSION=2.99.7" <<<"$out" || { echo "check_find_nccl: wrong version"; exit 1; }
echo "check_find_nccl: ok"
