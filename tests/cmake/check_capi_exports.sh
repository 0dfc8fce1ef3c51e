#!/usr/bin/env bash
# libstrata_c.so exports exactly the functions offload/strata_c.h declares:
# the engine and its statically linked libraries stay internal
# (offload/strata_c.map), and no declared function is missing.
#   check_capi_exports.sh <libstrata_c.so> <strata_c.h>
set -euo pipefail
lib=$1 header=$2
declared=$(grep -oE '^[a-z][a-z_ *0-9]*[ *](strata_[a-z0-9_]+)\(' "$header" |
           grep -oE 'strata_[a-z0-9_]+' | sort -u)
exported=$(nm -D --defined-only "$lib" | awk '{print $NF}' | sort -u)
[ -n "$declared" ] || { echo "no functions found in $header"; exit 1; }
extra=$(comm -13 <(echo "$declared") <(echo "$exported"))
missing=$(comm -23 <(echo "$declared") <(echo "$exported"))
status=0
if [ -n "$extra" ]; then
  echo "$lib exports $(echo "$extra" | wc -l) symbols strata_c.h does not declare, e.g.:"
  echo "$extra" | head -5
  status=1
fi
if [ -n "$missing" ]; then
  echo "$lib does not export these functions of strata_c.h:"
  echo "$missing"
  status=1
fi
[ $status -eq 0 ] && echo "$lib exports the $(echo "$declared" | wc -l) functions of strata_c.h and nothing else"
exit $status
