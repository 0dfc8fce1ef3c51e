"""Engine logs reach Python `logging` (logger "strata", with the rank), a
broken handler loses no line, import order with torch does not matter, and
nvme_path folders are created. Each subprocess case runs a fresh interpreter
so that what it checks is not an artefact of this one's state."""
import logging
import os
import subprocess
import sys

import pytest
import torch

import strata
from strata import _strata
from strata.torch import OffloadAdam

ENV = dict(os.environ, STRATA_LOG="info")


def run_python(code, env=ENV):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)


def test_engine_logs_reach_the_strata_logger_with_the_rank(caplog):
    caplog.set_level(logging.INFO, logger="strata")
    _strata.set_log_level("info")
    w = torch.zeros(1000, requires_grad=True)
    opt = OffloadAdam([w], lr=1e-3)
    records = [r for r in caplog.records if r.name == "strata" and "placement plan" in r.getMessage()]
    assert records, [r.getMessage() for r in caplog.records]
    r = records[0]
    assert r.levelno == logging.INFO
    assert r.rank == 0
    assert r.getMessage().startswith("[rank 0] ")
    del opt


def test_levels_map_and_the_engine_level_filters_first(caplog):
    caplog.set_level(logging.DEBUG, logger="strata")
    _strata.set_log_level("info")
    try:
        _strata.log("debug", "below the engine's level")
        _strata.log("warning", "a warning")
        _strata.log("error", "an error")
    finally:
        _strata.set_log_level(os.environ.get("STRATA_LOG", "info"))
    got = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "strata"]
    assert got == [(logging.WARNING, "[rank 0] a warning"), (logging.ERROR, "[rank 0] an error")]
    with pytest.raises(ValueError, match="log level 'loud'"):
        _strata.log("loud", "x")


def test_a_line_that_is_not_utf8_reaches_the_handler_escaped(caplog, capfd):
    """An engine line may quote a path's bytes that are not UTF-8: the handler gets
    them as \\xNN text (it used to fail to decode, and the line went to stderr with
    an 'Exception ignored' report)."""
    caplog.set_level(logging.WARNING, logger="strata")
    _strata.log("warning", b"write /data/\xff\xfe/x: failed")
    got = [r.getMessage() for r in caplog.records if r.name == "strata"]
    assert any(m.endswith("write /data/\\xff\\xfe/x: failed") for m in got), got
    assert "Exception ignored" not in capfd.readouterr().err


def test_warnings_show_on_stderr_without_any_logging_setup():
    p = run_python("import strata, strata._strata as s; s.log('warning', 'disk is slow')")
    assert p.returncode == 0, p.stderr
    assert "[rank 0] disk is slow" in p.stderr, p.stderr
    # Info lines stay quiet until logging is configured ...
    p = run_python("import strata, strata._strata as s; s.log('info', 'the plan')")
    assert "the plan" not in p.stderr, p.stderr
    # ... and show once it is.
    p = run_python("import logging, strata, strata._strata as s; "
                   "logging.basicConfig(level=logging.INFO, format='%(name)s %(levelname)s "
                   "rank=%(rank)s %(message)s'); s.log('info', 'the plan')")
    assert "strata INFO rank=0 [rank 0] the plan" in p.stderr, p.stderr


def test_rank_comes_from_torch_distributed_else_the_environment():
    p = run_python("import strata, strata._strata as s; s.log('warning', 'hello')",
                   env=dict(ENV, RANK="3"))
    assert "[rank 3] hello" in p.stderr, p.stderr
    code = """
import os, tempfile, torch, torch.distributed as dist
import strata, strata._strata as s
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
dist.init_process_group("gloo", rank=0, world_size=1)
s.log("warning", "from rank")
dist.destroy_process_group()
"""
    p = run_python(code, env=dict(ENV, RANK="7"))
    assert p.returncode == 0, p.stderr
    assert "[rank 0] from rank" in p.stderr, p.stderr


def test_a_failing_handler_loses_no_line(capfd, monkeypatch):
    def broken(level, message):
        raise RuntimeError("handler is broken")

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    _strata.set_log_handler(broken)
    try:
        _strata.log("warning", "still delivered")
    finally:
        _strata.set_log_handler(strata._forward)
    err = capfd.readouterr().err
    assert "strata: warning: still delivered" in err, err
    assert [str(u.exc_value) for u in unraisable] == ["handler is broken"]


def test_handler_none_goes_back_to_stderr(capfd):
    _strata.set_log_handler(None)
    try:
        _strata.log("warning", "plain stderr")
    finally:
        _strata.set_log_handler(strata._forward)
    assert "strata: warning: plain stderr" in capfd.readouterr().err


def test_import_order_with_torch_does_not_matter():
    for code in ["import strata.torch, torch; print(torch.__version__)",
                 "import torch, strata.torch; print(torch.__version__)"]:
        p = run_python(code)
        assert p.returncode == 0, (code, p.stderr)


def test_engine_threads_logging_at_exit_do_not_crash():
    # An engine alive at interpreter exit, its threads logging while it goes.
    code = """
import torch, strata._strata as s
from strata.torch import OffloadAdam
w = torch.zeros(4096, requires_grad=True)
opt = OffloadAdam([w], lr=1e-3)
w.grad = torch.ones_like(w)
opt.step()
s.log("warning", "bye")
"""
    p = run_python(code)
    assert p.returncode == 0, p.stderr
    assert "bye" in p.stderr


def test_a_missing_nvme_path_folder_is_created(tmp_path):
    path = tmp_path / "new" / "state"
    w = torch.zeros(3000, requires_grad=True)
    opt = OffloadAdam([w], lr=1e-2, offload="nvme", nvme_path=str(path), host_budget=0,
                      sub_group_size=1024)
    assert path.is_dir()
    assert (path / "strata-rank0.state").exists()
    w.grad = torch.ones_like(w)
    opt.step()
    assert torch.all(w < 0)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    # Refused by the preflight, before anything is created, naming the file in the way.
    with pytest.raises(strata.StrataError,
                       match=f"{blocker}/sub: cannot be created: {blocker} is not a directory"):
        OffloadAdam([torch.zeros(3000, requires_grad=True)], offload="nvme",
                    nvme_path=str(blocker / "sub"), host_budget=0, sub_group_size=1024)


def test_an_unused_nvme_path_is_logged_once(caplog, tmp_path):
    """nvme_path with device "cpu" is said once per OffloadAdam: it was logged by
    each ValidateConfig, and the module and the engine's Create both run one."""
    caplog.set_level(logging.INFO, logger="strata")
    _strata.set_log_level("info")
    try:
        config = {"zero_optimization": {"offload_optimizer": {
            "device": "cpu", "nvme_path": str(tmp_path / "unused")}}}
        opt = OffloadAdam([torch.zeros(100, requires_grad=True)], lr=1e-3, config=config)
    finally:
        _strata.set_log_level(os.environ.get("STRATA_LOG", "info"))
    said = [r.getMessage() for r in caplog.records
            if r.name == "strata" and "nvme_path is unused with device" in r.getMessage()]
    assert len(said) == 1, said
    del opt
