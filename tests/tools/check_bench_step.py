#!/usr/bin/env python3
"""`strata bench step` end to end on the host device: the JSON carries the
machine's same-run baselines, the bound and the traffic per param the streamed
path must have (bf16 in and out: 2 B/param each way over the link, 28 B/param
of the optimizer's DRAM traffic), and --trace writes a Chrome trace that
scripts/plot_trace.py --summary reads; the "together" term (the step's link
and CPU work measured at once) is in the bound. Figures, not speeds: nothing here is
timed against a target.

usage: check_bench_step.py STRATA PLOT_TRACE SCRATCH_DIR
"""
import json
import os
import shutil
import subprocess
import sys

strata, plot, scratch = sys.argv[1:4]
shutil.rmtree(scratch, ignore_errors=True)
os.makedirs(scratch)
trace = os.path.join(scratch, "step.json")


def bench(*extra):
    cmd = [strata, "bench", "step", "--params", "2097152", "--sub-group", "262144", "--steps", "2",
           "--warmup", "0", "--pcie-rate", "4G", "--threads", "1", "--json", *extra]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def near(a, b):
    return abs(a - b) <= 1e-9 * max(1, abs(b))


# All state in DRAM, bf16 params and grads (2^21 params: no padding in the
# shard, so the optimizer pass is exactly 28 B a param).
j = bench("--offload", "cpu", "--trace", trace)
assert near(j["d2h_bytes_per_param"], 2.0), j["d2h_bytes_per_param"]
assert near(j["h2d_bytes_per_param"], 2.0), j["h2d_bytes_per_param"]
assert near(j["host_dram_bytes_per_param"], 28.0), j["host_dram_bytes_per_param"]
b = j["baselines"]
for k in ("h2d_bytes_per_sec", "d2h_bytes_per_sec", "adam_stream_bytes_per_sec"):
    assert b[k] > 0, (k, b)
# The modelled link: the probe cannot beat it.
assert max(b["h2d_bytes_per_sec"], b["d2h_bytes_per_sec"]) <= 4 * 2**30 * 1.02, b  # 4G: GiB
assert b["drive_read_bytes_per_sec"] == 0  # no NVMe state: no drive probe
assert j["bound_sec"] == max(j["bound"].values()) > 0, j["bound"]
assert j["bound_resource"] in ("d2h", "h2d", "cpu", "nvme", "together")
assert near(j["bound_efficiency"], j["bound_sec"] / j["step_sec"]), j
# The step's link and CPU work run at once (measured), beside each term alone.
assert j["bound"]["together"] > 0, j["bound"]
alone = {k: v for k, v in j["bound"].items() if k != "together"}
assert j["alone_bound_sec"] == max(alone.values()), (j["alone_bound_sec"], alone)
assert j["bound_sec"] >= j["alone_bound_sec"]
assert near(j["alone_bound_efficiency"], j["alone_bound_sec"] / j["step_sec"]), j
assert j["trace_overhead"] is not None

# The trace: the resources of the pipeline, each with its slices.
out = subprocess.run([sys.executable, plot, trace, "--summary"], check=True,
                     capture_output=True, text=True).stdout
for lane in ("device", "pcie d2h", "cpu adam", "pcie h2d"):
    assert f"  {lane} " in out, (lane, out)
assert "bound_efficiency" in out, out
with open(trace) as f:
    other = json.load(f)["otherData"]
assert other["bound_sec"] == j["bound_sec"], other

# State on NVMe (3/4 by default): the drive is measured and bounds its part.
j = bench("--offload", "nvme", "--nvme-dir", scratch, "--drive-probe", "8MiB")
b = j["baselines"]
assert b["drive_read_bytes_per_sec"] > 0 and b["drive_write_bytes_per_sec"] > 0, b
assert j["bound"]["nvme"] > 0 and j["nvme_efficiency"] > 0, j
assert j["traffic_per_step"]["nvme_read"] > 0
assert not [f for f in os.listdir(scratch) if f.startswith("strata-drive-probe")], \
    "the drive probe's files are removed"
# Partial offload: half the sub-groups on the device. Their gradients and
# params never cross the link and the CPU's pass covers only the other half
# (1, 1 and 14 B/param over all params); the device Adam is measured alone
# and bounds its part.
j = bench("--offload", "cpu", "--gpu-fraction", "0.5")
assert j["device_sub_groups"] == 4 and near(j["gpu_fraction"], 0.5), j
assert near(j["d2h_bytes_per_param"], 1.0), j["d2h_bytes_per_param"]
assert near(j["h2d_bytes_per_param"], 1.0), j["h2d_bytes_per_param"]
assert near(j["host_dram_bytes_per_param"], 14.0), j["host_dram_bytes_per_param"]
assert j["baselines"]["device_adam_bytes_per_sec"] > 0, j["baselines"]
assert j["bound"]["device_adam"] > 0 and j["stages"]["device_adam"] > 0, j
assert j["bytes_per_tier"]["device"]["state"] == 2**20 * 12, j["bytes_per_tier"]
assert j["bound_sec"] == max(j["bound"].values()), j["bound"]
assert j["bound"]["together"] > 0, j["bound"]
print("bench step JSON, bound and trace: ok")
