"""`strata info --nvme-dir` names what is wrong with a directory: a file is
"exists and is not a directory" (it once read "does not exist yet ... the
engine creates it"), and a directory this user cannot write is a permissions
problem with the fix (it once read "refuses O_DIRECT: EACCES" with a
filesystem fix). As root the unwritable case runs as nobody (runuser).
    check_info_nvme_dir.py <strata binary> <scratch dir>"""
import json
import os
import shutil
import stat
import subprocess
import sys


def fail(msg):
    print(f"check_info_nvme_dir: {msg}")
    sys.exit(1)


def info(prefix, strata, dirs):
    args = prefix + [strata, "info", "--no-python", "--json"]
    for d in dirs:
        args += ["--nvme-dir", d]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
    print(proc.stdout)
    print(proc.stderr, file=sys.stderr)
    if proc.returncode != 0:
        fail(f"{args}: exit code {proc.returncode}")
    return json.loads(proc.stdout)


def problem_about(j, path):
    found = [p for p in j["problems"] if p["what"].startswith(path + ":") or
             p["what"].startswith(path + " ")]
    if len(found) != 1:
        fail(f"want one problem about {path}, got {found}")
    return found[0]


def main():
    strata, scratch = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    os.chmod(scratch, 0o755)

    # A file, and a path under a file.
    file = os.path.join(scratch, "a-file")
    with open(file, "w") as f:
        f.write("x")
    under = os.path.join(file, "sub")
    j = info([], strata, [file, under])
    d_file, d_under = j["nvme_dirs"]
    if d_file["kind"] != "not a directory" or d_file["exists"]:
        fail(f"a file: {d_file}")
    if "not checked (not a directory)" not in d_file["o_direct"]:
        fail(f"a file: o_direct {d_file['o_direct']}")
    p = problem_about(j, file)
    if p["severity"] != "error" or "exists and is not a directory" not in p["what"]:
        fail(f"a file: {p}")
    if "does not exist yet" in p["what"] or "creates it" in p["what"]:
        fail(f"a file is reported as a directory to be created: {p}")
    p = problem_about(j, under)
    if p["severity"] != "error" or f"{file} is not a directory" not in p["what"]:
        fail(f"a path under a file: {p}")

    # /proc holds no files: an error, as the engine's preflight refuses it (it read as
    # warnings about O_DIRECT and io_uring).
    j = info([], strata, ["/proc", "/proc/strata-none"])
    for path in ("/proc", "/proc/strata-none"):
        p = problem_about(j, path)
        if p["severity"] != "error" or "is on proc, a filesystem that holds no files" not in \
                p["what"]:
            fail(f"{path}: {p}")
    if any("O_DIRECT" in q["what"] or "io_uring" in q["what"] for q in j["problems"]):
        fail(f"/proc reported as an O_DIRECT or io_uring problem: {j['problems']}")

    # A directory this user cannot write, and one that cannot be made in it.
    locked = os.path.join(scratch, "locked")
    os.makedirs(locked)
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            print("check_info_nvme_dir: no runuser: the unwritable case is not checked")
            return
        prefix = ["runuser", "-u", "nobody", "--"]
        # nobody must reach the binary and the scratch directory.
        if subprocess.run(prefix + [strata, "--version"], capture_output=True).returncode != 0:
            print("check_info_nvme_dir: nobody cannot run the binary: the unwritable case "
                  "is not checked")
            return
    os.chmod(locked, stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH |
             stat.S_IXOTH)
    new = os.path.join(locked, "new")
    j = info(prefix, strata, [locked, new])
    os.chmod(locked, 0o755)
    d_locked = j["nvme_dirs"][0]
    if d_locked["kind"] != "directory" or "not writable by this user" not in d_locked["writable"]:
        fail(f"an unwritable directory: {d_locked}")
    if d_locked["o_direct"] != "not checked (not writable)":
        fail(f"an unwritable directory: o_direct {d_locked['o_direct']}")
    p = problem_about(j, locked)
    if p["severity"] != "error" or "not writable by this user" not in p["what"] or \
            "EACCES" not in p["what"] or "write access" not in p["fix"]:
        fail(f"an unwritable directory: {p}")
    if any("O_DIRECT" in q["what"] for q in j["problems"]):
        fail(f"a permissions problem reported as an O_DIRECT one: {j['problems']}")
    p = problem_about(j, new)
    if p["severity"] != "error" or "cannot be created in " + locked not in p["what"]:
        fail(f"a directory that cannot be made: {p}")
    shutil.rmtree(scratch, ignore_errors=True)
    print("check_info_nvme_dir: ok")


if __name__ == "__main__":
    main()
