#!/usr/bin/env python3
"""scripts/plot_trace.py --summary on a made-up trace: a lane's busy time is
the union of its slices. A slice nested in another on the same track (decide
inside step) and NVMe requests in flight together count once, and the rate
"while busy" divides by that union (the sum of durations gave the step lane
128% of the span).
    check_plot_trace.py <scripts/plot_trace.py> <scratch dir>
"""
import json
import os
import re
import subprocess
import sys

plot, scratch = sys.argv[1], sys.argv[2]
os.makedirs(scratch, exist_ok=True)


def meta(tid, name):
    return {"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": name}}


def x(tid, name, ts, dur, **args):
    return {"ph": "X", "name": name, "pid": 0, "tid": tid, "ts": ts, "dur": dur,
            "args": {"step": 1, **args}}


events = [
    meta(1, "step"), meta(2, "nvme read"), meta(3, "nvme write"),
    # step 0..10 ms with decide nested at 1..3 ms: busy 10 ms, not 12.
    x(1, "step", 0, 10000), x(1, "decide", 1000, 2000),
    # Reads 0..4 and 2..6 overlap, 7..8 apart: busy 7 ms, not 9; 21 MB in 7 ms.
    x(2, "read", 0, 4000, bytes=7_000_000), x(2, "read", 2000, 4000, bytes=7_000_000),
    x(2, "read", 7000, 1000, bytes=7_000_000),
    # Writes end to end (1..2, 2..3) and one inside them: busy 2 ms.
    x(3, "write", 1000, 1000), x(3, "write", 2000, 1000), x(3, "write", 1500, 200),
]
path = os.path.join(scratch, "nested.json")
with open(path, "w") as f:
    json.dump({"traceEvents": events, "otherData": {}}, f)
out = subprocess.run([sys.executable, plot, path, "--summary"], capture_output=True, text=True,
                     timeout=120)
print(out.stdout, out.stderr)
assert out.returncode == 0, out.returncode
busy = {m.group(1): (float(m.group(2)), float(m.group(3)))
        for m in re.finditer(r"^  (\S.*?) +busy +([\d.]+) ms \( *([\d.]+)% of the span\)",
                             out.stdout, re.M)}
assert busy == {"step": (10.0, 100.0), "nvme read": (7.0, 70.0), "nvme write": (2.0, 20.0)}, busy
assert "3 slices, 3.00 GB/s while busy" in out.stdout, out.stdout
print("check_plot_trace: ok")
