"""Builds strata._strata with the project's CMake for the Python running pip,
then installs the package python/strata (pyproject.toml holds the metadata).

    python -m pip install --no-build-isolation .

Environment:
  STRATA_BUILD_DIR=build    reuse a configured CMake build tree instead of
                            configuring a new one: only the strata_python
                            target is (re)built there, which is quick when it
                            is up to date. The tree must have been configured
                            for this Python's ABI (STRATA_PYTHON); the build
                            checks the module's file name.
  STRATA_CMAKE_ARGS="..."   extra arguments for the configure step, e.g.
                            "-DSTRATA_CUDA=OFF" or "-DCMAKE_CUDA_ARCHITECTURES=80".
  STRATA_BUILD_JOBS=N       parallel build jobs (default: every core).
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def run(cmd, **kwargs):
    print("strata setup:", " ".join(shlex.quote(str(c)) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kwargs)


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        if shutil.which("cmake") is None:
            raise SystemExit("strata setup: cmake is not on PATH; install CMake >= 3.25 "
                             "(Debian: apt-get install cmake ninja-build)")
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        reuse = os.environ.get("STRATA_BUILD_DIR")
        if reuse:
            build = Path(reuse)
            if not build.is_absolute():
                build = ROOT / build
            if not (build / "CMakeCache.txt").exists():
                raise SystemExit(f"strata setup: STRATA_BUILD_DIR={reuse} is not a configured "
                                 "CMake build tree (no CMakeCache.txt); configure it first, or "
                                 "unset STRATA_BUILD_DIR to let pip configure one")
        else:
            build = Path(self.build_temp).resolve() / "cmake"
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            if not (build / "CMakeCache.txt").exists():
                run(["cmake", "-S", ROOT, "-B", build, *generator, "-DCMAKE_BUILD_TYPE=Release",
                     "-DSTRATA_BUILD_TESTS=OFF", "-DSTRATA_BUILD_BENCH=OFF",
                     f"-DSTRATA_PYTHON={sys.executable}",
                     *shlex.split(os.environ.get("STRATA_CMAKE_ARGS", ""))])
        jobs = os.environ.get("STRATA_BUILD_JOBS") or str(os.cpu_count() or 1)
        run(["cmake", "--build", build, "--target", "strata_python", "-j", jobs])
        built = build / "python" / "strata" / f"_strata{suffix}"
        if not built.exists():
            found = sorted(p.name for p in (build / "python" / "strata").glob("_strata*"))
            cache = (build / "CMakeCache.txt").read_text(errors="replace")
            m = re.search(r"^STRATA_PYTHON:[A-Z]+=(.*)$", cache, re.M)
            raise SystemExit(
                f"strata setup: {build} built {found or 'no module'} for "
                f"{m.group(1) if m else 'another Python'}, not _strata{suffix} for "
                f"{sys.executable}; reconfigure it with -DSTRATA_PYTHON={sys.executable}, or "
                "unset STRATA_BUILD_DIR")
        dest = Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, dest)


setup(
    ext_modules=[CMakeExtension("strata._strata")],
    cmdclass={"build_ext": CMakeBuild},
    # Not build/: that is the CMake presets' build tree.
    options={"build": {"build_base": "build-pip"}},
)
