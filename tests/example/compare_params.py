#!/usr/bin/env python3
"""Compares two F32 safetensors files of the same tree with the standard library and NumPy: same names
and shapes, and the largest absolute difference of any value within a tolerance. Prints it.
   compare_params.py a.safetensors b.safetensors tolerance"""
import json
import struct
import sys

import numpy as np


def read(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n:]
    out = {}
    for name, e in header.items():
        assert e["dtype"] == "F32", f"{path}: {name} is {e['dtype']}, expected F32"
        b, end = e["data_offsets"]
        out[name] = np.frombuffer(data[b:end], dtype="<f4").reshape(e["shape"])
    return out


a, b = read(sys.argv[1]), read(sys.argv[2])
tolerance = float(sys.argv[3])
if a.keys() != b.keys():
    sys.exit(f"FAIL different tensors: {sorted(a)} vs {sorted(b)}")
worst, where = 0.0, ""
for name in a:
    if a[name].shape != b[name].shape:
        sys.exit(f"FAIL {name}: shape {a[name].shape} vs {b[name].shape}")
    d = float(np.max(np.abs(a[name].astype(np.float64) - b[name]))) if a[name].size else 0.0
    if d >= worst:
        worst, where = d, name
ok = worst <= tolerance
print(f"{'ok  ' if ok else 'FAIL'} 1 rank vs 2 ranks: max |param diff| = {worst:.3g} (at {where}; tolerance {tolerance:g})")
sys.exit(0 if ok else 1)
