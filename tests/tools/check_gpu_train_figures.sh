#!/usr/bin/env bash
# scripts/gpu-train-figures --smoke as README gives it, on a machine whose
# python3 on PATH has no torch and with no PYTHONPATH: the runs use the
# build's Python and its python/ module (they once used the python3 running
# the script and no PYTHONPATH, so every run failed on `import torch`).
# Then --run-timeout and --on-run-done.
#   check_gpu_train_figures.sh <source dir> <build dir> <scratch dir>
set -euo pipefail
src=$1 build=$2 work=$3
# A failure shows the run's log too (where it is), to tell a hang, a killed
# run or a wrong line apart.
fail() {
  echo "check_gpu_train_figures: $*"
  for log in "$work"/out/*.log; do [ -f "$log" ] && { echo "--- $log"; tail -n 40 "$log"; }; done
  exit 1
}
rm -rf "$work" && mkdir -p "$work"
# A python3 without torch first on PATH (a venv without system packages).
/usr/bin/python3 -m venv --without-pip "$work/venv" || { echo "SKIPPED: no venv module"; exit 77; }
if "$work/venv/bin/python3" -c "import torch" 2>/dev/null; then fail "the venv has torch"; fi
set +e
out=$(cd "$work" && env -u PYTHONPATH -u STRATA_PYTHON PATH="$work/venv/bin:$PATH" \
      "$src/scripts/gpu-train-figures" --smoke --only 2b --build-dir "$build" --out "$work/out" \
      --run-timeout 240 2>&1)
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

# A run past --run-timeout is killed, its log kept, exit 124 in the report;
# --on-run-done runs after each run with the report holding it (what
# scripts/gpu-session packs for the device tool).
set +e
out=$(env -u PYTHONPATH "$src/scripts/gpu-train-figures" --smoke --only 2b,2b-overlap \
      --build-dir "$build" --out "$work/cut" --run-timeout 0.2 \
      --on-run-done "wc -l < '$work/cut/train-figures.txt' >> '$work/done.txt'" 2>&1)
rc=$?
set -e
[ $rc = 1 ] || fail "runs cut by --run-timeout: exit code $rc, wanted 1: $out"
grep -q "killed after 0.2 s (--run-timeout)" "$work/cut/2b.log" || fail "2b.log does not say it was cut"
grep -q "exit 124" "$work/cut/train-figures.txt" || fail "the report has no exit 124"
[ "$(tr -d ' ' < "$work/done.txt" | paste -sd,)" = "1,2" ] ||
  fail "--on-run-done did not run after each run with the report so far: $(cat "$work/done.txt")"
echo "check_gpu_train_figures: ok"
