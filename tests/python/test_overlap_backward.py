"""OffloadAdam(overlap_backward=True): gradients handed to the engine during backward.

Each registered param's hook reports its gradient as soon as autograd has
accumulated it, so the engine starts that sub-group's statistics (several
ranks: reduce-scatter and copy to host) while backward goes on. The results
must be bitwise those of the step-time hand-over, for every dtype, with
clipping, the fp16 loss scaler's skipped steps, set_to_none grads, gradient
accumulation (no_sync()), unused params and re-registered params; misuse (a
second gradient before step()) must raise, and step() must refuse until
zero_grad().
"""
import gc
import weakref

import pytest
import torch

from strata.torch import OffloadAdam

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_model(dtype, unused=False):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(10, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48), torch.nn.Tanh(),
              torch.nn.Linear(48, 3)]
    if unused:
        layers.append(torch.nn.Linear(3, 3))  # never called: no gradient
    return torch.nn.Sequential(*layers).to(dtype)


def forward(model, x, unused=False):
    """In fp32 whatever the params' dtype (PyTorch 1.13 has no fp16 matmul on CPU)."""
    h = x.float()
    for layer in (model[:-1] if unused else model):
        if isinstance(layer, torch.nn.Linear):
            h = torch.nn.functional.linear(h, layer.weight.float(), layer.bias.float())
        else:
            h = layer(h)
    return h


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(32, 10, generator=g), torch.randn(32, 3, generator=g)


def make_opt(model, overlap, **kwargs):
    args = dict(lr=2e-3, weight_decay=0.05, max_grad_norm=0.5, sub_group_size=1024)
    args.update(kwargs)
    return OffloadAdam(model.parameters(), overlap_backward=overlap, **args)


def loss_of(model, step, dtype, unused=False, scale=1.0):
    x, y = batch(step)
    return torch.nn.functional.mse_loss(forward(model, x, unused), y) * scale


def assert_same(a, b):
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def _emulated_post_accumulate_grad_hook(self, hook):
    """torch >= 2.1's Tensor.register_post_accumulate_grad_hook on an older torch:
    hook(param) once autograd has accumulated param.grad."""
    node = self.expand_as(self).grad_fn.next_functions[0][0]
    self._emulated_accumulate_node = node  # autograd holds it weakly
    return node.register_hook(lambda *_: hook(self))


@pytest.fixture(params=["autograd node", "post-accumulate hook"])
def hook_api(request, monkeypatch):
    """Runs a test over both ways OffloadAdam hooks a param: torch >= 2.1's
    register_post_accumulate_grad_hook (emulated on an older torch, such as
    Debian's 1.13) and the AccumulateGrad node's post hook (where the tensor
    method is absent: hidden on a newer torch)."""
    has = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")
    if request.param == "autograd node" and has:
        monkeypatch.delattr(torch.Tensor, "register_post_accumulate_grad_hook")
    if request.param == "post-accumulate hook" and not has:
        monkeypatch.setattr(torch.Tensor, "register_post_accumulate_grad_hook",
                            _emulated_post_accumulate_grad_hook, raising=False)
    return request.param


class Recorder:
    """The engine, with its grad_ready calls recorded."""

    def __init__(self, engine):
        self._engine, self.ready = engine, []

    def grad_ready(self, index):
        self.ready.append(index)
        self._engine.grad_ready(index)

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("set_to_none", [False, True])
def test_overlap_matches_the_step_time_hand_over_bitwise(dtype, set_to_none, hook_api):
    models = [make_model(DTYPES[dtype]) for _ in range(2)]
    opts = [make_opt(m, overlap) for m, overlap in zip(models, (False, True))]
    skipped = []
    for step in range(6):
        # fp16: step 3's loss overflows, so the loss scaler skips it.
        scale = 1e30 if dtype == "fp16" and step == 3 else 1.0
        for model, opt in zip(models, opts):
            opt.backward(loss_of(model, step, DTYPES[dtype], scale=scale))
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        assert_same(*models)
        skipped.append([opt.last_step()["skipped"] for opt in opts])
    assert all(a == b for a, b in skipped)
    assert any(a for a, _ in skipped) == (dtype == "fp16")
    states = [opt.state_dict()["state"]["strata"] for opt in opts]
    assert states[0]["loss_scaler"] == states[1]["loss_scaler"]
    for a, b in zip(states[0]["arrays"], states[1]["arrays"]):
        assert torch.equal(a, b)  # master weights, m and v


def test_gradients_are_handed_over_before_backward_ends(hook_api):
    model = make_model(torch.float32)
    opt = make_opt(model, True)
    opt._engine = recorder = Recorder(opt._engine)
    n = len(list(model.parameters()))
    # The hook API the fixture chose is the one OffloadAdam used (a node is kept
    # alive only for the AccumulateGrad hook).
    assert len(opt._hooks) == n
    assert all((node is None) == (hook_api == "post-accumulate hook")
               for _, node in opt._hooks.values())
    for step in range(2):
        x, y = batch(step)
        x.requires_grad_(True)
        at_input = []
        # The input's gradient comes last: by then every layer but the first has
        # handed its gradients over (the first layer's come with the input's).
        x.register_hook(lambda g: at_input.append(len(recorder.ready)))
        torch.nn.functional.mse_loss(forward(model, x), y).backward()
        assert at_input and at_input[0] >= n - 2
        assert sorted(recorder.ready) == list(range(n)), "each param once"
        assert recorder.ready[0] >= n - 2, "the last layer's gradients come first"
        opt.step()
        opt.zero_grad()
        recorder.ready.clear()


def test_accumulation_with_no_sync_matches_without_overlap():
    models = [make_model(torch.bfloat16) for _ in range(2)]
    opts = [make_opt(m, overlap) for m, overlap in zip(models, (False, True))]
    for step in range(3):
        for model, opt in zip(models, opts):
            for micro in range(3):
                loss = loss_of(model, 10 * step + micro, torch.bfloat16)
                if micro < 2:
                    with opt.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            opt.step()
            opt.zero_grad()
        assert_same(*models)


def test_a_second_gradient_before_step_raises_and_step_refuses_until_zero_grad():
    models = [make_model(torch.float32) for _ in range(2)]
    ref, opt = make_opt(models[0], False), make_opt(models[1], True)
    loss_of(models[1], 0, torch.float32).backward()
    with pytest.raises(RuntimeError, match=r"second gradient before step\(\).*no_sync"):
        loss_of(models[1], 1, torch.float32).backward()
    with pytest.raises(RuntimeError, match=r"zero_grad\(\)"):
        opt.step()
    opt.zero_grad()
    for step in range(2):
        for model, o in zip(models, (ref, opt)):
            loss_of(model, step, torch.float32).backward()
            o.step()
            o.zero_grad()
        assert_same(*models)


def test_unused_params_and_replaced_storage_match_without_overlap():
    models = [make_model(torch.float32, unused=True) for _ in range(2)]
    opts = [make_opt(m, overlap) for m, overlap in zip(models, (False, True))]
    for step in range(4):
        for model, opt in zip(models, opts):
            if step == 2:  # new storage, same shape: re-registered (and re-hooked)
                for p in model.parameters():
                    p.data = p.data.clone()
            loss_of(model, step, torch.float32, unused=True).backward()
            opt.step()
            opt.zero_grad()
        assert_same(*models)
    # The re-registered params still hand their gradients over during backward.
    opts[1]._engine = recorder = Recorder(opts[1]._engine)
    loss_of(models[1], 9, torch.float32, unused=True).backward()
    assert len(recorder.ready) == len(list(models[1].parameters())) - 2  # not the unused layer


def test_the_hooks_do_not_keep_the_optimizer_alive():
    model = make_model(torch.float32)
    opt = make_opt(model, True)
    ref = weakref.ref(opt)
    loss_of(model, 0, torch.float32).backward()
    opt.step()
    del opt
    gc.collect()
    assert ref() is None
    model.zero_grad()
    loss_of(model, 1, torch.float32).backward()  # no optimizer to report to: no error
    assert all(p.grad is not None for p in model.parameters())


def test_overlap_backward_must_be_a_bool():
    with pytest.raises(ValueError, match="overlap_backward"):
        make_opt(make_model(torch.float32), "yes")


@pytest.mark.parametrize("set_to_none", [False, True])
def test_a_grad_written_after_the_hand_over_is_refused(set_to_none):
    """clip_grad_norm_ after backward with overlap_backward=True: the engine had read
    the gradients already, so the clip was ignored (set_to_none=True) or applied from
    the next step on. step() refuses, naming the param, until a clean backward."""
    model = make_model(torch.float32)
    opt = make_opt(model, True, max_grad_norm=None)
    opt.zero_grad(set_to_none=set_to_none)
    before = [p.detach().clone() for p in model.parameters()]
    loss_of(model, 0, torch.float32).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with pytest.raises(RuntimeError, match=r"the .grad of param 0 .* changed after backward "
                                           r"handed it to the engine .*max_grad_norm"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    opt.zero_grad(set_to_none=set_to_none)
    loss_of(model, 0, torch.float32).backward()
    opt.step()
    assert opt.step_count == 1


def test_an_unscaled_fp16_backward_is_refused_before_anything_is_handed_over():
    """With several ranks a refusal in step() came after this rank's reduce-scatters had
    gone out, so the advised retry met the other ranks' step. The first hook refuses,
    before the engine is handed anything; the retry then steps as usual."""
    model = make_model(torch.float16)
    opt = make_opt(model, True, config={"fp16": {"initial_scale_power": 4}})
    recorder = Recorder(opt._engine)
    opt._engine = recorder
    with pytest.raises(RuntimeError, match=r"OffloadAdam.backward: the params are float16"):
        loss_of(model, 0, torch.float16).backward()
    assert recorder.ready == []
    opt.zero_grad()
    opt.backward(loss_of(model, 0, torch.float16))
    opt.step()
    assert opt.step_count == 1 and len(recorder.ready) == len(list(model.parameters()))


def test_a_load_between_backward_and_step_takes_the_next_backwards_gradients():
    """load_state_dict() drops the gradients the backward before it handed over (the
    engine's RestoreCounters): the next backward reports afresh, and the step takes
    what .grad holds then, as without overlap (it used to raise "second gradient")."""
    models = [make_model(torch.float32) for _ in range(2)]
    opts = [make_opt(m, overlap) for m, overlap in zip(models, (False, True))]
    for model, opt in zip(models, opts):
        loss_of(model, 0, torch.float32).backward()
        opt.step()
        opt.zero_grad()
    saved = opts[1].state_dict()
    for model, opt in zip(models, opts):
        loss_of(model, 1, torch.float32).backward()  # handed over, then replaced
        opt.load_state_dict(saved)
        loss_of(model, 2, torch.float32).backward()  # .grad: both backwards' sum
        opt.step()
        opt.zero_grad()
    assert_same(*models)
