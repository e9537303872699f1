#!/usr/bin/env python3
"""Writes tests/data/numpy_random_golden.txt: NumPy's default_rng outputs that tests/test_numpy_random.cpp must
reproduce with tg::random::numpy (include/tapegrad/random/numpy.hpp).

Run with NumPy from PyPI (pip install numpy): python3 scripts/gen_numpy_golden.py [out-path]. The test reads only
the committed file. A section starts with `@ name count`; the count values follow, whitespace-separated (bit
patterns in hexadecimal, indices and integers in decimal). Full 60000-element permutations are written for a few
seeds; for every seed, `fnv1a/...` sections hold the FNV-1a 64 hash of the whole array's little-endian int64
bytes, so each large array is still checked in full.
"""
import sys

import numpy as np

SEEDS = (0, 1, 7, 42, 12345, 2**32 + 5, 2**63 - 1, 2**64 - 1)
out = []


def section(name, values, fmt="d"):
    # Lists stay Python ints: np.asarray would turn a list mixing words above and below 2**63 into float64.
    values = [int(v) for v in (values.reshape(-1) if isinstance(values, np.ndarray) else values)]
    out.append(f"@ {name} {len(values)}")
    for i in range(0, len(values), 16):
        out.append(" ".join(format(v, "x" if fmt == "x" else "d") for v in values[i:i + 16]))


def fnv1a(values):
    h = 0xCBF29CE484222325
    for b in np.asarray(values, dtype="<i8").tobytes():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def rng(seed):
    return np.random.default_rng(seed)


for s in SEEDS:
    ss = np.random.SeedSequence(s)
    section(f"pool/{s}", ss.pool, "x")
    section(f"state32/{s}", ss.generate_state(4, np.uint32), "x")
    section(f"state64/{s}", ss.generate_state(4, np.uint64), "x")
    bg = np.random.PCG64(s)
    st = bg.state["state"]
    m = 2**64 - 1
    # As pcg64_get_state lays it out: state high, state low, inc high, inc low.
    section(f"pcg_state/{s}", [st["state"] >> 64, st["state"] & m, st["inc"] >> 64, st["inc"] & m], "x")
    section(f"raw64/{s}", bg.random_raw(8), "x")
    # integers(0, 2**32) is next_uint32 itself (rng = 0xFFFFFFFF bypasses Lemire): the buffered halves.
    section(f"next32/{s}", rng(s).integers(0, 2**32, size=9), "x")

    for n in (0, 1, 2, 10, 1000):
        section(f"permutation/{s}/{n}", rng(s).permutation(n))
    p = rng(s).permutation(60000)
    out.append(f"@ fnv1a/permutation/{s}/60000 1\n{fnv1a(p):x}")
    if s in (1, 7, 42):
        section(f"permutation/{s}/60000", p)

    # (60000, 1000), (20000, 401), (10001, 201), (30000, 30000): the tail shuffle (n > 10000, k > n // 50);
    # (20000, 400) and (10000, 5000) just miss it and run Floyd's algorithm; (2**32 + 2, 4) draws at
    # j = 2**32 - 2 (32-bit Lemire), 2**32 - 1 (raw next32), 2**32 and 2**32 + 1 (64-bit Lemire).
    for n, k in ((10000, 25), (60000, 1000), (100, 100), (50, 3), (5, 0), (1, 1), (20000, 400), (20000, 401),
                 (10001, 201), (10000, 5000), (2**40, 10), (2**32 + 2, 4)):
        section(f"choice/{s}/{n}/{k}", rng(s).choice(n, k, replace=False))
    out.append(f"@ fnv1a/choice/{s}/30000/30000 1\n{fnv1a(rng(s).choice(30000, 30000, replace=False)):x}")

    # (0, 3 * 2**30) and (-2**62, 2**63 - 1) reject about a quarter of the draws (32- and 64-bit Lemire);
    # (0, 1) draws nothing.
    for lo, hi in ((0, 10), (-5, 5), (0, 1), (0, 3 * 2**30), (0, 2**32), (0, 2**32 + 1), (0, 2**33),
                   (-2**62, 2**63 - 1), (-2**63, 2**63 - 1)):
        section(f"integers/{s}/{lo}/{hi}", rng(s).integers(lo, hi, size=20))

    # One generator through a mix of calls: next32's buffered half carries from one call into the next.
    g = rng(s)
    seq = [g.integers(0, 2**32)]
    seq += list(g.permutation(10))
    seq += list(g.choice(50, 3, replace=False))
    seq += [g.integers(0, 10)]
    seq += list(g.choice(30000, 1000, replace=False))
    seq += list(g.permutation(7))
    seq += [g.integers(0, 2**40)]
    seq += [g.integers(0, 2**32)]
    section(f"sequence/{s}", seq)

# The codelab's two calls, exactly as it makes them.
section("codelab/permutation", np.random.default_rng(0).permutation(60000))
section("codelab/choice", np.random.default_rng(7).choice(10000, 25, replace=False))

header = [
    f"# numpy {np.__version__}: np.random.default_rng / PCG64 / SeedSequence",
    "# written by scripts/gen_numpy_golden.py; sections: '@ name count', then count whitespace-separated values",
]
path = sys.argv[1] if len(sys.argv) > 1 else "tests/data/numpy_random_golden.txt"
with open(path, "w") as f:
    f.write("\n".join(header + out) + "\n")
print(f"wrote {sum(not l.startswith('@') for l in out)} lines to {path}")
