#!/usr/bin/python3
"""Side-by-side: PyTorch's CPU AdamW (foreach=True) vs `strata bench adam`.

Run with Debian's Python (it has python3-torch):
    /usr/bin/python3 bench/cpu_adam_vs_torch.py --params 256M --threads 2
    MALLOC_MMAP_THRESHOLD_=4294967296 /usr/bin/python3 bench/cpu_adam_vs_torch.py ...

PyTorch needs grads of the params' dtype, so it runs fp32 params with fp32
grads and writes no low-precision copy: 4 (grad) + 24 (p, m, v read and
written) = 28 bytes/param of required traffic. Strata is run in the same
process order on the same sizes for fp32 grads/no output (the same 28
bytes/param) and for bf16 grads/bf16 output (also 28 bytes/param), and
prints its same-traffic baseline. Timings are best of --steps after
--warmup steps.
"""
import argparse
import json
import os
import subprocess
import sys
import time


def parse_count(text):
    mult = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}
    t = text.strip().upper()
    if t and t[-1] in mult:
        return int(float(t[:-1]) * mult[t[-1]])
    return int(t)


def bench_torch(n, threads, warmup, steps):
    import torch

    torch.set_num_threads(threads)
    p = torch.nn.Parameter(torch.rand(n, dtype=torch.float32) - 0.5)
    p.grad = torch.full((n,), 1e-3, dtype=torch.float32)
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, foreach=True)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.step()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    best = min(times)
    return {
        "torch_version": torch.__version__,
        "params": n,
        "threads": threads,
        "step_seconds_best": best,
        "step_seconds_median": sorted(times)[len(times) // 2],
        "params_per_sec": n / best,
        "bytes_per_param": 28,
        "bytes_per_sec": 28 * n / best,
    }


def bench_strata(binary, n, threads, grad, out, warmup, steps):
    cmd = [binary, "bench", "adam", "--params", str(n), "--threads", str(threads),
           "--grad", grad, "--out", out, "--warmup", str(warmup), "--steps", str(steps),
           "--json"]
    res = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(res.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="256M")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--strata", default=os.path.join(os.path.dirname(__file__), "..", "build",
                                                    "bin", "strata"))
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    n = parse_count(args.params)

    print(f"torch AdamW foreach=True: {n} params, {args.threads} threads "
          f"(MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')}) ...",
          file=sys.stderr)
    torch_res = bench_torch(n, args.threads, args.warmup, args.steps)
    print("strata bench adam ...", file=sys.stderr)
    s_fp32 = bench_strata(args.strata, n, args.threads, "fp32", "none", args.warmup, args.steps)
    s_bf16 = bench_strata(args.strata, n, args.threads, "bf16", "bf16", args.warmup, args.steps)
    result = {"torch": torch_res, "strata_fp32_grad_no_out": s_fp32,
              "strata_bf16_grad_bf16_out": s_bf16,
              "speedup_fp32_vs_torch": s_fp32["params_per_sec"] / torch_res["params_per_sec"],
              "speedup_bf16_vs_torch": s_bf16["params_per_sec"] / torch_res["params_per_sec"]}
    if args.json:
        print(json.dumps(result))
        return
    gb = 1e9
    print(f"{'':34} {'params/s':>12} {'GB/s':>8} {'bytes/param':>12}")
    print(f"{'torch ' + torch_res['torch_version'] + ' AdamW foreach':34} "
          f"{torch_res['params_per_sec']:12.4g} {torch_res['bytes_per_sec'] / gb:8.2f} {28:12d}")
    for name, r in (("strata fp32 grad, no out", s_fp32), ("strata bf16 grad, bf16 out", s_bf16)):
        print(f"{name:34} {r['params_per_sec']:12.4g} {r['bytes_per_sec'] / gb:8.2f} "
              f"{r['bytes_per_param']:12d}  (baseline {r['baseline_bytes_per_sec'] / gb:.2f} GB/s, "
              f"ratio {r['ratio_to_baseline']:.3f})")
    print(f"speed-up vs torch: fp32 {result['speedup_fp32_vs_torch']:.2f}x, "
          f"bf16 {result['speedup_bf16_vs_torch']:.2f}x")


if __name__ == "__main__":
    main()
