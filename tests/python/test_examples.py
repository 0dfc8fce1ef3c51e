"""examples/train_gpt.py (what scripts/demo runs) as a user meets it: bad flags are
refused in one line naming the flag, a size string works for --host-budget, Ctrl-C,
SIGTERM, SIGHUP and engine errors end it in one line, and it removes the NVMe directory
it made."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_gpt.py")
TINY = ["--params", "300K", "--layers", "2", "--seq", "16", "--batch", "4"]


def run(*args, timeout=240):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["--layers", "0"], "argument --layers: 0: give at least 1"),
    (["--steps", "-1"], "argument --steps: -1: give at least 1"),
    (["--params", "1X"], "argument --params: '1X' is not a count"),
    (["--heads", "5", "--d-model", "64"], "--d-model 64 is not a multiple of --heads 5"),
    (["--dtype", "fp16"], "--dtype fp16 needs --device cuda"),
    (["--gpu-fraction", "half"], "--gpu-fraction 'half': give a number in [0, 1] or auto"),
])
def test_bad_flags_are_refused_naming_them(args, message):
    r = run(*args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_the_help_and_bad_flags_need_no_built_module(tmp_path):
    """scripts/demo --help runs before the build: the help and a bad flag's refusal come
    before strata is imported, a module that is not built is said after them."""
    (tmp_path / "strata").mkdir()
    (tmp_path / "strata" / "__init__.py").write_text("raise ImportError('not built')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))

    def run_without_module(*args):
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                              timeout=240, env=env)

    r = run_without_module("--help")
    assert r.returncode == 0 and "usage: train_gpt.py" in r.stdout, r.stderr
    r = run_without_module("--layers", "0")
    assert r.returncode == 2 and "argument --layers: 0: give at least 1" in r.stderr
    r = run_without_module("--steps", "1")
    assert r.returncode == 1
    assert "train_gpt: cannot import strata.torch (not built); build first" in r.stderr


def made_dir(output):
    m = re.search(r"offload: nvme at (\S+),", output)
    assert m, output
    return m.group(1)


def test_a_tiny_run_with_a_size_string_budget_cleans_up():
    r = run(*TINY, "--steps", "3", "--host-budget", "64MiB")
    # A short run that trained is a success: its loss is not judged (it exited 1).
    assert r.returncode == 0, r.stderr
    assert "loss check  not made: 3 steps are too few to judge" in r.stdout
    assert "host budget 64MiB" in r.stdout and "summary" in r.stdout
    assert not os.path.exists(made_dir(r.stdout))


def test_an_engine_error_and_ctrl_c_end_in_one_line(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    r = run(*TINY, "--steps", "2", "--nvme-path", str(not_a_dir))
    assert r.returncode == 1
    assert "train_gpt: OffloadAdam: nvme_path" in r.stderr and "Traceback" not in r.stderr

    p, out = start_until_first_step()
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "train_gpt: interrupted" in err and "Traceback" not in err
    assert not os.path.exists(made_dir(out + rest))


def start_until_first_step():
    """A long run, started and read until it has printed its first step."""
    p = subprocess.Popen([sys.executable, SCRIPT, *TINY, "--steps", "100000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = ""
    deadline = time.monotonic() + 120
    while "step   1/" not in out and time.monotonic() < deadline:
        out += p.stdout.readline()
    return p, out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_end_it_as_ctrl_c_does(sig):
    """kill, a job scheduler or a closed terminal: the NVMe directory it made (where the
    state file is) is removed, and the exit status says which signal (128 + signal)."""
    p, out = start_until_first_step()
    nvme_dir = made_dir(out)
    assert os.path.isdir(nvme_dir)
    p.send_signal(sig)
    rest, err = p.communicate(timeout=60)
    assert p.returncode == 128 + sig, err
    assert f"train_gpt: ended by {sig.name}" in err and "Traceback" not in err
    assert not os.path.exists(nvme_dir), os.listdir(nvme_dir)
