#!/usr/bin/env python3
"""The numbers the JAX codelab prints, computed by its own JAX + Optax code, for the fashion_mnist example
to stand beside: writes examples/fashion_mnist/codelab_golden.json, which the example reads (its side-by-side table)
and a test checks against the example's metrics.json.

Run by hand, with JAX and Optax from PyPI (pip install jax optax); no test runs JAX:
    python3 scripts/codelab_golden.py [--data-dir /usr/share/datasets/fashion-mnist] [--out examples/fashion_mnist/codelab_golden.json]

Written as the codelab writes its cells: the data read with gzip + NumPy, pixels / 255; the training set
shuffled once with np.random.default_rng(0).permutation(60000) and cut into batches of 512 (tail trimmed),
the test set in file order (19 batches); the MLP 784-256-128-10 with GELU (jax.nn.gelu, the tanh form),
He-normal weights from jax.random.split(key, 3), zero biases; mean softmax cross-entropy with integer labels
(optax); the one-step demo from key(1) with plain SGD at the learning rate 3e-3; one compiled Optax step
(adamw(3e-3, weight_decay=1e-4)) from key(2); the 400-step training from key(3) after one warm-up step on the
first batch, metrics every 25 steps; evaluation over the test batches; the 25 sample test images
np.random.default_rng(7).choice(10000, 25, replace=False).
"""
import argparse
import gzip
import json
import math
import struct

import jax
import jax.numpy as jnp
import numpy as np
import optax

ap = argparse.ArgumentParser()
ap.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
ap.add_argument("--out", default="examples/fashion_mnist/codelab_golden.json")
args = ap.parse_args()


def read_idx(path, magic, ndim):
    with gzip.open(path, "rb") as f:
        head = struct.unpack(">" + "I" * (1 + ndim), f.read(4 * (1 + ndim)))
        assert head[0] == magic, path
        return np.frombuffer(f.read(), dtype=np.uint8).reshape(head[1:])


d = args.data_dir
train_images = read_idx(f"{d}/train-images-idx3-ubyte.gz", 2051, 3)
train_labels = read_idx(f"{d}/train-labels-idx1-ubyte.gz", 2049, 1)
test_images = read_idx(f"{d}/t10k-images-idx3-ubyte.gz", 2051, 3)
test_labels = read_idx(f"{d}/t10k-labels-idx1-ubyte.gz", 2049, 1)
BATCH_SIZE, INPUT_DIM, NUM_CLASSES, HIDDEN1, HIDDEN2, LEARNING_RATE, STEPS = 512, 784, 10, 256, 128, 3e-3, 400


def prepare_images(images):
    return (images.astype(np.float32) / 255.0).reshape(images.shape[0], -1)


rng = np.random.default_rng(0)
train_perm = rng.permutation(len(train_images))
x_train, y_train = prepare_images(train_images[train_perm]), train_labels[train_perm].astype(np.int32)
x_test, y_test = prepare_images(test_images), test_labels.astype(np.int32)


def make_fixed_batches(x, y, bs):
    usable = (len(x) // bs) * bs
    return jnp.asarray(x[:usable].reshape(usable // bs, bs, x.shape[-1])), jnp.asarray(y[:usable].reshape(usable // bs, bs))


x_train_batches, y_train_batches = make_fixed_batches(x_train, y_train, BATCH_SIZE)
x_test_batches, y_test_batches = make_fixed_batches(x_test, y_test, BATCH_SIZE)
first_batch = (x_train_batches[0], y_train_batches[0])


def init_mlp_params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    he = lambda k, i, o: jax.random.normal(k, (i, o), dtype=jnp.float32) * math.sqrt(2.0 / i)
    return {"w1": he(k1, INPUT_DIM, HIDDEN1), "b1": jnp.zeros((HIDDEN1,), jnp.float32), "w2": he(k2, HIDDEN1, HIDDEN2),
            "b2": jnp.zeros((HIDDEN2,), jnp.float32), "w3": he(k3, HIDDEN2, NUM_CLASSES), "b3": jnp.zeros((NUM_CLASSES,), jnp.float32)}


def mlp(params, x):
    x = jax.nn.gelu(x @ params["w1"] + params["b1"])
    x = jax.nn.gelu(x @ params["w2"] + params["b2"])
    return x @ params["w3"] + params["b3"]


def cross_entropy_loss(params, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(mlp(params, x), y).mean()


def loss_with_metrics(params, batch):
    x, y = batch
    logits = mlp(params, x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, axis=-1) == y)}


out = {"jax": jax.__version__, "optax": optax.__version__, "numpy": np.__version__, "backend": jax.default_backend()}

# The one-step demo: key(1), the first batch, one plain SGD step.
params = init_mlp_params(jax.random.key(1))
loss0, grads = jax.value_and_grad(cross_entropy_loss)(params, first_batch)
stepped = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
out["first_batch_loss"] = float(loss0)
out["loss_after_one_sgd_step"] = float(cross_entropy_loss(stepped, first_batch))

optimizer = optax.adamw(learning_rate=LEARNING_RATE, weight_decay=1e-4)


@jax.jit
def train_step(params, opt_state, batch):
    (loss, m), grads = jax.value_and_grad(loss_with_metrics, has_aux=True)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss, "accuracy": m["accuracy"], "grad_norm": optax.global_norm(grads)}


# One compiled Optax step from key(2).
p2 = init_mlp_params(jax.random.key(2))
_, _, m = train_step(p2, optimizer.init(p2), first_batch)
out["one_step"] = {k: float(v) for k, v in m.items()}

# The training: key(3), one warm-up step on the first batch, then 400 steps over the batches in turn.
params_train = init_mlp_params(jax.random.key(3))
opt_state = optimizer.init(params_train)
params_train, opt_state, _ = train_step(params_train, opt_state, first_batch)
history = []
for step in range(STEPS):
    i = step % x_train_batches.shape[0]
    params_train, opt_state, metrics = train_step(params_train, opt_state, (x_train_batches[i], y_train_batches[i]))
    if step % 25 == 0 or step == STEPS - 1:
        history.append({"step": step} | {k: float(v) for k, v in metrics.items()})
out["history"] = history


@jax.jit
def evaluate_batches(params, xb, yb):
    losses, accs = jax.vmap(lambda x, y: (lambda l_m: (l_m[0], l_m[1]["accuracy"]))(loss_with_metrics(params, (x, y))))(xb, yb)
    return jnp.mean(losses), jnp.mean(accs)


tl, ta = evaluate_batches(params_train, x_test_batches, y_test_batches)
out["test_loss"], out["test_accuracy"] = float(tl), float(ta)
out["sample_test_images"] = [int(i) for i in np.random.default_rng(7).choice(10000, 25, replace=False)]

with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
    f.write("\n")
print(json.dumps({k: v for k, v in out.items() if k != "history"}, indent=1))
