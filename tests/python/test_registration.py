"""OffloadAdam's registration check: the engine holds each param's memory, so
every step first compares the params with what was registered.

A param whose storage was replaced (model.double().float(), p.data =
p.data.clone(), ...) must be re-registered: before the check, the engine
wrote into the freed memory (a 16x4 Linear after m.double().float() ended in
a segfault). Any other change (dtype, shape, device, requires_grad, the
groups' lists) must raise an error naming the param, before the engine
touches anything. CI also runs this file under AddressSanitizer
(scripts/asan_python), where a stale access is a hard error.
"""
import copy
import os
import warnings

import pytest
import torch

from strata import _strata
from strata.torch import OffloadAdam

ATOL, RTOL = 2e-6, 1e-5


def linear():
    torch.manual_seed(0)
    return torch.nn.Linear(16, 4)


def batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def train(model, opt, steps, before_step=None):
    x, y = batch()
    for s in range(steps):
        torch.nn.functional.mse_loss(model(x), y).backward()
        if before_step is not None:
            before_step(s)
        opt.step()
        opt.zero_grad()


def assert_same(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")


def offload_kwargs(offload, tmp_path):
    if offload == "nvme":
        return {"offload": "nvme", "nvme_path": str(tmp_path), "sub_group_size": 16}
    return {"offload": "cpu"}


def replace_storage(how):
    """Each way a trainer replaces a param's storage with the same shape and dtype."""
    def go(model):
        if how == "double_float":
            model.double().float()
        elif how == "data_clone":
            for p in model.parameters():
                p.data = p.data.clone()
        elif how == "to_copy":
            for p in model.parameters():
                p.data = p.data.to(torch.float32, copy=True)
        elif how == "load_state_dict_assign":
            # What Accelerate's prepare and meta-device init do: new tensors in place.
            new = {k: v.clone() for k, v in model.state_dict().items()}
            for name, p in model.named_parameters():
                p.data = new[name]
    return go


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("how", ["double_float", "data_clone", "to_copy",
                                 "load_state_dict_assign"])
def test_replaced_storage_is_reregistered_and_training_is_unchanged(how, offload, tmp_path):
    m_ours, m_ref = linear(), linear()
    ours = OffloadAdam(m_ours.named_parameters(), lr=1e-2, **offload_kwargs(offload, tmp_path))
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-2, weight_decay=0.0)
    train(m_ours, ours, 2)
    train(m_ref, ref, 2)
    old = [p.data_ptr() for p in m_ours.parameters()]
    replace_storage(how)(m_ours)
    assert [p.data_ptr() for p in m_ours.parameters()] != old, "the case must move storage"
    # Churn the allocator so the freed blocks are reused by other tensors.
    junk = [torch.full((16, 4), 7.0) for _ in range(8)]
    train(m_ours, ours, 3)
    train(m_ref, ref, 3)
    assert_same(m_ours, m_ref)
    assert all(torch.equal(j, torch.full((16, 4), 7.0)) for j in junk), \
        "the engine wrote into memory it no longer owns"
    # The step wrote the new tensors, and zero_grad points .grad at the engine's buffers.
    assert all(p.grad is not None and not p.grad.any() for p in m_ours.parameters())


def test_params_that_trade_storage_are_reregistered():
    """New storage where another param's old storage was (allocators reuse freed
    blocks; here two params swap theirs): every param is re-registered at once, and
    each continues from the values it now holds, as with torch.optim."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False),
                                   torch.nn.Linear(4, 4, bias=False))
    ours, twin = model(), model()
    opt = OffloadAdam(ours.parameters(), lr=1e-2)
    opt_twin = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.0)
    for m, o in ((ours, opt), (twin, opt_twin)):
        a, b = m[0].weight, m[1].weight
        a.data, b.data = b.data, a.data
        for i, p in enumerate(m.parameters()):
            p.grad = torch.full_like(p, 0.1 * (i + 1))
        o.step()
    assert_same(ours, twin)


def test_params_whose_memory_overlaps_are_refused_naming_both():
    """Two params that are overlapping views of one storage would both be written
    in place by a step, the result depending on the order: refused at construction,
    naming both. Adjacent views are separate memory and train."""
    base = torch.zeros(10)
    a, b = torch.nn.Parameter(base[0:6]), torch.nn.Parameter(base[4:10])
    with pytest.raises(_strata.InvalidArgumentError,
                       match=r"the data of param 1 \(b\) .* overlaps the data of param 0 \(a\)"):
        OffloadAdam([("a", a), ("b", b)], lr=1e-2)
    a, b = torch.nn.Parameter(base[0:5]), torch.nn.Parameter(base[5:10])
    opt = OffloadAdam([("a", a), ("b", b)], lr=1e-2)
    a.grad, b.grad = torch.ones(5), -torch.ones(5)
    opt.step()
    assert torch.all(base[0:5] < 0) and torch.all(base[5:10] > 0)


def test_a_grad_buffer_whose_storage_was_replaced_is_reregistered():
    """After zero_grad() a param's .grad is the engine's buffer; module.to()/.double()
    replace a grad's storage as they do a param's, and the param's storage may land
    where it was (same address): the buffer is checked too."""
    m_ours, m_ref = linear(), linear()
    ours = OffloadAdam(m_ours.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-2, weight_decay=0.0)
    train(m_ours, ours, 1)
    train(m_ref, ref, 1)
    for p in m_ours.parameters():
        p.grad.data = p.grad.data.clone()     # the buffer object, new storage
    junk = [torch.full((16, 4), 7.0) for _ in range(8)]
    train(m_ours, ours, 2)
    train(m_ref, ref, 2)
    assert_same(m_ours, m_ref)
    assert all(torch.equal(j, torch.full((16, 4), 7.0)) for j in junk)


def test_replaced_storage_while_a_step_runs_under_a_closure():
    """A closure that replaces storage (rare, but allowed): the check runs after it."""
    m = linear()
    opt = OffloadAdam(m.parameters(), lr=1e-2)
    x, y = batch()

    def closure():
        m.double().float()
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        return loss

    before = [p.detach().clone() for p in m.parameters()]
    opt.step(closure)
    assert all(not torch.equal(a, b) for a, b in zip(m.parameters(), before))


def changed_dtype(model, opt):
    model.double()


def changed_shape(model, opt):
    model.weight.data = torch.zeros(16, 4)


def not_contiguous(model, opt):
    model.weight.data = torch.zeros(16, 4).t()


def frozen_later(model, opt):
    model.bias.requires_grad_(False)


def group_edited(model, opt):
    opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.zeros(3)))


def group_added(model, opt):
    opt.param_groups.append({"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 1e-3,
                             "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0})


@pytest.mark.parametrize("change,message", [
    (changed_dtype, r"param 0 \('weight'\).*changed dtype from torch.float32 to torch.float64"),
    (changed_shape, r"param 0 \('weight'\).*changed shape from \(4, 16\) to \(16, 4\)"),
    (not_contiguous, r"param 0 \('weight'\).*no longer dense and contiguous"),
    (frozen_later, r"param 1 \('bias'\).*no longer requires grad"),
    (group_edited, r"param_groups\[0\]\['params'\] is not the list"),
    (group_added, r"param_groups has 2 groups"),
])
def test_other_changes_raise_naming_the_param_and_change_nothing(change, message):
    m = linear()
    opt = OffloadAdam(m.named_parameters(), lr=1e-2)
    train(m, opt, 1)
    x, y = batch()
    torch.nn.functional.mse_loss(m(x), y).backward()
    change(m, opt)
    before = [p.detach().clone() for p in m.parameters()]
    count = opt.step_count
    with pytest.raises(RuntimeError, match=message):
        opt.step()
    assert opt.step_count == count
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), before))


def test_a_param_frozen_at_construction_that_starts_training_is_named():
    m = linear()
    m.bias.requires_grad_(False)
    opt = OffloadAdam(m.parameters(), lr=1e-2)
    train(m, opt, 1)
    m.bias.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[1\].*requires grad "
                                           "now but did not"):
        train(m, opt, 1)


def test_grads_never_land_in_another_params_buffer():
    """The old failure: requires_grad changed, grads were copied by position into
    the wrong buffers. Now the step refuses, and zero_grad keeps each .grad with
    its own param."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = OffloadAdam(model.named_parameters(), lr=1e-2)
    model[0].weight.requires_grad_(False)
    opt.zero_grad(set_to_none=False)
    for p in model.parameters():
        assert p.grad is None or p.grad.shape == p.shape
    with pytest.raises(RuntimeError, match=r"'0.weight'.*no longer requires grad"):
        opt.step()


@pytest.mark.skipif(not torch.cuda.is_available() or not _strata.cuda_available(),
                    reason="no CUDA device here; model.cuda() after building the optimizer is "
                           "checked on the GPU machine")
def test_model_cuda_after_construction_is_refused():
    m = linear()
    opt = OffloadAdam(m.parameters(), lr=1e-2)
    m.cuda()
    with pytest.raises(RuntimeError, match="moved from cpu to cuda"):
        opt.step()


# ---- Writes into the params between steps -----------------------------------------
#
# The engine writes the params from its fp32 master weights at every step; a
# value the trainer wrote into a param (model.load_state_dict after building
# the optimizer, a clamp under no_grad, an embedding's max_norm, a new .data)
# used to be overwritten by the next step as if never written. torch.optim
# steps from the param's current value: so must OffloadAdam.

def write_pretrained(model):
    torch.manual_seed(7)
    model.load_state_dict(torch.nn.Linear(16, 4).state_dict())


def clamp_under_no_grad(model):
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.05, 0.05)


def new_data(model):
    model.bias.data = torch.full((4,), 5.0)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("write", [write_pretrained, clamp_under_no_grad, new_data])
def test_values_written_into_params_are_where_the_next_step_starts(write, offload, tmp_path):
    m_ours, m_ref = linear(), linear()
    ours = OffloadAdam(m_ours.parameters(), lr=1e-2, weight_decay=0.1,
                       **offload_kwargs(offload, tmp_path))
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-2, weight_decay=0.1)
    train(m_ours, ours, 2)
    train(m_ref, ref, 2)
    write(m_ours)
    write(m_ref)
    train(m_ours, ours, 2)
    train(m_ref, ref, 2)
    assert_same(m_ours, m_ref)


@pytest.mark.skipif(not torch.cuda.is_available() or not _strata.cuda_available(),
                    reason="no CUDA device here; written CUDA params are checked on the GPU "
                           "machine")
@pytest.mark.parametrize("write", [write_pretrained, clamp_under_no_grad])
def test_values_written_into_cuda_params_are_where_the_next_step_starts(write):
    """On CUDA the engine reads the written params itself (a copy to the host on its
    stream, after the trainer's work on the current one)."""
    m_ours, m_ref = linear().cuda(), linear().cuda()
    ours = OffloadAdam(m_ours.parameters(), lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-2, weight_decay=0.1)
    x, y = (t.cuda() for t in batch())

    def run(model, opt):
        for _ in range(2):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    run(m_ours, ours)
    run(m_ref, ref)
    write(m_ours)
    write(m_ref)
    run(m_ours, ours)
    run(m_ref, ref)
    assert_same(m_ours, m_ref)


def test_a_write_through_data_is_taken_by_reload_params():
    """torch does not track writes through .data: reload_params() takes them."""
    m_ours, m_ref = linear(), linear()
    ours = OffloadAdam(m_ours.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-2, weight_decay=0.0)
    for model, opt in ((m_ours, ours), (m_ref, ref)):
        train(model, opt, 1)
        for p in model.parameters():
            p.data.clamp_(-0.01, 0.01)
    ours.reload_params()
    train(m_ours, ours, 1)
    train(m_ref, ref, 1)
    assert_same(m_ours, m_ref)
    with pytest.raises(ValueError, match=r"params\[0\] \(shape \(3,\)\) is not a param"):
        ours.reload_params([torch.zeros(3)])


def test_a_version_bump_that_changes_nothing_keeps_the_fp32_master():
    """bf16 params: an in-place write of the same values must not round the fp32
    master weights to bf16 (they would drift from a run without the write)."""
    def run(touch):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 4).to(torch.bfloat16)
        opt = OffloadAdam(model.parameters(), lr=1e-3)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        for _ in range(3):
            model(x).float().square().mean().backward()
            if touch:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1.0)  # bumps the version, changes no value
            opt.step()
            opt.zero_grad()
        return torch.cat([t.reshape(-1) for _, _, t in opt.iter_state()])
    assert torch.equal(run(False), run(True))


def _rss_and_peak():
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return tuple(int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_adopting_written_params_holds_no_copy_of_the_state(offload, tmp_path):
    """A write into the params is adopted into the master weights in place: the step
    after it used to read each touched sub-group's whole state into a new tensor (up
    to 12 GB at the default sub_group_size) and write it back."""
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("AddressSanitizer's allocator holds freed memory in quarantine: RSS "
                    "measures it, not the step (scripts/asan_python)")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to VmRSS (Linux >= 4.0)
    except OSError as e:
        pytest.skip(f"cannot reset the peak RSS here ({e}): the bound is not measurable")
    n = 1 << 24  # one sub-group: 192 MiB of fp32 state
    p = torch.nn.Parameter(torch.zeros(n))
    kw = {"offload": "cpu"} if offload == "cpu" else {"offload": "nvme",
                                                      "nvme_path": str(tmp_path)}
    opt = OffloadAdam([p], lr=1e-3, sub_group_size=n, **kw)
    for _ in range(2):
        p.grad = torch.full((n,), 0.5)
        opt.step()
    with torch.no_grad():
        p.add_(1.0)  # every element differs from its master weight
    want = p.detach().clone()
    p.grad = torch.zeros(n)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss, _ = _rss_and_peak()
    opt.step()
    _, peak = _rss_and_peak()
    state_bytes = n * 12
    assert peak - rss < state_bytes // 2, f"the step's peak RSS grew by {peak - rss} bytes"
    # The written values became the master weights (a zero grad: Adam moves them by
    # its moments only, far less than the write).
    torch.testing.assert_close(p.detach(), want, atol=1e-2, rtol=0)


# ---- optimizer.load_state_dict after writes into the params ----------------------------
#
# torch.optim's state holds no params: after model.load_state_dict(W) and
# optimizer.load_state_dict(sd), in either order, the next step starts from W.
# OffloadAdam's state_dict holds fp32 master weights, and the loaded ones used
# to replace W when the model was loaded first (at the next step with the
# "arrays" kind, at the load itself with state_dict_dir).

def other_weights(model):
    torch.manual_seed(7)
    model.load_state_dict(torch.nn.Linear(16, 4).state_dict())


def other_storage(model):
    torch.manual_seed(7)
    new = torch.nn.Linear(16, 4)
    model.weight.data = new.weight.detach().clone()
    model.bias.data = new.bias.detach().clone()


def state_dict_kind(kind, tmp_path):
    return {"state_dict_dir": str(tmp_path / "sd")} if kind == "state_dict_dir" else {}


def masters(opt):
    """Each registered param's fp32 master weight, flat, as the engine holds it."""
    state = {i: t for i, _, t in opt.iter_state()}
    bounds = opt._engine.sub_groups()
    out = []
    for offset, elems in opt._engine.layout():
        i = next(i for i, (b, e) in enumerate(bounds) if b <= offset < e or elems == 0)
        begin = bounds[i][0]
        out.append(state[i][offset - begin:offset - begin + elems].clone())
    return out


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("kind", ["arrays", "state_dict_dir"])
@pytest.mark.parametrize("order", ["model_first", "optimizer_first", "model_before_building"])
@pytest.mark.parametrize("write", [other_weights, other_storage])
def test_weights_given_to_the_model_win_over_the_loaded_master_in_either_order(
        kind, order, write, offload, tmp_path):
    kw = dict(state_dict_kind(kind, tmp_path), **offload_kwargs(offload, tmp_path))
    m_ours, m_ref = linear(), linear()
    ours = OffloadAdam(m_ours.parameters(), lr=1e-2, weight_decay=0.1, **kw)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-2, weight_decay=0.1)
    train(m_ours, ours, 3)
    train(m_ref, ref, 3)
    sd_ours, sd_ref = ours.state_dict(), copy.deepcopy(ref.state_dict())
    ours.close()

    m_ours, m_ref = linear(), linear()
    if order == "model_before_building":
        write(m_ours)
        write(m_ref)
    ours = OffloadAdam(m_ours.parameters(), lr=1e-2, weight_decay=0.1, **kw)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-2, weight_decay=0.1)
    for model, opt, sd in ((m_ours, ours, sd_ours), (m_ref, ref, sd_ref)):
        if order == "model_before_building":
            opt.load_state_dict(sd)
        elif order == "model_first":
            write(model)
            opt.load_state_dict(sd)
        else:
            opt.load_state_dict(sd)
            write(model)
    for p, q in zip(m_ours.parameters(), m_ref.parameters()):
        assert torch.equal(p, q), "the load replaced the weights the model was given"
    if order == "model_before_building":
        # Indistinguishable from a model never loaded: the first step says which
        # weights it goes on from.
        with pytest.warns(UserWarning, match="were not written since"):
            train(m_ours, ours, 2)
    else:
        train(m_ours, ours, 2)
    train(m_ref, ref, 2)
    assert_same(m_ours, m_ref)
    assert ours.step_count == 5


@pytest.mark.parametrize("kind", ["arrays", "state_dict_dir"])
def test_a_state_dict_loaded_into_a_model_never_loaded_is_warned_about_at_the_step(
        kind, tmp_path):
    """torch's rule (the model's weights win) turns a resume that forgot the model's
    state_dict into training from the model's fresh weights: the first step says so,
    unless the model was written after the load, or before it (after building)."""
    kw = state_dict_kind(kind, tmp_path)
    model = linear()
    opt = OffloadAdam(model.parameters(), lr=1e-2, **kw)
    train(model, opt, 3)
    sd, weights = opt.state_dict(), copy.deepcopy(model.state_dict())
    opt.close()

    def resume(load_model):
        torch.manual_seed(11)
        fresh = torch.nn.Linear(16, 4)  # other initial weights than the saved ones
        o = OffloadAdam(fresh.parameters(), lr=1e-2, **kw)
        if load_model == "before":
            fresh.load_state_dict(weights)
        o.load_state_dict(sd)
        if load_model == "after":
            fresh.load_state_dict(weights)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(fresh, o, 1)
        o.close()
        return [str(w.message) for w in caught if "were not written since" in str(w.message)]

    said = resume(None)
    assert len(said) == 1 and "load the model's state_dict too" in said[0], said
    assert resume("before") == []
    assert resume("after") == []


@pytest.mark.parametrize("kind", ["arrays", "state_dict_dir"])
def test_a_bf16_load_keeps_the_fp32_master_where_the_model_holds_it_rounded(kind, tmp_path):
    """The master weights are more precise than bf16 params. A consistent resume
    (model, then optimizer) keeps them bitwise and continues exactly; elements the
    trainer changed since (pruned to 0 here) take the model's values."""
    x = batch()[0].to(torch.bfloat16)

    def train_bf16(model, opt, steps):
        for _ in range(steps):
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4).to(torch.bfloat16)
    opt = OffloadAdam(model.parameters(), lr=1e-2, weight_decay=0.1,
                      **state_dict_kind(kind, tmp_path))
    train_bf16(model, opt, 3)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), opt.state_dict()
    saved = masters(opt)
    assert not torch.equal(saved[0].to(torch.bfloat16).float(), saved[0]), \
        "the case needs masters that bf16 does not hold exactly"
    train_bf16(model, opt, 3)
    first = [p.detach().clone() for p in model.parameters()]

    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    assert all(torch.equal(a, b) for a, b in zip(masters(opt), saved))
    train_bf16(model, opt, 3)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), first))

    # The same into a new optimizer over a model loaded before building it.
    torch.manual_seed(1)
    fresh = torch.nn.Linear(16, 4).to(torch.bfloat16)
    fresh.load_state_dict(saved_model)
    fresh_opt = OffloadAdam(fresh.parameters(), lr=1e-2, weight_decay=0.1,
                            **state_dict_kind(kind, tmp_path / "fresh"))
    fresh_opt.load_state_dict(saved_opt)
    assert all(torch.equal(a, b) for a, b in zip(masters(fresh_opt), saved))
    train_bf16(fresh, fresh_opt, 3)
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), first))

    # The same the other way round: a new optimizer over a fresh model loads its
    # state first, the model's comes next. The load kept the fresh weights
    # unwritten; the step compares them with the loaded master only then, once
    # the model holds it rounded. (The fresh weights became the master at the
    # load, and the model's load then brought back only the bf16 values.)
    torch.manual_seed(2)
    late = torch.nn.Linear(16, 4).to(torch.bfloat16)
    fresh_weights = [p.detach().clone() for p in late.parameters()]
    late_opt = OffloadAdam(late.parameters(), lr=1e-2, weight_decay=0.1,
                           **state_dict_kind(kind, tmp_path / "late"))
    late_opt.load_state_dict(saved_opt)
    assert all(torch.equal(p, q) for p, q in zip(late.parameters(), fresh_weights)), \
        "the load wrote into the fresh model's params"
    late.load_state_dict(saved_model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_bf16(late, late_opt, 3)
    assert not [w for w in caught if "were not written since" in str(w.message)]
    assert all(torch.equal(p, q) for p, q in zip(late.parameters(), first))

    model.load_state_dict(saved_model)
    with torch.no_grad():
        model.weight[0].zero_()  # pruned after the save
    opt.load_state_dict(saved_opt)
    weight, bias = masters(opt)
    assert torch.equal(weight[:16], torch.zeros(16))
    assert torch.equal(weight[16:], saved[0][16:]) and torch.equal(bias, saved[1])
    assert torch.equal(model.weight[0], torch.zeros(16, dtype=torch.bfloat16))


@pytest.mark.parametrize("kind", ["arrays", "state_dict_dir"])
def test_a_load_writes_the_loaded_weights_into_params_the_model_left_alone(kind, tmp_path):
    """Rolled back without a model load, the params are the loaded master weights
    at once, so the next forward and its step agree (with the "arrays" kind the
    params kept the newer values, and the step applied their gradient to the
    older master)."""
    model = linear()
    opt = OffloadAdam(model.parameters(), lr=1e-2, **state_dict_kind(kind, tmp_path))
    train(model, opt, 2)
    saved_weights, saved_opt = copy.deepcopy(model.state_dict()), opt.state_dict()
    train(model, opt, 3)
    after = copy.deepcopy(model.state_dict())
    opt.load_state_dict(saved_opt)
    assert all(torch.equal(model.state_dict()[k], saved_weights[k]) for k in saved_weights)
    train(model, opt, 3)
    assert all(torch.equal(model.state_dict()[k], after[k]) for k in after)


@pytest.mark.parametrize("convert", ["double_float", "half"])
def test_zero_grad_after_a_conversion_touches_no_freed_memory(convert):
    """zero_grad() right after model.double().float() zeroed the grad memory the
    conversion had freed (heap corruption under the default allocator); now the
    buffers are re-registered first, and after an unsupported conversion the engine
    zeroes nothing and step() names it."""
    m_ours, m_ref = linear(), linear()
    ours = OffloadAdam(m_ours.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-2, weight_decay=0.0)
    train(m_ours, ours, 1)
    train(m_ref, ref, 1)
    if convert == "half":
        m_ours.half()
        ours.zero_grad()
        with pytest.raises(RuntimeError, match=r"step: param 0 .* changed dtype"):
            ours.step()
        return
    m_ours.double().float()
    ours.zero_grad()
    assert all(torch.count_nonzero(p.grad) == 0 for p in m_ours.parameters())
    train(m_ours, ours, 2)
    train(m_ref, ref, 2)
    assert_same(m_ours, m_ref)
