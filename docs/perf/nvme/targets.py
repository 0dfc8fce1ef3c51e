#!/usr/bin/env python3
"""Turns targets.jsonl (one `strata bench nvme --vs-fio --json` object per
line) into the markdown table of docs/perf/nvme.md: best and median of each
side, both ratios, pairs where strata >= 0.95 x fio, and the median number of
physically contiguous runs (DMA segments) per 1 MiB buffer on strata's side.

  python3 docs/perf/nvme/targets.py docs/perf/nvme/targets.jsonl
"""
import json
import statistics
import sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
print("| IO buffers | op | qd | strata best | fio best | ratio best/best | strata median "
      "| fio median | ratio median/median | pairs >= 0.95 | strata segments/MiB (median) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for r in rows:
    ours, fio = r["runs_bytes_per_sec"], r["fio_runs_bytes_per_sec"]
    pairs = sum(1 for a, b in zip(ours, fio) if a >= 0.95 * b)
    kind = r["buffers"] + (", fresh per run" if r.get("fresh_buffers") else "")
    segs = [s for s in r.get("runs_segments_per_block", []) if s > 0]
    seg = f"{statistics.median(segs):.0f}" if segs else "n/a"
    print(f"| {kind} | {r['op']} | {r['queue_depth']} | {max(ours) / 1e9:.2f} | "
          f"{max(fio) / 1e9:.2f} | {r['ratio_to_fio']:.2f} | "
          f"{r['median_bytes_per_sec'] / 1e9:.2f} | {r['fio_median_bytes_per_sec'] / 1e9:.2f} | "
          f"{r['ratio_to_fio_median']:.2f} | {pairs}/{len(ours)} | {seg} |")
