"""What checkpoints and exports do to the files around them: retention removes
only Strata's own saves (never the user's files named step-*); a checkpoint
the user cannot write is still read; export output paths are checked and
joined as given; an export directory holds one layout."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

import strata
from strata.torch import OffloadAdam, export_checkpoint, state_dict_from_checkpoint

from safetensors_file import read_safetensors

SAVE_NAME = re.compile(r"step-\d{10}-[0-9a-f]{12}")


def trained(**kwargs):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = OffloadAdam(model.named_parameters(), **kwargs)
    return model, opt


def step(model, opt):
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


def users_files(root):
    """A user's files named step-*, as a training script leaves them."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "step-1000.pt").write_bytes(b"weights at step 1000")
    (root / "step-500").mkdir()
    (root / "step-500" / "model.pt").write_bytes(b"weights at step 500")
    return {"step-1000.pt": b"weights at step 1000",
            os.path.join("step-500", "model.pt"): b"weights at step 500"}


def saves_in(root):
    return sorted(p.name for p in root.iterdir() if SAVE_NAME.fullmatch(p.name))


@pytest.mark.parametrize("how", ["save_checkpoint", "state_dict_dir"])
def test_saves_keep_the_users_step_files_and_prune_their_own(tmp_path, how):
    runs = tmp_path / "runs"
    want = users_files(runs)
    model, opt = trained(**({"state_dict_dir": runs} if how == "state_dict_dir" else {}))
    published = []
    for _ in range(4):
        step(model, opt)
        if how == "state_dict_dir":
            opt.state_dict()
        else:
            opt.save_checkpoint(runs)
        published.append(json.loads((runs / "latest.json").read_text())["checkpoint"])
        for name, data in want.items():
            assert (runs / name).read_bytes() == data, f"{name} was removed by a save"
    # Strata's own older saves are pruned as documented: the newest two stay.
    assert saves_in(runs) == sorted(published[-2:])


@pytest.mark.parametrize("how", ["save_checkpoint", "state_dict_dir"])
def test_a_gans_two_optimizers_cannot_save_into_one_directory(tmp_path, how):
    """A generator's and a discriminator's optimizers (same shapes) saving into one
    directory replaced each other's saves, and load_checkpoint gave the generator
    whichever came last. The second save is refused and writes nothing; the
    directory is free again once the first optimizer is closed."""
    ckpt = tmp_path / "ckpt"
    kw = {"state_dict_dir": ckpt} if how == "state_dict_dir" else {}
    (gen, g_opt), (disc, d_opt) = trained(**kw), trained(**kw)

    def save(opt):
        return opt.state_dict() if how == "state_dict_dir" else opt.save_checkpoint(ckpt)

    step(gen, g_opt)
    save(g_opt)
    latest = (ckpt / "latest.json").read_bytes()
    saves = saves_in(ckpt)
    step(disc, d_opt)
    with pytest.raises(strata.StrataError) as e:
        save(d_opt)
    assert f"another optimizer of this process saves into {ckpt}" in str(e.value)
    assert "Give each optimizer a directory of its own" in str(e.value)
    assert "nothing was written" in str(e.value)
    assert (ckpt / "latest.json").read_bytes() == latest and saves_in(ckpt) == saves
    # The generator's save is still the one a resume finds.
    want = [p.detach().clone() for p in gen.parameters()]
    g_opt.close()
    fresh, f_opt = trained()
    f_opt.load_checkpoint(ckpt)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), want))
    f_opt.close()
    save(d_opt)  # the generator's optimizer is closed: the directory is free
    assert saves_in(ckpt) != saves


def chmod_tree(root, dirs, files):
    for base, subdirs, names in os.walk(root):
        for n in names:
            os.chmod(os.path.join(base, n), files)
        for n in subdirs:
            os.chmod(os.path.join(base, n), dirs)
    os.chmod(root, dirs)


READ_CHECKPOINT = """
import sys, torch
from strata.torch import export_checkpoint, state_dict_from_checkpoint
ckpt, out = sys.argv[1], sys.argv[2]
torch.save(state_dict_from_checkpoint(ckpt), out + "/sd.pt")
export_checkpoint(ckpt, out + "/model.safetensors")
"""


def test_a_checkpoint_the_user_cannot_write_is_read(tmp_path):
    """chmod -R a-w (like a read-only mount or another user's files): the readers
    open every file read-only, so state_dict_from_checkpoint and export_checkpoint
    work (they failed with EACCES). Root may write anything, so as root the reading
    runs as `nobody` through runuser."""
    runuser = shutil.which("runuser") if os.geteuid() == 0 else None
    if os.geteuid() == 0 and runuser is None:
        pytest.skip("running as root without runuser: cannot read as a user without write access")
    model, opt = trained()
    step(model, opt)
    # Under a directory every user can enter (pytest's tmp_path is private to root).
    root = tempfile.mkdtemp(prefix="strata-ro-")
    try:
        os.chmod(root, 0o755)
        ckpt, out = os.path.join(root, "ckpt"), os.path.join(root, "out")
        opt.save_checkpoint(ckpt)
        os.mkdir(out)
        os.chmod(out, 0o777)
        chmod_tree(ckpt, 0o555, 0o444)
        cmd = [sys.executable, "-c", READ_CHECKPOINT, ckpt, out]
        if runuser is not None:
            can_write = subprocess.run(
                [runuser, "-u", "nobody", "--", sys.executable, "-c",
                 f"open({os.path.join(ckpt, 'latest.json')!r}, 'r+')"], capture_output=True)
            assert can_write.returncode != 0, "the premise: nobody cannot write the checkpoint"
            cmd = [runuser, "-u", "nobody", "--"] + cmd
        env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(strata.__file__)))
        ran = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert ran.returncode == 0, ran.stderr
        sd = torch.load(os.path.join(out, "sd.pt"))
        assert list(sd) == [n for n, _ in model.named_parameters()]
        for name, p in model.named_parameters():
            assert torch.equal(sd[name], p.detach()), name
        assert os.path.getsize(os.path.join(out, "model.safetensors")) > 8
        # In this process too (as root it shows nothing more, but it must not break).
        assert all(torch.equal(a, sd[k]) for k, a in state_dict_from_checkpoint(ckpt).items())
    finally:
        chmod_tree(root, 0o755, 0o644)
        shutil.rmtree(root, ignore_errors=True)


def test_export_output_paths_are_checked_and_joined_as_given(tmp_path):
    model, opt = trained()
    step(model, opt)
    ckpt = tmp_path / "ckpt"
    opt.save_checkpoint(ckpt)
    root_file_before = os.path.exists("/model.safetensors")
    with pytest.raises(strata.StrataError, match="InvalidArgument.*the output path is empty"):
        export_checkpoint(ckpt, "")
    with pytest.raises(strata.StrataError, match="the output path is empty"):
        export_checkpoint(ckpt, "", force=True)
    if not root_file_before:
        assert not os.path.exists("/model.safetensors"), "an empty path wrote into /"
    files = export_checkpoint(ckpt, str(tmp_path / "ee.safetensors") + "/")
    assert files == [str(tmp_path / "ee.safetensors" / "model.safetensors")]
    missing = tmp_path / "nope" / "x.safetensors"
    with pytest.raises(strata.StrataError) as e:
        export_checkpoint(ckpt, missing)
    assert f"{missing}: the parent directory {tmp_path / 'nope'} does not exist" in str(e.value)
    assert ".tmp-" not in str(e.value)


@pytest.mark.parametrize("first,then", [(None, 256), (256, None)],
                         ids=["single_then_sharded", "sharded_then_single"])
def test_an_export_directory_holds_one_layout(tmp_path, first, then):
    """Hugging Face loaders prefer model.safetensors over an index: a single file left
    beside new shards (or an index beside a new single file) would load old weights.
    Without force the export refuses naming the stale files; with force they go."""
    model, opt = trained()
    step(model, opt)
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    opt.save_checkpoint(ckpt)
    old = export_checkpoint(ckpt, out, max_shard_size=first)
    (out / "README.md").write_text("the user's")
    before = sorted(os.listdir(out))
    with pytest.raises(strata.StrataError, match="earlier export") as e:
        export_checkpoint(ckpt, out, max_shard_size=then)
    assert old[0] in str(e.value) or old[-1] in str(e.value)
    assert sorted(os.listdir(out)) == before, "a refused export writes nothing"
    step(model, opt)  # new weights, so that old ones would show
    opt.save_checkpoint(ckpt)
    files = export_checkpoint(ckpt, out, max_shard_size=then, force=True)
    assert sorted(os.listdir(out)) == sorted([os.path.basename(f) for f in files] + ["README.md"])
    merged = {}
    for f in files:
        if f.endswith(".safetensors"):
            merged.update(read_safetensors(f, "F32"))
    for name, p in model.named_parameters():
        assert torch.equal(merged[name], p.detach()), name


def test_unnamed_params_load_loudly_and_buffers_stay_the_models(tmp_path):
    """An optimizer built from unnamed params saves param.0 ... param.N, which a
    strict=False load matched to nothing, silently: state_dict_from_checkpoint warns.
    The documented load (update the model's state_dict) keeps buffers and works
    with named params."""
    import warnings

    import torch
    from strata.torch import OffloadAdam, state_dict_from_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model(torch.randn(8, 4)).sum().backward()  # BatchNorm's running stats move
    with OffloadAdam(list(model.parameters()), lr=0.1) as opt:
        opt.step()
        opt.save_checkpoint(tmp_path / "unnamed")
    with pytest.warns(UserWarning, match="params without names"):
        sd = state_dict_from_checkpoint(tmp_path / "unnamed", dtype="bf16")
    assert list(sd) == ["param.0", "param.1", "param.2", "param.3"]
    assert all(t.dtype == torch.bfloat16 for t in sd.values())

    with OffloadAdam(model.named_parameters(), lr=0.1) as opt:
        opt.step()
        opt.save_checkpoint(tmp_path / "named")
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    fresh[1].running_mean.copy_(model[1].running_mean)  # buffers come from the model's save
    weights = fresh.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        weights.update(state_dict_from_checkpoint(tmp_path / "named"))
    fresh.load_state_dict(weights)
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(fresh[1].running_mean, model[1].running_mean)
    with pytest.raises(ValueError, match="force='no'"):
        strata.torch.export_checkpoint(tmp_path / "named", tmp_path / "x.safetensors", force="no")


def test_an_fp16_export_says_which_values_overflow(tmp_path, caplog):
    """Values beyond float16's range became inf in the file without a word."""
    import logging
    caplog.set_level(logging.WARNING, logger="strata")
    w = torch.nn.Parameter(torch.zeros(10))
    with OffloadAdam([("w", w)], lr=0.0) as opt:
        with torch.no_grad():
            w[3], w[7] = 1e5, -7e4  # beyond +-65504
        opt.reload_params()
        opt.step()
        opt.save_checkpoint(tmp_path / "ckpt")
    export_checkpoint(tmp_path / "ckpt", tmp_path / "m16.safetensors", dtype="fp16")
    warned = [r.getMessage() for r in caplog.records if "beyond" in r.getMessage()]
    assert len(warned) == 1 and "2 of the 10 values of tensor 'w'" in warned[0], warned
    caplog.clear()
    export_checkpoint(tmp_path / "ckpt", tmp_path / "m.safetensors", dtype="bf16")
    assert not [r for r in caplog.records if "beyond" in r.getMessage()]


def test_an_export_counts_the_finite_values_that_overflow_anywhere_in_a_tensor(tmp_path, caplog):
    """The count is taken over the vectorized body and the tail of a long
    tensor alike; values that were inf already, and NaNs, are not counted."""
    import logging
    caplog.set_level(logging.WARNING, logger="strata")
    w = torch.nn.Parameter(torch.zeros(1003))
    big = torch.finfo(torch.float32).max  # finite; inf in bf16 (round to nearest even)
    with OffloadAdam([("w", w)], lr=0.0) as opt:
        with torch.no_grad():
            w[3], w[500], w[1002] = 1e5, -7e4, 7e4  # beyond fp16's +-65504 only
            w[64], w[1001] = big, -big
            w[100], w[101], w[1000] = float("inf"), float("-inf"), float("nan")
        opt.reload_params()
        opt.save_checkpoint(tmp_path / "ckpt")
    expected = {"fp16": 5, "bf16": 2}
    for dtype, n in expected.items():
        caplog.clear()
        out = tmp_path / f"m-{dtype}.safetensors"
        export_checkpoint(tmp_path / "ckpt", out, dtype=dtype)
        warned = [r.getMessage() for r in caplog.records if "beyond" in r.getMessage()]
        assert len(warned) == 1 and f"{n} of the 1003 values of tensor 'w'" in warned[0], warned
        got = read_safetensors(out, {"fp16": "F16", "bf16": "BF16"}[dtype])["w"]
        want = w.detach().to(got.dtype)
        assert torch.equal(got.view(torch.int16)[~want.isnan()], want.view(torch.int16)[~want.isnan()])
        assert got[1000].isnan() and got.isinf().sum() == n + 2


class Interrupted(Exception):
    pass


def test_a_signal_stops_an_export_and_leaves_nothing(tmp_path):
    """Ctrl-C (any signal whose handler raises) stops a long export between buffers:
    the exception propagates, and the file being written and the shards sealed
    before it are removed (the export ran to the end, then raised)."""
    import signal
    import threading
    import time
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(16)])
    opt = OffloadAdam(model.named_parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    opt.save_checkpoint(ckpt)
    opt.close()
    out.mkdir()
    (out / "README.md").write_text("the user's")
    seen = {}

    def handler(signum, frame):
        # Raise only inside the export: while a shard is being written after at
        # least one was sealed (two temporaries: what is on disk then must go).
        names = os.listdir(out)
        if sum(".tmp-" in n for n in names) >= 2:
            seen["at"] = sorted(names)
            raise Interrupted()

    done = threading.Event()

    def sender():
        while not done.is_set():
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.002)

    old = signal.signal(signal.SIGUSR1, handler)
    thread = threading.Thread(target=sender)
    try:
        thread.start()
        with pytest.raises(Interrupted):
            export_checkpoint(ckpt, out, max_shard_size=8 << 20)  # 8 shards of 8 MiB
    finally:
        done.set()
        thread.join()
        signal.signal(signal.SIGUSR1, old)
    assert "at" in seen, "the signal was never handled inside the export"
    assert sorted(os.listdir(out)) == ["README.md"], f"left {os.listdir(out)} (at {seen['at']})"
    files = export_checkpoint(ckpt, out, max_shard_size=8 << 20)  # the re-run needs no force
    assert len(files) == 9
