#!/usr/bin/env bash
# NCCL is opened at its first use, not linked: no binary of the build needs
# libnccl.so.2 to start (a host-only user, a machine without NCCL), and the
# runtime finds the NCCL the build found without a run path to it, or the
# file STRATA_NCCL_LIBRARY names, and says why it cannot.
#   check_nccl_loading.sh <built with NCCL: 0|1> <strata> <libstrata_c.so> [<binary>...]
set -euo pipefail
have_nccl=$1 strata=$2 capi=$3
shift 1
fail() { echo "check_nccl_loading: $*"; exit 1; }
for bin in "$@"; do
  if readelf -d "$bin" | grep -q 'NEEDED.*libnccl'; then
    fail "$bin needs libnccl.so.2 to start"
  fi
  echo "$bin: no libnccl.so.2 needed"
done
if [ "$have_nccl" != 1 ]; then
  echo "check_nccl_loading: this build has no NCCL; there is nothing to load"
  exit 0
fi
# "version|library|error" as strata info --json reports them.
versions() {
  "$strata" info --no-python --json | python3 -c 'import json, sys
v = json.load(sys.stdin)["versions"]
print(v["nccl"], v["nccl_library"], v["nccl_error"], sep="|")'
}
# The loader's own search, then the file the build found (no run path leads there).
got=$(LD_LIBRARY_PATH= STRATA_NCCL_LIBRARY= versions)
echo "default: $got"
case "$got" in 2.*"|/"*"|") ;; *) fail "the NCCL the build found was not loaded";; esac
got=$(STRATA_NCCL_LIBRARY=/no/such/libnccl.so.2 versions)
echo "missing file: $got"
case "$got" in "||load NCCL from STRATA_NCCL_LIBRARY: /no/such/libnccl.so.2: "*"unset the variable"*) ;;
  *) fail "a missing STRATA_NCCL_LIBRARY is not named";; esac
got=$(STRATA_NCCL_LIBRARY=$capi versions)
echo "not NCCL: $got"
case "$got" in *"$capi is not NCCL (no ncclGetVersion)"*) ;; *) fail "a library that is not NCCL is not named";; esac
echo "check_nccl_loading: ok"
