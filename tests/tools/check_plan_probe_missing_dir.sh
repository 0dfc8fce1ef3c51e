#!/usr/bin/env bash
# `strata plan --probe-drive` on an nvme_path that does not exist yet: the
# folders are made as the engine would make them, the drive is measured, and
# the folders are removed afterwards (it once failed with ENOENT naming the
# probe's temporary file).
#   check_plan_probe_missing_dir.sh <strata binary> <scratch dir>
set -uo pipefail
strata=$1 scratch=$2
rm -rf "$scratch"
mkdir -p "$scratch"
missing="$scratch/nvme/not/yet"
cat >"$scratch/config.json" <<JSON
{"bf16": {"enabled": true}, "zero_optimization": {"sub_group_size": 1e7,
 "offload_optimizer": {"device": "nvme", "nvme_path": "$missing"}},
 "strata": {"host_budget": "1GiB"}}
JSON
out=$("$strata" plan --params 300M --config "$scratch/config.json" --probe-drive 16MiB 2>&1)
rc=$?
echo "$out"
fail() { echo "check_plan_probe_missing_dir: $1"; exit 1; }
[ "$rc" = 0 ] || fail "exit code $rc"
grep -q "made for the probe as the engine would, removed afterwards" <<<"$out" ||
  fail "does not say the folders were made for the probe"
grep -q "nvme per step: this drive reads" <<<"$out" || fail "no drive measurement"
[ ! -e "$scratch/nvme" ] || fail "left $(find "$scratch/nvme") behind"
rm -rf "$scratch"
echo "check_plan_probe_missing_dir: ok"
