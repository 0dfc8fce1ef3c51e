"""`strata bench step --trace`: a trace path that cannot be written is refused
before any work (exit 2, no step run), and a trace that fails at the end (its
directory removed during the run) still prints every result, then fails
naming the trace (exit 1). Both once lost the whole run's measurements.
    check_bench_step_trace.py <strata binary> <scratch dir>"""
import json
import os
import shutil
import subprocess
import sys

from bench_step_run import start_until_first_step

BENCH = ["bench", "step", "--params", "4M", "--sub-group", "1M"]


def fail(msg):
    print(f"check_bench_step_trace: {msg}")
    sys.exit(1)


def refused_up_front(strata, args, want):
    proc = subprocess.run([strata] + BENCH + ["--steps", "1"] + args, capture_output=True,
                          text=True, timeout=120)
    print(proc.stderr)
    if proc.returncode != 2:
        fail(f"{args}: exit code {proc.returncode}, want 2")
    if want not in proc.stderr:
        fail(f"{args}: stderr does not say {want!r}")
    if "bench step: measuring" in proc.stderr or "bench step: step" in proc.stderr:
        fail(f"{args}: work ran before the option was refused")


def main():
    strata, scratch = sys.argv[1], sys.argv[2]
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)

    missing = os.path.join(scratch, "no", "t.json")
    refused_up_front(strata, ["--trace", missing],
                     f"--trace {missing}: the directory {os.path.dirname(missing)} does not exist")
    refused_up_front(strata, ["--trace", scratch], f"--trace {scratch}: is a directory")
    refused_up_front(strata, ["--drive-probe", "abc"], "--drive-probe abc: give a size")
    refused_up_front(strata, ["--pcie-rate", "fast"], "--pcie-rate fast: give bytes per second")

    # The trace's directory exists at the start and is gone at the end.
    gone = os.path.join(scratch, "gone")
    os.makedirs(gone)
    proc, err = start_until_first_step(
        [strata] + BENCH + ["--steps", "20", "--drive-probe", "0", "--json", "--trace",
                            os.path.join(gone, "t.json")], fail, stdout=subprocess.PIPE)
    os.rmdir(gone)
    out, rest = proc.communicate(timeout=300)
    err = (err + rest).decode()
    print(err)
    if proc.returncode != 1:
        fail(f"trace lost at the end: exit code {proc.returncode}, want 1")
    try:
        j = json.loads(out)
    except json.JSONDecodeError:
        fail(f"trace lost at the end: the results are not on stdout: {out!r}")
    if not j.get("step_sec", 0) > 0:
        fail("trace lost at the end: no step_sec in the results")
    if "the trace is lost (--trace)" not in err or "t.json" not in err:
        fail("trace lost at the end: stderr does not name the trace")
    shutil.rmtree(scratch, ignore_errors=True)
    print("check_bench_step_trace: ok")


if __name__ == "__main__":
    main()
