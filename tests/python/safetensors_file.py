"""Reads a .safetensors file by its spec (the package is not installed on
CI): the tests' check of what `strata export` wrote."""
import json
import struct

import torch

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
NAMES = {v: k for k, v in DTYPES.items()}  # torch dtype -> the header's name


def read_safetensors(path, dtype=None):
    """name -> tensor; with `dtype` ("F32", "F16", "BF16"), every tensor must be
    of it."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert dtype is None or t["dtype"] == dtype, (name, t["dtype"], dtype)
        b, e = t["data_offsets"]
        data, t_dtype = raw[8 + n + b:8 + n + e], DTYPES[t["dtype"]]
        # torch.frombuffer refuses an empty buffer
        x = torch.frombuffer(bytearray(data), dtype=t_dtype) if data else torch.zeros(0, dtype=t_dtype)
        out[name] = x.reshape(t["shape"])
    return out
