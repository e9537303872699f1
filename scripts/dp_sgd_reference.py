#!/usr/bin/env python3
"""examples/dp_sgd in JAX + Optax: the codelab's MLP, per-example gradients by
jax.vmap(jax.grad(loss, has_aux=True), in_axes=(None, 0, 0)), each clipped to an L2 norm of at most C,
summed, Gaussian noise sigma * C * N(0, 1) added (leaf i's from jax.random.fold_in(key, i)), divided by the
batch size, then optax.sgd(lr, momentum); the step's key is jax.random.fold_in(jax.random.key(seed), step).

Two modes, run by hand with JAX and Optax from PyPI (pip install jax optax); no test runs JAX:
  golden  writes examples/dp_sgd/dp_sgd_golden.json: at the codelab's key(1) parameters and on its first
          batch (512 examples, np.random.default_rng(0)), every example's gradient norm, and the loss after
          one DP-SGD step with key fold_in(key(0), 0); and the privacy spent by the example's defaults
          (3 epochs of batches of 512: 351 steps at q = 512 / 60000, sigma 1.1, delta 1e-5) from Google's
          dp_accounting (pip install dp-accounting), its RDP accountant at the orders 2..256;
          `dp_sgd --check-golden` compares all three (1e-6 relative).
  bench   the step under jax.jit at --batch-size, timed over --steps steps after one that compiles, --runs
          times; prints one JSON line (median examples/sec), for scripts/bench-dp-sgd-vs-jax.
    python3 scripts/dp_sgd_reference.py golden [--data-dir DIR] [--out FILE]
    python3 scripts/dp_sgd_reference.py bench [--data-dir DIR] [--batch-size 512] [--steps 30] [--runs 3]
"""
import argparse
import gzip
import importlib.metadata
import json
import math
import statistics
import struct
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=["golden", "bench"])
ap.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
ap.add_argument("--out", default="examples/dp_sgd/dp_sgd_golden.json")
ap.add_argument("--batch-size", type=int, default=512)
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--runs", type=int, default=3)
ap.add_argument("--lr", type=float, default=0.1)
ap.add_argument("--momentum", type=float, default=0.9)
ap.add_argument("--l2-norm-clip", type=float, default=1.0)
ap.add_argument("--noise-multiplier", type=float, default=1.1)
args = ap.parse_args()


def read_idx(path, magic, ndim):
    with gzip.open(path, "rb") as f:
        head = struct.unpack(">" + "I" * (1 + ndim), f.read(4 * (1 + ndim)))
        assert head[0] == magic, path
        return np.frombuffer(f.read(), dtype=np.uint8).reshape(head[1:])


d = args.data_dir
train_images = read_idx(f"{d}/train-images-idx3-ubyte.gz", 2051, 3)
train_labels = read_idx(f"{d}/train-labels-idx1-ubyte.gz", 2049, 1)
perm = np.random.default_rng(0).permutation(len(train_images))
x_train = (train_images[perm].astype(np.float32) / 255.0).reshape(len(perm), -1)
y_train = train_labels[perm].astype(np.int32)


def batches(bs):
    usable = (len(x_train) // bs) * bs
    return jnp.asarray(x_train[:usable].reshape(-1, bs, 784)), jnp.asarray(y_train[:usable].reshape(-1, bs))


def init_mlp_params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    he = lambda k, i, o: jax.random.normal(k, (i, o), dtype=jnp.float32) * math.sqrt(2.0 / i)
    return {"w1": he(k1, 784, 256), "b1": jnp.zeros((256,), jnp.float32), "w2": he(k2, 256, 128),
            "b2": jnp.zeros((128,), jnp.float32), "w3": he(k3, 128, 10), "b3": jnp.zeros((10,), jnp.float32)}


def mlp(params, x):
    x = jax.nn.gelu(x @ params["w1"] + params["b1"])
    x = jax.nn.gelu(x @ params["w2"] + params["b2"])
    return x @ params["w3"] + params["b3"]


def example_loss(params, x, y):
    logits = mlp(params, x[None])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y[None]).mean(), jnp.mean(jnp.argmax(logits, -1) == y[None])


NAMES = ["w1", "b1", "w2", "b2", "w3", "b3"]  # the C++ struct's order
C, SIGMA = args.l2_norm_clip, args.noise_multiplier
optimizer = optax.sgd(args.lr, momentum=args.momentum)


def per_example_norms(grads):
    sq = 0.0
    for k in NAMES:
        sq = sq + jnp.sum(jnp.square(grads[k].reshape(grads[k].shape[0], -1)), axis=1)
    return jnp.sqrt(sq)


@jax.jit
def train_step(params, opt_state, x, y, key):
    (losses, correct), grads = jax.vmap(jax.value_and_grad(example_loss, has_aux=True), in_axes=(None, 0, 0))(params, x, y)
    norms = per_example_norms(grads)
    scale = 1.0 / jnp.maximum(norms * (1.0 / C), 1.0)
    n = x.shape[0]
    private = {}
    for i, k in enumerate(NAMES):
        clipped_sum = jnp.tensordot(scale, grads[k], axes=1)
        noise = jax.random.normal(jax.random.fold_in(key, i), clipped_sum.shape)
        private[k] = (clipped_sum + noise * (C * SIGMA)) * (1.0 / n)
    updates, opt_state = optimizer.update(private, opt_state, params)
    metrics = {"loss": jnp.mean(losses), "accuracy": jnp.mean(correct), "mean_norm": jnp.mean(norms)}
    return optax.apply_updates(params, updates), opt_state, metrics


def step_key(step, seed=0):
    return jax.random.fold_in(jax.random.key(seed), step)


if args.mode == "golden":
    xb, yb = batches(512)
    params = init_mlp_params(jax.random.key(1))
    (_, _), grads = jax.vmap(jax.value_and_grad(example_loss, has_aux=True), in_axes=(None, 0, 0))(params, xb[0], yb[0])
    norms = per_example_norms(grads)
    p1, _, _ = train_step(params, optimizer.init(params), xb[0], yb[0], step_key(0))
    loss_after = optax.softmax_cross_entropy_with_integer_labels(mlp(p1, xb[0]), yb[0]).mean()
    import dp_accounting
    from dp_accounting import rdp
    accountant = rdp.RdpAccountant(orders=list(range(2, 257)))
    event = dp_accounting.PoissonSampledDpEvent(512 / 60000, dp_accounting.GaussianDpEvent(SIGMA))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, 351))
    out = {"jax": jax.__version__, "optax": optax.__version__, "numpy": np.__version__, "backend": jax.default_backend(),
           "what": "per-example gradient norms of the codelab's first batch (512, np.random.default_rng(0)) at init_mlp_params(key(1)); "
                   "the loss on that batch after one DP-SGD step (sgd 0.1, momentum 0.9, C 1, sigma 1.1, key fold_in(key(0), 0))",
           "per_example_grad_norms": [float(v) for v in norms], "loss_after_one_dp_step": float(loss_after),
           "privacy": {"sampling_rate": 512 / 60000, "noise_multiplier": SIGMA, "steps": 351, "delta": 1e-5,
                       "epsilon": accountant.get_epsilon(1e-5), "dp_accounting": importlib.metadata.version("dp-accounting")}}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: {len(out['per_example_grad_norms'])} norms (mean {float(jnp.mean(norms)):.6f}), "
          f"loss after one step {out['loss_after_one_dp_step']:.8f}")
else:
    xb, yb = batches(args.batch_size)
    rates = []
    for _ in range(args.runs):
        params = init_mlp_params(jax.random.key(1))
        state = optimizer.init(params)
        params, state, m = train_step(params, state, xb[0], yb[0], step_key(0))  # compiles
        jax.block_until_ready(params)
        t0 = time.perf_counter()
        for i in range(1, args.steps + 1):
            params, state, m = train_step(params, state, xb[i % xb.shape[0]], yb[i % xb.shape[0]], step_key(i))
        jax.block_until_ready(params)
        rates.append(args.steps * args.batch_size / (time.perf_counter() - t0))
    print(json.dumps({"examples_per_sec": statistics.median(rates), "runs": rates, "batch": args.batch_size, "steps": args.steps,
                      "loss": float(m["loss"]), "jax": jax.__version__, "backend": jax.default_backend()}))
