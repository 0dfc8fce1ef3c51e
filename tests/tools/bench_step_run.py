"""Shared by the bench checks: start a `strata bench` and read its stderr
until it prints a marker (bench step: its first timed step has begun)."""
import os
import subprocess
import time


def start_until(cmd, marker, fail, stdout=subprocess.DEVNULL, timeout=120):
    """Popen(cmd); returns (proc, stderr read so far) once stderr holds
    `marker` (bytes); fail(msg) (which exits) when it ends or stalls first."""
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE)
    err = b""
    deadline = time.time() + timeout
    while marker not in err:
        chunk = os.read(proc.stderr.fileno(), 4096)
        if not chunk or time.time() > deadline:
            proc.kill()
            fail(f"{cmd[1:]}: the bench ended (or stalled) before it printed "
                 f"{marker.decode()!r}: {err.decode()}")
        err += chunk
    return proc, err


def start_until_first_step(cmd, fail, stdout=subprocess.DEVNULL):
    """start_until the bench step's "step 1/"."""
    return start_until(cmd, b"bench step: step 1/", fail, stdout)
