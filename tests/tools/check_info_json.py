"""Checks `strata info --json` (the doctor): runs it on a directory that
exists and one that does not, parses the JSON and checks every section a user
or a script reads, with types and cross-checks against this machine.
    check_info_json.py <strata binary> <scratch dir>"""
import json
import os
import shutil
import subprocess
import sys


def fail(msg):
    print(f"check_info_json: {msg}")
    sys.exit(1)


def main():
    strata, scratch = sys.argv[1], sys.argv[2]
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    missing = os.path.join(scratch, "not", "yet")
    proc = subprocess.run([strata, "info", "--json", "--nvme-dir", scratch, "--nvme-dir", missing],
                          capture_output=True, text=True, timeout=300)
    print(proc.stdout)
    print(proc.stderr, file=sys.stderr)
    if proc.returncode != 0:
        fail(f"exit code {proc.returncode}")
    j = json.loads(proc.stdout)

    for key in ["strata", "cpu", "memory", "io_uring", "devices", "versions", "nvme_dirs",
                "python", "problems"]:
        if key not in j:
            fail(f"no '{key}' section")
    s = j["strata"]
    for key in ["version", "build_type", "cuda", "nccl", "io_uring"]:
        if key not in s:
            fail(f"strata.{key} missing")
    if not isinstance(s["cuda"], bool):
        fail("strata.cuda is not a bool")

    cpu = j["cpu"]
    if not (1 <= cpu["usable_cores"] <= cpu["online_cores"]):
        fail(f"cores: {cpu}")
    if cpu["usable_cores"] != len(os.sched_getaffinity(0)):
        fail(f"usable_cores {cpu['usable_cores']} but this process may use "
             f"{len(os.sched_getaffinity(0))}")
    if not cpu["cpu_adam_simd_target"]:
        fail("no SIMD target")

    mem = j["memory"]
    with open("/proc/meminfo") as f:
        total_kib = int(next(l for l in f if l.startswith("MemTotal:")).split()[1])
    if mem["total_bytes"] != total_kib * 1024:
        fail(f"memory.total_bytes {mem['total_bytes']} != MemTotal {total_kib} KiB")
    if not (0 < mem["available_bytes"] <= mem["total_bytes"]):
        fail(f"memory.available_bytes {mem['available_bytes']}")
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    want = None if soft == resource.RLIM_INFINITY else soft
    if mem["memlock_limit_bytes"] != want:
        fail(f"memlock_limit_bytes {mem['memlock_limit_bytes']} != ulimit -l {want}")
    if not isinstance(mem["memlock_unlimited"], bool) or "pin_test" not in mem:
        fail("memlock_unlimited / pin_test")

    if not any(d["name"] == "host" for d in j["devices"]):
        fail("the host device is not listed")
    for key in ["cuda_runtime", "cuda_driver", "nccl"]:
        if key not in j["versions"]:
            fail(f"versions.{key} missing")
    if s["cuda"] and not j["versions"]["cuda_runtime"]:
        fail("a CUDA build reports no CUDA runtime version")

    dirs = j["nvme_dirs"]
    if [d["path"] for d in dirs] != [scratch, missing]:
        fail(f"nvme_dirs paths: {[d['path'] for d in dirs]}")
    here, later = dirs
    st = os.statvfs(scratch)
    free = st.f_bavail * st.f_frsize
    if not here["exists"] or abs(here["free_bytes"] - free) > max(free // 10, 1 << 30):
        fail(f"free space of {scratch}: {here['free_bytes']} vs statvfs {free}")
    if here["io_uring"] != "ok" and j["io_uring"]:
        fail(f"io_uring works here but not in {scratch}: {here['io_uring']}")
    if not (here["o_direct"] == "ok" or "O_DIRECT" in here["o_direct"]):
        fail(f"o_direct: {here['o_direct']}")
    if os.listdir(scratch) != ["not"] and os.listdir(scratch) != []:
        fail(f"the probe left files behind: {os.listdir(scratch)}")
    if later["exists"] or "not checked" not in later["o_direct"]:
        fail(f"the missing directory: {later}")
    if os.path.exists(missing):
        fail("strata info created the missing directory")
    if not any(missing in p["what"] and "does not exist yet" in p["what"]
               for p in j["problems"]):
        fail("no problem reported for the missing directory")

    for p in j["problems"]:
        if p["severity"] not in ("error", "warning") or not p["what"] or not p["fix"]:
            fail(f"malformed problem: {p}")
    for py in j["python"]:
        if "executable" not in py:
            fail(f"python entry without executable: {py}")
    print("check_info_json: ok")


if __name__ == "__main__":
    main()
