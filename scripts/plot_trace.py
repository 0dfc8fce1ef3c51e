#!/usr/bin/env python3
"""Turns a Strata step trace (Chrome trace JSON from `strata bench step --trace`,
OffloadAdam(trace=...) or TraceRecorder::WriteChromeTrace) into a PNG timeline:
one lane per rank and resource (step, device, PCIe D2H, CPU Adam, PCIe H2D,
NVMe read, NVMe write, comm), one box per sub-group's stage, and the step's
lower bound (the trace's otherData.bound_sec, or --bound) as a dashed line
from the start of each step.

    scripts/plot_trace.py step.json -o step.png            # every step recorded
    scripts/plot_trace.py step.json -o step.png --step -1  # the last step only
    scripts/plot_trace.py step.json --summary              # text only, no plot

Draws with matplotlib where it is installed, else with gnuplot
(apt-get install python3-matplotlib, or gnuplot-nox). --summary prints each
lane's busy time (the union of its slices: nested or overlapping ones count
once), the step's span and the bound; it needs neither.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

# Lanes top to bottom, in the order data flows through a step.
LANE_ORDER = ["step", "device", "pcie d2h", "comm", "cpu adam", "pcie h2d", "nvme read",
              "nvme write"]
COLORS = {"step": "#9e9e9e", "device": "#8e44ad", "pcie d2h": "#2e86c1", "comm": "#17a589",
          "cpu adam": "#e67e22", "pcie h2d": "#28b463", "nvme read": "#c0392b",
          "nvme write": "#7b241c"}


def load(path):
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    other = trace.get("otherData", {}) if isinstance(trace, dict) else {}
    procs, threads, slices = {}, {}, []
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
        elif e.get("ph") == "X":
            slices.append(e)
    if not slices:
        sys.exit(f"{path}: no slices in the trace (was the recorder enabled during the steps?)")
    return procs, threads, slices, other


def select_steps(slices, which):
    steps = sorted({s.get("args", {}).get("step", 0) for s in slices})
    if which is None:
        return slices, steps
    try:
        chosen = steps[which]
    except IndexError:
        sys.exit(f"--step {which}: the trace holds steps {steps}")
    return [s for s in slices if s.get("args", {}).get("step", 0) == chosen], [chosen]


def lanes_of(procs, threads, slices):
    """[(label, pid, tid)] top to bottom: ranks in order, lanes in LANE_ORDER."""
    used = sorted({(s["pid"], s["tid"]) for s in slices})
    def key(pt):
        name = threads.get(pt, str(pt[1]))
        return (pt[0], LANE_ORDER.index(name) if name in LANE_ORDER else len(LANE_ORDER), name)
    lanes = []
    for pid, tid in sorted(used, key=key):
        name = threads.get((pid, tid), f"track {tid}")
        label = name if len(procs) <= 1 else f"{procs.get(pid, pid)}: {name}"
        lanes.append((label, name, pid, tid))
    return lanes


def step_starts(slices):
    """Start (us) of each step: its 'step' slice where recorded, else its first slice."""
    starts = {}
    for s in slices:
        st = s.get("args", {}).get("step", 0)
        if s["name"] == "step":
            starts[st] = s["ts"]
    for s in slices:
        st = s.get("args", {}).get("step", 0)
        starts.setdefault(st, min(x["ts"] for x in slices if x.get("args", {}).get("step", 0) == st))
    return starts


def busy_us(slices):
    """Time (us) a lane is busy: the union of its slices' intervals. A slice
    nested in another (decide inside step) or overlapping one (NVMe requests
    in flight together) counts once, so a lane is never busy over 100%."""
    busy, end = 0.0, None
    for begin, stop in sorted((s["ts"], s["ts"] + s["dur"]) for s in slices):
        if end is None or begin > end:
            busy += stop - begin
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy


def summary(lanes, slices, bound_sec, starts):
    t0 = min(s["ts"] for s in slices)
    t1 = max(s["ts"] + s["dur"] for s in slices)
    print(f"span {(t1 - t0) / 1e3:.2f} ms over {len(starts)} step(s)")
    for label, _, pid, tid in lanes:
        mine = [s for s in slices if (s["pid"], s["tid"]) == (pid, tid)]
        busy = busy_us(mine)
        moved = sum(s.get("args", {}).get("bytes", 0) for s in mine)
        rate = f", {moved / busy / 1e3:.2f} GB/s while busy" if moved and busy else ""
        print(f"  {label:<22} busy {busy / 1e3:9.2f} ms ({100 * busy / (t1 - t0):5.1f}% of the "
              f"span), {len(mine)} slices{rate}")
    for st, begin in sorted(starts.items()):
        whole = [s for s in slices if s["name"] == "step" and s.get("args", {}).get("step") == st]
        took = f"{whole[0]['dur'] / 1e3:.2f} ms" if whole else "?"
        line = f"  step {st}: {took}"
        if bound_sec:
            line += f", bound {bound_sec * 1e3:.2f} ms"
            if whole:
                line += f" (bound_efficiency {bound_sec * 1e6 / whole[0]['dur']:.3f})"
        print(line)


def plot_matplotlib(lanes, slices, bound_sec, starts, out, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t0 = min(s["ts"] for s in slices)
    fig, ax = plt.subplots(figsize=(14, 0.45 * len(lanes) + 1.6))
    index = {(pid, tid): i for i, (_, _, pid, tid) in enumerate(lanes)}
    span = max(s["ts"] + s["dur"] for s in slices) - t0
    for s in slices:
        i = index[(s["pid"], s["tid"])]
        name = lanes[i][1]
        x, w = (s["ts"] - t0) / 1e3, s["dur"] / 1e3
        ax.barh(i, w, left=x, height=0.7, color=COLORS.get(name, "#555555"),
                edgecolor="white", linewidth=0.4)
        sg = s.get("args", {}).get("sub_group")
        if sg is not None and s["dur"] > span / 60:
            ax.text(x + w / 2, i, str(sg), ha="center", va="center", fontsize=7, color="white")
    if bound_sec:
        for begin in starts.values():
            x = (begin - t0) / 1e3 + bound_sec * 1e3
            ax.axvline(x, color="black", linestyle="--", linewidth=1)
        ax.plot([], [], color="black", linestyle="--", label=f"bound {bound_sec * 1e3:.1f} ms")
        ax.legend(loc="upper right", fontsize=8)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([l[0] for l in lanes], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_gnuplot(lanes, slices, bound_sec, starts, out, title):
    t0 = min(s["ts"] for s in slices)
    index = {(pid, tid): i for i, (_, _, pid, tid) in enumerate(lanes)}
    tmp = tempfile.mkdtemp(prefix="strata-plot-")
    try:
        data = os.path.join(tmp, "boxes.dat")
        with open(data, "w") as f:
            for s in slices:
                i = index[(s["pid"], s["tid"])]
                color = int(COLORS.get(lanes[i][1], "#555555")[1:], 16)
                x0, x1 = (s["ts"] - t0) / 1e3, (s["ts"] + s["dur"] - t0) / 1e3
                f.write(f"{x0} {x1} {i - 0.35} {i + 0.35} {color}\n")
        n = len(lanes)
        ytics = ", ".join(f'"{l[0]}" {i}' for i, l in enumerate(lanes))
        bound_lines = ""
        if bound_sec:
            for k, begin in enumerate(starts.values()):
                x = (begin - t0) / 1e3 + bound_sec * 1e3
                bound_lines += (f"set arrow {k + 1} from {x}, graph 0 to {x}, graph 1 nohead "
                                f"dt 2 lw 1.5 lc rgb 'black'\n")
            title += f"   (dashed: bound {bound_sec * 1e3:.1f} ms)"
        script = f"""
set terminal pngcairo size 1400,{int(45 * n + 160)} font ",9"
set output '{out}'
set title "{title}"
set xlabel "ms"
set ytics ({ytics})
set yrange [{n - 0.5}:-0.5]
set grid xtics
set style fill solid 1.0 border rgb 'white'
unset key
{bound_lines}
plot '{data}' using (($1+$2)/2):(($3+$4)/2):1:2:3:4:5 with boxxyerror lc rgb variable
"""
        subprocess.run(["gnuplot"], input=script, text=True, check=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="Chrome trace JSON written by Strata")
    ap.add_argument("-o", "--out", help="PNG to write (default: the trace's name with .png)")
    ap.add_argument("--step", type=int, default=None,
                    help="plot one step: an index into the steps recorded (0 first, -1 last)")
    ap.add_argument("--bound", type=float, default=None,
                    help="the step's lower bound in seconds (default: otherData.bound_sec)")
    ap.add_argument("--title", default=None)
    ap.add_argument("--backend", choices=["auto", "matplotlib", "gnuplot"], default="auto")
    ap.add_argument("--summary", action="store_true", help="print busy times; no plot")
    a = ap.parse_args()

    procs, threads, slices, other = load(a.trace)
    slices, steps = select_steps(slices, a.step)
    lanes = lanes_of(procs, threads, slices)
    bound = a.bound if a.bound is not None else other.get("bound_sec")
    starts = step_starts(slices)
    if a.summary:
        summary(lanes, slices, bound, starts)
        return
    out = a.out or os.path.splitext(a.trace)[0] + ".png"
    title = a.title or (f"{other.get('command', 'strata')}: "
                        f"{other.get('params', '?')} params, step(s) {', '.join(map(str, steps))}")
    backend = a.backend
    if backend == "auto":
        try:
            import matplotlib  # noqa: F401
            backend = "matplotlib"
        except ImportError:
            backend = "gnuplot" if shutil.which("gnuplot") else None
    if backend is None:
        sys.exit("plot_trace: neither matplotlib nor gnuplot is installed (apt-get install "
                 "python3-matplotlib, or gnuplot-nox); --summary prints the figures without them")
    (plot_matplotlib if backend == "matplotlib" else plot_gnuplot)(lanes, slices, bound, starts,
                                                                  out, title)
    print(f"plot_trace: wrote {out} ({backend})")


if __name__ == "__main__":
    main()
