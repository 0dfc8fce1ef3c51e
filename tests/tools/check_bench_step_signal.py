"""`strata bench step` ended by SIGINT, SIGTERM, SIGHUP (a closed terminal) or
SIGPIPE (output piped into a reader that quit) in the middle of its steps
leaves nothing behind: its temporary directory is removed with the state
store's files (strata-rank0.state and .lock: the lock file once stayed, so
the directory did too). In a directory the user gave, the bench's files go
and the directory stays; a lock file that was there before is left.
    check_bench_step_signal.py <strata binary> <scratch dir>"""
import os
import re
import shutil
import signal
import sys

from bench_step_run import start_until_first_step

BENCH = ["bench", "step", "--params", "16M", "--sub-group", "1M", "--steps", "1000",
         "--warmup", "0", "--drive-probe", "0"]


def fail(msg):
    print(f"check_bench_step_signal: {msg}")
    sys.exit(1)


def interrupt(strata, args, sig):
    """Runs the bench until its first step, sends `sig`, returns (stderr, state dir)."""
    proc, err = start_until_first_step([strata] + BENCH + args, fail)
    text = err.decode()
    m = re.search(r"state files in (\S+) \(removed afterwards", text)
    state_dir = m.group(1) if m else None
    here = state_dir or args[args.index("--nvme-dir") + 1]
    if "strata-rank0.lock" not in os.listdir(here):
        proc.kill()
        fail(f"{args}: no state store in {here} when the signal was sent: {os.listdir(here)}")
    proc.send_signal(sig)
    _, rest = proc.communicate(timeout=120)
    print(text + rest.decode())
    if proc.returncode != -sig:
        fail(f"{args}: exit status {proc.returncode}, want death by signal {sig}")
    return state_dir


def main():
    strata, scratch = sys.argv[1], sys.argv[2]
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)

    # The bench's own temporary directory, by each signal that ends a command.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        state_dir = interrupt(strata, [], sig)
        if state_dir is None:
            fail("the bench did not say where its temporary directory is")
        if os.path.exists(state_dir):
            fail(f"{signal.Signals(sig).name}: {state_dir} is left behind: "
                 f"{os.listdir(state_dir)}")

    # A directory the user gave: the bench's files go, the directory stays.
    mine = os.path.join(scratch, "mine")
    os.makedirs(mine)
    interrupt(strata, ["--nvme-dir", mine], signal.SIGINT)
    if os.listdir(mine):
        fail(f"--nvme-dir: left {os.listdir(mine)} in {mine}")
    # A lock file that was there before is not the bench's to remove.
    with open(os.path.join(mine, "strata-rank0.lock"), "w"):
        pass
    interrupt(strata, ["--nvme-dir", mine], signal.SIGINT)
    if os.listdir(mine) != ["strata-rank0.lock"]:
        fail(f"--nvme-dir with a lock file there before: {os.listdir(mine)}")
    shutil.rmtree(scratch, ignore_errors=True)
    print("check_bench_step_signal: ok")


if __name__ == "__main__":
    main()
