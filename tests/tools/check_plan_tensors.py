"""Checks `strata plan --model`: the model's own tensors are laid out as the
engine lays them out (each tensor aligned), so padding that adds a sub-group
shows in the plan; --params N plans one tensor. The same model given as a
.safetensors file, a sharded index, a directory and a text list plans alike;
bad files and bad command lines are refused, naming what is wrong.
    check_plan_tensors.py <strata binary> <scratch dir>"""
import json
import os
import shutil
import struct
import subprocess
import sys


def fail(msg):
    print(f"check_plan_tensors: {msg}")
    sys.exit(1)


def write_safetensors(path, tensors):
    """A safetensors file (header and zero data) of (name, shape) bf16 tensors."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        elems = 1
        for d in shape:
            elems *= d
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + 2 * elems]}
        offset += 2 * elems
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.truncate(8 + len(text) + offset)


def plan(strata, *args, expect=0):
    proc = subprocess.run([strata, "plan", "--no-preflight", *args], capture_output=True,
                          text=True, timeout=120)
    if proc.returncode != expect:
        fail(f"plan {' '.join(args)}: exit {proc.returncode}, expected {expect}\n"
             f"{proc.stdout}\n{proc.stderr}")
    return proc


def plan_json(strata, config, *args):
    return json.loads(plan(strata, "--config", config, "--json", *args).stdout)


def main():
    strata, scratch = sys.argv[1], sys.argv[2]
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    config = os.path.join(scratch, "config.json")
    with open(config, "w") as f:
        json.dump({"zero_optimization": {
            "sub_group_size": 1000000,
            "offload_optimizer": {"device": "nvme", "nvme_path": os.path.join(scratch, "nvme")}}}, f)

    # Four tensors of 1.5 M elements: each pads to a multiple of 64, so the
    # 6,000,128 elements need 7 sub-groups of 1 M; one tensor of 6 M needs 6.
    layers = [(f"h.{i}.w", [1000, 1500]) for i in range(4)]
    single = os.path.join(scratch, "model.safetensors")
    write_safetensors(single, layers)
    one = plan_json(strata, config, "--params", "6M")
    own = plan_json(strata, config, "--model", single)
    if len(one["plan"]["sub_group_tiers"]) != 6 or one["model"]["tensors"] != 1:
        fail(f"--params 6M: {one['model']}, {len(one['plan']['sub_group_tiers'])} sub-groups")
    if own["model"] != {"tensors": 4, "elems": 6000000, "padded_elems": 6000128, "from": single}:
        fail(f"--model model.safetensors: model {own['model']}")
    if len(own["plan"]["sub_group_tiers"]) != 7:
        fail(f"--model: {len(own['plan']['sub_group_tiers'])} sub-groups, expected 7")
    if own["plan"]["nvme_file_bytes"] <= one["plan"]["nvme_file_bytes"]:
        fail(f"--model: the NVMe file ({own['plan']['nvme_file_bytes']}) is not larger than "
             f"one tensor's ({one['plan']['nvme_file_bytes']})")
    text = plan(strata, "--config", config, "--model", single).stdout
    if "model: 4 tensors" not in text or "padding adds 128" not in text or "7 sub-groups" not in text:
        fail(f"--model text output:\n{text}")
    if "as one tensor" not in plan(strata, "--config", config, "--params", "6M").stdout:
        fail("--params does not say it plans one tensor")

    # The same model, sharded with an index, as a directory, and as a list.
    sharded = os.path.join(scratch, "sharded")
    os.makedirs(sharded)
    write_safetensors(os.path.join(sharded, "model-00001-of-00002.safetensors"), layers[:3])
    write_safetensors(os.path.join(sharded, "model-00002-of-00002.safetensors"), layers[3:])
    index = os.path.join(sharded, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": {
            name: f"model-0000{1 if i < 3 else 2}-of-00002.safetensors"
            for i, (name, _) in enumerate(layers)}}, f)
    listing = os.path.join(scratch, "tensors.txt")
    with open(listing, "w") as f:
        f.write("# name shape\nh.0.w 1000x1500\n\nh.1.w 1000,1500  # comma too\n1500000\n"
                "h.3.w 1500x1000\nh.bias_free 0\n")
    # Shapes as Python prints them, with spaces (each line was read as its last
    # number alone: 1500 elements for "1000, 1500").
    spaced = os.path.join(scratch, "spaced.txt")
    with open(spaced, "w") as f:
        f.write("h.0.w 1000 x 1500\nh.1.w (1000, 1500)\n[1500000]\nh.3.w 1500, 1000\n")
    for given in (index, sharded, listing, spaced):
        got = plan_json(strata, config, "--model", given)
        if (got["model"]["tensors"], got["model"]["padded_elems"]) != (4, 6000128) or \
                got["plan"] != own["plan"]:
            fail(f"--model {given}: {got['model']}, plan differs from the single file's")

    # Several ranks: the padded total is a multiple of world_size x 64.
    two = plan_json(strata, config, "--model", single, "--world-size", "2")
    if two["model"]["padded_elems"] % 128 or two["shard_elems"] * 2 != two["model"]["padded_elems"]:
        fail(f"--world-size 2: {two['model']}, shard {two['shard_elems']}")

    # Refusals, naming the file and what is wrong (exit 2).
    def refused(args, *words):
        proc = plan(strata, *args, expect=2)
        for w in words:
            if w not in proc.stderr:
                fail(f"plan {' '.join(args)}: stderr lacks {w!r}:\n{proc.stderr}")

    truncated = os.path.join(scratch, "cut.safetensors")
    with open(truncated, "wb") as f:
        f.write(struct.pack("<Q", 1 << 40) + b"{}")
    refused(["--model", truncated], "cut.safetensors", "not a safetensors file", "header length")
    bad_line = os.path.join(scratch, "bad.txt")
    with open(bad_line, "w") as f:
        f.write("4096x4096\nwte 4096xabc\n")
    refused(["--model", bad_line], "bad.txt:2", "'4096xabc' is not a tensor size")
    with open(bad_line, "w") as f:
        f.write("wte 4096x4096\nwte two 4096\n")  # one name, then the size
    refused(["--model", bad_line], "bad.txt:2", "'two 4096' is not a tensor size")
    with open(bad_line, "w") as f:
        f.write("wte\n")
    refused(["--model", bad_line], "bad.txt:1", "'wte' names no size")
    empty = os.path.join(scratch, "empty.txt")
    with open(empty, "w") as f:
        f.write("# nothing\n0\n")
    refused(["--model", empty], "no tensor with elements")
    bad_shape = os.path.join(scratch, "neg.safetensors")
    text = json.dumps({"w": {"dtype": "F32", "shape": [4, -1], "data_offsets": [0, 0]}}).encode()
    with open(bad_shape, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
    refused(["--model", bad_shape], "tensor 'w'", "[4,-1]")
    lost = os.path.join(scratch, "lost")
    os.makedirs(lost)
    with open(os.path.join(lost, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"w": "gone.safetensors"}}, f)
    proc = plan(strata, "--model", lost, expect=1)
    if "gone.safetensors" not in proc.stderr:
        fail(f"an index naming a missing file:\n{proc.stderr}")
    refused(["--model", single, "--params", "6M"], "excludes")
    refused([], "--params", "--model")
    print("check_plan_tensors: ok")


if __name__ == "__main__":
    main()
