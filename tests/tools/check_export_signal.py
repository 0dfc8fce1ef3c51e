"""`strata export` ended by SIGINT, SIGTERM or SIGHUP in the middle leaves no
temporary (`.NAME.tmp-PID-N`, as large as its target, once left behind by
every interruption), and in a sharded export no shards without their index
(a re-run refused them as existing files without saying what they were); the
re-run then succeeds. Shards that an export left for another reason (SIGKILL)
are named as an unfinished export in the re-run's error, with the temporary
nothing removed.
    check_export_signal.py <strata binary> <scratch dir>
Needs the Python module (PYTHONPATH) and torch to make the checkpoint."""
import os
import shutil
import signal
import subprocess
import sys
import time

try:
    import torch
    from strata.torch import OffloadAdam
except ImportError as e:
    print(f"SKIPPED: no torch or strata module to make a checkpoint ({e})")
    sys.exit(77)

INDEX = "model.safetensors.index.json"


def fail(msg):
    print(f"check_export_signal: {msg}")
    sys.exit(1)


def make_checkpoint(path):
    """16 tensors of 2 Mi elements (32M params: 128 MiB of fp32 weights)."""
    torch.manual_seed(0)
    model = torch.nn.ParameterDict(
        {f"w{i}": torch.nn.Parameter(torch.randn(2048, 1024)) for i in range(16)})
    with OffloadAdam(model.named_parameters(), offload="cpu") as opt:
        sum(p.sum() for p in model.values()).backward()
        opt.step()
        opt.save_checkpoint(path)


def temporaries(out):
    return [n for n in os.listdir(out) if ".tmp-" in n] if os.path.isdir(out) else []


def shards(out):
    return [n for n in os.listdir(out) if n.startswith("model-")] if os.path.isdir(out) else []


def interrupt(strata, args, out, sig, sharded):
    """Runs `strata export ARGS`, sends `sig` once a temporary is being written (and, when
    `sharded`, a shard is done). Returns True when it landed mid-export."""
    proc = subprocess.Popen([strata, "export"] + args, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        # One listing for both: two could see a temporary in the first and, in
        # the second, the shard it has just become, with no temporary left.
        names = os.listdir(out) if os.path.isdir(out) else []
        if any(".tmp-" in n for n in names) and (
                not sharded or any(n.startswith("model-") for n in names)):
            proc.send_signal(sig)
            break
        time.sleep(0.001)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        return False  # finished before the signal: too fast to interrupt
    if proc.returncode != -sig:
        fail(f"export {args} by {sig.name}: exit status {proc.returncode}: {err.decode()}")
    return True


def main():
    strata, scratch = sys.argv[1], sys.argv[2]
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    ckpt = os.path.join(scratch, "ckpt")
    make_checkpoint(ckpt)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        # One file: the temporary goes.
        outd = os.path.join(scratch, f"one-{sig.name}")
        os.makedirs(outd)
        out = os.path.join(outd, "out.safetensors")
        if not interrupt(strata, [ckpt, out], outd, sig, sharded=False):
            fail(f"{sig.name}: the export finished before the signal; make the checkpoint larger")
        if os.listdir(outd):
            fail(f"{sig.name}: one-file export interrupted: left {os.listdir(outd)}")

        # Shards: the temporary and the shards written so far go (there is no index).
        hf = os.path.join(scratch, f"hf-{sig.name}")
        args = [ckpt, hf, "--max-shard-size", "16MiB"]
        if not interrupt(strata, args, hf, sig, sharded=True):
            fail(f"{sig.name}: the sharded export finished before the signal")
        if os.listdir(hf):
            fail(f"{sig.name}: sharded export interrupted: left {sorted(os.listdir(hf))}")
        r = subprocess.run([strata, "export"] + args, capture_output=True, text=True)
        if r.returncode != 0 or INDEX not in os.listdir(hf) or temporaries(hf):
            fail(f"{sig.name}: the re-run: exit {r.returncode} {r.stderr}, {os.listdir(hf)}")

    # Shards left without an index (a SIGKILL'ed export): the re-run says what they are.
    # The kill can still land between a shard's commit and the next temporary
    # (the listing above is a moment old): then it is tried again, so that
    # the re-run below always meets a temporary too.
    hf = os.path.join(scratch, "hf-kill")
    args = [ckpt, hf, "--max-shard-size", "16MiB"]
    for attempt in range(10):
        shutil.rmtree(hf, ignore_errors=True)
        if not interrupt(strata, args, hf, signal.SIGKILL, sharded=True):
            fail("SIGKILL: the sharded export finished before the signal")
        if temporaries(hf):
            break
    else:
        fail("SIGKILL: 10 kills left no temporary behind")
    left = sorted(shards(hf))
    r = subprocess.run([strata, "export"] + args, capture_output=True, text=True)
    want = f"{hf} holds {len(left)} shard"
    if r.returncode != 1 or want not in r.stderr or \
            "interrupted or failed before it wrote its index; --force replaces them" not in r.stderr \
            or "--force replaces them and removes its hidden temporaries (.model-" not in r.stderr:
        fail(f"re-run over the shards of a killed export: exit {r.returncode}, stderr "
             f"{r.stderr!r}, want {want!r}")
    # --force replaces them and removes the temporaries, saying so (an info line).
    r = subprocess.run([strata, "export"] + args + ["--force"], capture_output=True, text=True,
                       env=dict(os.environ, STRATA_LOG="info"))
    if r.returncode != 0 or INDEX not in os.listdir(hf) or temporaries(hf) or \
            "that exports killed part way left: " + hf + "/.model-" not in r.stderr:
        fail(f"--force over the shards of a killed export: exit {r.returncode} {r.stderr}, "
             f"left {sorted(os.listdir(hf))}")
    shutil.rmtree(scratch, ignore_errors=True)
    print("check_export_signal: ok")


if __name__ == "__main__":
    main()
