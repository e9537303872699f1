#!/usr/bin/env python3
"""Golden values of the higher-order transformations, from JAX, for tests/golden/higher_order_golden.cpp
(ctest golden_higher_order): writes tests/data/higher_order_golden.json.

1. The Hessian-vector product of the codelab's loss (the MLP 784-256-128-10 with GELU, mean softmax
   cross-entropy) at its key(1) parameters on its first batch (512 images, np.random.default_rng(0)'s
   permutation), with v: leaf i (w1, b1, w2, b2, w3, b3) = jax.random.normal(fold_in(key(7), i)), by
   jax.jvp(jax.grad(loss), (params,), (v,)) (forward over reverse).
2. The JVP of the ViT's forward (scripts/vit_reference.py's model; key(0) parameters, which tg::random draws
   bit for bit) on the ViT example's first batch (128 images, default_rng(0)) along the tangent whose leaf
   of sorted-name index i is jax.random.normal(fold_in(key(7), i)): jax.jvp(forward, (params,), (t,)).

Run by hand, with JAX from PyPI (pip install jax optax); no test runs JAX:
    python3 scripts/higher_order_golden.py [--data-dir /usr/share/datasets/fashion-mnist] [--out tests/data/higher_order_golden.json]
"""
import argparse
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vit_reference as vr  # noqa: E402  (the ViT model and the data reader)

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
ap.add_argument("--out", default="tests/data/higher_order_golden.json")
args = ap.parse_args()

TANGENT_KEY = 7
MLP_NAMES = ["w1", "b1", "w2", "b2", "w3", "b3"]  # the C++ struct's order


def codelab_params(key):
    """codelab::init_mlp_params: He-normal weights from jax.random.split(key, 3), zero biases."""
    k1, k2, k3 = jax.random.split(key, 3)
    he = lambda k, i, o: jax.random.normal(k, (i, o), dtype=jnp.float32) * math.sqrt(2.0 / i)
    return {"w1": he(k1, 784, 256), "b1": jnp.zeros((256,), jnp.float32), "w2": he(k2, 256, 128),
            "b2": jnp.zeros((128,), jnp.float32), "w3": he(k3, 128, 10), "b3": jnp.zeros((10,), jnp.float32)}


def codelab_loss(params, x, y):
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    h = jax.nn.gelu(h @ params["w2"] + params["b2"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["w3"] + params["b3"], y).mean()


def tangent(key, shapes_in_order):
    return [jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32) for i, s in enumerate(shapes_in_order)]


def summary(v, most=4096):
    """What the test compares: the L2 norm of all values (float64 of the float32 values) and every
    `stride`-th value (stride = ceil(size / most), so at most `most` of them)."""
    a = np.asarray(v, np.float64).ravel()
    stride = -(-a.size // most)
    return {"norm": float(np.linalg.norm(a)), "size": int(a.size), "stride": stride, "values": [float(t) for t in a[::stride]]}


# 1. The codelab's HVP. Its first batch: the training set in default_rng(0)'s order, the first 512.
images = vr.read_idx(f"{args.data_dir}/train-images-idx3-ubyte.gz", 2051, 3)
labels = vr.read_idx(f"{args.data_dir}/train-labels-idx1-ubyte.gz", 2049, 1)
perm = np.random.default_rng(0).permutation(len(images))[:512]
x = (images[perm].astype(np.float32) / 255.0).reshape(512, -1)
y = labels[perm].astype(np.int32)
params = codelab_params(jax.random.key(1))
v = dict(zip(MLP_NAMES, tangent(jax.random.key(TANGENT_KEY), [params[n].shape for n in MLP_NAMES])))
hvp = jax.jit(lambda p, t: jax.jvp(lambda q: jax.grad(codelab_loss)(q, x, y), (p,), (t,))[1])(params, v)
codelab = {name: summary(hvp[name]) for name in MLP_NAMES}
vhv = float(sum(np.dot(np.asarray(hvp[n], np.float64).ravel(), np.asarray(v[n], np.float64).ravel()) for n in MLP_NAMES))

# 2. The ViT forward's JVP, on the ViT example's first batch (default_rng(0), 128 images).
c = vr.Config()
vparams = vr.init_params(jax.random.key(0), c)
named = list(vr.named_leaves(vparams))
order = sorted(name for name, _ in named)
shapes = {name: leaf.shape for name, leaf in named}
t_sorted = tangent(jax.random.key(TANGENT_KEY), [shapes[n] for n in order])
t_by_name = dict(zip(order, t_sorted))
vx, vy, vidx = vr.first_batch(args.data_dir, 128, 0)
# The tangent as a tree of vparams' structure, its leaves matched to the parameters' by name.
flat, treedef = jax.tree_util.tree_flatten(vparams)
name_of_leaf = {id(leaf): name for name, leaf in named}
vt = jax.tree_util.tree_unflatten(treedef, [t_by_name[name_of_leaf[id(leaf)]] for leaf in flat])
logits, logits_t = jax.jit(lambda p, t: jax.jvp(lambda q: vr.forward(q, vx, c, jnp.float32), (p,), (t,)))(vparams, vt)

out = {
    "generated_by": "scripts/higher_order_golden.py",
    "jax": jax.__version__, "optax": optax.__version__, "numpy": np.__version__, "backend": jax.default_backend(),
    "tangent_key": TANGENT_KEY,
    "codelab_hvp": {"params_key": 1, "batch": 512, "data_order_seed": 0, "first_batch_indices_head": [int(i) for i in perm[:8]],
                    "loss": float(codelab_loss(params, x, y)), "vHv": vhv, "leaves": codelab},
    "vit_jvp": {"params_key": 0, "batch": 128, "data_order_seed": 0, "first_batch_indices_head": [int(i) for i in vidx[:8]],
                "config": {"dim": c.dim, "heads": c.heads, "layers": c.layers, "mlp": c.mlp, "ln_eps": c.ln_eps},
                "tangent_leaf_order": order, "logits": summary(logits), "logits_tangent": summary(logits_t)},
}
with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
    f.write("\n")
print(f"{args.out}: codelab loss {out['codelab_hvp']['loss']!r}, v.Hv {vhv!r}; ViT JVP norm {out['vit_jvp']['logits_tangent']['norm']!r}")
