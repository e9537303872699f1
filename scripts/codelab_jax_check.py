#!/usr/bin/env python3
"""The codelab's JAX code on the example's first batch: checks the fashion_mnist example's loss before the
first update (metrics.json "initial_loss") against JAX, and its parameters' initialisation.

Run by hand, with JAX from PyPI (pip install "jax[cpu]"); no test downloads JAX:
    build/examples/fashion_mnist --out out
    python3 scripts/codelab_jax_check.py out/metrics.json [--data-dir /usr/share/datasets/fashion-mnist]

The JAX side is written as the codelab writes it: the data read with gzip + NumPy, pixels / 255, the
training set shuffled once with jax.random.permutation(key(seed)), batches of 512; He-normal weights from
jax.random.split(key(1), 3), zero biases; GELU (jax.nn.gelu's default, the tanh form); mean softmax
cross-entropy with integer labels (optax's formula, written out). It prints both losses and exits 1 when
they differ by more than 1e-5 relative.
"""
import argparse
import gzip
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def init_params(hidden):
    sizes = [784, *hidden, 10]
    keys = jax.random.split(jax.random.key(1), 3)
    params = []
    for k, fan_in, fan_out in zip(keys, sizes[:-1], sizes[1:]):
        w = jax.random.normal(k, (fan_in, fan_out), jnp.float32) * jnp.sqrt(2.0 / fan_in)
        params.append((w, jnp.zeros((fan_out,), jnp.float32)))
    return params


def loss_fn(params, x, y):
    h = x
    for i, (w, b) in enumerate(params):
        h = h @ w + b
        if i < len(params) - 1:
            h = jax.nn.gelu(h)  # approximate=True: the tanh form
    logp = jax.nn.log_softmax(h)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("metrics", help="metrics.json written by the fashion_mnist example")
    ap.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    args = ap.parse_args()
    with open(args.metrics) as f:
        m = json.load(f)
    cfg = m["config"]
    images = read_idx(f"{args.data_dir}/train-images-idx3-ubyte.gz").reshape(-1, 784).astype(np.float32) / 255.0
    labels = read_idx(f"{args.data_dir}/train-labels-idx1-ubyte.gz").astype(np.int32)
    order = np.asarray(jax.random.permutation(jax.random.key(cfg["seed"]), images.shape[0]))
    first = order[: cfg["batch"]]
    x, y = jnp.asarray(images[first]), jnp.asarray(labels[first])
    params = init_params(cfg["hidden"])
    jax_loss = float(loss_fn(params, x, y))
    ours = float(m["initial_loss"])
    rel = abs(ours - jax_loss) / abs(jax_loss)
    print(f"JAX {jax.__version__}: loss before the first update {jax_loss:.8f}")
    print(f"tapegrad (metrics.json):             {ours:.8f}")
    print(f"relative difference: {rel:.2e} ({'within' if rel <= 1e-5 else 'NOT within'} 1e-5)")
    return 0 if rel <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
