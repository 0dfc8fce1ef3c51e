#!/usr/bin/env python3
"""Runs one fio command and, while it runs, counts the physically contiguous
runs (DMA segments) per MiB of fio's IO buffer, read from the job process's
/proc/<pid>/pagemap (needs root to see frame numbers). Prints that and fio's
read or write throughput. The buffer is found as the one anonymous mapping
of iodepth x bs plus a few pages.

  sudo python3 docs/perf/nvme/fio_segments.py 8388608 fio --output-format=json \\
      --ioengine=io_uring --direct=1 --rw=read --bs=1048576 --iodepth=8 --size=2G \\
      --fixedbufs --registerfiles --name=job0 --filename=/tmp/nvme-bench/f.dat
"""
import json
import struct
import subprocess
import sys
import time

buffer_bytes = int(sys.argv[1])
cmd = sys.argv[2:]
proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
time.sleep(0.35)  # the job process has registered its buffers by then


def children(pid):
    try:
        return [int(x) for x in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []


pids = [proc.pid]
for p in list(pids):
    pids += children(p)
for p in list(pids)[1:]:
    pids += children(p)
seen = set()
for pid in pids:
    try:
        maps = open(f"/proc/{pid}/maps").read().splitlines()
    except OSError:
        continue
    for line in maps:
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        size = hi - lo
        # fio's buffer: iodepth x bs plus alignment slack, anonymous, not yet seen.
        if len(fields) >= 6 or not buffer_bytes < size <= buffer_bytes + (64 << 10) or lo in seen:
            continue
        seen.add(lo)
        pages = size // 4096
        with open(f"/proc/{pid}/pagemap", "rb") as f:
            f.seek(lo // 4096 * 8)
            entries = struct.unpack(f"{pages}Q", f.read(pages * 8))
        mask = (1 << 55) - 1
        present = [e & mask for e in entries if e >> 63]
        runs = 1 + sum(1 for a, b in zip(present, present[1:]) if b != a + 1)
        print(f"pid {pid} buffer {size} bytes, {len(present)} pages present: "
              f"{runs / (size / (1 << 20)):.1f} contiguous runs per MiB")
out = proc.communicate()[0]
j = json.loads(out[out.find(b"{"):])
op = "read" if "read" in " ".join(cmd) else "write"
print(f"fio {op}: {sum(job[op]['bw_bytes'] for job in j['jobs']) / 1e9:.2f} GB/s")
