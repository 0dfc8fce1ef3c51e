"""Shared by the bench step checks: start `strata bench step` and read its
stderr until its first timed step has begun."""
import os
import subprocess
import time


def start_until_first_step(cmd, fail, stdout=subprocess.DEVNULL):
    """Popen(cmd); returns (proc, stderr read so far) once the bench says
    "step 1/"; fail(msg) (which exits) when it ends or stalls first."""
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE)
    err = b""
    deadline = time.time() + 120
    while b"bench step: step 1/" not in err:
        chunk = os.read(proc.stderr.fileno(), 4096)
        if not chunk or time.time() > deadline:
            proc.kill()
            fail(f"{cmd[1:]}: the bench ended (or stalled) before its first step: "
                 f"{err.decode()}")
        err += chunk
    return proc, err
