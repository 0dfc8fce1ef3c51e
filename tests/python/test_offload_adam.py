"""strata.torch.OffloadAdam against torch.optim, step by step.

Tolerance (fp32 params): after every one of 30 steps each parameter is within
atol 2e-6 + rtol 1e-5 of torch's, and each loss within 1e-5 relative. The
engine's fused CPU Adam rounds in another order than torch's sequence of
tensor ops (a few ulps per step), nothing more: a wrong bias correction, a
decay applied to the wrong group or a missed LR change is off by orders of
magnitude more.
"""
import copy
import ctypes
import os

import pytest
import torch

import strata
from strata import _strata
from strata.torch import OffloadAdam

STEPS = 30
ATOL, RTOL, LOSS_RTOL = 2e-6, 1e-5, 1e-5


class Net(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Linear(12, 48)
        self.norm = torch.nn.LayerNorm(48)
        self.hidden = torch.nn.Linear(48, 48)
        self.out = torch.nn.Linear(48, 5)
        self.to(dtype)

    def forward(self, x):
        h = torch.tanh(self.norm(self.emb(x)))
        return self.out(torch.relu(self.hidden(h)) + h)


def data(n=64, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 12, generator=g)
    y = torch.randn(n, 5, generator=g)
    return x.to(dtype), y.to(dtype)


def loss_fn(model, x, y):
    return torch.nn.functional.mse_loss(model(x).float(), y.float())


def groups_of(model, lr):
    """Weights decay with the group lr, biases and norms do not and train faster."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    other = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0,
                                                      "lr": lr * 3}]


def offload_kwargs(offload, tmp_path):
    if offload == "nvme":
        # Small sub-groups, all on NVMe (no host budget for state).
        return {"offload": "nvme", "nvme_path": str(tmp_path), "sub_group_size": 1024}
    return {"offload": "cpu"}


def train_side_by_side(ours, ref, m_ours, m_ref, steps=STEPS, clip=None, scheds=()):
    x, y = data()
    for step in range(steps):
        losses = []
        for model, opt in ((m_ours, ours), (m_ref, ref)):
            loss = loss_fn(model, x, y)
            loss.backward()
            if clip is not None and opt is ref:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        for s in scheds:
            s.step()
        assert losses[0] == pytest.approx(losses[1], rel=LOSS_RTOL), f"loss at step {step}"
        for (name, a), b in zip(m_ours.named_parameters(), m_ref.parameters()):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"{name} at step {step}: {m}")
    return losses


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_adamw_groups_and_scheduler_match_torch(offload, tmp_path):
    lr = 2e-3
    m_ours, m_ref = Net(), Net()
    ours = OffloadAdam(groups_of(m_ours, lr), lr=lr, **offload_kwargs(offload, tmp_path))
    ref = torch.optim.AdamW(groups_of(m_ref, lr), lr=lr)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.5) for o in (ours, ref)]
    losses = train_side_by_side(ours, ref, m_ours, m_ref, scheds=scheds)
    assert ours.param_groups[0]["lr"] == pytest.approx(lr * 0.5 ** (STEPS // 7))
    assert ours.step_count == STEPS
    if offload == "nvme":
        assert ours.plan()["nvme_sub_groups"] > 1
        # Read, or still in a buffer from the step before (all are, with as many
        # buffers as extents).
        last = ours.last_step()
        assert last["read_bytes"] + last["resident_bytes"] > 0 and last["write_bytes"] > 0
    assert losses[0] < 1.0


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_adam_l2_matches_torch_adam(offload, tmp_path):
    m_ours, m_ref = Net(), Net()
    ours = OffloadAdam(m_ours.parameters(), lr=1e-3, betas=(0.8, 0.99), eps=1e-6,
                       weight_decay=0.05, adamw=False, **offload_kwargs(offload, tmp_path))
    ref = torch.optim.Adam(m_ref.parameters(), lr=1e-3, betas=(0.8, 0.99), eps=1e-6,
                           weight_decay=0.05)
    train_side_by_side(ours, ref, m_ours, m_ref)


@pytest.mark.parametrize("params,torch_opt", [
    ({"weight_decay": 0.1}, torch.optim.AdamW),
    ({"weight_decay": 0.1, "adam_w_mode": True}, torch.optim.AdamW),
    ({"weight_decay": 0.1, "adam_w_mode": False}, torch.optim.Adam)])
def test_a_deepspeed_adam_config_decays_as_deepspeed_does(params, torch_opt):
    """DeepSpeed's "type": "Adam" is AdamW unless adam_w_mode is false; it ran Adam with
    L2 decay whatever adam_w_mode said (while engine_config said AdamW)."""
    m_ours, m_ref = Net(), Net()
    ours = OffloadAdam(m_ours.parameters(),
                       config={"optimizer": {"type": "Adam", "params": dict(params, lr=1e-3)}})
    ref = torch_opt(m_ref.parameters(), lr=1e-3, weight_decay=0.1)
    assert ours.engine_config["optimizer"]["params"]["adam_w_mode"] == (torch_opt is
                                                                       torch.optim.AdamW)
    train_side_by_side(ours, ref, m_ours, m_ref)


def test_max_grad_norm_matches_clip_grad_norm():
    m_ours, m_ref = Net(), Net()
    ours = OffloadAdam(m_ours.parameters(), lr=1e-3, weight_decay=0.01, max_grad_norm=0.05)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-3, weight_decay=0.01)
    train_side_by_side(ours, ref, m_ours, m_ref, clip=0.05)
    stats = ours.last_step()
    assert stats["clip_coef"] < 1.0, "the test must exercise clipping"
    assert stats["grad_norm"] > 0.05


def test_mixed_placement_host_and_nvme(tmp_path):
    def wide():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(12, 160), torch.nn.Tanh(),
                                   torch.nn.Linear(160, 160), torch.nn.Tanh(),
                                   torch.nn.Linear(160, 5))
    m_ours, m_ref = wide(), wide()
    # 28.6k params in 8 sub-groups (335 KiB of state): 450 KiB holds the NVMe
    # staging (340 KiB) and 2 sub-groups of 48 KiB.
    ours = OffloadAdam(m_ours.parameters(), lr=1e-3, offload="nvme", nvme_path=str(tmp_path),
                       sub_group_size=4096, host_budget="450KiB")
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-3, weight_decay=0.0)
    plan = ours.plan()
    assert plan["host_sub_groups"] > 0 and plan["nvme_sub_groups"] > 0, plan["text"]
    train_side_by_side(ours, ref, m_ours, m_ref, steps=10)


def test_step_closure_returns_loss_and_set_to_none():
    m_ours, m_ref = Net(), Net()
    ours = OffloadAdam(m_ours.parameters(), lr=1e-3)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-3, weight_decay=0.0)
    x, y = data()
    for step in range(5):
        def closure(model=m_ours):
            loss = loss_fn(model, x, y)
            loss.backward()
            return loss
        loss = ours.step(closure)
        assert isinstance(loss, torch.Tensor)
        ours.zero_grad(set_to_none=step % 2 == 0)
        assert all((p.grad is None) == (step % 2 == 0) for p in m_ours.parameters())
        ref_loss = loss_fn(m_ref, x, y)
        ref_loss.backward()
        ref.step()
        ref.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=LOSS_RTOL)
    # A param whose grad is None counts as zero (AdamW still decays, moments decay).
    for a, b in zip(m_ours.parameters(), m_ref.parameters()):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


def test_zero_grad_keeps_grads_in_engine_buffers():
    model = Net()
    opt = OffloadAdam(model.parameters(), lr=1e-3)
    x, y = data()
    loss_fn(model, x, y).backward()
    opt.step()
    opt.zero_grad()
    buffers = [p.grad.data_ptr() for p in model.parameters()]
    assert all(p.grad.abs().sum() == 0 for p in model.parameters())
    loss_fn(model, x, y).backward()
    assert [p.grad.data_ptr() for p in model.parameters()] == buffers  # accumulated in place


def reference_low_precision(model, dtype, steps, lr):
    """torch.optim.AdamW on an fp32 master copy, params rounded to `dtype` after each step."""
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(master, lr=lr, weight_decay=0.0)
    x, y = data(dtype=dtype)
    for _ in range(steps):
        loss_fn(model, x, y).backward()
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, model.parameters()):
                p.copy_(m.to(dtype))


def test_bf16_params_follow_fp32_master():
    lr, steps = 1e-3, 10
    ours_model, ref_model = Net(torch.bfloat16), Net(torch.bfloat16)
    opt = OffloadAdam(ours_model.parameters(), lr=lr)
    assert opt.engine_config["bf16"]["enabled"] is True
    x, y = data(dtype=torch.bfloat16)
    for _ in range(steps):
        loss_fn(ours_model, x, y).backward()
        opt.step()
        opt.zero_grad()
    reference_low_precision(ref_model, torch.bfloat16, steps, lr)
    for a, b in zip(ours_model.parameters(), ref_model.parameters()):
        assert a.dtype == torch.bfloat16
        # One bf16 ulp: fused vs unfused fp32 arithmetic may round a master weight
        # onto the other side of a bf16 rounding boundary.
        torch.testing.assert_close(a.float(), b.float(), atol=1e-6, rtol=2 ** -7)


def test_fp16_loss_scaling_skips_overflow():
    # fp16 params, the loss computed in fp32 (PyTorch 1.13 has no fp16 matmul on CPU).
    torch.manual_seed(0)
    w = torch.randn(8, 12).half().requires_grad_()
    x, y = data()
    opt = OffloadAdam([w], lr=1e-3, config={"fp16": {"initial_scale_power": 8, "hysteresis": 1}})
    assert opt.engine_config["fp16"]["enabled"] is True
    assert opt.loss_scale == 256.0

    def loss():
        return torch.nn.functional.mse_loss(x @ w.float().t(), y.repeat(1, 2)[:, :8])

    opt.backward(loss())
    assert w.grad.dtype == torch.float16
    before = w.detach().clone()
    opt.step()
    opt.zero_grad()
    assert not opt.last_step()["skipped"] and opt.step_count == 1
    assert not torch.equal(w, before)
    before = w.detach().clone()
    opt.backward(loss())
    w.grad[0, 0] = float("inf")
    opt.step()
    opt.zero_grad()
    assert opt.last_step()["skipped"] and opt.step_count == 1
    assert opt.loss_scale == 128.0
    assert torch.equal(w, before)
    assert torch.equal(opt.scale_loss(torch.tensor(1.0)), torch.tensor(128.0))


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_state_dict_round_trip_resumes_exactly(offload, tmp_path):
    x, y = data()

    def train(model, opt, sched, steps):
        for _ in range(steps):
            loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad()
            sched.step()

    def make(model, path):
        path.mkdir()
        opt = OffloadAdam(groups_of(model, 1e-3), lr=1e-3, **offload_kwargs(offload, path))
        return opt, torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)

    model = Net()
    opt, sched = make(model, tmp_path / "a")
    train(model, opt, sched, 8)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    saved_sched = copy.deepcopy(sched.state_dict())
    assert saved_opt["state"]["strata"]["step"] == 8
    train(model, opt, sched, 7)

    fresh = Net()
    fresh.load_state_dict(saved_model)
    fresh_opt, fresh_sched = make(fresh, tmp_path / "b")
    fresh_opt.load_state_dict(saved_opt)
    fresh_sched.load_state_dict(saved_sched)
    assert fresh_opt.param_groups[0]["lr"] == saved_opt["param_groups"][0]["lr"]
    train(fresh, fresh_opt, fresh_sched, 7)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert fresh_opt.step_count == 15


def test_load_state_dict_refuses_other_shapes():
    a, b = Net(), torch.nn.Linear(3, 3)
    opt_a = OffloadAdam(a.parameters())
    opt_b = OffloadAdam(b.parameters())
    with pytest.raises(ValueError, match="other shapes: .* tensors where this optimizer has 2"):
        opt_b.load_state_dict(opt_a.state_dict())
    # As many tensors: the message names the first that differs.
    c, d = torch.nn.Linear(4, 3), torch.nn.Linear(3, 4)
    opt_c, opt_d = OffloadAdam(c.named_parameters()), OffloadAdam(d.named_parameters())
    with pytest.raises(ValueError, match=r"param 0 \(weight\) was \[3, 4\] where this "
                                         r"optimizer's is \[4, 3\]"):
        opt_d.load_state_dict(opt_c.state_dict())
    with pytest.raises(ValueError, match="not an optimizer state_dict"):
        opt_a.load_state_dict({"state": {}})
    # A torch AdamW state_dict of as many elements in another shape (two layers
    # swapped): torch's own step refuses it; it was loaded, moments scrambled.
    torch_c = torch.optim.AdamW(c.parameters())
    c(torch.randn(2, 4)).sum().backward()
    torch_c.step()
    with pytest.raises(ValueError, match=r"exp_avg has shape \(3, 4\) where the param's is "
                                         r"\(4, 3\)"):
        opt_d.load_state_dict(torch_c.state_dict())


def test_bad_inputs_raise_clear_errors(tmp_path):
    w = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="non-leaf"):
        OffloadAdam([w * 2])
    with pytest.raises(ValueError, match="more than one device"):
        OffloadAdam([w, torch.empty(3, device="meta", requires_grad=True)])
    with pytest.raises(ValueError, match="more than one dtype"):
        OffloadAdam([w, torch.randn(3, dtype=torch.bfloat16, requires_grad=True)])
    with pytest.raises(TypeError, match="float64"):
        OffloadAdam([torch.randn(3, dtype=torch.float64, requires_grad=True)])
    with pytest.raises(ValueError, match="needs nvme_path"):
        OffloadAdam([w], offload="nvme")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        OffloadAdam([w], offload="nvme", nvme_path=str(tmp_path / "a-file"))
    with pytest.raises(ValueError, match="offload="):
        OffloadAdam([w], offload="gpu")
    with pytest.raises(strata.ResourceExhaustedError, match="budget"):
        OffloadAdam([w], offload="cpu", host_budget=1024)
    with pytest.raises(MemoryError):  # the same error, as a builtin type
        OffloadAdam([w], offload="nvme", nvme_path=str(tmp_path), host_budget="1KiB")
    with pytest.raises(strata.InvalidArgumentError, match="did you mean"):
        OffloadAdam([w], config={"zero_optimization": {"sub_group_sise": 10}})
    with pytest.raises(ValueError, match="config says params bf16"):
        OffloadAdam([w], config={"bf16": {"enabled": True}})
    with pytest.raises(ValueError, match="grads fp16"):
        OffloadAdam([w], config={"strata": {"grad_dtype": "fp16"}})
    with pytest.raises(ValueError, match="learning rate"):
        OffloadAdam([w], lr=-1)

    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = OffloadAdam(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradient"):
        opt.step()

    opt = OffloadAdam([w])
    opt.param_groups[0]["lr"] = -0.5
    with pytest.raises(ValueError, match="lr is -0.5"):
        opt.step()


def test_stats_and_plan_are_reported(tmp_path):
    model = Net()
    opt = OffloadAdam(model.parameters(), offload="nvme", nvme_path=str(tmp_path),
                      sub_group_size=2048)
    assert "nvme" in opt.plan()["text"]
    x, y = data()
    loss_fn(model, x, y).backward()
    opt.step()
    s = opt.last_step()
    assert s["step"] == 1 and not s["skipped"] and s["times"]["step"] > 0
    assert s["write_bytes"] >= sum(p.numel() for p in model.parameters()) * 12
    assert s["text"].startswith("step 1:")


def test_cuda_tensors_use_the_cuda_device():
    if not torch.cuda.is_available() or not _strata.cuda_available():
        pytest.skip("no CUDA device here (torch.cuda.is_available() is "
                    f"{torch.cuda.is_available()}, strata sees "
                    f"{'one' if _strata.cuda_available() else 'none'}); the CUDA path is built "
                    "but not run")
    m_ours, m_ref = Net().cuda(), Net().cuda()
    ours = OffloadAdam(m_ours.parameters(), lr=1e-3, weight_decay=0.01)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-3, weight_decay=0.01)
    x, y = (t.cuda() for t in data())
    for _ in range(10):
        for model, opt in ((m_ours, ours), (m_ref, ref)):
            loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad()
    assert ours.engine_config is not None
    for a, b in zip(m_ours.parameters(), m_ref.parameters()):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


def test_frozen_params_are_left_alone():
    m_ours, m_ref = Net(), Net()
    for m in (m_ours, m_ref):
        m.emb.requires_grad_(False)
    groups = [{"params": list(m_ours.emb.parameters()), "weight_decay": 0.5},  # all frozen
              {"params": [p for n, p in m_ours.named_parameters() if not n.startswith("emb")],
               "weight_decay": 0.1}]
    ours = OffloadAdam(groups, lr=1e-3)
    ref = torch.optim.AdamW([p for p in m_ref.parameters() if p.requires_grad], lr=1e-3,
                            weight_decay=0.1)
    frozen = [p.detach().clone() for p in m_ours.emb.parameters()]
    train_side_by_side(ours, ref, m_ours, m_ref, steps=5)
    for a, b in zip(m_ours.emb.parameters(), frozen):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="no param requires grad"):
        OffloadAdam(m_ours.emb.parameters())


def test_named_parameters_are_accepted():
    m_ours, m_ref = Net(), Net()
    ours = OffloadAdam(m_ours.named_parameters(), lr=1e-3)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-3, weight_decay=0.0)
    assert all(isinstance(p, torch.Tensor) for p in ours.param_groups[0]["params"])
    train_side_by_side(ours, ref, m_ours, m_ref, steps=3)
    grouped = OffloadAdam([{"params": list(Net().named_parameters())[:2], "lr": 1e-2}])
    assert len(grouped.param_groups[0]["params"]) == 2


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_save_and_load_checkpoint_resume_exactly(offload, tmp_path):
    """The C++ checkpoint format through save_checkpoint/load_checkpoint: a fresh
    optimizer over differently initialized params resumes bitwise, with the
    saved hyperparameters."""
    x, y = data()

    def train(model, opt, steps):
        for _ in range(steps):
            loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad()

    def make(model, path):
        path.mkdir()
        return OffloadAdam(groups_of(model, 1e-3), lr=1e-3, **offload_kwargs(offload, path))

    model = Net()
    opt = make(model, tmp_path / "a")
    train(model, opt, 6)
    opt.param_groups[1]["lr"] = 5e-3  # set after the last step: saved all the same
    opt.save_checkpoint(tmp_path / "ckpt")
    train(model, opt, 5)

    fresh = Net()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    fresh_opt = make(fresh, tmp_path / "b")
    fresh_opt.load_checkpoint(tmp_path / "ckpt")
    assert fresh_opt.step_count == 6
    assert fresh_opt.param_groups[1]["lr"] == 5e-3
    train(fresh, fresh_opt, 5)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


class _CParam(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("data", ctypes.c_void_p), ("grad", ctypes.c_void_p),
                ("elems", ctypes.c_uint64), ("group", ctypes.c_uint32)]


def test_checkpoint_written_through_the_c_api_loads_into_offload_adam(tmp_path):
    """Interop: a C trainer (libstrata_c.so through ctypes) saves; OffloadAdam loads
    the C++ checkpoint and both continue bitwise alike."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(strata.__file__), "..", "..", "lib",
                                   "libstrata_c.so"))
    lib.strata_last_error.restype = ctypes.c_char_p
    lib.strata_optimizer_create.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p,
        ctypes.POINTER(_CParam), ctypes.c_size_t, ctypes.c_void_p, ctypes.c_uint32,
        ctypes.POINTER(ctypes.c_void_p)]
    for fn in ("strata_optimizer_step", "strata_optimizer_free", "strata_device_free"):
        getattr(lib, fn).argtypes = [ctypes.c_void_p]
    lib.strata_optimizer_save.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

    n = 300
    torch.manual_seed(0)
    w, g = torch.randn(n), torch.zeros(n)
    dev, opt = ctypes.c_void_p(), ctypes.c_void_p()
    assert lib.strata_device_open(b"host", ctypes.byref(dev)) == 0, lib.strata_last_error()
    param = _CParam(b"w", w.data_ptr(), g.data_ptr(), n, 0)
    assert lib.strata_optimizer_create(dev, None, None, b'{"gradient_clipping": 0}',
                                       ctypes.byref(param), 1, None, 1,
                                       ctypes.byref(opt)) == 0, lib.strata_last_error()
    for _ in range(3):
        g.copy_(torch.randn(n))
        assert lib.strata_optimizer_step(opt) == 0, lib.strata_last_error()
    ckpt = tmp_path / "ckpt"
    assert lib.strata_optimizer_save(opt, str(ckpt).encode()) == 0, lib.strata_last_error()

    p = torch.zeros(n, requires_grad=True)
    ours = OffloadAdam([("w", p)], lr=1e-3)
    ours.load_checkpoint(ckpt)
    assert ours.step_count == 3
    assert torch.equal(p.detach(), w)
    grad = torch.randn(n)
    g.copy_(grad)
    assert lib.strata_optimizer_step(opt) == 0, lib.strata_last_error()
    p.grad = grad.clone()
    ours.step()
    assert torch.equal(p.detach(), w)
    lib.strata_optimizer_free(opt)
    lib.strata_device_free(dev)


@pytest.mark.parametrize("fraction", [0.5, 1.0, "auto"])
def test_gpu_fraction_is_bitwise_the_all_offloaded_run(fraction, tmp_path):
    """Partial offload: the share kept on the device (here the host device:
    CPU tensors) is updated by the device Adam; params and state stay bitwise
    those of the run that offloads everything, and a state_dict moves between
    fractions."""
    x, y = data()
    runs = {}
    for f in (0.0, fraction):
        model = Net()
        budget = "64KiB" if f == "auto" else None
        # "auto": the CPU's rate measured at construction; the device's given
        # (strata.rates), far faster, so that the budget decides how many sub-groups the
        # device takes (two rates measured on one loaded CPU balance anywhere).
        extra = {"config": {"strata": {"rates": {"device_adam": 1e12}}}} if f == "auto" else {}
        opt = OffloadAdam(groups_of(model, 1e-3), lr=1e-3, max_grad_norm=0.5,
                          sub_group_size=1024, gpu_fraction=f, device_budget=budget, **extra)
        for _ in range(5):
            loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        runs[f] = (model, opt)
    model0, opt0 = runs[0.0]
    model1, opt1 = runs[fraction]
    plan = opt1.plan()
    assert plan["device_sub_groups"] > 0, plan["text"]
    assert 0 < plan["gpu_fraction"] <= 1.0
    if fraction == 1.0:
        assert plan["host_sub_groups"] == 0, plan["text"]
    if fraction == "auto":
        # The CPU's Adam rate measured at construction, the device's given; the plan
        # balances them within the budget.
        assert plan["rates"]["cpu_adam"] > 0 and plan["rates"]["device_adam"] > 0, plan
        assert plan["estimate"]["device_adam"] > 0 and plan["estimate"]["cpu_adam"] >= 0, plan
    assert opt1.last_step()["times"]["device_adam"] > 0
    assert opt0.last_step()["times"]["device_adam"] == 0
    for a, b in zip(model0.parameters(), model1.parameters()):
        assert torch.equal(a, b)
    s0, s1 = opt0.state_dict(), opt1.state_dict()
    a0, a1 = s0["state"]["strata"]["arrays"], s1["state"]["strata"]["arrays"]
    assert len(a0) == len(a1) > 0
    for t0, t1 in zip(a0, a1):
        assert torch.equal(t0, t1)
    # The fraction's state loads into an all-offloaded optimizer and back.
    fresh = Net()
    fresh_opt = OffloadAdam(groups_of(fresh, 1e-3), lr=1e-3, max_grad_norm=0.5,
                            sub_group_size=1024)
    fresh_opt.load_state_dict(s1)
    assert fresh_opt.step_count == 5


def test_gpu_fraction_bad_values_raise_clear_errors():
    w = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="gpu_fraction=1.5"):
        OffloadAdam([w], gpu_fraction=1.5)
    with pytest.raises(ValueError, match="gpu_fraction="):
        OffloadAdam([w], gpu_fraction="most")
    with pytest.raises(ValueError, match="needs device_budget"):
        OffloadAdam([w], gpu_fraction="auto")
    with pytest.raises(strata.ResourceExhaustedError, match="lower gpu_fraction"):
        OffloadAdam([torch.randn(4096, requires_grad=True)], gpu_fraction=1.0,
                    device_budget="16KiB")
