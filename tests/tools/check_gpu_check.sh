#!/usr/bin/env bash
# scripts/gpu-check where there is no GPU.
#   check_gpu_check.sh no-gpu   <source dir> <scratch dir>
#     no nvidia-smi: exit 77, says NO GPU, every step "skipped" in report.json.
#   check_gpu_check.sh fake-gpu <source dir> <scratch dir> <build dir> <python>
#     an nvidia-smi that lists a GPU the build cannot open: exit 1, and every
#     step that needs the GPU failed (none passes on the emulated device);
#     pytest-all (one suite) passed under this machine's torch.
# Exits 77 (skipped) when a real GPU is present: these are the no-GPU paths.
set -euo pipefail
mode=$1 src=$2 work=$3
fail() { echo "check_gpu_check: $*"; exit 1; }
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  echo "SKIPPED: this machine has a GPU; run scripts/gpu-check itself"; exit 77
fi
rm -rf "$work" && mkdir -p "$work/bin"
report=$work/out/report.json
jq_py() { python3 -c "import json,sys; r=json.load(open('$report')); $1"; }
case $mode in
  no-gpu)
    # A PATH without any nvidia-smi.
    path=$(tr ':' '\n' <<<"$PATH" | while read -r d; do [ -x "$d/nvidia-smi" ] || printf '%s:' "$d"; done)
    set +e; out=$(PATH="${path%:}" "$src/scripts/gpu-check" --out "$work/out" 2>&1); rc=$?; set -e
    echo "$out"
    [ $rc = 77 ] || fail "exit code $rc, wanted 77"
    grep -q "NO GPU on this machine" <<<"$out" || fail "does not say there is no GPU"
    jq_py "assert r['status'] == 'no_gpu', r['status']; \
assert [s['name'] for s in r['steps']] == ['build','info','ctest-gpu','import-order','pytest-cuda','pytest-all','bench-pcie','bench-step','demo']; \
assert all(s['status'] == 'skipped' and s['summary'] == 'no GPU' for s in r['steps'])" ||
      fail "report.json does not list every step as skipped"
    [ -s "$work/out/report.txt" ] || fail "no report.txt"
    # scripts/gpu-session packs gpu-check's report for the device tool.
    set +e
    out=$(PATH="${path%:}" B="$work/no-build" OUT="$work/session" TMPDIR="$work" \
          "$src/scripts/gpu-session" check 2>&1); rc=$?
    set -e
    [ $rc = 77 ] || fail "gpu-session check: exit code $rc, wanted 77: $out"
    # The listing in full first: `tar | grep -q` fails under pipefail when
    # grep exits before tar has written its last name (SIGPIPE).
    listing=$(tar -tzf "$work/session/check.tgz" 2>&1) || listing=
    grep -q "NO_GPU" "$work/session/check.txt" && grep -q report.json <<<"$listing" ||
      fail "gpu-session check did not leave check.txt and check.tgz in \$OUT: $listing"
    set +e; out=$("$src/scripts/gpu-check" --out "$work/out2" --skip demo,ctest-gpu 2>&1); rc=$?; set -e
    [ $rc = 2 ] && grep -q -- "--skip ctest-gpu: only pytest-all, bench-step, demo can be skipped" <<<"$out" ||
      fail "--skip of a step that cannot be skipped: exit $rc, $out"
    ;;
  fake-gpu)
    build=$4 python=$5
    printf '#!/bin/sh\necho "Fake GPU, 81559 MiB, 580.00"\n' > "$work/bin/nvidia-smi"
    chmod +x "$work/bin/nvidia-smi"
    set +e
    out=$(PATH="$work/bin:$PATH" "$src/scripts/gpu-check" --no-build --build-dir "$build" \
          --python "$python" --out "$work/out" --demo-steps 2 --pytest-suites test_logging 2>&1)
    rc=$?
    set -e
    echo "$out"
    [ $rc = 1 ] || fail "exit code $rc, wanted 1"
    jq_py "st = {s['name']: s['status'] for s in r['steps']}; print(st); \
assert r['status'] == 'failed'; \
assert all(st[n] == 'failed' for n in ['info','ctest-gpu','import-order','pytest-cuda','bench-pcie','bench-step','demo']), st; \
p = next(s for s in r['steps'] if s['name'] == 'pytest-all'); \
assert p['status'] == 'passed' and p['counts']['passed'] > 0 and p['torch'] != '?', p" ||
      fail "a GPU step passed without a GPU, or pytest-all did not run the suite under this torch"
    ;;
  *) fail "mode $mode?" ;;
esac
echo "check_gpu_check: ok"
