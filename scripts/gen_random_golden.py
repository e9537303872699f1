#!/usr/bin/env python3
"""Writes tests/data/jax_random_golden.txt: JAX's PRNG outputs that tests/test_random.cpp must reproduce.

Run with JAX from PyPI (pip install "jax[cpu]"); the test reads only the committed file. A section starts with
`@ name size`; each line after it is `index value`, the value as the hexadecimal bit pattern of the element (keys and bits as uint32,
float32 as its 32 bits, bfloat16 as its 16 bits, int32 as the integer). Large arrays are sampled: the
first elements, a regular stride, and every element in the tails (both erf_inv branches for normals).
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

out = []


def record(name, values, indices=None):
    flat = np.asarray(values).reshape(-1)
    if flat.dtype == jnp.bfloat16:
        bits = flat.view(np.uint16).astype(np.uint64)
    elif flat.dtype == np.float32:
        bits = flat.view(np.uint32).astype(np.uint64)
    elif flat.dtype in (np.uint32, np.int32):
        bits = flat.astype(np.int64).astype(np.uint64) & 0xFFFFFFFF
    else:
        raise TypeError(flat.dtype)
    idx = range(flat.size) if indices is None else sorted(set(int(i) for i in indices))
    out.append(f"@ {name} {flat.size}")
    out.extend(f"{i} {int(bits[i]):x}" for i in idx)


key = jax.random.key
data = jax.random.key_data
for seed in (0, 1, 42, 2**31 - 1, -1):
    record(f"key/{seed}", data(key(seed)))
record("split/1/5", data(jax.random.split(key(1), 5)))
record("split/42/2", data(jax.random.split(key(42))))
record("fold_in/1/7", data(jax.random.fold_in(key(1), 7)))
record("fold_in/1/4294967295", data(jax.random.fold_in(key(1), 2**32 - 1)))
record("bits/1/7x11", jax.random.bits(key(1), (7, 11)))
record("uniform/1/784x256", jax.random.uniform(key(1), (784, 256)), list(range(256)) + list(range(0, 784 * 256, 97)))
record("uniform_range/3/1000/-2.5/7.25", jax.random.uniform(key(3), (1000,), minval=-2.5, maxval=7.25))
record("uniform_bf16/5/300", jax.random.uniform(key(5), (300,), jnp.bfloat16))

z = np.asarray(jax.random.normal(key(1), (784, 256))).reshape(-1)
# |z| > 2.5 includes every element in erf_inv's second branch (w >= 5 starts near |z| = 2.93).
tails = np.nonzero(np.abs(z) > 2.5)[0]
record("normal/1/784x256", z, list(range(512)) + list(range(0, z.size, 101)) + list(tails))
record("normal_bf16/1/1000", jax.random.normal(key(1), (1000,), jnp.bfloat16))

record("permutation/1/10", jax.random.permutation(key(1), 10))
record("permutation/7/2000", jax.random.permutation(key(7), 2000))  # two sort rounds from n = 1626 on
p = np.asarray(jax.random.permutation(key(0), 60000))
record("permutation/0/60000", p, list(range(100)) + list(range(59900, 60000)) + list(range(0, 60000, 37)))

header = [
    f"# jax {jax.__version__}, jax_threefry_partitionable={jax.config.jax_threefry_partitionable}",
    "# written by scripts/gen_random_golden.py; sections: '@ name size', then 'index hex-bits' lines",
]
path = sys.argv[1] if len(sys.argv) > 1 else "tests/data/jax_random_golden.txt"
with open(path, "w") as f:
    f.write("\n".join(header + out) + "\n")
print(f"wrote {sum(not l.startswith('@') for l in out)} values to {path}")
