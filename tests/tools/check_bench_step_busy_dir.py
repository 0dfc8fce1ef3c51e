"""`strata bench step --nvme-dir D` where another run holds D's lock, or D is
read-only: refused before anything is measured (it used to run its probes,
the drive's in the other run's directory, and fail seconds later)."""
import fcntl
import os
import subprocess
import sys

strata, scratch = sys.argv[1], sys.argv[2]
os.makedirs(scratch, exist_ok=True)
lock_path = os.path.join(scratch, "strata-rank0.lock")
with open(lock_path, "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    lock.write("%d\n" % os.getpid())
    lock.flush()
    run = subprocess.run([strata, "bench", "step", "--params", "4M", "--steps", "1",
                          "--nvme-dir", scratch], capture_output=True, text=True, timeout=120)
    err = run.stderr
    assert run.returncode != 0, err
    assert "another run uses it" in err and "held by process %d" % os.getpid() in err, err
    assert "measuring" not in err, "refused only after measuring:\n" + err
# The other run's lock file is left where it was.
assert os.path.exists(lock_path)
print("ok")
