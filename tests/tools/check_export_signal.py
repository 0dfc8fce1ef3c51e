"""`strata export` ended by SIGINT, SIGTERM or SIGHUP in the middle leaves no
temporary (`.NAME.tmp-PID-N`, as large as its target, once left behind by
every interruption), and in a sharded export no shards without their index
(a re-run refused them as existing files without saying what they were); the
re-run then succeeds. A sharded export renames its shards into place only
once all are written, so one killed part way (SIGKILL) leaves temporaries
only, never a shard; the re-run removes them, saying so, and succeeds.
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
    `sharded`, a shard is done: its temporary is sealed, the next one is being written).
    Returns True when it landed mid-export."""
    proc = subprocess.Popen([strata, "export"] + args, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if len(temporaries(out)) >= (2 if sharded else 1):
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

    # A SIGKILL'ed sharded export: its sealed shards are temporaries still, none is
    # in place; the re-run (no --force needed) removes them, saying so (an info line).
    hf = os.path.join(scratch, "hf-kill")
    args = [ckpt, hf, "--max-shard-size", "16MiB"]
    if not interrupt(strata, args, hf, signal.SIGKILL, sharded=True):
        fail("SIGKILL: the sharded export finished before the signal")
    left = temporaries(hf)
    if shards(hf) or len(left) < 2:
        fail(f"SIGKILL: want two temporaries or more and no shard, left {sorted(os.listdir(hf))}")
    r = subprocess.run([strata, "export"] + args, capture_output=True, text=True,
                       env=dict(os.environ, STRATA_LOG="info"))
    if r.returncode != 0 or INDEX not in os.listdir(hf) or temporaries(hf) or \
            f"removed {len(left)} temporary file(s)" not in r.stderr or \
            "that exports killed part way left: " + hf + "/.model-" not in r.stderr:
        fail(f"re-run over a killed export: exit {r.returncode} {r.stderr}, "
             f"left {sorted(os.listdir(hf))}")
    shutil.rmtree(scratch, ignore_errors=True)
    print("check_export_signal: ok")


if __name__ == "__main__":
    main()
