"""A forked child (a DataLoader worker, os.fork) and an OffloadAdam it
inherited: the child may free it without hanging, and it keeps no lock on the
parent's nvme_path."""
import os
import signal
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
from strata.torch import OffloadAdam  # noqa: E402


def _wait(pid, seconds=30.0):
    """The child's exit status, or None (the child is killed) after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def _trained(**kwargs):
    model = torch.nn.Linear(16, 4)
    opt = OffloadAdam(model.parameters(), lr=1e-2, **kwargs)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    return model, opt


def test_a_child_that_frees_an_inherited_optimizer_exits(tmp_path):
    """The engine's destructor joined threads the child does not have and
    blocked for ever (a DataLoader worker whose garbage collector freed an
    optimizer stalled the training)."""
    model, opt = _trained(offload="nvme", nvme_path=str(tmp_path))
    state = tmp_path / "strata-rank0.state"
    assert state.exists()
    pid = os.fork()
    if pid == 0:
        del opt  # the engine, its device, its streams
        os._exit(0 if not state.exists() or state.stat().st_size > 0 else 3)
    status = _wait(pid)
    assert status is not None, "the child hung freeing the optimizer"
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    # The parent's state is whole: it steps on.
    assert state.exists() and state.stat().st_size > 0
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    assert opt.step_count == 2


_EXITING_CHILD = """
import os, sys, torch
from strata.torch import OffloadAdam
m = torch.nn.Linear(16, 4)
o = OffloadAdam(m.parameters(), lr=1e-2)
m(torch.randn(2, 16)).sum().backward()
o.step()
pid = os.fork()
if pid == 0:
    sys.exit(0)  # the interpreter's finalization frees the optimizer
_, status = os.waitpid(pid, 0)
print("child exited", status)
"""


def test_a_child_exiting_normally_does_not_hang():
    """sys.exit in the child: the interpreter's finalization frees the
    optimizer it inherited."""
    done = subprocess.run([sys.executable, "-c", _EXITING_CHILD], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    assert "child exited 0" in done.stdout, done.stdout + done.stderr


def test_close_releases_the_nvme_path_while_a_forked_child_lives(tmp_path):
    """The child's copy of the lock file's descriptor held the lock until it
    exited: close() did not free the directory for a new optimizer."""
    _model, opt = _trained(offload="nvme", nvme_path=str(tmp_path))
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(write_end)
        os.read(read_end, 1)  # lives until the parent is done
        os._exit(0)
    os.close(read_end)
    try:
        opt.close()
        _model2, opt2 = _trained(offload="nvme", nvme_path=str(tmp_path))
        assert opt2.step_count == 1
        opt2.close()
    finally:
        os.write(write_end, b"x")
        os.close(write_end)
        status = _wait(pid)
    assert status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
