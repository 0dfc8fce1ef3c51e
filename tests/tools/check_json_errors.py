#!/usr/bin/env python3
"""Every --json command that fails prints one JSON object on stdout with the
error as `strata plan --json` gives it, {"error": {"code", "message"}}, beside
the message on stderr and the exit code (stdout was empty: inspect of a
missing directory, a --params the count parser refuses, ...). A command that
printed its own object on failure (plan's refusal) prints only that one.
    check_json_errors.py <strata> <scratch dir>
"""
import json
import os
import subprocess
import sys

strata, scratch = sys.argv[1], sys.argv[2]
os.makedirs(scratch, exist_ok=True)
missing = os.path.join(scratch, "no-such-checkpoint")

CASES = [
    # (argv, exit code, error code, text in the message)
    (["inspect", missing, "--json"], 1, "NotFound", "no such directory"),
    (["inspect", missing, "--json", "--verify"], 1, "NotFound", "no such directory"),
    (["plan", "--params", "1X", "--json"], 2, "InvalidArgument", "unknown suffix 'X'"),
    (["bench", "adam", "--params", "1X", "--json"], 2, "InvalidArgument", "unknown suffix 'X'"),
    (["bench", "step", "--params", "1X", "--json"], 2, "InvalidArgument", "unknown suffix 'X'"),
    (["bench", "nvme", "--dir", scratch, "--size", "1X", "--json"], 2, "InvalidArgument",
     "unknown suffix 'X'"),
    (["info", "--no-python", "--pin-test", "1024TiB", "--json"], 2, "InvalidArgument",
     "more than half"),
    # Its own object: fits false, the plan's numbers and the error; not a second one.
    (["plan", "--params", "50B", "--json"], 1, "ResourceExhausted", "available"),
]

for argv, want_exit, want_code, want_text in CASES:
    p = subprocess.run([strata, *argv], capture_output=True, text=True, timeout=120)
    what = f"strata {' '.join(argv)}: exit {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}"
    assert p.returncode == want_exit, what
    try:
        j = json.loads(p.stdout)  # one object and nothing else
    except json.JSONDecodeError as e:
        raise AssertionError(f"stdout is not one JSON object ({e}): {what}")
    assert isinstance(j, dict), what
    err = j.get("error")
    assert isinstance(err, dict) and set(err) == {"code", "message"}, what
    assert err["code"] == want_code, what
    assert want_text in err["message"], what
    assert err["message"] in p.stderr, what  # the same failure on stderr
    print(f"ok: strata {' '.join(argv)} -> {want_exit}, {err['code']}")

# A success has "error": null where the command reports one (plan, inspect).
p = subprocess.run([strata, "plan", "--params", "1M", "--json"], capture_output=True, text=True,
                   timeout=120)
assert p.returncode == 0 and json.loads(p.stdout)["error"] is None, p
print("check_json_errors: ok")
