"""OffloadAdam's step trace: trace(path) blocks, trace=N with write_trace(path),
per-rank files, and the errors for paths that cannot be written.

The files are read back as JSON (Chrome trace event format): the slices on the
PCIe and CPU Adam tracks must belong to the steps taken inside the block and
to no other, otherData must name the model size and world size, and
scripts/plot_trace.py --summary must read them.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from strata.torch import OffloadAdam, StrataError

PLOT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "plot_trace.py")
STAGE_TRACKS = ("pcie d2h", "cpu adam", "pcie h2d")


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def make_opt(model, **kwargs):
    # Small sub-groups: a step has several of them on every track.
    return OffloadAdam(model.parameters(), lr=1e-3, sub_group_size=512, threads=1, **kwargs)


def train(model, opt, steps):
    torch.manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def load(path):
    with open(path) as f:
        doc = json.load(f)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    slices = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    for s in slices:
        s["track"] = threads[(s["pid"], s["tid"])]
    return doc, slices


def steps_on(slices, track):
    return {s["args"]["step"] for s in slices if s["track"] == track}


def trace_steps(model, opt, path, steps):
    """Takes `steps` steps in a trace(path) block; the steps on the CPU Adam track."""
    with opt.trace(path):
        train(model, opt, steps)
    return steps_on(load(path)[1], "cpu adam")


def test_a_block_records_its_steps_and_no_others(tmp_path):
    model = make_model()
    opt = make_opt(model)
    train(model, opt, 2)
    path = tmp_path / "step.json"
    with opt.trace(path, steps=8) as written:
        assert written == str(path)
        train(model, opt, 3)
        assert not path.exists()  # written when the block ends
    train(model, opt, 2)
    assert opt._engine.trace_info()["enabled"] is False

    doc, slices = load(path)
    for track in STAGE_TRACKS:
        assert steps_on(slices, track) == {3, 4, 5}, track
    sub_groups = len(opt._engine.sub_groups())
    assert sub_groups > 1
    adam = [s for s in slices if s["track"] == "cpu adam" and s["args"]["step"] == 4]
    assert sorted(s["args"]["sub_group"] for s in adam) == list(range(sub_groups))
    assert all(s["dur"] >= 0 and s["ts"] >= 0 for s in slices)
    other = doc["otherData"]
    assert other["params"] == sum(p.numel() for p in model.parameters())
    assert other["world_size"] == 1 and other["rank"] == 0
    assert (other["first_step"], other["last_step"]) == (3, 5)
    assert other["source"] == "strata.torch.OffloadAdam"
    # Later steps recorded nothing: the file is as the block left it.
    before = path.read_bytes()
    train(model, opt, 1)
    assert path.read_bytes() == before


def test_plot_trace_summary_reads_it(tmp_path):
    model = make_model()
    opt = make_opt(model)
    path = tmp_path / "step.json"
    with opt.trace(path):
        train(model, opt, 2)
    out = subprocess.run([sys.executable, PLOT, str(path), "--summary"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for track in STAGE_TRACKS:
        assert track in out.stdout, out.stdout


def test_the_ring_keeps_the_newest_steps(tmp_path):
    # The ring is sized by the events the engine reserves per step (an upper
    # bound; the host device records fewer), so it keeps at least `steps`
    # steps and a few more here: 6 steps through a 1-step ring drop the first.
    model = make_model()
    opt = make_opt(model)
    path = tmp_path / "step.json"
    with opt.trace(path, steps=1):
        train(model, opt, 6)
    _, slices = load(path)
    kept = steps_on(slices, "cpu adam")
    assert 6 in kept and 1 not in kept and 2 not in kept, kept
    adam = [s for s in slices if s["track"] == "cpu adam" and s["args"]["step"] == 6]
    assert len(adam) == len(opt._engine.sub_groups())  # the newest step is whole
    assert json.loads(path.read_text())["otherData"]["dropped_events"] > 0


def test_a_block_that_raises_writes_what_it_recorded_and_re_raises(tmp_path):
    model = make_model()
    opt = make_opt(model)
    path = tmp_path / "step.json"
    with pytest.raises(KeyError, match="from the trainer"):
        with opt.trace(path):
            train(model, opt, 2)
            raise KeyError("from the trainer")
    _, slices = load(path)
    assert steps_on(slices, "cpu adam") == {1, 2}
    assert opt._engine.trace_info()["enabled"] is False
    assert trace_steps(model, opt, tmp_path / "again.json", 1) == {3}  # it traces again


def test_bad_paths_are_refused_before_any_step(tmp_path, monkeypatch):
    model = make_model()
    opt = make_opt(model)
    missing = tmp_path / "no" / "such" / "step.json"
    with pytest.raises(FileNotFoundError, match="does not exist") as e:
        with opt.trace(missing):
            pytest.fail("the block must not run")
    assert str(tmp_path / "no" / "such") in str(e.value)
    with pytest.raises(IsADirectoryError, match="is a directory"):
        with opt.trace(tmp_path):
            pytest.fail("the block must not run")
    with pytest.raises(TypeError, match="give a file path"):
        with opt.trace(3):
            pytest.fail("the block must not run")
    for steps in (0, -1, 2.5, "8", 1001, 2**31):
        with pytest.raises(ValueError, match="steps") as e:
            with opt.trace(tmp_path / "s.json", steps=steps):
                pytest.fail("the block must not run")
        assert "from 1 to 1000" in str(e.value)
    assert opt._engine.trace_info()["enabled"] is False
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.geteuid() == 0:  # root writes anywhere: let access() answer as for a user
        monkeypatch.setattr(os, "access", lambda p, mode: os.fspath(p) != str(locked))
    with pytest.raises(PermissionError, match="not writable") as e:
        with opt.trace(locked / "step.json"):
            pytest.fail("the block must not run")
    assert str(locked) in str(e.value)
    monkeypatch.undo()
    # Nothing was recorded: the optimizer still steps and traces.
    train(model, opt, 1)
    assert trace_steps(model, opt, tmp_path / "ok.json", 1) == {2}


def test_a_write_that_fails_at_the_end_names_the_file(tmp_path):
    model = make_model()
    opt = make_opt(model)
    folder = tmp_path / "gone"
    folder.mkdir()
    with pytest.raises(StrataError, match="gone"):
        with opt.trace(folder / "step.json"):
            train(model, opt, 1)
            folder.rmdir()
    assert opt._engine.trace_info()["enabled"] is False
    train(model, opt, 1)  # the optimizer is unharmed


def test_trace_n_records_from_construction_and_write_trace_writes(tmp_path):
    model = make_model()
    opt = make_opt(model, trace=2)
    train(model, opt, 12)
    path = opt.write_trace(tmp_path / "a.json")
    _, slices = load(path)
    kept = steps_on(slices, "cpu adam")
    assert {11, 12} <= kept and not kept & {1, 2, 3}, kept
    train(model, opt, 1)  # recording goes on
    kept = steps_on(load(opt.write_trace(tmp_path / "b.json"))[1], "cpu adam")
    assert {12, 13} <= kept, kept
    with pytest.raises(RuntimeError, match="write_trace"):
        with opt.trace(tmp_path / "c.json"):
            pass
    with pytest.raises(FileNotFoundError, match="does not exist"):
        opt.write_trace(tmp_path / "missing" / "d.json")


def test_trace_options_are_checked(tmp_path):
    model = make_model()
    with pytest.raises(ValueError, match="trace='step.json'"):
        make_opt(model, trace="step.json")
    with pytest.raises(ValueError, match="trace=0"):
        make_opt(model, trace=0)
    with pytest.raises(ValueError, match=r"trace=1000000.*from 1 to 1000"):
        make_opt(model, trace=10**6)
    assert make_opt(make_model(), trace=1000)._engine.trace_info()["steps"] == 1000
    opt = make_opt(model, trace=None)
    with pytest.raises(RuntimeError, match="records no trace"):
        opt.write_trace(tmp_path / "x.json")
    with opt.trace(tmp_path / "outer.json"):
        with pytest.raises(RuntimeError, match="already recording"):
            with opt.trace(tmp_path / "inner.json"):
                pass
    assert make_opt(make_model(), trace=True)._engine.trace_info()["steps"] == 8


WORLD = 2


def rank_worker(rank, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    try:
        model = make_model()
        opt = make_opt(model)
        train(model, opt, 1)
        with opt.trace(os.path.join(out_dir, "step.json")) as path:
            assert path == os.path.join(out_dir, f"step.rank{rank}.json")
            train(model, opt, 2)
    finally:
        dist.destroy_process_group()


def test_each_rank_writes_its_own_file(tmp_path):
    mp.spawn(rank_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    assert not (tmp_path / "step.json").exists()
    for rank in range(WORLD):
        doc, slices = load(tmp_path / f"step.rank{rank}.json")
        assert {s["pid"] for s in slices} == {rank}
        assert steps_on(slices, "cpu adam") == {2, 3}
        assert doc["otherData"]["world_size"] == WORLD and doc["otherData"]["rank"] == rank
        assert doc["otherData"]["params"] == sum(p.numel() for p in make_model().parameters())
