#!/usr/bin/env bash
# scripts/gpu-train-figures --smoke as README gives it, on a machine whose
# python3 on PATH has no torch and with no PYTHONPATH: the runs use the
# build's Python and its python/ module (they once used the python3 running
# the script and no PYTHONPATH, so every run failed on `import torch`).
#   check_gpu_train_figures.sh <source dir> <build dir> <scratch dir>
set -euo pipefail
src=$1 build=$2 work=$3
fail() { echo "check_gpu_train_figures: $*"; exit 1; }
rm -rf "$work" && mkdir -p "$work"
# A python3 without torch first on PATH (a venv without system packages).
/usr/bin/python3 -m venv --without-pip "$work/venv" || { echo "SKIPPED: no venv module"; exit 77; }
if "$work/venv/bin/python3" -c "import torch" 2>/dev/null; then fail "the venv has torch"; fi
set +e
out=$(cd "$work" && env -u PYTHONPATH -u STRATA_PYTHON PATH="$work/venv/bin:$PATH" \
      "$src/scripts/gpu-train-figures" --smoke --only 2b --build-dir "$build" --out "$work/out" 2>&1)
rc=$?
set -e
echo "$out"
[ $rc = 0 ] || fail "exit code $rc, wanted 0"
"$work/venv/bin/python3" - "$work/out/train-figures.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["2b"]
assert r["steps"] == 4, r
assert r["step_sec"] > 0 and r["opt_sec"] >= 0, r
PY
grep -q "step *4/4" "$work/out/2b.log" || fail "2b.log has no step 4/4"
echo "check_gpu_train_figures: ok"
