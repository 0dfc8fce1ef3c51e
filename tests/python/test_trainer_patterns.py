"""OffloadAdam driven the way the common trainers drive an optimizer.

Hugging Face Trainer, Accelerate and PyTorch Lightning cannot be installed
here (no PyPI; Debian packages none of them), so each test reproduces the
library's calling pattern: the order of backward, clipping, step, scheduler
and zero_grad, how the optimizer is wrapped, and how its state_dict travels
through torch.save. Each pattern runs with OffloadAdam and with
torch.optim.AdamW; the params agree within the parity tolerance of
test_offload_adam.py after every optimizer step, and a run resumed from
torch.save'd state is bitwise the uninterrupted one.
"""
import pytest
import torch

from strata.torch import OffloadAdam

ATOL, RTOL = 2e-6, 1e-5


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.GELU(),
                               torch.nn.LayerNorm(32), torch.nn.Linear(32, 3))


def batches(n, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(n)]


def decay_groups(model, weight_decay=0.01):
    """Hugging Face Trainer's grouping: no decay for biases and LayerNorm weights."""
    no_decay = [n for n, _ in model.named_parameters() if n.endswith("bias") or n.startswith("2.")]
    return [{"params": [p for n, p in model.named_parameters() if n not in no_decay],
             "weight_decay": weight_decay},
            {"params": [p for n, p in model.named_parameters() if n in no_decay],
             "weight_decay": 0.0}]


def linear_schedule(optimizer, warmup, total):
    """transformers.get_linear_schedule_with_warmup."""
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, f)


def assert_close_models(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")


# ---- Hugging Face Trainer ------------------------------------------------------------

class TrainerLoop:
    """transformers.Trainer's inner loop: loss / accumulation steps, backward; every
    `accum` micro-batches clip through the trainer (clip_grad_norm_ on the model),
    optimizer.step(), lr_scheduler.step(), model.zero_grad() (set_to_none in torch 2).
    Trainer(optimizers=(opt, sched)) takes the pair as built here."""

    def __init__(self, model, optimizer, scheduler, accum=2, max_grad_norm=1.0):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.accum, self.max_grad_norm = accum, max_grad_norm

    def train(self, data, after_step=None):
        for i, (x, y) in enumerate(data):
            loss = torch.nn.functional.cross_entropy(self.model(x), y) / self.accum
            loss.backward()
            if (i + 1) % self.accum == 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
                self.optimizer.step()
                self.scheduler.step()
                self.model.zero_grad(set_to_none=True)
                if after_step:
                    after_step()

    def save(self, path):
        """_save_checkpoint: model, optimizer and scheduler state through torch.save."""
        torch.save(self.model.state_dict(), path / "model.pt")
        torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
        torch.save(self.scheduler.state_dict(), path / "scheduler.pt")

    def load(self, path):
        """_load_optimizer_and_scheduler (map_location as the Trainer passes it)."""
        self.model.load_state_dict(torch.load(path / "model.pt"))
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu"))
        self.scheduler.load_state_dict(torch.load(path / "scheduler.pt"))


def hf_pair(model, offload, tmp_path, name="nvme"):
    groups = decay_groups(model)
    if offload is None:
        opt = torch.optim.AdamW(groups, lr=5e-3)
    else:
        kw = {}
        if offload == "nvme":
            (tmp_path / name).mkdir(exist_ok=True)
            kw = {"offload": "nvme", "nvme_path": str(tmp_path / name), "sub_group_size": 256}
        opt = OffloadAdam(groups, lr=5e-3, **kw)
    return opt, linear_schedule(opt, warmup=3, total=20)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_hugging_face_trainer_loop_matches_adamw_and_resumes_bitwise(offload, tmp_path):
    data = batches(24)
    m_ref, m_ours = make_model(), make_model()
    ref = TrainerLoop(m_ref, *hf_pair(m_ref, None, tmp_path))
    ours = TrainerLoop(m_ours, *hf_pair(m_ours, offload, tmp_path))

    ref.train(data[:12])
    ours.train(data[:12])
    assert_close_models(m_ours, m_ref)
    ours.save(tmp_path)
    ours.train(data[12:])
    ref.train(data[12:])
    assert_close_models(m_ours, m_ref)
    assert ours.optimizer.param_groups[0]["lr"] == pytest.approx(
        ref.optimizer.param_groups[0]["lr"])

    # Resume from the checkpoint in a fresh process's objects: bitwise the same run.
    m_res = make_model()
    resumed = TrainerLoop(m_res, *hf_pair(m_res, offload, tmp_path, "nvme2"))
    resumed.load(tmp_path)
    assert resumed.optimizer.step_count == 6
    resumed.train(data[12:])
    for a, b in zip(m_res.parameters(), m_ours.parameters()):
        assert torch.equal(a, b)


# ---- Accelerate ----------------------------------------------------------------------

def move_to_device(obj, device):
    """accelerate.utils.move_to_device: every tensor of a nested state, .to(device)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return type(obj)({k: move_to_device(v, device) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_to_device(v, device) for v in obj)
    return obj


class AcceleratedOptimizer(torch.optim.Optimizer):
    """accelerate.optimizer.AcceleratedOptimizer: wraps the optimizer, forwards step and
    zero_grad, shares param_groups, and moves a state_dict onto the device before
    loading it (device_placement=True)."""

    def __init__(self, optimizer, device):
        self.optimizer, self.device = optimizer, device

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none=None):
        self.optimizer.zero_grad(set_to_none=bool(set_to_none))

    def step(self, closure=None):
        self.optimizer.step(closure)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(move_to_device(state_dict, self.device))


def prepare(model, optimizer, device):
    """Accelerator.prepare(model, optimizer): the model goes to the device (a real move
    gives every param new storage, which the optimizer built on the CPU still points
    at), the optimizer is wrapped."""
    for p in model.parameters():
        p.data = p.data.to(device, copy=True)
    return model, AcceleratedOptimizer(optimizer, device)


def test_accelerate_prepare_after_building_the_optimizer_and_save_state(tmp_path):
    data = batches(10)
    m_ref, m_ours = make_model(), make_model()
    ref_opt = torch.optim.AdamW(m_ref.parameters(), lr=5e-3, weight_decay=0.0)
    ours_opt = OffloadAdam(m_ours.parameters(), lr=5e-3)
    m_ours, ours_opt = prepare(m_ours, ours_opt, "cpu")
    for model, opt in ((m_ref, ref_opt), (m_ours, ours_opt)):
        for i, (x, y) in enumerate(data[:5]):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()  # accelerator.backward(loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # accelerator.clip_grad_norm_
            opt.step()
    assert_close_models(m_ours, m_ref)
    # accelerator.save_state / load_state: torch.save of the state_dicts.
    torch.save(ours_opt.state_dict(), tmp_path / "optimizer.bin")
    torch.save(m_ours.state_dict(), tmp_path / "model.bin")
    m_res = make_model()
    res_opt = OffloadAdam(m_res.parameters(), lr=5e-3)
    m_res, res_opt = prepare(m_res, res_opt, "cpu")
    m_res.load_state_dict(torch.load(tmp_path / "model.bin"))
    res_opt.load_state_dict(torch.load(tmp_path / "optimizer.bin"))
    for model, opt in ((m_ours, ours_opt), (m_res, res_opt)):
        for x, y in data[5:]:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    for a, b in zip(m_res.parameters(), m_ours.parameters()):
        assert torch.equal(a, b)


# ---- PyTorch Lightning ------------------------------------------------------------------

class LitModule:
    """A LightningModule: configure_optimizers returns the optimizer and a per-step
    scheduler; training_step returns the loss."""

    def __init__(self, model, make_optimizer):
        self.model, self.make_optimizer = model, make_optimizer

    def configure_optimizers(self):
        opt = self.make_optimizer(self.model.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def training_step(self, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model(x), y)


def lightning_fit(module, data, gradient_clip_val=0.5, ckpt=None, resume=None):
    """Trainer.fit's automatic optimization: optimizer.step(closure) where the closure
    runs training_step, zero_grad, backward and the trainer's gradient clipping
    (on_before_optimizer_step); then the step-interval scheduler. Checkpoints hold
    optimizer.state_dict() under "optimizer_states"."""
    cfg = module.configure_optimizers()
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
    if resume is not None:
        state = torch.load(resume)
        module.model.load_state_dict(state["state_dict"])
        opt.load_state_dict(state["optimizer_states"][0])
        sched.load_state_dict(state["lr_schedulers"][0])
    for i, batch in enumerate(data):
        def closure():
            loss = module.training_step(batch)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.model.parameters(), gradient_clip_val)
            return loss
        opt.step(closure=closure)
        sched.step()
        if ckpt is not None and i == len(data) // 2 - 1:
            torch.save({"state_dict": module.model.state_dict(),
                        "optimizer_states": [opt.state_dict()],
                        "lr_schedulers": [sched.state_dict()]}, ckpt)
    return opt


def test_lightning_automatic_optimization_matches_adamw_and_resumes(tmp_path):
    data = batches(8, seed=9)
    ref = LitModule(make_model(), lambda p: torch.optim.AdamW(p, lr=4e-3, weight_decay=0.02))
    ours = LitModule(make_model(), lambda p: OffloadAdam(p, lr=4e-3, weight_decay=0.02))
    lightning_fit(ref, data)
    lightning_fit(ours, data, ckpt=tmp_path / "last.ckpt")
    assert_close_models(ours.model, ref.model)
    resumed = LitModule(make_model(), lambda p: OffloadAdam(p, lr=4e-3, weight_decay=0.02))
    opt = lightning_fit(resumed, data[4:], resume=tmp_path / "last.ckpt")
    assert opt.step_count == 8
    for a, b in zip(resumed.model.parameters(), ours.model.parameters()):
        assert torch.equal(a, b)


# ---- AMP: torch's GradScaler (fp32 params, fp16 autocast) -------------------------------
#
# A GradScaler drives the optimizer through param_groups: scale(loss).backward();
# unscale_(optimizer) divides each param's .grad in place and notes whether one holds
# an inf or NaN; step(optimizer) calls optimizer.step() unless one did; update() moves
# the scale. torch 1.13's GradScaler takes CUDA tensors only (the CPU one came in torch
# 2.3), so the CI test drives OffloadAdam with MiniGradScaler, which makes exactly those
# calls; test_torch_grad_scaler_* runs torch's own wherever this torch and machine can.

class MiniGradScaler:
    """torch.amp.GradScaler's calls into the optimizer, in plain tensor ops."""

    def __init__(self, init_scale=2.0 ** 10, growth_interval=3):
        self.scale_, self.growth_interval, self.good, self.found_inf = init_scale, \
            growth_interval, 0, None

    def scale(self, loss):
        return loss * self.scale_

    @torch.no_grad()
    def unscale_(self, optimizer):
        found = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    found |= not bool(torch.isfinite(p.grad).all())
                    p.grad.mul_(1.0 / self.scale_)
        self.found_inf = found

    def step(self, optimizer):
        if self.found_inf is None:
            self.unscale_(optimizer)
        if not self.found_inf:
            optimizer.step()

    def update(self):
        self.good = 0 if self.found_inf else self.good + 1
        if self.found_inf:
            self.scale_ /= 2
        elif self.good == self.growth_interval:
            self.scale_, self.good = self.scale_ * 2, 0
        self.found_inf = None

    def get_scale(self):
        return self.scale_


def amp_loop(model, opt, scaler, data, overflow_at=(), device="cpu"):
    """The AMP recipe: scale, backward, unscale_, clip, scaler.step, update, zero_grad.
    Batches in `overflow_at` give inf gradients (the scaler skips their step)."""
    for i, (x, y) in enumerate(data):
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        if i in overflow_at:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_a_grad_scaler_drives_offload_adam_like_adamw(offload, tmp_path):
    data = batches(10, seed=11)
    kw = {"offload": "nvme", "nvme_path": str(tmp_path), "sub_group_size": 256} \
        if offload == "nvme" else {}
    m_ref, m_ours = make_model(), make_model()
    ref = torch.optim.AdamW(m_ref.parameters(), lr=5e-3, weight_decay=0.01)
    ours = OffloadAdam(m_ours.parameters(), lr=5e-3, weight_decay=0.01, **kw)
    s_ref, s_ours = MiniGradScaler(), MiniGradScaler()
    amp_loop(m_ref, ref, s_ref, data, overflow_at=(4,))
    amp_loop(m_ours, ours, s_ours, data, overflow_at=(4,))
    assert_close_models(m_ours, m_ref)
    assert ours.step_count == 9  # the overflowed batch was skipped by the scaler
    assert s_ours.get_scale() == s_ref.get_scale()


def test_a_grad_scaler_with_overlap_backward_is_refused_naming_it():
    """overlap_backward hands each gradient to the engine during backward, scaled; the
    scaler's unscale_ writes the .grad after that: step() must refuse, not apply a
    gradient 1024 times too large, and say what to do."""
    model = make_model()
    opt = OffloadAdam(model.parameters(), lr=5e-3, overlap_backward=True)
    scaler = MiniGradScaler()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batches(1)[0]
    scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"changed after backward handed it to the engine "
                                           r".*GradScaler.*overlap_backward=False"):
        scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def torch_grad_scaler(device):
    """torch's own GradScaler for `device`, or a visible skip where this torch or machine
    has none."""
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device here: torch's CUDA GradScaler runs on the GPU machine")
        return torch.cuda.amp.GradScaler(init_scale=2.0 ** 10, growth_interval=3)
    try:
        return torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    except (AttributeError, TypeError, RuntimeError) as e:
        pytest.skip(f"torch {torch.__version__} has no CPU GradScaler (torch >= 2.3): {e}")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_torch_grad_scaler_drives_offload_adam_like_adamw(device):
    scalers = [torch_grad_scaler(device), torch_grad_scaler(device)]
    data = batches(10, seed=11)
    m_ref, m_ours = make_model().to(device), make_model().to(device)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=5e-3, weight_decay=0.01)
    ours = OffloadAdam(m_ours.parameters(), lr=5e-3, weight_decay=0.01)
    amp_loop(m_ref, ref, scalers[0], data, overflow_at=(4,), device=device)
    amp_loop(m_ours, ours, scalers[1], data, overflow_at=(4,), device=device)
    assert_close_models(m_ours, m_ref)
    assert ours.step_count == 9
    assert scalers[0].get_scale() == scalers[1].get_scale()
