#!/usr/bin/env python3
"""The small Vision Transformer of examples/vit_fashion_mnist/vit.hpp in JAX + Optax, op for op: the reference
that the tests' golden first-batch values come from, and the JAX peer of the ViT training-step benchmark.

A reference tool run by hand, never by CI or a test (pip install jax optax safetensors numpy); its outputs are
committed. Two subcommands:

  golden: loads the parameters the C++ example saved (safetensors, F32, tree-path names such as
  "blocks[0].qkv.w"), takes the first training batch (the training-set indices
  np.random.default_rng(seed).permutation(60000)[:batch], in that order), computes jax.value_and_grad of the
  mean cross-entropy with the accuracy as aux in float32 under one jax.jit, and writes JSON: the loss, the
  accuracy, the gradient's global norm and each leaf's gradient L2 norm (both in float64 from the float32
  gradients, NumPy), with a digest of the parameters to tie the values to the file.
      python3 scripts/vit_reference.py golden --params PARAMS.safetensors --out GOLDEN.json [--batch 128] [--seed 0]

  bench: times the jitted training step (value_and_grad, clip_by_global_norm + AdamW with a warm-up cosine
  schedule, apply_updates, the metrics) on a fixed batch already on the device, then the same number of steps
  with the loop inside one jit (lax.scan), and prints one JSON line.
      python3 scripts/vit_reference.py bench [--batch 128] [--steps 50] [--dtype f32|bf16] [--params FILE]

Both take the model's sizes (--dim --heads --layers --mlp; vit::Config's defaults) and --data-dir (the gzip IDX
Fashion-MNIST files, by default /usr/share/datasets/fashion-mnist from the dataset-fashion-mnist package). With a
parameters file the number of blocks comes from the file, and every tensor's shape is checked against the sizes.
"""
import argparse
import dataclasses
import gzip
import hashlib
import json
import math
import re
import statistics
import struct
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

BLOCK_LEAVES = ("ln1_scale", "ln1_bias", "qkv_w", "qkv_b", "out_w", "out_b", "ln2_scale", "ln2_bias", "fc1_w", "fc1_b", "fc2_w", "fc2_b")
TOP_LEAVES = ("patch_w", "patch_b", "pos", "ln_scale", "ln_bias", "head_w", "head_b")


def file_name(leaf):
    """A leaf's name in the C++ example's safetensors file, its tree path: vit.hpp nests Flax's modules
    (Dense {w, b}, LayerNorm {scale, bias}), so "qkv_w" is "qkv.w" and "ln1_scale" is "ln1.scale"."""
    module, _, field = leaf.rpartition("_")
    return f"{module}.{field}" if module else leaf
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Config:
    """vit::Config: 28x28 images cut into 7x7 patches (16 tokens of 49 pixels)."""

    dim: int = 64
    heads: int = 4
    layers: int = 4
    mlp: int = 128
    classes: int = 10
    image: int = 28
    patch: int = 7
    ln_eps: float = 1e-6

    @property
    def grid(self):
        return self.image // self.patch

    @property
    def tokens(self):
        return self.grid * self.grid

    @property
    def head_dim(self):
        return self.dim // self.heads


def param_shapes(c):
    """Each leaf's name and shape, in vit.hpp's tree order (weights (fan_in, fan_out), biases 1-d)."""
    block = {"ln1_scale": (c.dim,), "ln1_bias": (c.dim,), "qkv_w": (c.dim, 3 * c.dim), "qkv_b": (3 * c.dim,),
             "out_w": (c.dim, c.dim), "out_b": (c.dim,), "ln2_scale": (c.dim,), "ln2_bias": (c.dim,),
             "fc1_w": (c.dim, c.mlp), "fc1_b": (c.mlp,), "fc2_w": (c.mlp, c.dim), "fc2_b": (c.dim,)}
    shapes = {"patch.w": (c.patch * c.patch, c.dim), "patch.b": (c.dim,), "pos": (c.tokens, c.dim)}
    for l in range(c.layers):
        shapes.update({f"blocks[{l}].{file_name(name)}": block[name] for name in BLOCK_LEAVES})
    shapes.update({"ln.scale": (c.dim,), "ln.bias": (c.dim,), "head.w": (c.dim, c.classes), "head.b": (c.classes,)})
    return shapes


def named_leaves(params):
    """(name, leaf) pairs of a parameter tree, named and ordered as in the safetensors file."""
    for name in TOP_LEAVES[:3]:
        yield file_name(name), params[name]
    for l, block in enumerate(params["blocks"]):
        for name in BLOCK_LEAVES:
            yield f"blocks[{l}].{file_name(name)}", block[name]
    for name in TOP_LEAVES[3:]:
        yield file_name(name), params[name]


def tree_from_named(tensors, layers):
    """The parameter tree (a dict, "blocks" a list of dicts) from a {name: array} mapping."""
    params = {name: tensors[file_name(name)] for name in TOP_LEAVES}
    params["blocks"] = [{name: tensors[f"blocks[{l}].{file_name(name)}"] for name in BLOCK_LEAVES} for l in range(layers)]
    return params


def load_params(path, c):
    """The parameters saved by the C++ example, and the config with the file's number of blocks."""
    from safetensors.numpy import load_file  # only here: bench without --params runs where safetensors is not installed

    tensors = load_file(path)
    layers = len({m.group(1) for m in (re.match(r"blocks\[(\d+)\]\.", name) for name in tensors) if m})
    c = dataclasses.replace(c, layers=layers)
    expected = param_shapes(c)
    if set(tensors) != set(expected):
        raise SystemExit(f"{path}: tensors {sorted(set(tensors) ^ set(expected))} are missing or unexpected")
    for name, shape in expected.items():
        if tensors[name].shape != shape or tensors[name].dtype != np.float32:
            raise SystemExit(f"{path}: {name} is {tensors[name].dtype} {tensors[name].shape}, expected float32 {shape} "
                             f"(--dim {c.dim} --mlp {c.mlp}: give the sizes the file was written with)")
    return tree_from_named({name: jnp.asarray(t) for name, t in tensors.items()}, layers), c


def params_digest(path):
    """SHA-256 over every tensor's little-endian float32 bytes, tensors in the file's data order (ascending
    data_offsets): unlike a hash of the whole file, independent of the header's bytes (key order, spacing,
    metadata). The header is read by hand: an 8-byte little-endian length, the JSON header, then the data."""
    with open(path, "rb") as f:
        raw = f.read()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    data = raw[8 + header_len:]
    entries = sorted((entry["data_offsets"], name) for name, entry in header.items() if name != "__metadata__")
    digest = hashlib.sha256()
    for (begin, end), name in entries:
        if header[name]["dtype"] != "F32":
            raise SystemExit(f"{path}: {name} is {header[name]['dtype']}, expected F32")
        digest.update(data[begin:end])  # safetensors data is little-endian by definition
    return digest.hexdigest()


def init_params(key, c):
    """vit::init_params: weights normal / sqrt(fan_in), pos normal * 0.02, biases 0, LayerNorm scales 1; keys
    split(key, 2 + 4 layers) ([0] patch, [1] pos, [2 + 4l + j] block l's qkv, out, fc1, fc2), fold_in(key, 1000)
    for the head. tg::random draws JAX's numbers, so the same seed gives the C++ example's initial parameters."""
    k = jax.random.split(key, 2 + 4 * c.layers)

    def dense(ki, fan_in, fan_out):
        return jax.random.normal(ki, (fan_in, fan_out), jnp.float32) * (1.0 / math.sqrt(fan_in))

    zeros, ones = partial(jnp.zeros, dtype=jnp.float32), partial(jnp.ones, dtype=jnp.float32)
    blocks = []
    for l in range(c.layers):
        kq, ko, k1, k2 = k[2 + 4 * l: 6 + 4 * l]
        blocks.append({"ln1_scale": ones(c.dim), "ln1_bias": zeros(c.dim), "qkv_w": dense(kq, c.dim, 3 * c.dim),
                       "qkv_b": zeros(3 * c.dim), "out_w": dense(ko, c.dim, c.dim), "out_b": zeros(c.dim),
                       "ln2_scale": ones(c.dim), "ln2_bias": zeros(c.dim), "fc1_w": dense(k1, c.dim, c.mlp),
                       "fc1_b": zeros(c.mlp), "fc2_w": dense(k2, c.mlp, c.dim), "fc2_b": zeros(c.dim)})
    return {"patch_w": dense(k[0], c.patch * c.patch, c.dim), "patch_b": zeros(c.dim),
            "pos": jax.random.normal(k[1], (c.tokens, c.dim), jnp.float32) * 0.02, "blocks": blocks,
            "ln_scale": ones(c.dim), "ln_bias": zeros(c.dim),
            "head_w": dense(jax.random.fold_in(key, 1000), c.dim, c.classes), "head_b": zeros(c.classes)}


# The model. `dtype` is the compute type: parameters are cast per use (tg::cast<C>), the patches after their
# transpose, and the logits back to float32. Python-float constants stay weakly typed, so they take the
# compute type, as the C++ float constants do.


def layer_norm(x, scale, bias, eps):
    """tg::layer_norm over the last axis: statistics in float32 (also for bf16), two-pass variance,
    rstd = 1 / sqrt(var + eps) computed and then multiplied, the result in x's type."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    rstd = 1.0 / jnp.sqrt(var + eps)
    return ((x32 - mean) * rstd * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def attention(b, h, c, cast):
    """vit::attention: multi-head self-attention of h (B, T, dim)."""
    B, T = h.shape[:2]
    qkv = (h.reshape(B * T, c.dim) @ cast(b["qkv_w"]) + cast(b["qkv_b"])).reshape(B, T, 3, c.heads, c.head_dim)
    qkv = qkv.transpose(2, 0, 3, 1, 4)  # (3, B, heads, T, head_dim)
    q, k, v = qkv[0], qkv[1], qkv[2]
    scores = (q @ jnp.swapaxes(k, -1, -2)) * (1.0 / math.sqrt(c.head_dim))  # the scale after the matmul
    p = jax.nn.softmax(scores, axis=-1)
    o = (p @ v).transpose(0, 2, 1, 3).reshape(B * T, c.dim)  # heads side by side
    return (o @ cast(b["out_w"]) + cast(b["out_b"])).reshape(B, T, c.dim)


def forward(params, x, c, dtype):
    """vit::forward: images (B, 784) in [0, 1] -> logits (B, classes) in float32. No dropout (rate 0)."""

    def cast(w):
        return w.astype(dtype)

    B, g, s = x.shape[0], c.grid, c.patch
    patches = x.reshape(B, g, s, g, s).transpose(0, 1, 3, 2, 4).astype(dtype).reshape(B * c.tokens, s * s)
    h = (patches @ cast(params["patch_w"]) + cast(params["patch_b"])).reshape(B, c.tokens, c.dim) + cast(params["pos"])
    for b in params["blocks"]:
        h = h + attention(b, layer_norm(h, cast(b["ln1_scale"]), cast(b["ln1_bias"]), c.ln_eps), c, cast)
        m = layer_norm(h, cast(b["ln2_scale"]), cast(b["ln2_bias"]), c.ln_eps).reshape(B * c.tokens, c.dim)
        f = jax.nn.gelu(m @ cast(b["fc1_w"]) + cast(b["fc1_b"]), approximate=True) @ cast(b["fc2_w"]) + cast(b["fc2_b"])
        h = h + f.reshape(B, c.tokens, c.dim)
    pooled = layer_norm(h, cast(params["ln_scale"]), cast(params["ln_bias"]), c.ln_eps).mean(axis=1)
    return (pooled @ cast(params["head_w"]) + cast(params["head_b"])).astype(jnp.float32)


def loss_with_metrics(params, x, y, c, dtype):
    """vit::loss_with_metrics: the mean softmax cross-entropy and, as aux, the batch accuracy."""
    logits = forward(params, x, c, dtype)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, jnp.mean((jnp.argmax(logits, axis=-1) == y).astype(jnp.float32))


def read_idx(path, magic, ndim):
    """A gzip IDX file (big-endian header: magic, then each dimension) as a uint8 array."""
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


def golden(args, c):
    """The first batch's loss, accuracy and gradient norms from the C++ example's parameters, as JSON."""
    params, c = load_params(args.params, c)
    x, y, idx = first_batch(args.data_dir, args.batch, args.seed)
    loss_fn = partial(loss_with_metrics, c=c, dtype=jnp.float32)
    (loss, accuracy), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, x, y)
    # The same float32 computation with jax_enable_x64 on: it must not change the loss.
    with jax.enable_x64(True):
        loss_x64, _ = jax.jit(loss_fn)(params, x, y)
    grad_norms = {name: float(np.linalg.norm(np.asarray(g, np.float64).ravel())) for name, g in named_leaves(grads)}
    out = {
        "generated_by": "scripts/vit_reference.py",
        "jax": jax.__version__, "optax": optax.__version__, "numpy": np.__version__,
        "config": {"dim": c.dim, "heads": c.heads, "layers": c.layers, "mlp": c.mlp, "batch": args.batch,
                   "seed": args.seed, "ln_eps": c.ln_eps},
        "params_digest": params_digest(args.params),
        "first_batch_indices_head": [int(i) for i in idx[:8]],
        "loss": float(loss),  # float32, jax_enable_x64 off (JAX's default)
        "loss_x64": float(loss_x64),  # the same float32 model traced with jax_enable_x64 on
        "accuracy": float(accuracy),
        # sqrt of the sum of the leaves' squared norms, in float64 from the float32 gradients (NumPy)
        "grad_global_norm": math.sqrt(sum(n * n for n in grad_norms.values())),
        "grad_global_norm_f32": float(optax.global_norm(grads)),  # optax.global_norm in float32, as the step's metric
        "grad_norms": grad_norms,  # each leaf's L2 norm, float64 from float32
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)  # json writes floats with repr: full precision
        f.write("\n")
    print(f"{args.out}: {c.layers} blocks, batch {args.batch} (seed {args.seed}): loss {out['loss']!r} "
          f"(x64 on {out['loss_x64']!r}), accuracy {out['accuracy']!r}, grad norm {out['grad_global_norm']!r}")


def make_optimizer():
    """vit::make_optimizer with OptimConfig's defaults."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, 2e-3, 200, 2000, 2e-5)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.05))


def timing(seconds, batch, steps):
    """Throughput and step time of the best and the median of the timed repeats."""
    best, median = min(seconds), statistics.median(seconds)
    return {"examples_per_sec": batch * steps / best, "step_ms": 1e3 * best / steps,
            "examples_per_sec_median": batch * steps / median, "step_ms_median": 1e3 * median / steps,
            "repeats": len(seconds)}


def bench(args, c, warmup=3, repeats=3):
    """Times `repeats` runs of args.steps training steps, jitted per step and inside one lax.scan."""
    if args.params:
        params, c = load_params(args.params, c)
    else:
        params = init_params(jax.random.key(args.seed), c)
    x, y, _ = first_batch(args.data_dir, args.batch, args.seed)
    x, y = jax.device_put(x), jax.device_put(y)
    optimizer = make_optimizer()
    loss_grad = jax.value_and_grad(partial(loss_with_metrics, c=c, dtype=DTYPES[args.dtype]), has_aux=True)

    def step(params, opt_state, x, y):
        """vit::train_step: the metrics carry the gradient norm before clipping."""
        (loss, accuracy), grads = loss_grad(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        metrics = {"loss": loss, "accuracy": accuracy, "grad_norm": optax.global_norm(grads)}
        return optax.apply_updates(params, updates), opt_state, metrics

    def train_loop(params, opt_state, x, y):
        """args.steps steps on the same batch inside one computation."""
        def body(carry, _):
            params, opt_state, metrics = step(*carry, x, y)
            return (params, opt_state), metrics

        (params, opt_state), metrics = jax.lax.scan(body, (params, opt_state), length=args.steps)
        return params, opt_state, metrics

    jit_step = jax.jit(step, donate_argnums=(0, 1))
    scan_loop = jax.jit(train_loop, donate_argnums=(0, 1))
    state = [params, optimizer.init(params)]  # (params, opt_state), donated and replaced by every call

    def run_steps(n):
        params, opt_state = state
        for _ in range(n):
            params, opt_state, metrics = jit_step(params, opt_state, x, y)
        jax.block_until_ready(metrics)
        state[:] = params, opt_state

    def run_scan():
        params, opt_state, metrics = scan_loop(*state, x, y)
        jax.block_until_ready(metrics)
        state[:] = params, opt_state

    def timed(run):
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    run_steps(warmup)  # compilation
    step_seconds = [timed(partial(run_steps, args.steps)) for _ in range(repeats)]
    run_scan()  # compilation, and one untimed run of the loop
    scan_seconds = [timed(run_scan) for _ in range(repeats)]
    print(json.dumps({"mode": "vit", "dtype": args.dtype, "batch": args.batch, "steps": args.steps,
                      "config": dataclasses.asdict(c),
                      "jit_step": timing(step_seconds, args.batch, args.steps),
                      "scan": timing(scan_seconds, args.batch, args.steps),
                      "jax": jax.__version__, "devices": str(jax.devices())}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    defaults = Config()
    common.add_argument("--dim", type=int, default=defaults.dim)
    common.add_argument("--heads", type=int, default=defaults.heads)
    common.add_argument("--layers", type=int, default=defaults.layers, help="ignored when a parameters file is given")
    common.add_argument("--mlp", type=int, default=defaults.mlp)
    common.add_argument("--batch", type=int, default=128)
    common.add_argument("--seed", type=int, default=0, help="the batch's permutation (and bench's initial parameters)")
    common.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("golden", parents=[common], help="first-batch loss, accuracy and gradient norms as JSON")
    g.add_argument("--params", required=True, help="safetensors file written by the C++ example")
    g.add_argument("--out", required=True, help="the JSON file to write")
    b = sub.add_parser("bench", parents=[common], help="time the training step: one jit per step, and lax.scan")
    b.add_argument("--steps", type=int, default=50, help="timed steps per repeat")
    b.add_argument("--dtype", choices=sorted(DTYPES), default="f32", help="compute type (parameters stay float32)")
    b.add_argument("--params", help="safetensors parameters (default: vit::init_params's from --seed)")
    args = ap.parse_args()
    if args.dim % args.heads:
        ap.error(f"--dim {args.dim} is not a multiple of --heads {args.heads}")
    c = Config(dim=args.dim, heads=args.heads, layers=args.layers, mlp=args.mlp)
    if args.command == "golden":
        golden(args, c)
    else:
        bench(args, c)


if __name__ == "__main__":
    main()
