"""Every --json output with a path that is not UTF-8: `strata info`, `bench
nvme` and `bench step` on a directory named b"bad\\xffdir" exit 0 and print
valid JSON in which the bad byte reads U+FFFD. They once aborted (exit 134,
nlohmann's type_error.316), bench step only after the whole benchmark.
    check_json_not_utf8.py <strata binary> <scratch dir>"""
import json
import os
import shutil
import subprocess
import sys


def fail(msg):
    print(f"check_json_not_utf8: {msg}")
    sys.exit(1)


def run_json(args):
    proc = subprocess.run(args, capture_output=True, timeout=300)
    sys.stdout.write(proc.stdout.decode("utf-8", "backslashreplace") + "\n")
    sys.stderr.write(proc.stderr.decode("utf-8", "backslashreplace") + "\n")
    name = " ".join(os.fsdecode(a) for a in args[1:3])
    if proc.returncode != 0:
        fail(f"{name}: exit code {proc.returncode}")
    try:
        return json.loads(proc.stdout.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        fail(f"{name}: stdout is not JSON in UTF-8: {e}")


def main():
    strata, scratch = os.fsencode(sys.argv[1]), os.fsencode(sys.argv[2])
    shutil.rmtree(scratch, ignore_errors=True)
    bad = os.path.join(scratch, b"bad\xffdir")
    os.makedirs(bad)
    shown = os.fsdecode(os.path.join(scratch, b"bad")) + "\ufffddir"

    j = run_json([strata, b"info", b"--no-python", b"--json", b"--nvme-dir", bad])
    if j["nvme_dirs"][0]["path"] != shown:
        fail(f"info: nvme_dirs[0].path is {j['nvme_dirs'][0]['path']!r}, want {shown!r}")

    j = run_json([strata, b"bench", b"nvme", b"--json", b"--dir", bad, b"--size", b"8MiB",
                  b"--repeat", b"1"])
    if j["paths"] != [shown]:
        fail(f"bench nvme: paths is {j['paths']!r}, want [{shown!r}]")

    j = run_json([strata, b"bench", b"step", b"--json", b"--nvme-dir", bad, b"--params", b"1M",
                  b"--sub-group", b"256K", b"--steps", b"1", b"--warmup", b"0",
                  b"--drive-probe", b"4MiB"])
    if j["nvme_paths"] != [shown]:
        fail(f"bench step: nvme_paths is {j['nvme_paths']!r}, want [{shown!r}]")
    shutil.rmtree(scratch, ignore_errors=True)
    print("check_json_not_utf8: ok")


if __name__ == "__main__":
    main()
