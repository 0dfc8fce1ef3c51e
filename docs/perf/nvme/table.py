#!/usr/bin/env python3
"""Turns sweep.jsonl (from sweep.sh) into a markdown table and gnuplot data.

  python3 docs/perf/nvme/table.py docs/perf/nvme/sweep.jsonl docs/perf/nvme/sweep.dat
"""
import json
import sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
blocks = sorted({r["block_bytes"] for r in rows})
qds = sorted({r["queue_depth"] for r in rows})


def kib(b):
    return f"{b // 1048576} MiB" if b >= 1048576 else f"{b // 1024} KiB"


for op in ("read", "write"):
    print(f"\n**{op}** — strata GB/s / fio GB/s (ratio)\n")
    print("| block \\ qd | " + " | ".join(str(q) for q in qds) + " |")
    print("| --- | " + " | ".join("---" for _ in qds) + " |")
    for b in blocks:
        cells = []
        for q in qds:
            m = [r for r in rows if r["op"] == op and r["block_bytes"] == b and r["queue_depth"] == q]
            if not m:
                cells.append("")
                continue
            r = m[0]
            cells.append(f"{r['bytes_per_sec'] / 1e9:.2f} / {r['fio_bytes_per_sec'] / 1e9:.2f} ({r['ratio_to_fio']:.2f})")
        print(f"| {kib(b)} | " + " | ".join(cells) + " |")

if len(sys.argv) > 2:
    with open(sys.argv[2], "w") as out:
        for op in ("read", "write"):
            out.write(f"# {op}: qd block_bytes strata_GBps fio_GBps\n")
            for b in blocks:
                for q in qds:
                    m = [r for r in rows if r["op"] == op and r["block_bytes"] == b and r["queue_depth"] == q]
                    if m:
                        r = m[0]
                        out.write(f"{q} {b} {r['bytes_per_sec'] / 1e9:.3f} {r['fio_bytes_per_sec'] / 1e9:.3f}\n")
                out.write("\n")
            out.write("\n")
