#!/usr/bin/env python3
"""Reads a safetensors file written by tests/io/write_known.cpp with nothing but the standard library
and NumPy (Debian's python3-numpy), and checks every name, dtype, shape, value and the metadata."""
import json
import struct
import sys

import numpy as np

path = sys.argv[1]
with open(path, "rb") as f:
    raw = f.read()
(n,) = struct.unpack("<Q", raw[:8])
header = json.loads(raw[8:8 + n])
data = raw[8 + n:]
dtypes = {"F32": "<f4", "F64": "<f8", "I32": "<i4", "U32": "<u4", "U8": "u1", "BF16": "<u2"}


def tensor(name):
    e = header[name]
    b, end = e["data_offsets"]
    a = np.frombuffer(data[b:end], dtype=dtypes[e["dtype"]]).reshape(e["shape"])
    if e["dtype"] == "BF16":  # bfloat16: the top 16 bits of a float32
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return a


def ramp(shape):
    return (np.arange(int(np.prod(shape)), dtype=np.float32) * 0.25 - 1.0).reshape(shape)


assert header["__metadata__"] == {"format": "pt", "step": "42"}, header["__metadata__"]
expect = {
    "layers[0].w": ("F32", ramp((2, 3))),
    "layers[0].b": ("BF16", ramp((3,))),
    "layers[1].w": ("F32", ramp((3, 4))),
    "layers[1].b": ("BF16", ramp((4,))),
    "scale": ("F64", np.array([-1.0, -0.75])),
    "count": ("I32", np.array(-3, dtype=np.int32)),
    "seed": ("U32", np.array([4000000000, 4000000001], dtype=np.uint32)),
    "mask": ("U8", np.array([0, 1, 0, 1, 0], dtype=np.uint8)),
    "empty": ("U8", np.zeros((0, 3), dtype=np.uint8)),
}
names = sorted(k for k in header if k != "__metadata__")
assert names == sorted(expect), names
for name, (dtype, want) in expect.items():
    got = tensor(name)
    assert header[name]["dtype"] == dtype, (name, header[name]["dtype"])
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert np.array_equal(got, want), (name, got, want)
print(f"{path}: {len(names)} tensors and the metadata read back exactly with NumPy {np.__version__}")
