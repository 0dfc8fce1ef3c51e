"""`strata bench nvme --vs-fio` runs fio as its own child: ended by SIGTERM or
SIGHUP sent to its pid alone (kill PID, timeout, a job scheduler), it kills
fio before it removes the test file, so no fio keeps running and re-creates
the file (a fio run through popen's shell did); SIGKILL'ed, fio dies with it
(PR_SET_PDEATHSIG). fio's JSON output and exit status are still read. A fake
`fio` first on PATH keeps this fast and deterministic.
    check_bench_nvme_fio_signal.py <strata binary> <scratch dir>"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

FAKE_FIO = r'''
import json, os, sys, time
mode = os.environ["FAKE_FIO_MODE"]
with open(os.environ["FAKE_FIO_PIDS"], "a") as f:
    f.write(f"{os.getpid()}\n")
files = [a[len("--filename="):].replace("\\:", ":") for a in sys.argv
         if a.startswith("--filename=")]
if mode == "json":
    print("note: a line fio may print before its JSON")
    print(json.dumps({"jobs": [{"read": {"bw_bytes": 123456789}}]}))
elif mode == "fail":
    sys.exit(3)
else:  # slow: keeps the test files open and re-creates them, as fio does
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for path in files:
            open(path, "a").close()
        time.sleep(0.05)
'''

BENCH = ["bench", "nvme", "--size", "8MiB", "--block", "256KiB", "--qd", "2", "--repeat", "1",
         "--order", "fio-first", "--vs-fio"]


def fail(msg):
    print(f"check_bench_nvme_fio_signal: {msg}")
    sys.exit(1)


def alive(pid):
    """True while `pid` runs (a zombie, exited but not reaped, is not running)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


class Setup:
    def __init__(self, scratch):
        self.scratch = scratch
        self.bin = os.path.join(scratch, "bin")
        self.dir = os.path.join(scratch, "dir")
        self.pids = os.path.join(scratch, "fio.pids")
        os.makedirs(self.bin)
        os.makedirs(self.dir)
        fio = os.path.join(self.bin, "fio")
        with open(fio, "w") as f:
            f.write(f"#!{sys.executable}\n{FAKE_FIO}")
        os.chmod(fio, 0o755)

    def env(self, mode, path=None):
        if os.path.exists(self.pids):
            os.remove(self.pids)
        env = dict(os.environ, FAKE_FIO_MODE=mode, FAKE_FIO_PIDS=self.pids)
        env["PATH"] = path if path is not None else self.bin + os.pathsep + env.get("PATH", "")
        return env

    def fio_pids(self):
        try:
            with open(self.pids) as f:
                return [int(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []


def run(strata, s, mode, extra=(), path=None):
    return subprocess.run([strata] + BENCH + ["--dir", s.dir] + list(extra), env=s.env(mode, path),
                          capture_output=True, text=True, timeout=120)


def main():
    strata, scratch = sys.argv[1], sys.argv[2]
    shutil.rmtree(scratch, ignore_errors=True)
    s = Setup(scratch)

    # The normal path: fio's JSON (after a note) and its exit status are read.
    r = run(strata, s, "json", ["--json"])
    if r.returncode != 0:
        fail(f"with a fio that succeeds: exit {r.returncode}: {r.stderr}")
    out = json.loads(r.stdout)
    if out.get("fio_runs_bytes_per_sec") != [123456789.0]:
        fail(f"fio's bandwidth not read from its JSON: {r.stdout}")
    r = run(strata, s, "fail")
    if r.returncode != 1 or "exit status 3" not in r.stderr:
        fail(f"with a fio that exits 3: exit {r.returncode}, stderr {r.stderr!r}")
    r = run(strata, s, "json", path=os.path.join(scratch, "nothing-here"))
    if r.returncode != 1 or "fio: not found on PATH" not in r.stderr or \
            "install the fio package" not in r.stderr:
        fail(f"without fio: exit {r.returncode}, stderr {r.stderr!r}")
    if os.listdir(s.dir):
        fail(f"left {os.listdir(s.dir)} after the runs that ended")

    # A signal to the bench's pid alone while fio runs.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGKILL):
        # stderr to a file: a fio left running would hold a pipe open.
        err_path = os.path.join(scratch, "stderr")
        with open(err_path, "w") as err:
            proc = subprocess.Popen([strata] + BENCH + ["--dir", s.dir], env=s.env("slow"),
                                    stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 60
        while not s.fio_pids() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        if not s.fio_pids():
            proc.kill()
            proc.wait()
            fail(f"{sig.name}: fio did not start: {open(err_path).read()}")
        time.sleep(0.2)  # fio has the file open
        proc.send_signal(sig)
        proc.wait(timeout=60)
        if proc.returncode != -sig:
            fail(f"{sig.name}: exit status {proc.returncode}, want death by the signal: "
                 f"{open(err_path).read()}")
        pid = s.fio_pids()[0]
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
            fail(f"{sig.name} to the bench: its fio (pid {pid}) is still running")
        if sig == signal.SIGKILL:  # nothing removes the file; the test does
            for name in os.listdir(s.dir):
                os.remove(os.path.join(s.dir, name))
            continue
        time.sleep(0.3)  # a fio left running re-creates the file within 50 ms
        if os.listdir(s.dir):
            fail(f"{sig.name} to the bench: {os.listdir(s.dir)} left in {s.dir}")
    shutil.rmtree(scratch, ignore_errors=True)
    print("check_bench_nvme_fio_signal: ok")


if __name__ == "__main__":
    main()
