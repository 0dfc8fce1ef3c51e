#!/usr/bin/env bash
# What a user does: a fresh venv on the Python that has torch (here Debian's
# /usr/bin/python3 with python3-torch, through --system-site-packages), then
# `pip install --no-build-isolation .`, offline, then `import strata.torch`
# from another folder and one OffloadAdam step. To stay quick the pip build
# reuses the configured ctest build tree (STRATA_BUILD_DIR): setup.py runs the
# same CMake target a fresh build would, so only the reuse of the tree is
# what this does not cover. The source is copied so that pip's build files
# stay out of the checkout.
#   check_pip_install.sh <python with torch> <strata source dir> <strata build dir> <scratch dir>
set -euo pipefail
python=$1 src=$2 build=$3 work=$4
fail() { echo "check_pip_install: $*"; exit 1; }
"$python" -c "import torch" 2>/dev/null || { echo "SKIPPED: $python has no torch"; exit 77; }
"$python" -m pip --version >/dev/null 2>&1 || { echo "SKIPPED: $python has no pip (python3-pip)"; exit 77; }
rm -rf "$work" && mkdir -p "$work/src" "$work/elsewhere"
# The tracked sources (and untracked ones not ignored), not the build trees.
(cd "$src" && { git ls-files -co --exclude-standard 2>/dev/null || find . -path ./build\* -prune -o -type f -print; } |
  grep -v '^build' | tar -cf - -T -) | tar -xf - -C "$work/src"
"$python" -m venv --system-site-packages --without-pip "$work/venv" || fail "venv failed (python3-venv?)"
venv_py=$work/venv/bin/python
(cd "$work/src" && STRATA_BUILD_DIR="$build" "$venv_py" -m pip install --no-build-isolation \
   --no-index --no-deps . > "$work/pip.log" 2>&1) || { cat "$work/pip.log"; fail "pip install failed"; }
tail -3 "$work/pip.log"
cd "$work/elsewhere"
"$venv_py" - "$work/venv" <<'PY' || fail "the installed package does not work"
import os, sys
import strata.torch  # before torch: the import order does not matter
import torch
import strata
venv = os.path.realpath(sys.argv[1])
where = os.path.realpath(strata.__file__)
assert where.startswith(venv), f"strata imported from {where}, not the venv {venv}"
assert os.path.realpath(strata._strata.__file__).startswith(venv)
w = torch.zeros(1000, requires_grad=True)
opt = strata.torch.OffloadAdam([w], lr=0.1)
w.grad = torch.ones_like(w)
opt.step()
assert abs(float(w[0]) + 0.1) < 1e-3, float(w[0])
print(f"check_pip_install: strata {strata.__version__} from {where}; one step ok")
PY
# Debian's /usr/bin/python3 itself stays as it was.
if "$python" -c "import strata" 2>/dev/null && [ -z "${PYTHONPATH:-}" ]; then
  fail "strata is importable by $python outside the venv"
fi
"$venv_py" -m pip uninstall -y strata > /dev/null || fail "pip uninstall failed"
"$venv_py" -c "import strata" 2>/dev/null && fail "strata still importable after uninstall"
echo "check_pip_install: ok"
