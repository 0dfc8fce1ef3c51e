#!/usr/bin/env bash
# `cmake --install` of the build into a scratch prefix, then what a user does
# with it: a C++ project with find_package(strata) and strata::offload (one
# optimizer step), and a C program built with `pkg-config strata_c`.
#   check_install.sh <strata build dir> <strata source dir> <scratch dir> [generator]
set -euo pipefail
build=$1 src=$2 work=$3 gen=${4:-Ninja}
rm -rf "$work" && mkdir -p "$work"
prefix=$work/prefix
fail() { echo "check_install: $*"; exit 1; }
cmake --install "$build" --prefix "$prefix" > "$work/install.log" || { cat "$work/install.log"; fail "install failed"; }
for f in lib/cmake/strata/strataConfig.cmake lib/cmake/strata/strataTargets.cmake \
         include/strata/offload/optimizer.h include/strata/runtime/status.h bin/strata; do
  [ -e "$prefix/$f" ] || fail "$f not installed"
done
ls "$prefix"/lib/libstrata_c.so >/dev/null || fail "libstrata_c.so not installed"
# A versioned soname (major.minor while the major is 0), which trainers record.
soname=$(readelf -d "$prefix"/lib/libstrata_c.so | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
[[ "$soname" =~ ^libstrata_c\.so\.[0-9]+\.[0-9]+$ ]] || fail "libstrata_c.so's soname is '$soname'"
[ -e "$prefix/lib/$soname" ] || fail "$soname, the soname's file, is not installed"
ls "$prefix"/include/strata/runtime/*_internal.h 2>/dev/null && fail "internal headers installed"

# C++: find_package(strata); strata::capi from C. The consumer's build tree
# finds libstrata_c.so through CMake's build rpath; its install through
# CMAKE_INSTALL_RPATH_USE_LINK_PATH, as README says (no LD_LIBRARY_PATH).
cmake -S "$src/tests/cmake/consumer" -B "$work/consumer" -G "$gen" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_INSTALL_PREFIX="$work/consumer-prefix" \
  -DCMAKE_INSTALL_RPATH_USE_LINK_PATH=ON > "$work/consumer-configure.log" 2>&1 ||
  { cat "$work/consumer-configure.log"; fail "find_package(strata) failed"; }
cmake --build "$work/consumer" > "$work/consumer-build.log" 2>&1 ||
  { cat "$work/consumer-build.log"; fail "the consumer did not build"; }
"$work/consumer/consumer" || fail "the consumer's optimizer step failed"
env -u LD_LIBRARY_PATH "$work/consumer/consumer_capi" || fail "the strata::capi consumer failed"
cmake --install "$work/consumer" > "$work/consumer-install.log" 2>&1 ||
  { cat "$work/consumer-install.log"; fail "the consumer did not install"; }
env -u LD_LIBRARY_PATH "$work/consumer-prefix/bin/consumer_capi" ||
  fail "the installed strata::capi consumer failed"

# C: pkg-config strata_c, as README gives it: the .pc's rpath finds the
# library in a prefix outside the loader's path (no LD_LIBRARY_PATH).
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
flags=$(pkg-config --cflags --libs strata_c) || fail "pkg-config strata_c failed"
echo "pkg-config strata_c: $flags"
cc -std=c11 -o "$work/consumer_c" "$src/tests/cmake/consumer/consumer_c.c" $flags ||
  fail "the C consumer did not build"
env -u LD_LIBRARY_PATH "$work/consumer_c" || fail "the C consumer failed"
readelf -d "$work/consumer_c" | grep -q "NEEDED.*\[$soname\]" ||
  fail "the C consumer does not record $soname: $(readelf -d "$work/consumer_c" | grep NEEDED)"

# C against the build tree: its own strata_c.pc, an rpath, no LD_LIBRARY_PATH.
flags=$(PKG_CONFIG_PATH=$build pkg-config --cflags --libs strata_c) ||
  fail "pkg-config strata_c of the build tree failed"
echo "pkg-config strata_c (build tree): $flags"
case "$flags" in *"$prefix"*) fail "the build tree's strata_c.pc points into the install";; esac
cc -std=c11 -o "$work/consumer_c_build" "$src/tests/cmake/consumer/consumer_c.c" $flags ||
  fail "the C consumer did not build against the build tree"
env -u LD_LIBRARY_PATH "$work/consumer_c_build" || fail "the C consumer of the build tree failed"

"$prefix/bin/strata" --version
echo "check_install: ok"
