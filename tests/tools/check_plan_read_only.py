"""`strata plan` with nvme_path on a read-only mount: the preflight says it does
not fit, naming EROFS, whether the plan puts state on NVMe or not (it said "fits
this machine", and Create then failed making or locking the directory). Needs a read-only bind mount, which only
root may make: SKIPPED (exit 77) otherwise.
    check_plan_read_only.py <strata binary> <scratch dir>"""
import json
import os
import shutil
import subprocess
import sys


def fail(msg):
    print(f"check_plan_read_only: {msg}")
    sys.exit(1)


def main():
    strata, scratch = sys.argv[1], sys.argv[2]
    shutil.rmtree(scratch, ignore_errors=True)
    ro = os.path.join(scratch, "ro")
    os.makedirs(ro)
    mount = subprocess.run(["mount", "--bind", ro, ro], capture_output=True, text=True)
    if mount.returncode != 0:
        print(f"SKIPPED: cannot make a read-only bind mount here ({mount.stderr.strip()})")
        sys.exit(77)
    try:
        r = subprocess.run(["mount", "-o", "remount,bind,ro", ro], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"SKIPPED: cannot remount read-only ({r.stderr.strip()})")
            sys.exit(77)
        for path in (ro, os.path.join(ro, "new")):
            config = os.path.join(scratch, "config.json")
            with open(config, "w") as f:
                json.dump({"zero_optimization": {
                    "sub_group_size": 262144,
                    "offload_optimizer": {"device": "nvme", "nvme_path": path}},
                    "strata": {"host_budget": "28MiB"}}, f)
            r = subprocess.run([strata, "plan", "--params", "2M", "--config", config],
                               capture_output=True, text=True)
            if r.returncode != 1 or "preflight: does not fit this machine" not in r.stdout or \
                    f"nvme_path {path}: " not in r.stderr or "EROFS" not in r.stderr:
                fail(f"{path}: exit {r.returncode}, stdout tail {r.stdout[-200:]!r}, "
                     f"stderr {r.stderr!r}")
            # All state in DRAM: refused too, as Create makes and locks nvme_path anyway.
            with open(config, "w") as f:
                json.dump({"zero_optimization": {
                    "offload_optimizer": {"device": "nvme", "nvme_path": path}},
                    "strata": {"host_budget": "1GiB"}}, f)
            r = subprocess.run([strata, "plan", "--params", "2M", "--config", config],
                               capture_output=True, text=True)
            if r.returncode != 1 or "EROFS" not in r.stderr:
                fail(f"{path}, state in DRAM: exit {r.returncode}, stderr {r.stderr!r}")
    finally:
        subprocess.run(["umount", ro], capture_output=True)
    shutil.rmtree(scratch, ignore_errors=True)
    print("check_plan_read_only: ok")


if __name__ == "__main__":
    main()
