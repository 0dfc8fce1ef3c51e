"""scripts/demo prints the help before it builds anything (it configured and
built for minutes first, silently), says so before a build that takes a
while, and shows the end of the build's log when the build fails (it exited
1 without a word). Runs a copy of the script in a scratch tree with a fake
`cmake` first on PATH and a stub examples/train_gpt.py.
    check_demo_script.py <source dir> <scratch dir>"""
import os
import shutil
import stat
import subprocess
import sys

FAKE_CMAKE = """#!/bin/sh
echo "cmake $*" >> "$FAKE_CMAKE_CALLS"
case "$FAKE_CMAKE_MODE" in
  refuse) exit 1 ;;
  slow) sleep 10 ;;  # the demo waits ~1.5 s, slower on a loaded machine
  fail) echo "FAILED: python/CMakeFiles/strata_python.dir/module.cc.o"
        echo "module.cc:1:1: error: the build broke here"; exit 1 ;;
esac
if [ "$1" = "--preset" ]; then mkdir -p build && : > build/build.ninja; fi
exit 0
"""

STUB = """import sys
print("stub train_gpt.py", *sys.argv[1:])
"""


def fail(msg):
    print(f"check_demo_script: {msg}")
    sys.exit(1)


def make_executable(path, text):
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def main():
    source, scratch = sys.argv[1], sys.argv[2]
    shutil.rmtree(scratch, ignore_errors=True)
    repo, fake_bin = os.path.join(scratch, "repo"), os.path.join(scratch, "bin")
    for d in ("scripts", "examples", "build"):
        os.makedirs(os.path.join(repo, d))
    os.makedirs(fake_bin)
    shutil.copy(os.path.join(source, "scripts", "demo"), os.path.join(repo, "scripts", "demo"))
    with open(os.path.join(repo, "examples", "train_gpt.py"), "w") as f:
        f.write(STUB)
    make_executable(os.path.join(fake_bin, "cmake"), FAKE_CMAKE)
    calls = os.path.join(scratch, "cmake.calls")

    def demo(mode, *args):
        if os.path.exists(calls):
            os.remove(calls)
        env = dict(os.environ, FAKE_CMAKE_MODE=mode, FAKE_CMAKE_CALLS=calls,
                   PATH=fake_bin + os.pathsep + os.environ.get("PATH", ""))
        env.pop("STRATA_PRESET", None)
        r = subprocess.run([os.path.join(repo, "scripts", "demo"), *args], env=env,
                           capture_output=True, text=True, timeout=120)
        called = open(calls).read() if os.path.exists(calls) else ""
        return r, called

    # The help: no configure, no build (a cmake that refuses shows any call).
    open(os.path.join(repo, "build", "build.ninja"), "w").close()
    for flag in ("--help", "-h"):
        r, called = demo("refuse", "--steps", "3", flag)
        if r.returncode != 0 or "stub train_gpt.py --help" not in r.stdout or called:
            fail(f"{flag}: exit {r.returncode}, stdout {r.stdout!r}, stderr {r.stderr!r}, "
                 f"cmake called: {called!r}")

    # A build that takes a while is announced; one that is quick is not.
    r, called = demo("slow", "--steps", "3")
    if r.returncode != 0 or "scripts/demo: building the Python module in build/" not in r.stderr \
            or "stub train_gpt.py --steps 3" not in r.stdout or "--build build" not in called:
        fail(f"a slow build: exit {r.returncode}, stderr {r.stderr!r}, stdout {r.stdout!r}, "
             f"cmake: {called!r}")
    r, _ = demo("quick", "--steps", "3")
    if r.returncode != 0 or r.stderr:
        fail(f"an up-to-date build: exit {r.returncode}, stderr {r.stderr!r}")

    # A failed build shows the end of its log.
    r, _ = demo("fail", "--steps", "3")
    if r.returncode != 1 or "error: the build broke here" not in r.stderr or \
            "scripts/demo: building the Python module failed (the whole log: " not in r.stderr:
        fail(f"a failed build: exit {r.returncode}, stderr {r.stderr!r}")

    # No build tree yet: the configure is announced first.
    shutil.rmtree(os.path.join(repo, "build"))
    r, called = demo("quick", "--steps", "3")
    if r.returncode != 0 or "configuring and building the Python module in build/ (the first " \
            "time: minutes)" not in r.stderr or "--preset default" not in called:
        fail(f"no build tree: exit {r.returncode}, stderr {r.stderr!r}, cmake: {called!r}")
    shutil.rmtree(scratch, ignore_errors=True)
    print("check_demo_script: ok")


if __name__ == "__main__":
    main()
