#!/usr/bin/env python3
"""The convolutional network of examples/cnn_fashion_mnist/cnn.hpp in JAX + Flax + Optax: the reference that the
tests' golden first-batch values come from, and the JAX peer of the CNN training-step benchmark.

A reference tool run by hand, never by CI or a test (pip install jax flax optax safetensors numpy); its outputs
are committed. The model is flax.linen: Conv(32, (3, 3)) -> relu -> max_pool((2, 2), (2, 2)) -> Conv(64, (3, 3))
-> relu -> max_pool -> flatten -> Dense(128) -> relu -> Dense(10), Flax's defaults ("SAME" padding, NHWC
inputs, HWIO kernels). Two subcommands:

  golden: loads the parameters the C++ example saved (safetensors, F32, tree-path names such as "conv1.w"),
  takes the first training batch (the training-set indices np.random.default_rng(seed).permutation(60000)[:batch],
  in that order), computes jax.value_and_grad of the mean cross-entropy with the accuracy as aux in float32 under
  one jax.jit, and writes JSON: the loss, the accuracy, the gradient's global norm and each leaf's gradient L2
  norm (float64 from the float32 gradients), with a digest of the parameters to tie the values to the file.
      python3 scripts/cnn_reference.py golden --params PARAMS.safetensors --out GOLDEN.json [--batch 128] [--seed 0]

  bench: times the jitted training step (value_and_grad, AdamW with a cosine decay, apply_updates, the
  metrics) on a fixed batch already on the device, then the same number of steps with the loop inside one jit
  (lax.scan), and prints one JSON line.
      python3 scripts/cnn_reference.py bench [--batch 128] [--steps 50] [--dtype f32|bf16]

Both take --data-dir (the gzip IDX Fashion-MNIST files, by default /usr/share/datasets/fashion-mnist from the
dataset-fashion-mnist package).
"""
import argparse
import gzip
import hashlib
import json
import math
import statistics
import struct
import time
from functools import partial

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
# (module, field) of each leaf in cnn.hpp's tree order, and its name in the C++ example's safetensors file.
LEAVES = [("conv1", "w"), ("conv1", "b"), ("conv2", "w"), ("conv2", "b"), ("dense", "w"), ("dense", "b"), ("head", "w"), ("head", "b")]
FLAX_FIELD = {"w": "kernel", "b": "bias"}


class CNN(nn.Module):
    """cnn::forward: images (B, 784) in [0, 1] -> logits (B, 10) in float32, computed in `dtype`."""

    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], 28, 28, 1)
        x = nn.max_pool(nn.relu(nn.Conv(32, (3, 3), dtype=self.dtype, name="conv1")(x)), (2, 2), strides=(2, 2))
        x = nn.max_pool(nn.relu(nn.Conv(64, (3, 3), dtype=self.dtype, name="conv2")(x)), (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(128, dtype=self.dtype, name="dense")(x.reshape(x.shape[0], -1)))
        return nn.Dense(10, dtype=self.dtype, name="head")(x).astype(jnp.float32)


def shapes():
    return {"conv1.w": (3, 3, 1, 32), "conv1.b": (32,), "conv2.w": (3, 3, 32, 64), "conv2.b": (64,),
            "dense.w": (7 * 7 * 64, 128), "dense.b": (128,), "head.w": (128, 10), "head.b": (10,)}


def load_params(path):
    """The parameters saved by the C++ example as Flax's {"params": {module: {kernel, bias}}}."""
    from safetensors.numpy import load_file

    tensors = load_file(path)
    expected = shapes()
    if set(tensors) != set(expected):
        raise SystemExit(f"{path}: tensors {sorted(set(tensors) ^ set(expected))} are missing or unexpected")
    for name, shape in expected.items():
        if tensors[name].shape != shape or tensors[name].dtype != np.float32:
            raise SystemExit(f"{path}: {name} is {tensors[name].dtype} {tensors[name].shape}, expected float32 {shape}")
    params = {}
    for module, field in LEAVES:
        params.setdefault(module, {})[FLAX_FIELD[field]] = jnp.asarray(tensors[f"{module}.{field}"])
    return {"params": params}


def params_digest(path):
    """SHA-256 over every tensor's float32 bytes in the file's data order (as scripts/vit_reference.py)."""
    with open(path, "rb") as f:
        raw = f.read()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    data = raw[8 + header_len:]
    digest = hashlib.sha256()
    for (begin, end), name in sorted((e["data_offsets"], n) for n, e in header.items() if n != "__metadata__"):
        digest.update(data[begin:end])
    return digest.hexdigest()


def loss_with_metrics(variables, x, y, dtype):
    """cnn::loss_with_metrics: the mean softmax cross-entropy and, as aux, the batch accuracy."""
    logits = CNN(dtype=dtype).apply(variables, x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, jnp.mean((jnp.argmax(logits, axis=-1) == y).astype(jnp.float32))


def read_idx(path, magic, ndim):
    with gzip.open(path, "rb") as f:
        head = struct.unpack(">" + "I" * (1 + ndim), f.read(4 * (1 + ndim)))
        if head[0] != magic:
            raise SystemExit(f"{path}: magic {head[0]}, expected {magic}")
        return np.frombuffer(f.read(), dtype=np.uint8).reshape(head[1:])


def first_batch(data_dir, batch, seed):
    """The first training batch: images (batch, 784) float32 = pixels / 255, labels int32, and its indices."""
    images = read_idx(f"{data_dir}/train-images-idx3-ubyte.gz", 2051, 3)
    labels = read_idx(f"{data_dir}/train-labels-idx1-ubyte.gz", 2049, 1)
    idx = np.random.default_rng(seed).permutation(len(images))[:batch]
    x = images[idx].reshape(batch, -1).astype(np.float32) / np.float32(255.0)
    return x, labels[idx].astype(np.int32), idx


def golden(args):
    variables = load_params(args.params)
    x, y, idx = first_batch(args.data_dir, args.batch, args.seed)
    loss_fn = partial(loss_with_metrics, dtype=jnp.float32)
    (loss, accuracy), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(variables, x, y)
    grad_norms = {f"{m}.{f}": float(np.linalg.norm(np.asarray(grads["params"][m][FLAX_FIELD[f]], np.float64).ravel())) for m, f in LEAVES}
    out = {
        "generated_by": "scripts/cnn_reference.py",
        "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__, "numpy": np.__version__,
        "config": {"conv1": 32, "conv2": 64, "kernel": 3, "dense": 128, "batch": args.batch, "seed": args.seed},
        "params_digest": params_digest(args.params),
        "first_batch_indices_head": [int(i) for i in idx[:8]],
        "loss": float(loss),
        "accuracy": float(accuracy),
        "grad_global_norm": math.sqrt(sum(n * n for n in grad_norms.values())),
        "grad_norms": grad_norms,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    print(f"{args.out}: batch {args.batch} (seed {args.seed}): loss {out['loss']!r}, accuracy {out['accuracy']!r}, "
          f"grad norm {out['grad_global_norm']!r}")


def timing(seconds, batch, steps):
    best, median = min(seconds), statistics.median(seconds)
    return {"examples_per_sec": batch * steps / best, "step_ms": 1e3 * best / steps,
            "examples_per_sec_median": batch * steps / median, "step_ms_median": 1e3 * median / steps, "repeats": len(seconds)}


def bench(args, warmup=3, repeats=3):
    """Times `repeats` runs of args.steps training steps, jitted per step and inside one lax.scan."""
    x, y, _ = first_batch(args.data_dir, args.batch, args.seed)
    x, y = jax.device_put(x), jax.device_put(y)
    variables = CNN().init(jax.random.key(args.seed), x[:1])
    optimizer = optax.adamw(optax.cosine_decay_schedule(2e-3, 2000, 0.01), weight_decay=1e-4)  # cnn::make_optimizer
    loss_grad = jax.value_and_grad(partial(loss_with_metrics, dtype=DTYPES[args.dtype]), has_aux=True)

    def step(variables, opt_state, x, y):
        (loss, accuracy), grads = loss_grad(variables, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, variables)
        metrics = {"loss": loss, "accuracy": accuracy, "grad_norm": optax.global_norm(grads)}
        return optax.apply_updates(variables, updates), opt_state, metrics

    def train_loop(variables, opt_state, x, y):
        def body(carry, _):
            variables, opt_state, metrics = step(*carry, x, y)
            return (variables, opt_state), metrics

        (variables, opt_state), metrics = jax.lax.scan(body, (variables, opt_state), length=args.steps)
        return variables, opt_state, metrics

    jit_step = jax.jit(step, donate_argnums=(0, 1))
    scan_loop = jax.jit(train_loop, donate_argnums=(0, 1))
    state = [variables, optimizer.init(variables)]

    def run_steps(n):
        v, s = state
        for _ in range(n):
            v, s, metrics = jit_step(v, s, x, y)
        jax.block_until_ready(metrics)
        state[:] = v, s

    def run_scan():
        v, s, metrics = scan_loop(*state, x, y)
        jax.block_until_ready(metrics)
        state[:] = v, s

    def timed(run):
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    run_steps(warmup)
    step_seconds = [timed(partial(run_steps, args.steps)) for _ in range(repeats)]
    run_scan()
    scan_seconds = [timed(run_scan) for _ in range(repeats)]
    print(json.dumps({"mode": "cnn", "dtype": args.dtype, "batch": args.batch, "steps": args.steps,
                      "jit_step": timing(step_seconds, args.batch, args.steps), "scan": timing(scan_seconds, args.batch, args.steps),
                      "jax": jax.__version__, "flax": flax.__version__, "devices": str(jax.devices())}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--batch", type=int, default=128)
    common.add_argument("--seed", type=int, default=0, help="the batch's permutation (and bench's initial parameters)")
    common.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("golden", parents=[common], help="first-batch loss, accuracy and gradient norms as JSON")
    g.add_argument("--params", required=True, help="safetensors file written by the C++ example (--export-init)")
    g.add_argument("--out", required=True, help="the JSON file to write")
    b = sub.add_parser("bench", parents=[common], help="time the training step: one jit per step, and lax.scan")
    b.add_argument("--steps", type=int, default=50, help="timed steps per repeat")
    b.add_argument("--dtype", choices=sorted(DTYPES), default="f32", help="compute type (parameters stay float32)")
    args = ap.parse_args()
    golden(args) if args.command == "golden" else bench(args)


if __name__ == "__main__":
    main()
