#!/usr/bin/env bash
# Sweeps `strata bench nvme --vs-fio` over block size x queue depth for reads
# and writes; prints one JSON object per line. Usage:
#   docs/perf/nvme/sweep.sh DIR [SIZE] [REPEAT] > docs/perf/nvme/sweep.jsonl
set -euo pipefail
dir="$1"
size="${2:-512MiB}"
repeat="${3:-2}"
strata="$(dirname "$0")/../../../build/bin/strata"
for op in read write; do
  for block in 64KiB 256KiB 1MiB 4MiB; do
    for qd in 1 4 8 32 64; do
      "$strata" bench nvme --dir "$dir" --size "$size" --block "$block" --qd "$qd" --op "$op" \
        --repeat "$repeat" --vs-fio --json 2>/dev/null
    done
  done
done
