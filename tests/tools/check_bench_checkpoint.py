"""`strata bench checkpoint`: one JSON object with the save, verify, load and
resume times and their bounds from the drive measured in the same run
(none with --drive-probe 0), with the state in DRAM and on NVMe; the bench's
own directories are gone afterwards, also when SIGINT ends it part way; bad
options are refused naming the option.
    check_bench_checkpoint.py <strata binary> <scratch dir>"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from bench_step_run import start_until


def fail(msg):
    print(f"check_bench_checkpoint: {msg}")
    sys.exit(1)


def run(strata, args, want_rc=0):
    p = subprocess.run([strata, "bench", "checkpoint"] + args, capture_output=True, text=True,
                       timeout=240)
    print(p.stderr)
    if p.returncode != want_rc:
        fail(f"{args}: exit {p.returncode}, want {want_rc}: {p.stdout}{p.stderr}")
    return p


def check_empty(d, args):
    if os.listdir(d):
        fail(f"{args}: left behind in {d}: {os.listdir(d)}")


def main():
    strata, scratch = sys.argv[1], sys.argv[2]
    shutil.rmtree(scratch, ignore_errors=True)
    ck, nv = os.path.join(scratch, "ck"), os.path.join(scratch, "nv")
    os.makedirs(ck)
    os.makedirs(nv)

    # DRAM state, with the drive baseline: every figure and its bound.
    args = ["--params", "2M", "--sub-group", "256K", "--repeat", "2", "--drive-probe", "16MiB",
            "--dir", ck, "--json"]
    j = json.loads(run(strata, args).stdout)
    if j["error"] is not None or j["offload"] != "cpu" or j["nvme_state_bytes"] != 0:
        fail(f"{args}: {j}")
    if j["state_bytes"] < 12 * 2_000_000:
        fail(f"{args}: state_bytes {j['state_bytes']} < 12 bytes per param")
    for k in ("save_sec", "verify_sec", "load_sec", "resume_sec"):
        if len(j[k]) != 2 or not all(t > 0 for t in j[k]):
            fail(f"{args}: {k} {j[k]}")
    if not j["drive_read_bytes_per_sec"] > 0 or not j["drive_write_bytes_per_sec"] > 0:
        fail(f"{args}: no drive baseline: {j}")
    # A save is durable: its bound is the state written into new files and synced.
    synced = j["drive_synced_write_bytes_per_sec"]
    if not synced > 0 or abs(j["save_bound_sec"] * synced / j["state_bytes"] - 1) > 1e-9:
        fail(f"{args}: the save bound is not the state at the synced write rate: {j}")
    for k in ("save", "verify", "load", "resume"):
        bound = j[f"{k}_bound_sec"] if k != "resume" else j["load_bound_sec"]
        e = j[f"{k}_efficiency"]
        if not bound > 0 or not e > 0:
            fail(f"{args}: {k}: bound {bound}, efficiency {e}")
    check_empty(ck, args)

    # NVMe state without the baseline: figures, no bound.
    args = ["--params", "2M", "--sub-group", "256K", "--repeat", "1", "--offload", "nvme",
            "--nvme-dir", nv, "--dir", ck, "--drive-probe", "0", "--json"]
    j = json.loads(run(strata, args).stdout)
    if not j["nvme_state_bytes"] > 0 or j["save_bound_sec"] is not None or \
            j["load_efficiency"] is not None or not j["one_drive"]:
        fail(f"{args}: {j}")
    check_empty(ck, args)
    check_empty(nv, args)

    # The text report names each row.
    args = ["--params", "1M", "--repeat", "1", "--drive-probe", "0", "--dir", ck]
    out = run(strata, args).stdout
    for row in ("save", "verify", "load", "resume"):
        if not re.search(rf"^{row} +\S+ \S+ +\S+ \S+ of state$", out, re.M):
            fail(f"{args}: no '{row}' row in:\n{out}")

    # Bad options: refused (exit 2, a usage error) before anything is written.
    p = run(strata, ["--nvme-dir", nv, "--dir", ck], want_rc=2)
    if "--nvme-dir is for state on NVMe" not in p.stderr:
        fail(f"--nvme-dir with cpu: {p.stderr}")
    p = run(strata, ["--dir", os.path.join(scratch, "missing")], want_rc=2)
    if "--dir " + os.path.join(scratch, "missing") + ": not an existing directory" not in p.stderr:
        fail(f"--dir missing: {p.stderr}")
    check_empty(ck, "bad options")

    # SIGINT part way (after the first round, inside the rounds that follow):
    # the save's temporaries and files, and the directories, are removed.
    cmd = [strata, "bench", "checkpoint", "--params", "16M", "--sub-group", "2M", "--repeat",
           "20", "--drive-probe", "0", "--offload", "nvme", "--nvme-dir", nv, "--dir", ck]
    proc, err = start_until(cmd, b"round 1/20", fail, timeout=180)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=120)
    print(err.decode() + rest.decode())
    if proc.returncode != -signal.SIGINT:
        fail(f"SIGINT: exit status {proc.returncode}")
    check_empty(ck, "SIGINT")
    check_empty(nv, "SIGINT")
    print("check_bench_checkpoint: ok")


main()
