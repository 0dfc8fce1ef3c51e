#!/usr/bin/env python3
"""Trains a small GPT with strata.torch.OffloadAdam, its optimizer state mostly on NVMe.

The task is generated: each sequence is an arithmetic progression modulo the
vocabulary (start and stride random per sequence), so the model has to infer
the stride from the context; the loss falls from ln(vocab) toward 0 as it
learns. The host budget is set below the size of the optimizer state, so most
of the fp32 master weights and Adam moments live in files under --nvme-path
and are streamed through the sub-group pipeline every step.

    PYTHONPATH=build/python /usr/bin/python3 examples/train_gpt.py            # ~20M params
    PYTHONPATH=build/python /usr/bin/python3 examples/train_gpt.py --params 200M --steps 100
    PYTHONPATH=build/python python3 examples/train_gpt.py --device cuda --dtype bf16
"""
import argparse
import math
import os
import shutil
import signal
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

try:
    from strata.torch import OffloadAdam, StrataError
except ImportError as e:  # said after the arguments are parsed: --help works without it
    strata_import_error = e
else:
    strata_import_error = None


class Block(torch.nn.Module):
    def __init__(self, d_model, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d_model)
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.proj = torch.nn.Linear(d_model, d_model)
        self.ln2 = torch.nn.LayerNorm(d_model)
        self.fc = torch.nn.Linear(d_model, 4 * d_model)
        self.out = torch.nn.Linear(4 * d_model, d_model)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(mask[:t, :t], float("-inf")).softmax(dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab, seq, d_model, layers, heads):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Embedding(seq, d_model)
        self.blocks = torch.nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1),
                             persistent=False)
        for m in self.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    torch.nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x, self.mask)
        return self.head(self.ln(x))


def progressions(batch, seq, vocab, generator, device):
    """Arithmetic progressions mod vocab: (inputs, targets) of shape (batch, seq)."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, vocab // 4, (batch, 1), generator=generator)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def parse_count(text):
    units = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}
    text = text.strip().upper()
    try:
        n = int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(float(text))
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 20M, 1.5B, 4096)")
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a count > 0")
    return n


def at_least(low):
    def parse(text):
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer")
        if n < low:
            raise argparse.ArgumentTypeError(f"{n}: give at least {low}")
        return n
    return parse


class Terminated(Exception):
    """SIGTERM or SIGHUP (kill, a job scheduler, a closed terminal): ends the run through
    the same path as Ctrl-C, so the NVMe directory it made is removed."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_terminated(signum, frame):
    # A second signal ends the process at once (the default action).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    raise Terminated(signum)


# The run ends with exit 1 when the loss did not fall clearly, from this many
# steps on (the default run has 60, scripts/gpu-check's 20): a shorter run
# (5 steps of warm-up) need not show a clear fall, and exited 1 after
# training correctly.
JUDGED_STEPS = 20


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default=parse_count("20M"), type=parse_count,
                    help="target model size (e.g. 20M, 100M, 1B); sets --d-model from --layers")
    ap.add_argument("--layers", type=at_least(1), default=6)
    ap.add_argument("--d-model", type=at_least(1), default=None, help="overrides --params")
    ap.add_argument("--heads", type=at_least(1), default=8)
    ap.add_argument("--vocab", type=at_least(8), default=64)
    ap.add_argument("--seq", type=at_least(1), default=32)
    ap.add_argument("--batch", type=at_least(1), default=8)
    ap.add_argument("--steps", type=at_least(1), default=60)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=at_least(1), default=5)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--offload", default="nvme", choices=["nvme", "cpu"])
    ap.add_argument("--nvme-path", default=None,
                    help="directory for the NVMe tier (default: a fresh one under /var/tmp)")
    ap.add_argument("--host-budget", default=None,
                    help="pinned DRAM for state + staging (default: the staging plus a quarter "
                         "of the state)")
    ap.add_argument("--sub-group-size", default=parse_count("1M"),
                    type=lambda s: s if s == "auto" else parse_count(s),
                    help="elements per sub-group, or auto (the planner's choice)")
    ap.add_argument("--threads", type=int, default=None, help="torch and CPU Adam threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu-fraction", default=None,
                    help="share of the optimizer state kept on the device, [0, 1] or auto")
    ap.add_argument("--device-budget", default=None,
                    help="device memory the optimizer may use, e.g. 60GiB (with auto)")
    ap.add_argument("--overlap-backward", action="store_true",
                    help="hand each gradient to the engine during backward")
    args = ap.parse_args()
    if args.gpu_fraction not in (None, "auto"):
        try:
            args.gpu_fraction = float(args.gpu_fraction)
        except ValueError:
            ap.error(f"--gpu-fraction {args.gpu_fraction!r}: give a number in [0, 1] or auto")
    if args.dtype == "fp16" and not args.device.startswith("cuda"):
        ap.error("--dtype fp16 needs --device cuda (this PyTorch has no fp16 matmul on the CPU); "
                 "use bf16 on the CPU")
    if strata_import_error is not None:
        sys.exit(f"train_gpt: cannot import strata.torch ({strata_import_error}); build first "
                 "(scripts/setup) and run with PYTHONPATH=build/python /usr/bin/python3")

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("train_gpt: --device cuda but torch sees no CUDA device")
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.d_model is None:
        per_layer = 12 * args.layers
        d = math.sqrt(args.params / per_layer)
        args.d_model = max(args.heads * 8, int(round(d / 64)) * 64)
    if args.d_model % args.heads:
        ap.error(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.seq, args.d_model, args.layers, args.heads).to(device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    state_bytes = 12 * n_params
    param_bytes = torch.finfo(dtype).bits // 8

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
            signal.signal(sig, raise_terminated)
    nvme_dir, made_dir = args.nvme_path, False
    try:
        if args.offload == "nvme" and nvme_dir is None:
            nvme_dir, made_dir = tempfile.mkdtemp(prefix="strata_demo_", dir="/var/tmp"), True
        return plan_and_train(args, model, device, nvme_dir, n_params, state_bytes, param_bytes)
    except StrataError as e:
        print(f"train_gpt: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("train_gpt: interrupted", file=sys.stderr)
        return 130
    except Terminated as e:
        print(f"train_gpt: ended by {e}", file=sys.stderr)
        return 128 + e.signum
    finally:
        if made_dir:
            shutil.rmtree(nvme_dir, ignore_errors=True)


def plan_and_train(args, model, device, nvme_dir, n_params, state_bytes, param_bytes):
    if args.host_budget is None and args.offload == "nvme":
        # What the planner needs for staging (docs/offload.md): 4 grad, 4 param
        # and 4 NVMe buffers of one sub-group (and 4 B per param of headroom);
        # plus a quarter of the state, so most of it goes to NVMe. With "auto"
        # sub-groups the planner keeps the staging within a quarter of the
        # budget, so a third of the state leaves a quarter of it in DRAM.
        if args.sub_group_size == "auto":
            args.host_budget = state_bytes // 3
        else:
            sg = min(args.sub_group_size, n_params)
            staging = (4 * (n_params + 64 * 256) + 4 * sg * param_bytes
                       + 4 * (12 * sg + 8192))
            args.host_budget = staging + state_bytes // 4
    print(f"model: GPT {args.layers} layers x d_model {args.d_model}, {args.heads} heads, "
          f"vocab {args.vocab}, seq {args.seq}: {n_params / 1e6:.1f}M params ({args.dtype}) on "
          f"{device}; optimizer state {fmt_bytes(state_bytes)}", flush=True)
    if args.offload == "nvme":
        budget = args.host_budget
        print(f"offload: nvme at {nvme_dir}, host budget "
              f"{fmt_bytes(budget) if isinstance(budget, int) else budget} (state "
              f"{fmt_bytes(state_bytes)})", flush=True)
    return train(args, model, device, nvme_dir)


def train(args, model, device, nvme_dir):
    # Named params: checkpoints and exports then carry the model's names.
    decay = [(n, p) for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [(n, p) for n, p in model.named_parameters() if p.dim() < 2]
    try:
        opt = OffloadAdam([{"params": decay, "weight_decay": 0.1},
                           {"params": no_decay, "weight_decay": 0.0}],
                          lr=args.lr, betas=(0.9, 0.95), max_grad_norm=1.0,
                          offload=args.offload, nvme_path=nvme_dir, host_budget=args.host_budget,
                          sub_group_size=args.sub_group_size, threads=args.threads,
                          gpu_fraction=args.gpu_fraction, device_budget=args.device_budget,
                          overlap_backward=args.overlap_backward)
    except ValueError as e:  # an argument OffloadAdam refuses, e.g. --nvme-path a file
        raise SystemExit(f"train_gpt: {e}")
    with opt:
        return train_with(args, model, device, opt)


def train_with(args, model, device, opt):
    plan = opt.plan()
    print(plan["text"], flush=True)
    print(f"state: {fmt_bytes(plan['host_state_bytes'])} in DRAM ({plan['host_sub_groups']} "
          f"sub-groups), {fmt_bytes(plan['nvme_state_bytes'])} on NVMe "
          f"({plan['nvme_sub_groups']} sub-groups)", flush=True)

    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) *
        (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))
    gen = torch.Generator().manual_seed(args.seed + 1)
    losses, step_times = [], []
    nvme_read = nvme_write = 0
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = progressions(args.batch, args.seq, args.vocab, gen, device)
        t0 = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, args.vocab), y.reshape(-1))
        opt.backward(loss)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        sched.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        s = opt.last_step()
        tm = s["times"]
        losses.append(loss.item())
        step_times.append(t2 - t0)
        nvme_read += s["read_bytes"]
        nvme_write += s["write_bytes"]
        print(f"step {step:3d}/{args.steps} | loss {losses[-1]:.4f} | {t2 - t0:.2f} s "
              f"(fwd+bwd {t1 - t0:.2f}, opt {t2 - t1:.2f}: d2h {tm['d2h']:.2f} "
              f"read {tm['read']:.2f} adam {tm['adam']:.2f} write {tm['write']:.2f} "
              f"h2d {tm['h2d']:.2f}) | nvme r {fmt_bytes(s['read_bytes'])} "
              f"w {fmt_bytes(s['write_bytes'])} | lr {sched.get_last_lr()[0]:.2e}"
              f"{' | SKIPPED (overflow)' if s['skipped'] else ''}", flush=True)
    total = time.perf_counter() - t_start
    k = max(1, min(5, len(losses) // 4))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print("\nsummary")
    print(f"  loss        {first:.4f} -> {last:.4f} (mean of first/last {k} steps; "
          f"ln(vocab) = {math.log(args.vocab):.4f})")
    print(f"  time        {total:.1f} s for {args.steps} steps, "
          f"{sum(step_times) / len(step_times):.2f} s/step, "
          f"{args.steps * args.batch * args.seq / total:.0f} tokens/s")
    print(f"  state       {fmt_bytes(plan['host_state_bytes'])} DRAM, "
          f"{fmt_bytes(plan['nvme_state_bytes'])} NVMe")
    print(f"  nvme        {fmt_bytes(nvme_read)} read, {fmt_bytes(nvme_write)} written")
    if args.steps < JUDGED_STEPS:
        print(f"  loss check  not made: {args.steps} steps are too few to judge (it is made "
              f"from --steps {JUDGED_STEPS} on)")
    elif not last < first * 0.8:
        print("train_gpt: the loss did not fall clearly", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
