"""Misuse loses nothing: a step that failed part way, state that comes in
(validated whole before anything is written), two optimizers on one
nvme_path, bad numbers, and the export to a model that load_state_dict takes."""
import copy
import json
import math
import os
import re
import threading
import warnings

import pytest
import torch

import strata
from strata.torch import OffloadAdam, StrataError, export_checkpoint, state_dict_from_checkpoint

from safetensors_file import NAMES, read_safetensors

ATOL, RTOL = 2e-6, 1e-5


class Net(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(12, 32)
        self.b = torch.nn.Linear(32, 5)
        self.to(dtype)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def batch(seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 12, generator=g).to(dtype), torch.randn(16, 5, generator=g).to(dtype)


def backward(model, seed=1):
    x, y = batch(seed, next(model.parameters()).dtype)
    torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()


def train(model, opt, steps, seed0=0):
    for s in range(steps):
        backward(model, seed0 + s)
        opt.step()
        opt.zero_grad()


def nvme(tmp_path, name="nvme"):
    path = tmp_path / name
    path.mkdir(exist_ok=True)
    return {"offload": "nvme", "nvme_path": str(path), "sub_group_size": 128}


def state_file(opt_kwargs):
    return os.path.join(opt_kwargs["nvme_path"], "strata-rank0.state")


class Corrupt:
    """Flips the headers of both slots of NVMe extent 0. Steps alternate the order of
    their NVMe sub-groups (each starts with the extents still in the buffers), and an
    odd step (the third here) takes them last first: it reads extent 0 last and fails
    on it after the others were updated. restore() undoes it (a transient fault: a
    retry then succeeds)."""

    def __init__(self, path):
        self.path = path
        with open(path, "rb") as f:
            sb = json.loads(f.read(4096).rstrip(b"\0"))
        block = sb["block_bytes"]  # the superblock and every slot are padded to blocks
        slot = (4096 + (sb["extent_bytes"] + 4095) // 4096 * 4096 + block - 1) // block * block
        assert sb["num_extents"] > 4, "extent 0 must be read, not still in a buffer"
        first = block
        self.ranges = [(first, 64), (first + slot, 64)]
        self.saved = []
        with open(path, "r+b") as f:
            for off, n in self.ranges:
                f.seek(off)
                self.saved.append(f.read(n))
                f.seek(off)
                f.write(bytes(b ^ 0xFF for b in self.saved[-1]))

    def restore(self):
        with open(self.path, "r+b") as f:
            for (off, _), data in zip(self.ranges, self.saved):
                f.seek(off)
                f.write(data)


# ---- A step that fails part way ----------------------------------------------------

def test_a_failed_step_refuses_step_state_dict_and_save_until_retried(tmp_path):
    kw = nvme(tmp_path)
    model, ref_model = Net(), Net()
    opt = OffloadAdam(model.parameters(), lr=1e-2, **kw)
    ref = OffloadAdam(ref_model.parameters(), lr=1e-2, **nvme(tmp_path, "ref"))
    assert opt.plan()["nvme_sub_groups"] >= 3
    train(model, opt, 2)
    train(ref_model, ref, 2)

    fault = Corrupt(state_file(kw))
    backward(model, 2)
    with pytest.raises(strata.StrataError, match="retry_step"):
        opt.step()
    assert opt.step_failed
    assert opt.step_count == 2
    # Nothing that would mix two steps, or apply the kept grads again silently.
    for call in (opt.step, opt.state_dict, lambda: opt.save_checkpoint(tmp_path / "never"),
                 lambda: list(opt.iter_state())):
        with pytest.raises(strata.StrataError,
                           match=r"step 3 failed part way.*retry_step\(\).*load_checkpoint"):
            call()
    assert not (tmp_path / "never").exists()
    # A new backward does not change what the retry applies: the kept grads;
    # nor does a param moved to new storage meanwhile (the old one is freed).
    opt.zero_grad()
    backward(model, 99)
    first = next(model.parameters())
    first.data = first.data.clone()
    fault.restore()
    opt.retry_step()
    assert not opt.step_failed and opt.step_count == 3
    opt.zero_grad()
    backward(ref_model, 2)
    ref.step()
    ref.zero_grad()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b), "the retried step is bitwise the clean run's"
    train(model, opt, 1, 3)  # and training goes on
    with pytest.raises(strata.StrataError, match="no step failed"):
        opt.retry_step()


def test_a_failed_step_is_recovered_by_loading_a_checkpoint(tmp_path):
    kw = nvme(tmp_path)
    model = Net()
    opt = OffloadAdam(model.named_parameters(), lr=1e-2, **kw)
    train(model, opt, 2)
    opt.save_checkpoint(tmp_path / "ckpt")
    saved = [p.detach().clone() for p in model.parameters()]
    Corrupt(state_file(kw))  # a lasting fault: the retry fails too
    backward(model)
    with pytest.raises(strata.StrataError):
        opt.step()
    with pytest.raises(strata.StrataError):
        opt.retry_step()
    assert opt.step_failed
    opt.load_checkpoint(tmp_path / "ckpt")  # rewrites every extent
    assert not opt.step_failed and opt.step_count == 2
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), saved))
    opt.zero_grad()
    train(model, opt, 1)
    assert opt.step_count == 3


def test_a_failed_step_recovered_by_load_state_dict_rewrites_the_params(tmp_path):
    """The failed step had written some params already: a state_dict() load puts
    them back with the master weights, and the next step is the clean run's."""
    kw = nvme(tmp_path)
    model, ref_model = Net(), Net()
    opt = OffloadAdam(model.parameters(), lr=1e-2, **kw)
    ref = OffloadAdam(ref_model.parameters(), lr=1e-2, **nvme(tmp_path, "ref"))
    train(model, opt, 2)
    train(ref_model, ref, 2)
    sd = opt.state_dict()
    saved = [p.detach().clone() for p in model.parameters()]
    Corrupt(state_file(kw))  # a lasting fault
    backward(model, 2)
    with pytest.raises(strata.StrataError, match=r"(?s)DataLoss.*load_checkpoint\(\) or "
                                                 r"load_state_dict\(\) replaces"):
        opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), saved)), \
        "the failed step wrote some params (else this test shows nothing)"
    opt.load_state_dict(sd)
    assert not opt.step_failed
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), saved))
    opt.zero_grad()
    train(model, opt, 1, 2)
    train(ref_model, ref, 1, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


# ---- State that comes in is validated before anything is written --------------------

def test_load_state_dict_checks_everything_before_writing(tmp_path):
    model = Net()
    opt = OffloadAdam(model.parameters(), lr=1e-2, **nvme(tmp_path))
    train(model, opt, 2)
    good = opt.state_dict()
    train(model, opt, 1)
    before = opt.state_dict()

    def broken(edit):
        sd = {"state": {"strata": dict(good["state"]["strata"])},
              "param_groups": [dict(g) for g in good["param_groups"]]}
        edit(sd["state"]["strata"], sd["param_groups"])
        return sd

    cases = [
        (lambda s, g: s.update(arrays=s["arrays"][:-1]), "state arrays for"),
        (lambda s, g: s.update(arrays=s["arrays"][:-1] + [s["arrays"][-1][:-1]]),
         "state array .* needs"),
        (lambda s, g: s.update(arrays=[a.double() for a in s["arrays"]]), "torch.float64"),
        (lambda s, g: s.update(arrays=s["arrays"][:-1] + ["x"]), "is a str"),
        (lambda s, g: s.update(step=-1), "step -1 is negative"),
        (lambda s, g: s.update(step="3"), "step is '3'"),
        (lambda s, g: s.update(loss_scaler={**s["loss_scaler"], "scale": -1.0}), "scale -1"),
        (lambda s, g: s.pop("loss_scaler"), "no loss_scaler"),
        (lambda s, g: g[0].update(lr=float("inf")), r"param_groups\[0\]: lr is inf"),
        (lambda s, g: g[0].update(betas=(0.9, 1.5)), r"betas\[1\] is 1.5"),
        # A refused flag was copied into param_groups after the state was written,
        # then failed the load and every step after it.
        (lambda s, g: g[0].update(maximize=True),
         r"load_state_dict: param_groups\[0\] has maximize=True"),
        (lambda s, g: g[0].update(amsgrad=True),
         r"load_state_dict: param_groups\[0\] has amsgrad=True"),
    ]
    for edit, message in cases:
        with pytest.raises(ValueError, match=message):
            opt.load_state_dict(broken(edit))
        assert not any(g.get(flag) for g in opt.param_groups for flag in ("maximize", "amsgrad"))
        after = opt.state_dict()
        assert after["state"]["strata"]["step"] == before["state"]["strata"]["step"]
        for a, b in zip(after["state"]["strata"]["arrays"], before["state"]["strata"]["arrays"]):
            assert torch.equal(a, b), f"{message}: the state was partly written"
    opt.load_state_dict(good)
    assert opt.step_count == 2


def test_a_torch_adamw_state_dict_loads_and_training_continues_alike():
    """Switching optimizers mid-run: torch AdamW for 3 steps, then OffloadAdam from its
    state_dict, side by side with AdamW going on."""
    m_ref, m_ours = Net(), Net()
    groups = lambda m: [{"params": [m.a.weight, m.b.weight], "weight_decay": 0.1},  # noqa
                        {"params": [m.a.bias, m.b.bias], "weight_decay": 0.0, "lr": 3e-3}]
    ref = torch.optim.AdamW(groups(m_ref), lr=1e-2, betas=(0.8, 0.99))
    train(m_ref, ref, 3)
    m_ours.load_state_dict(m_ref.state_dict())
    ours = OffloadAdam(groups(m_ours), lr=5e-2)
    ours.load_state_dict(ref.state_dict())
    assert ours.step_count == 3
    assert ours.param_groups[0]["lr"] == 1e-2 and ours.param_groups[0]["betas"] == (0.8, 0.99)
    for s in range(5):
        for model, opt in ((m_ref, ref), (m_ours, ours)):
            backward(model, 10 + s)
            opt.step()
            opt.zero_grad()
        for a, b in zip(m_ours.parameters(), m_ref.parameters()):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)

    amsgrad = torch.optim.Adam(groups(Net()), amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad=True"):
        ours.load_state_dict(amsgrad.state_dict())
    bad = ref.state_dict()
    bad["state"][0]["step"] = torch.tensor(7.0)
    with pytest.raises(ValueError, match="different numbers of steps"):
        ours.load_state_dict(bad)
    bad = ref.state_dict()
    bad["state"][1]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match="exp_avg is not a float tensor of 160 elements"):
        ours.load_state_dict(bad)


def test_a_newer_torch_state_dict_of_the_other_decay_rule_is_refused():
    """Newer torch writes decoupled_weight_decay into every Adam/AdamW group. A
    torch.optim.Adam (L2 decay) state_dict loaded into the default OffloadAdam (AdamW)
    used to go on under decoupled decay with the saved weight_decay, silently."""
    m_ref = Net()
    ref = torch.optim.Adam(m_ref.parameters(), lr=1e-2, weight_decay=0.1)
    train(m_ref, ref, 2)

    def saved(decoupled, weight_decay=0.1):
        sd = ref.state_dict()
        for g in sd["param_groups"]:
            g.update(decoupled_weight_decay=decoupled, weight_decay=weight_decay)
        return sd

    ours = OffloadAdam(Net().parameters(), lr=1e-2)
    before = [t.clone() for _, _, t in ours.iter_state()]
    with pytest.raises(ValueError) as e:
        ours.load_state_dict(saved(False))
    assert ("param_groups[0] was saved by torch.optim.Adam with L2 decay "
            "(decoupled_weight_decay=False) with weight_decay 0.1; this optimizer runs AdamW "
            "(adamw=True)") in str(e.value)
    assert "Build OffloadAdam with adamw=False" in str(e.value)
    assert ours.step_count == 0 and ours.param_groups[0]["weight_decay"] == 0.0
    assert all(torch.equal(a, b) for a, (_, _, b) in zip(before, ours.iter_state()))
    l2 = OffloadAdam(Net().parameters(), lr=1e-2, adamw=False)
    with pytest.raises(ValueError, match=r"saved by torch.optim.AdamW \(decoupled_weight_decay="
                       r"True\) with weight_decay 0.1; this optimizer runs Adam with L2 decay"):
        l2.load_state_dict(saved(True))
    # The same rule, or no decay on either side: both load.
    l2.load_state_dict(saved(False))
    ours.load_state_dict(saved(True))
    ours.close()
    ours = OffloadAdam(Net().parameters(), lr=1e-2)
    ours.load_state_dict(saved(False, weight_decay=0.0))
    assert ours.step_count == 2


# ---- Two optimizers on one nvme_path -------------------------------------------------

# A host budget that holds all the state: no byte on NVMe, the directory still its own.
@pytest.mark.parametrize("budget", [None, "64MiB"], ids=["state_on_nvme", "state_in_dram"])
def test_two_optimizers_on_one_nvme_path_are_refused_naming_it(tmp_path, budget):
    kw = nvme(tmp_path)
    if budget is not None:
        kw["host_budget"] = budget
    g_model, d_model = Net(), Net()
    gen = OffloadAdam(g_model.parameters(), lr=1e-2, **kw)
    assert (gen.plan()["nvme_sub_groups"] > 0) == (budget is None)
    train(g_model, gen, 1)
    before = [p.detach().clone() for p in g_model.parameters()]
    with pytest.raises(strata.StrataError, match=rf"(?s){kw['nvme_path']}/strata-rank0.lock: "
                                                 rf"held by this process \(pid {os.getpid()}\)"
                                                 r".*own nvme_path.*call its close\(\)"):
        OffloadAdam(d_model.parameters(), lr=1e-2, **kw)
    # The first one's state was not truncated: it trains on as if alone.
    twin_model = Net()
    twin = OffloadAdam(twin_model.parameters(), lr=1e-2, **nvme(tmp_path, "twin"))
    train(twin_model, twin, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, twin_model.parameters()))
    train(g_model, gen, 1, 1)
    train(twin_model, twin, 1, 1)
    assert all(torch.equal(a, b) for a, b in zip(g_model.parameters(), twin_model.parameters()))
    # Its own directory each: fine. Once the first is gone, the directory is free.
    OffloadAdam(d_model.parameters(), lr=1e-2, **nvme(tmp_path, "disc"))
    del gen
    OffloadAdam(d_model.parameters(), lr=1e-2, **kw)


# ---- Numbers checked where they enter --------------------------------------------------

def test_bad_numbers_are_named():
    w = torch.nn.Parameter(torch.randn(4))
    for kwargs, message in [
        ({"lr": float("inf")}, "lr is inf"),
        ({"lr": float("nan")}, "lr is nan"),
        ({"eps": 0.0}, r"eps is 0.0; it must be finite and in \[1.2e-38, 3.4e38\]"),
        # Text is no number, though float() reads it (torch.optim refuses it too).
        ({"lr": "0.1"}, "lr is '0.1'; it must be a number"),
        ({"betas": (0.9, "0.99")}, r"betas\[1\] is '0.99'; it must be a number"),
        ({"betas": (0.9, 1.0)}, r"betas\[1\] is 1.0"),
        ({"weight_decay": -0.1}, "weight_decay is -0.1"),
        ({"max_grad_norm": float("inf")}, "max_grad_norm=inf"),
        ({"config": {"optimizer": {"params": {"lr": float("inf")}}}},
         "config optimizer.params.lr = inf"),
        ({"config": {"fp16": {"loss_scale": float("nan")}}}, "config fp16.loss_scale = nan"),
    ]:
        with pytest.raises(ValueError, match=message):
            OffloadAdam([w], **kwargs)
    with pytest.raises(ValueError, match=r"param_groups\[1\]: lr is inf"):
        OffloadAdam([{"params": [w]}, {"params": [torch.nn.Parameter(torch.randn(2))],
                                        "lr": float("inf")}])
    opt = OffloadAdam([w])
    opt.param_groups[0]["eps"] = float("nan")  # e.g. a scheduler gone wrong
    w.grad = torch.ones(4)
    with pytest.raises(ValueError, match=r"param_groups\[0\]: eps is nan"):
        opt.step()
    opt.param_groups[0]["eps"] = "1e-8"
    with pytest.raises(ValueError, match=r"param_groups\[0\]: eps is '1e-8'; it must be a number"):
        opt.step()
    # A key taken out of a group: named, not a bare KeyError.
    opt.param_groups[0]["eps"] = 1e-8
    del opt.param_groups[0]["weight_decay"]
    with pytest.raises(ValueError, match=r"param_groups\[0\]: has no weight_decay; every param "
                                         r"group needs lr, betas, eps and weight_decay"):
        opt.step()
    opt.param_groups[0]["weight_decay"] = 0.0
    opt.step()


def test_numbers_the_fp32_update_cannot_take_are_named_in_the_users_terms():
    """The engine refuses what is finite in double but not usable in the fp32 update;
    its message named its own group index (0 when a frozen group came first) and
    "beta2". The plug-in applies the same rules first and names param_groups[i] and
    betas[1]."""
    frozen = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    w = torch.nn.Parameter(torch.zeros(3))
    opt = OffloadAdam([{"params": [frozen]}, {"params": [w]}])
    w.grad = torch.ones(3)
    for key, value, message in [
        ("eps", 1e-45, r"param_groups\[1\]: eps is 1e-45; it must be finite and in "
                       r"\[1.2e-38, 3.4e38\]"),
        ("betas", (0.9, 0.99999999999), r"param_groups\[1\]: betas\[1\] is 0.99999999999; "
                                        r"it must be in \[0, 1\), and below 1 in fp32"),
        ("lr", 1e39, r"param_groups\[1\]: lr is 1e\+39"),
        ("weight_decay", 1e39, r"param_groups\[1\]: weight_decay is 1e\+39"),
    ]:
        good = opt.param_groups[1][key]
        opt.param_groups[1][key] = value
        with pytest.raises(ValueError, match=message):
            opt.step()
        opt.param_groups[1][key] = good
    opt.step()
    with pytest.raises(ValueError, match=r"param_groups\[1\]: lr is 1e\+39"):
        OffloadAdam([{"params": [frozen]}, {"params": [torch.nn.Parameter(torch.zeros(2))],
                                             "lr": 1e39}])


def test_engine_errors_name_the_argument_that_set_the_key():
    w = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(strata.InvalidArgumentError,
                       match=r'(?s)strata.host_budget = "lots".*\nOffloadAdam: strata.host_budget '
                             r"is the host_budget= argument \('lots'\)"):
        OffloadAdam([w], host_budget="lots")
    # Set in config, the key is what the user wrote: no argument is named.
    with pytest.raises(strata.InvalidArgumentError) as e:
        OffloadAdam([w], config={"strata": {"host_budget": "lots"}})
    assert "argument" not in str(e.value)


def test_nvme_path_without_nvme_offload_warns(tmp_path):
    w = torch.nn.Parameter(torch.randn(4))
    with pytest.warns(UserWarning, match=r"nvme_path is given but the state is offloaded to "
                                         r"'cpu': nothing is written there; pass offload='nvme'"):
        OffloadAdam([w], nvme_path=str(tmp_path)).close()
    assert os.listdir(tmp_path) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the config's device is nvme: no warning
        OffloadAdam([w], nvme_path=str(tmp_path), config={
            "zero_optimization": {"offload_optimizer": {"device": "nvme"}}}).close()


def test_more_threads_than_cores_run_on_the_cores_and_say_so(capfd):
    cores = len(os.sched_getaffinity(0))
    w = torch.nn.Parameter(torch.randn(4))
    opt = OffloadAdam([w], threads=cores + 8)
    w.grad = torch.ones(4)
    opt.step()
    assert opt.engine_config["strata"]["threads"] == cores
    err = capfd.readouterr().err
    assert "TBB Warning" not in err  # oneTBB's own complaint, once printed on stderr


def test_duplicate_nvme_paths_get_their_own_message(tmp_path):
    w = torch.nn.Parameter(torch.randn(4))
    d = str(tmp_path)
    with pytest.raises(strata.InvalidArgumentError, match="is listed twice"):
        OffloadAdam([w], offload="nvme", nvme_path=[d, d])
    # Another spelling of the same directory meets the lock.
    with pytest.raises(strata.StrataError, match="listed twice in nvme_path"):
        OffloadAdam([w], offload="nvme", nvme_path=[d, d + "/."])


def test_hugging_face_auto_values_are_filled_from_the_arguments():
    """The shape of Hugging Face's DeepSpeed ZeRO config examples."""
    config = {
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
                 "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                     "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                "pin_memory": True},
                              "allgather_partitions": True, "allgather_bucket_size": 2e8,
                              "overlap_comm": True, "reduce_scatter": True,
                              "reduce_bucket_size": "auto", "contiguous_gradients": True,
                              "sub_group_size": "auto"},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "steps_per_print": 2000, "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
    }
    model = Net(torch.bfloat16)
    opt = OffloadAdam(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-6,
                      weight_decay=0.1, max_grad_norm=1.0, config=config)
    cfg = opt.engine_config
    assert cfg["optimizer"]["params"]["lr"] == 3e-4
    assert cfg["optimizer"]["params"]["betas"] == [0.9, 0.95]
    assert cfg["optimizer"]["params"]["weight_decay"] == 0.1
    assert cfg["gradient_clipping"] == 1.0
    assert cfg["bf16"]["enabled"] is True
    assert cfg["zero_optimization"]["sub_group_size"] == "auto", "the planner picks it"
    assert config["optimizer"]["params"]["lr"] == "auto", "the caller's dict is not changed"
    train(model, opt, 1)
    with pytest.raises(strata.InvalidArgumentError, match="auto"):
        OffloadAdam(Net().parameters(), config={"aio": {"queue_depth": "auto"}})
    # Those it cannot fill are named in one error.
    with pytest.raises(strata.InvalidArgumentError,
                       match=r'2 values are "auto".*: aio.block_size, aio.queue_depth$'):
        OffloadAdam(Net().parameters(), config={"aio": {"queue_depth": "auto",
                                                        "block_size": "auto"}})


def test_config_hyperparameters_win_over_the_arguments():
    """A DeepSpeed config's numbers are the run's: they train, they are the groups'
    defaults (a scheduler sees them), and a group's own value still wins."""
    config = {"optimizer": {"params": {"lr": 0.05, "weight_decay": 0.3, "betas": [0.8, 0.9],
                                       "eps": 1e-6}}}
    runs = []
    for kwargs in ({"config": config},
                   {"lr": 0.05, "weight_decay": 0.3, "betas": (0.8, 0.9), "eps": 1e-6}):
        model = Net()
        opt = OffloadAdam(model.parameters(), **kwargs)
        g = opt.param_groups[0]
        assert (g["lr"], g["weight_decay"], tuple(g["betas"]), g["eps"]) == (
            0.05, 0.3, (0.8, 0.9), 1e-6), g
        train(model, opt, 3)
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    model = Net()
    opt = OffloadAdam([{"params": [model.a.weight], "lr": 0.2}, {"params": [model.b.weight]}],
                      lr=1e-3, config=config)
    assert [g["lr"] for g in opt.param_groups] == [0.2, 0.05]
    assert opt.engine_config["optimizer"]["params"]["lr"] == 0.05
    with pytest.raises(ValueError, match=r"config optimizer.params: lr is -1.0"):
        OffloadAdam(Net().parameters(), config={"optimizer": {"params": {"lr": -1.0}}})


def test_arguments_of_the_wrong_kind_are_refused_naming_them():
    params = list(Net().parameters())
    for kwargs, match in [({"sub_group_size": 1.5}, "sub_group_size=1.5"),
                          ({"sub_group_size": "1M"}, "sub_group_size='1M'"),
                          ({"sub_group_size": 0}, "sub_group_size=0"),
                          ({"threads": 1.5}, "threads=1.5"),
                          ({"threads": True}, "threads=True"),
                          ({"adamw": "no"}, "adamw='no'"),
                          ({"config": [1]}, "config is a list"),
                          ({"config": "{not json"}, "config is not valid JSON"),
                          ({"lr": torch.tensor([0.1, 0.2])}, "lr is a tensor of 2")]:
        with pytest.raises((ValueError, TypeError), match=match):
            OffloadAdam(params, **kwargs)
    # What is whole is taken: 1e3 elements, a numpy-like integer, a one-element lr tensor.
    opt = OffloadAdam(params, sub_group_size=1e3, threads=1, lr=torch.tensor(0.01))
    assert opt.engine_config["zero_optimization"]["sub_group_size"] == 1000
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)


def test_a_json_config_that_repeats_a_key_is_refused_naming_its_path(tmp_path):
    """json.loads keeps a repeated key's last value: a setting would vanish unseen. The
    engine's parser (and DeepSpeed) refuse it; a JSON string given to OffloadAdam too."""
    params = list(Net().parameters())
    for text, path in [('{"gradient_clipping": 0.5, "gradient_clipping": 0.0}',
                        "gradient_clipping"),
                       ('{"optimizer": {"params": {"lr": 1e-4, "lr": 1e-2}}}',
                        "optimizer.params.lr"),
                       ('{"strata": {"rates": {"pcie": 1, "pcie": 2}}}', "strata.rates.pcie"),
                       ('{"zero_optimization": {"offload_optimizer": {"nvme_path": '
                        '[{"a": 1, "a": 2}]}}}',
                        "zero_optimization.offload_optimizer.nvme_path[0].a")]:
        with pytest.raises(ValueError, match=rf"the key {re.escape(path)} appears more than "
                                             "once in its object"):
            OffloadAdam(params, config=text)
        with pytest.raises(ValueError, match="appears more than once"):
            OffloadAdam(params, config=text.encode())
    # The same key in different objects is fine.
    opt = OffloadAdam(params, config='{"fp16": {"enabled": false}, "bf16": {"enabled": false},'
                                     ' "optimizer": {"params": {"lr": 0.5}}}')
    assert opt.engine_config["optimizer"]["params"]["lr"] == 0.5
    opt.close()
    # A deeply nested document is a ValueError, not a RecursionError.
    with pytest.raises(ValueError, match="nested too deeply"):
        OffloadAdam(params, config="[" * 200_000 + "]" * 200_000)
    # A file name is not JSON: the message says to pass the text.
    path = tmp_path / "ds_config.json"
    path.write_text('{"gradient_clipping": 1.0}')
    with pytest.raises(ValueError, match=r"is a file: pass its text"):
        OffloadAdam(params, config=str(path))


def test_optimizer_type_is_read_in_any_case_as_the_engine_does():
    params = list(Net().parameters())
    opt = OffloadAdam(params, config={"optimizer": {"type": "adamw"}})
    assert opt.engine_config["optimizer"]["type"] == "AdamW"
    opt.close()
    opt = OffloadAdam(params, config={"optimizer": {"type": "ADAM",
                                                    "params": {"adam_w_mode": False}}})
    assert opt.engine_config["optimizer"]["type"] == "Adam"
    opt.close()
    for opt_type in ("Lion", "Lamb", 3):
        with pytest.raises(ValueError, match=r"runs only Adam and AdamW \(any case\)"):
            OffloadAdam(params, config={"optimizer": {"type": opt_type}})
    with pytest.raises(ValueError, match=r"config optimizer = \[.*expected an object"):
        OffloadAdam(params, config={"optimizer": [{"type": "AdamW"}]})


def test_sub_group_size_auto_is_the_planners_choice():
    w = torch.zeros(9 << 20, requires_grad=True)
    opt = OffloadAdam([w], sub_group_size="auto")
    sizes = [end - begin for begin, end in opt._engine.sub_groups()]
    assert sizes[:2] == [4 << 20, 4 << 20] and len(sizes) == 3, sizes  # at least 4 Mi each
    assert opt.engine_config["zero_optimization"]["sub_group_size"] == "auto"
    assert opt.plan()["host_sub_groups"] == 3


def test_add_param_group_is_refused_with_a_way_out():
    model = Net()
    opt = OffloadAdam([model.a.weight])
    with pytest.raises(RuntimeError, match="lr=0.*whose state starts anew") as e:
        opt.add_param_group({"params": [model.b.weight]})
    # It once offered save_checkpoint()/load_checkpoint() to carry the state over,
    # which a checkpoint of other params refuses.
    assert "save_checkpoint" not in str(e.value)


# ---- Bounded state_dict and exports -----------------------------------------------------

def test_state_dict_dir_keeps_state_dicts_small_and_resumes_exactly(tmp_path):
    model = Net()
    opt = OffloadAdam(model.named_parameters(), lr=1e-2, state_dict_dir=tmp_path / "sd",
                      **nvme(tmp_path))
    train(model, opt, 2)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ck.pt")
    assert os.path.getsize(tmp_path / "ck.pt") < os.path.getsize(tmp_path / "sd") + 64 * 1024
    sd = torch.load(tmp_path / "ck.pt")["optimizer"]
    assert sd["state"]["strata"]["kind"] == "checkpoint"
    assert not any(isinstance(v, torch.Tensor) for v in sd["state"]["strata"].values())
    train(model, opt, 3, 2)

    fresh = Net()
    fresh.load_state_dict(torch.load(tmp_path / "ck.pt")["model"])
    fresh_opt = OffloadAdam(fresh.named_parameters(), lr=1e-2, **nvme(tmp_path, "fresh"))
    fresh_opt.load_state_dict(sd)
    assert fresh_opt.step_count == 2
    train(fresh, fresh_opt, 3, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))

    # Two more state_dict()s rotate that save out (the newest two are kept): the old
    # dict is refused saying so, not "no such directory; pass the directory given to Save".
    opt.state_dict()
    opt.state_dict()
    assert not os.path.isdir(sd["state"]["strata"]["checkpoint"])
    step = fresh_opt.step_count
    with pytest.raises(ValueError, match="which no longer exists .*keeps the newest two saves"):
        fresh_opt.load_state_dict(sd)
    assert fresh_opt.step_count == step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_export_loads_into_the_model(tmp_path, dtype):
    model = Net()
    opt = OffloadAdam(model.named_parameters(), lr=1e-2, **nvme(tmp_path))
    train(model, opt, 3)
    opt.save_checkpoint(tmp_path / "ckpt")
    files = export_checkpoint(tmp_path / "ckpt", tmp_path / "model.safetensors", dtype=dtype)
    assert files == [str(tmp_path / "model.safetensors")]
    tensors = read_safetensors(files[0], NAMES[dtype])
    other = Net(dtype)
    other.load_state_dict(tensors)  # strict: every name and shape matches
    for a, b in zip(other.parameters(), model.parameters()):
        assert torch.equal(a, b.detach().to(dtype))

    sd = state_dict_from_checkpoint(tmp_path / "ckpt", dtype=dtype)
    assert list(sd) == [n for n, _ in model.named_parameters()]
    assert all(torch.equal(sd[k], tensors[k]) for k in sd)
    # The fix names Python's argument too, not only the CLI's flag.
    with pytest.raises(strata.StrataError, match=r"exists.*force=True in Python"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "model.safetensors", dtype=dtype)
    export_checkpoint(tmp_path / "ckpt", tmp_path / "model.safetensors", dtype=dtype, force=True)


def test_sharded_export_has_a_hugging_face_index(tmp_path):
    model = Net()
    opt = OffloadAdam(model.named_parameters(), lr=1e-2)
    train(model, opt, 1)
    opt.save_checkpoint(tmp_path / "ckpt")
    files = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", max_shard_size="1KiB")
    index = json.load(open(tmp_path / "hf" / "model.safetensors.index.json"))
    assert files[-1] == str(tmp_path / "hf" / "model.safetensors.index.json")
    merged = {}
    for f in files[:-1]:
        merged.update(read_safetensors(f, "F32"))
    assert set(index["weight_map"]) == set(merged) == {n for n, _ in model.named_parameters()}
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in merged.values())
    Net().load_state_dict(merged)
    latest = open(tmp_path / "ckpt" / "latest.json").read()
    with pytest.raises(strata.StrataError, match="inside the checkpoint directory"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "ckpt" / "latest.json", force=True)
    assert open(tmp_path / "ckpt" / "latest.json").read() == latest
    with pytest.raises(strata.StrataError, match="not a directory"):
        export_checkpoint(tmp_path / "ckpt", "/dev/null", force=True)
    os.symlink("/dev/null", tmp_path / "null.safetensors")
    with pytest.raises(strata.StrataError, match="symbolic link, not a regular file"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "null.safetensors", force=True)


def test_a_checkpoint_load_checks_shapes_not_only_sizes(tmp_path):
    torch.manual_seed(0)
    a = torch.nn.Linear(8, 4)      # weight 4x8 = 32 elems
    b = torch.nn.Linear(4, 8)      # weight 8x4 = 32 elems, bias 8 != 4
    opt_a = OffloadAdam([a.weight], lr=1e-2)
    a.weight.grad = torch.ones_like(a.weight)
    opt_a.step()
    opt_a.save_checkpoint(tmp_path / "ckpt")
    opt_b = OffloadAdam([b.weight], lr=1e-2)
    before = b.weight.detach().clone()
    with pytest.raises(strata.StrataError, match=r"shape \[4, 8\] in the checkpoint, \[8, 4\] "
                                                 "here"):
        opt_b.load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(b.weight, before) and opt_b.step_count == 0


def test_a_second_thread_is_refused_while_one_drives_the_optimizer():
    """A background thread (a checkpoint saver, say) calling the optimizer while the
    training thread is inside step() is refused with StrataError naming step(); it never
    runs beside it. The training thread itself may call further methods (its closure's
    zero_grad()), and afterwards every thread may call again."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = OffloadAdam(model.parameters(), lr=1e-2)
    inside, release, errors = threading.Event(), threading.Event(), []

    def closure():
        opt.zero_grad()  # the same thread: allowed
        inside.set()
        release.wait(30)
        loss = model(torch.ones(2, 8)).sum()
        loss.backward()
        return loss

    def train():
        try:
            opt.step(closure)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=train)
    t.start()
    try:
        assert inside.wait(30)
        for call in (opt.state_dict, opt.zero_grad, opt.step):
            with pytest.raises(strata.StrataError,
                               match=rf"OffloadAdam.{call.__name__}: step\(\) is running in "
                                     "another thread"):
                call()
    finally:
        release.set()
        t.join(30)
    assert not errors
    assert opt.step_count == 1
    assert opt.state_dict()["state"]["strata"]["step"] == 1


def test_engine_calls_from_two_threads_never_run_at_once():
    """The engine under OffloadAdam releases the GIL in its calls: a call while another
    thread's runs is refused (the C++ side checks), never run beside it."""
    opt = OffloadAdam(torch.nn.Linear(64, 64).parameters(), lr=1e-2)
    engine, stop, seen = opt._engine, threading.Event(), []

    def spin():
        while not stop.is_set():
            try:
                engine.synchronize()
            except strata.StrataError as e:
                seen.append(str(e))

    t = threading.Thread(target=spin)
    t.start()
    try:
        for _ in range(20000):
            try:
                engine.step()
            except strata.StrataError as e:
                seen.append(str(e))
            if seen:
                break
    finally:
        stop.set()
        t.join(30)
    assert seen, "no call was ever refused"
    assert all("is running on this optimizer in another thread" in m for m in seen), seen


def test_iter_state_refuses_to_mix_two_steps():
    """A step between two sub-groups of iter_state() (here from the same thread) would
    give the rest from another step: the next sub-group raises instead."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = OffloadAdam(model.parameters(), lr=1e-2, sub_group_size=1024)
    states = opt.iter_state()
    first = next(states)
    assert first[0] == 0
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    with pytest.raises(strata.StrataError, match="after 1 of its sub-groups were read"):
        next(states)
    assert len(list(opt.iter_state())) > 1  # a fresh read, between steps, works


def test_what_torch_would_accept_and_offloadadam_cannot_run_is_refused():
    w, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match="iterable of Tensors"):
        OffloadAdam(w)
    # A set's order changes between runs (torch.optim refuses it too).
    for params in ({w}, [{"params": {w}}]):
        with pytest.raises(TypeError, match="params given as a set, whose order changes"):
            OffloadAdam(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's own duplicate warning comes too late to show
        with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] is the same "
                                             r"tensor as param_groups\[0\]\['params'\]\[0\]"):
            OffloadAdam([w, w])
    for flag in ("amsgrad", "maximize"):
        with pytest.raises(ValueError, match=rf"param_groups\[0\] has {flag}=True"):
            OffloadAdam([{"params": [w], flag: True}])
    opt = OffloadAdam([{"params": [w, b], "foreach": True}])  # a torch hint: harmless
    with pytest.raises(ValueError, match="already trained by another OffloadAdam"):
        OffloadAdam([b])
    opt.param_groups[0]["maximize"] = True
    with pytest.raises(ValueError, match=r"param_groups\[0\] has maximize=True"):
        opt.step()
    opt.param_groups[0]["maximize"] = False
    for key, value, message in (("lr", None, r"lr is None; it must be a number"),
                                ("betas", 0.9, r"betas is 0.9; give two numbers"),
                                ("betas", (0.9, "x"), r"betas\[1\] is 'x'; it must be a number")):
        good = opt.param_groups[0][key]
        opt.param_groups[0][key] = value
        with pytest.raises(ValueError, match=r"param_groups\[0\]: " + message):
            opt.step()
        opt.param_groups[0][key] = good
    opt.step()


def test_torch_positional_arguments_mean_what_they_mean_to_torch():
    """torch.optim.AdamW's 6th positional argument is amsgrad; OffloadAdam's was adamw,
    so AdamW(p, lr, betas, eps, wd, False) trained Adam with L2 decay, silently."""
    m_ours, m_ref = Net(), Net()
    ours = OffloadAdam(m_ours.parameters(), 1e-2, (0.9, 0.99), 1e-8, 0.5, False)
    ref = torch.optim.AdamW(m_ref.parameters(), 1e-2, (0.9, 0.99), 1e-8, 0.5, False)
    assert ours.engine_config["optimizer"]["params"]["adam_w_mode"]
    for model, opt in ((m_ours, ours), (m_ref, ref)):
        train(model, opt, 5)
    for p, q in zip(m_ours.parameters(), m_ref.parameters()):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL)
    w = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"OffloadAdam: amsgrad=True; OffloadAdam runs "
                                         r"Adam/AdamW without amsgrad: drop it"):
        OffloadAdam([w], 1e-2, (0.9, 0.99), 1e-8, 0.5, True)
    # The Strata arguments are keyword-only; keyword callers are unchanged.
    with pytest.raises(TypeError, match="positional argument"):
        OffloadAdam([w], 1e-2, (0.9, 0.99), 1e-8, 0.5, False, True)
    opt = OffloadAdam([w], lr=1e-2, weight_decay=0.5, adamw=False, max_grad_norm=1.0,
                      offload="cpu", amsgrad=False)
    assert not opt.engine_config["optimizer"]["params"]["adam_w_mode"]


@pytest.mark.parametrize("kwargs", [
    dict(amsgrad=False), dict(maximize=False), dict(capturable=False),
    dict(differentiable=False), dict(foreach=None), dict(foreach=True), dict(foreach=False),
    dict(fused=None), dict(fused=True), dict(fused=False),
    dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
         fused=None)])
def test_torch_keyword_arguments_are_accepted(kwargs):
    """Configs written for torch.optim.AdamW/Adam (hydra's _target_ swapped, a trainer's
    optimizer kwargs) raised TypeError even for torch's own defaults. The hints
    (foreach, fused) are ignored: training is torch's AdamW's."""
    m_ours, m_ref = Net(), Net()
    ours = OffloadAdam(m_ours.parameters(), lr=1e-2, weight_decay=0.1, **kwargs)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-2, weight_decay=0.1)
    for model, opt in ((m_ours, ours), (m_ref, ref)):
        train(model, opt, 3)
    for p, q in zip(m_ours.parameters(), m_ref.parameters()):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("flag", ["amsgrad", "maximize", "capturable", "differentiable"])
def test_torch_keyword_arguments_offloadadam_cannot_honour_are_refused_when_true(flag):
    w = torch.nn.Parameter(torch.zeros(3))
    message = (rf"OffloadAdam: {flag}=True; OffloadAdam runs Adam/AdamW without {flag}: drop it "
               r"\(or use torch.optim for this model\)")
    with pytest.raises(ValueError, match=message):
        OffloadAdam([w], lr=1e-2, **{flag: True})
    # The same in a group, at construction and at a step.
    with pytest.raises(ValueError, match=rf"param_groups\[0\] has {flag}=True; OffloadAdam"):
        OffloadAdam([{"params": [w], flag: True}])
    opt = OffloadAdam([w])
    opt.param_groups[0][flag] = True
    with pytest.raises(ValueError, match=rf"param_groups\[0\] has {flag}=True"):
        opt.step()
    if flag in ("capturable", "differentiable"):
        # A torch state_dict would give the groups the flag: refused before any write.
        model = Net()
        ref = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train(model, ref, 1)
        sd = ref.state_dict()
        sd["param_groups"][0][flag] = True
        ours = OffloadAdam(model.parameters(), lr=1e-2)
        with pytest.raises(ValueError, match=rf"has {flag}=True; .*: set "
                                             rf"state_dict\['param_groups'\]\[0\]\['{flag}'\] "
                                             r"= False"):
            ours.load_state_dict(sd)
        assert ours.step_count == 0


def test_copying_is_refused_and_close_releases_the_engine(tmp_path):
    model = Net()
    opt = OffloadAdam(model.parameters(), **nvme(tmp_path))
    for copy_it in (copy.deepcopy, copy.copy):
        with pytest.raises(TypeError, match="cannot be copied"):
            copy_it(opt)
    train(model, opt, 1)
    opt.close()
    with pytest.raises(StrataError, match=r"OffloadAdam.step: the optimizer was closed"):
        opt.step()
    opt.close()  # again: nothing to do
    # Its nvme_path and its params are free again, while the old object lives.
    with OffloadAdam(model.parameters(), **nvme(tmp_path)) as again:
        train(model, again, 1)
    with pytest.raises(StrataError, match=r"OffloadAdam.state_dict: the optimizer was closed"):
        again.state_dict()


@pytest.mark.parametrize("other_params", [False, True], ids=["same_params", "other_params"])
def test_an_optimizer_dropped_with_its_onecycle_scheduler_makes_room_for_a_new_one(
        other_params, tmp_path):
    """torch 1.13's OneCycleLR holds a bound method of itself: after `del opt, sched`
    both live on in a reference cycle until the cycle collector runs. A new optimizer
    over the same params, or over other params on the same nvme_path (whose lock the
    old one held), was refused as if the old one were in use."""
    import gc
    kw = nvme(tmp_path)
    first = Net()
    second = Net() if other_params else first
    opt = OffloadAdam(first.parameters(), lr=1e-2, **kw)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    train(first, opt, 1)
    gc.disable()  # as between two automatic collections
    try:
        del opt, sched
        opt = OffloadAdam(second.parameters(), lr=1e-2, **kw)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
        train(second, opt, 1)
        # Still referred to (by its scheduler here): refused, saying so.
        del opt
        if other_params:
            with pytest.raises(strata.StrataError, match=r"(?s)held by this process.*survived "
                                                         r"a garbage collection"):
                OffloadAdam(first.parameters(), lr=1e-2, **kw)
        else:
            with pytest.raises(ValueError, match=r"already trained by another OffloadAdam that "
                                                 r"is alive.*a scheduler or another object "
                                                 r"still refers to it"):
                OffloadAdam(first.parameters(), lr=1e-2)
    finally:
        gc.enable()


def test_a_monitor_thread_reads_the_properties_while_the_training_thread_steps():
    """Getters are not calls into the engine: a monitor thread reads the values as
    of the end of the last call (they used to read the engine's fields while a step
    wrote them), and is never refused."""
    model = Net()
    opt = OffloadAdam(model.parameters(), lr=1e-2)
    seen, errors, done = [], [], threading.Event()

    def monitor():
        try:
            while not done.is_set():
                seen.append(opt.step_count)
                last = opt.last_step()
                assert last["step"] <= opt.step_count
                assert opt.loss_scale == 1.0 and not opt.step_failed
        except Exception as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=monitor)
    t.start()
    try:
        train(model, opt, 20)
    finally:
        done.set()
        t.join()
    assert not errors, errors
    assert seen and seen == sorted(seen) and 0 <= seen[0] and seen[-1] <= 20
    assert opt.step_count == 20 and opt.last_step()["step"] == 20


def test_an_fp16_optimizer_keeps_its_loss_scale_when_loading_a_bf16_state_dict():
    """A bf16 optimizer's scaler is a static 1: loaded into an fp16 optimizer, fp16
    training ran unscaled (most small gradients flush to zero). It keeps its own."""
    bf16, fp16 = Net().to(torch.bfloat16), Net().half()
    src = OffloadAdam(bf16.parameters(), lr=1e-2)
    train(bf16, src, 1)
    dst = OffloadAdam(fp16.parameters(), lr=1e-2)
    initial = dst.loss_scale
    assert initial > 1.0
    dst.load_state_dict(src.state_dict())
    assert dst.loss_scale == initial and dst.step_count == 1


def test_duplicate_names_and_non_finite_counts_reach_python():
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    groups = [{"params": list(a.named_parameters())}, {"params": list(b.named_parameters())}]
    with pytest.raises(strata.InvalidArgumentError, match="'weight'"):
        OffloadAdam(groups)
    # The key safetensors keeps for metadata: refused here, not first at export.
    with pytest.raises(strata.InvalidArgumentError, match="named '__metadata__'"):
        OffloadAdam([("__metadata__", torch.nn.Parameter(torch.zeros(3)))])
    model = Net()
    opt = OffloadAdam(model.parameters())
    backward(model)
    next(model.parameters()).grad[0, 0] = float("nan")
    opt.step()
    assert opt.last_step()["skipped"] and opt.last_step()["nonfinite_elems"] == 1


def test_a_pickled_optimizer_is_a_placeholder_so_onecycle_state_dicts_save():
    """torch 1.13's OneCycleLR.state_dict() holds a bound method of the scheduler, so
    torch.save pickles the optimizer with it: that raised TypeError (a trainer's first
    checkpoint failed). The optimizer pickles as a placeholder, with a warning, that
    refuses any use; the scheduler resumes exactly."""
    import io
    import pickle
    model = Net()
    opt = OffloadAdam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=50)
    for s in range(5):
        backward(model, s)
        opt.step()
        sched.step()
        opt.zero_grad()
    buf = io.BytesIO()
    with pytest.warns(UserWarning, match="pickled as a placeholder"):
        torch.save(sched.state_dict(), buf)
    buf.seek(0)
    resumed = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=50)
    resumed.load_state_dict(torch.load(buf))
    for _ in range(5):
        sched.step()
        lr = opt.param_groups[0]["lr"]
        resumed.step()
        assert opt.param_groups[0]["lr"] == lr
    with pytest.warns(UserWarning, match="pickled as a placeholder"):
        placeholder = pickle.loads(pickle.dumps(opt))
    with pytest.raises(RuntimeError, match="pickled at step 5 was unpickled.*load_state_dict"):
        placeholder.step()


def test_torch_save_of_the_optimizer_does_what_the_docs_say():
    """docs/pytorch.md said `torch.save(optimizer)` raises TypeError; it saves a
    placeholder, with a warning, that raises at any use once loaded (as a later
    bullet of the same page said). The page says what the code does."""
    import io
    model = Net()
    opt = OffloadAdam(model.parameters(), lr=1e-2)
    train(model, opt, 2)
    buf = io.BytesIO()
    with pytest.warns(UserWarning, match="OffloadAdam pickled as a placeholder"):
        torch.save(opt, buf)
    buf.seek(0)
    placeholder = torch.load(buf)
    with pytest.raises(RuntimeError, match="pickled at step 2 was unpickled.*load_state_dict"):
        placeholder.step()
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.deepcopy(opt)
    docs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs",
                        "pytorch.md")
    with open(docs) as f:
        text = " ".join(f.read().split())
    claims = [c for c in re.split(r"(?<=[.:;])\s", text) if "torch.save(optimizer)" in c]
    assert claims, "docs/pytorch.md no longer says what torch.save(optimizer) does"
    assert not [c for c in claims if "TypeError" in c], claims
    assert any("placeholder" in c for c in claims), claims


def test_fp16_step_after_an_unscaled_backward_is_refused():
    """fp16 params: step() divides by the loss scale, so a plain loss.backward()
    trained 65536 times too slowly without a word. It is refused until the backward
    goes through optimizer.backward(); a scale of 1 needs no scaling."""
    x, y = batch()
    w = torch.randn(5, 12).half().requires_grad_()

    def loss():  # in fp32: PyTorch 1.13 has no fp16 matmul on CPU
        return torch.nn.functional.mse_loss(x @ w.float().t(), y)

    opt = OffloadAdam([w], lr=1e-2, config={"fp16": {"initial_scale_power": 8}})
    before = w.detach().clone()
    loss().backward()
    with pytest.raises(RuntimeError, match=r"no backward since the last step went through "
                                           r"optimizer.backward\(loss\)"):
        opt.step()
    assert torch.equal(w, before) and opt.step_count == 0
    opt.zero_grad()
    opt.backward(loss())
    opt.step()
    assert opt.step_count == 1 and not torch.equal(w, before)
    opt.zero_grad()
    loss().backward()  # the scaled backward counts for one step only
    with pytest.raises(RuntimeError, match="optimizer.backward"):
        opt.step()
    opt.close()
    opt = OffloadAdam([w], config={"fp16": {"loss_scale": 1}})
    for _ in range(2):
        loss().backward()
        opt.step()
        opt.zero_grad()
    assert opt.step_count == 2


def test_a_param_without_a_gradient_is_named_in_a_warning_once():
    """torch.optim skips a param whose .grad is None; OffloadAdam steps it with a zero
    gradient (momentum still moves it): say so, once."""
    model = Net()
    model.unused = torch.nn.Linear(3, 3)
    opt = OffloadAdam(model.named_parameters())
    backward(model)
    with pytest.warns(UserWarning, match=r"'unused.weight'.*got no gradient.*torch.optim skips"):
        opt.step()
    opt.zero_grad(set_to_none=True)
    backward(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()


@pytest.mark.parametrize("adamw", [True, False])
def test_a_state_dict_of_adam_and_of_adamw_refuse_each_other(adamw):
    """load_checkpoint refused it; load_state_dict continued under the other rule."""
    src_model, dst_model = Net(), Net()
    src = OffloadAdam(src_model.parameters(), adamw=adamw, weight_decay=0.1)
    train(src_model, src, 1)
    dst = OffloadAdam(dst_model.parameters(), adamw=not adamw, weight_decay=0.1)
    with pytest.raises(ValueError, match="saved by an .* optimizer, loading into an"):
        dst.load_state_dict(src.state_dict())
    assert dst.step_count == 0
    same = OffloadAdam(Net().parameters(), adamw=adamw, weight_decay=0.1)
    same.load_state_dict(src.state_dict())
    assert same.step_count == 1
    # Without weight decay the two rules are one update: either loads.
    model0 = Net()
    src0 = OffloadAdam(model0.parameters(), adamw=adamw, weight_decay=0.0)
    train(model0, src0, 1)
    other0 = OffloadAdam(Net().parameters(), adamw=not adamw, weight_decay=0.0)
    other0.load_state_dict(src0.state_dict())
    assert other0.step_count == 1


def test_close_releases_the_engine_while_a_step_error_is_alive(tmp_path):
    """An exception from step() kept the engine alive through its traceback, so close()
    (or a `with` block's end) freed nothing and an optimizer rebuilt on the same
    nvme_path was refused as long as the exception lived (an except block, a
    notebook's last error)."""
    kwargs = dict(nvme(tmp_path), config={"fp16": {"initial_scale_power": 0, "hysteresis": 1,
                                                   "min_loss_scale": 1}})
    w = torch.randn(5, 12).half().requires_grad_()
    opt = OffloadAdam([w], **kwargs)
    w.grad = torch.full_like(w, float("nan"))
    with pytest.raises(StrataError) as failed:
        opt.step()
    opt.close()
    assert failed.value is not None  # the exception and its traceback are alive here
    again = OffloadAdam([torch.randn(3, requires_grad=True)], **nvme(tmp_path))
    again.close()


def test_a_checkpoint_holds_weights_written_since_the_last_step(tmp_path):
    """save_checkpoint() saved the master weights as the last step left them: weights
    the trainer wrote since (a pretrained model loaded after building the optimizer)
    were missing from the checkpoint and its export, and load_checkpoint() rolled the
    model back. The save takes them first, as step() does."""
    model = Net()
    opt = OffloadAdam(model.named_parameters(), lr=1e-2)
    train(model, opt, 2)
    with torch.no_grad():
        model.a.weight.fill_(0.25)  # what model.load_state_dict(pretrained) does
    want = {k: v.clone() for k, v in model.state_dict().items()}
    opt.save_checkpoint(tmp_path / "ckpt")
    saved = state_dict_from_checkpoint(tmp_path / "ckpt")
    for name, p in model.named_parameters():
        assert torch.equal(saved[name], p), name
    # The trained-on reference: the same writes, then a step of each.
    ref_model = Net()
    ref = OffloadAdam(ref_model.named_parameters(), lr=1e-2)
    train(ref_model, ref, 2)
    with torch.no_grad():
        ref_model.a.weight.fill_(0.25)
    train(ref_model, ref, 1, seed0=7)
    # Loading brings the written weights back, and training goes on from them.
    with torch.no_grad():
        model.a.weight.fill_(-1.0)
    opt.load_checkpoint(tmp_path / "ckpt")
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
    train(model, opt, 1, seed0=7)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


def test_zero_grad_zeroes_every_grad_when_one_buffer_was_replaced():
    """A submodule converted away and back between step() and zero_grad() gives its
    grads new storage: the engine then zeroes none of its buffers (it never writes
    freed memory), and zero_grad() still pointed the other params' .grad at their
    un-zeroed buffers, so the next backward added the last step's gradients in."""
    model = Net()
    opt = OffloadAdam(model.parameters(), lr=1e-2)
    opt.zero_grad()
    backward(model)
    opt.step()
    model.b.double()
    opt.zero_grad()
    model.b.float()
    for name, p in model.a.named_parameters():
        assert p.grad is not None and p.grad.count_nonzero() == 0, name
    # And the next step is that of an optimizer whose model was not converted.
    ref_model = Net()
    ref = OffloadAdam(ref_model.parameters(), lr=1e-2)
    for _ in range(2):
        ref.zero_grad()
        backward(ref_model, 1)
        ref.step()
    backward(model, 1)
    opt.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


def test_a_scaled_backward_thrown_away_by_zero_grad_does_not_pass_for_the_next():
    """fp16: the "backward went through optimizer.backward" flag outlived zero_grad(),
    so a plain loss.backward() after a discarded scaled one stepped with gradients
    loss_scale times too small. zero_grad() ends the flag with the gradients."""
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))  # (no fp16 matmul on CPU)
    opt = OffloadAdam([p], lr=1e-2)

    def loss():
        return (p.float() * torch.arange(4.0)).sum()

    opt.backward(loss())
    opt.zero_grad()
    loss().backward()
    with pytest.raises(RuntimeError, match=r"optimizer\.backward\(loss\)"):
        opt.step()
    opt.zero_grad()
    opt.backward(loss())
    opt.step()  # a scaled backward again: taken


def test_close_lets_go_of_the_grad_buffers_and_a_closed_optimizer_pickles():
    """close() kept one model-sized grad buffer per param (GPU memory on CUDA) for as
    long as anything referred to the optimizer, and pickling a closed one (a
    scheduler's state_dict saved after `with OffloadAdam(...)`) raised "step_count:
    the optimizer was closed"."""
    import gc
    import io
    import weakref
    model = Net()
    opt = OffloadAdam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    train(model, opt, 3)
    sched.step()
    bufs = [weakref.ref(p.grad) for p in model.parameters()]
    opt.zero_grad(set_to_none=True)  # nothing but the optimizer holds them now
    opt.close()
    gc.collect()
    assert all(b() is None for b in bufs)
    with pytest.warns(UserWarning, match="pickled as a placeholder"):
        torch.save(sched.state_dict(), io.BytesIO())
    import pickle
    with pytest.warns(UserWarning, match="pickled as a placeholder"):
        placeholder = pickle.loads(pickle.dumps(opt))
    with pytest.raises(RuntimeError, match="pickled at step 3 was unpickled"):
        placeholder.step()


@pytest.mark.parametrize("optimizer", ["torch", "offload"])
def test_a_backward_through_a_graph_saved_before_the_update_is_refused(tmp_path, optimizer):
    """torch.optim updates params in place, which moves their version counters:
    autograd then refuses a backward through a graph saved before the update
    (retain_graph, a GAN's second pass). The engine wrote the params behind torch's
    back, so such a backward ran on the new weights without a word. Steps, retries
    and loads now move the counters as torch.optim's updates do."""
    torch.manual_seed(0)
    x = torch.randn(8, 4, requires_grad=True)  # the graph saves the weight for x's grad
    lin = torch.nn.Linear(4, 1)
    if optimizer == "torch":
        opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
    else:
        opt = OffloadAdam(lin.parameters(), lr=0.1)
    out = (lin(x) ** 2).sum()
    out.backward(retain_graph=True)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()
    if optimizer == "torch":
        return
    opt.save_checkpoint(tmp_path / "ckpt")
    opt.zero_grad()
    out = (lin(x) ** 2).sum()
    opt.load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()
    # The moved counters are the engine's, not a write of the trainer's: the next step
    # is what a run without the refused backwards makes.
    opt.zero_grad()
    (lin(x) ** 2).sum().backward()
    opt.step()
    torch.manual_seed(0)
    x2 = torch.randn(8, 4, requires_grad=True)
    ref_lin = torch.nn.Linear(4, 1)
    ref = OffloadAdam(ref_lin.parameters(), lr=0.1)
    for _ in range(2):
        ref.zero_grad()
        (ref_lin(x2) ** 2).sum().backward()
        ref.step()
    for p, q in zip(lin.parameters(), ref_lin.parameters()):
        assert torch.equal(p, q)
