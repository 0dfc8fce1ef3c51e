#!/usr/bin/env bash
# Sweeps `strata bench nvme --vs-fio` over block size x queue depth for reads
# and writes; prints one JSON object per line. Usage:
#   docs/perf/nvme/sweep.sh DIR [SIZE] [REPEAT] [BUFFERS] [EXTRA...] > docs/perf/nvme/sweep.jsonl
# BUFFERS is thp (default) or plain (4 KiB pages, like fio's); EXTRA flags go
# to every run (e.g. --fresh-buffers).
set -euo pipefail
dir="$1"
size="${2:-512MiB}"
repeat="${3:-2}"
buffers="${4:-thp}"
shift $(( $# < 4 ? $# : 4 ))
strata="$(dirname "$0")/../../../build/bin/strata"
for op in read write; do
  for block in 64KiB 256KiB 1MiB 4MiB; do
    for qd in 1 4 8 32 64; do
      "$strata" bench nvme --dir "$dir" --size "$size" --block "$block" --qd "$qd" --op "$op" \
        --repeat "$repeat" --buffers "$buffers" --vs-fio --json "$@" 2>/dev/null
    done
  done
done
