#!/usr/bin/env python3
"""The JAX peer of benchmarks/forward.cpp (bench_forward): the same three models and quantities under jax.jit,
on the CPU, f32 (JAX's default), medians of --runs runs of --reps calls, each call blocked on its result.

  1. The MLP 64 -> 256 -> 128 -> 10, tanh and layer_norm after each hidden layer, batch 256: forward (the
     logits), jax.jvp of the logits in the parameters, jax.grad of the mean cross-entropy, and its
     Hessian-vector product jax.jvp(jax.grad(loss)) (forward over reverse).
  2. The ViT's forward (scripts/vit_reference.py, vit::Config's default sizes), batch --vit-batch: forward and
     jax.jvp of the logits in the parameters.
  3. The PINN's network (width 32) at the 32 x 32 collocation points: forward, jax.jvp of u in the parameters,
     jax.grad of sum(u) in the points and its jax.jvp along e0 (the Laplacian's inner part).

A reference tool run by hand (pip install jax optax); prints a table like bench_forward's.
    python3 scripts/bench_forward_jax.py [--runs 5] [--reps 10] [--vit-batch 128]
"""
import argparse
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vit_reference  # noqa: E402  (the ViT, op for op)

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--runs", type=int, default=5)
ap.add_argument("--reps", type=int, default=10)
ap.add_argument("--vit-batch", type=int, default=128)
args = ap.parse_args()


def ms(f, reps):
    jax.block_until_ready(f())
    times = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        for _ in range(reps):
            jax.block_until_ready(f())
        times.append((time.perf_counter() - t0) * 1e3 / reps)
    return statistics.median(times)


def row(what, t, base, of):
    print(f"  {what:<44} {t:9.3f} ms   {t / base:5.2f}x {of}")


def layer_norm(x, scale, bias, eps=1e-6):
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * (1.0 / jnp.sqrt(var + eps)) * scale + bias


def init_mlp(key):
    k = jax.random.split(key, 10)
    w = lambda ki, i, o: jax.random.normal(ki, (i, o), jnp.float32) / math.sqrt(i)
    b = lambda ki, n: jax.random.normal(ki, (n,), jnp.float32) * 0.1
    return {"w1": w(k[0], 64, 256), "b1": b(k[1], 256), "s1": b(k[2], 256) + 1, "o1": b(k[3], 256), "w2": w(k[4], 256, 128),
            "b2": b(k[5], 128), "s2": b(k[6], 128) + 1, "o2": b(k[7], 128), "w3": w(k[8], 128, 10), "b3": b(k[9], 10)}


def logits(p, x):
    h = layer_norm(jnp.tanh(x @ p["w1"] + p["b1"]), p["s1"], p["o1"])
    h = layer_norm(jnp.tanh(h @ p["w2"] + p["b2"]), p["s2"], p["o2"])
    return h @ p["w3"] + p["b3"]


def loss(p, x, y):
    lg = logits(p, x)
    return jnp.mean(jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, y[:, None], -1)[:, 0])


print(f"bench_forward_jax: JAX {jax.__version__} on {jax.devices()[0].platform}, medians of {args.runs} runs of {args.reps} calls, jax.jit, f32")
p, v = init_mlp(jax.random.key(1)), init_mlp(jax.random.key(20))
x = jax.random.normal(jax.random.key(40), (256, 64), jnp.float32)
y = jnp.asarray((np.arange(256) * 7) % 10, jnp.int32)
print(f"MLP 64-256-128-10, tanh + layer_norm, {sum(a.size for a in jax.tree.leaves(p))} parameters, batch 256")
fwd = jax.jit(lambda q: logits(q, x))
jvp = jax.jit(lambda q, t: jax.jvp(lambda r: logits(r, x), (q,), (t,))[1])
grad = jax.jit(lambda q: jax.grad(lambda r: loss(r, x, y))(q))
hvp = jax.jit(lambda q, t: jax.jvp(lambda r: jax.grad(lambda s: loss(s, x, y))(r), (q,), (t,))[1])
t_fwd, t_jvp = ms(lambda: fwd(p), args.reps), ms(lambda: jvp(p, v), args.reps)
t_grad, t_hvp = ms(lambda: grad(p), args.reps), ms(lambda: hvp(p, v), args.reps)
row("forward (logits)", t_fwd, t_fwd, "forward")
row("jax.jvp of the logits", t_jvp, t_fwd, "forward")
row("grad of the loss", t_grad, t_grad, "grad")
row("hvp of the loss (jvp of grad)", t_hvp, t_grad, "grad")

c = vit_reference.Config()
vp, vv = vit_reference.init_params(jax.random.key(0), c), vit_reference.init_params(jax.random.key(5), c)
vx = jax.random.uniform(jax.random.key(41), (args.vit_batch, c.image * c.image), jnp.float32)
print(f"ViT forward (dim {c.dim}, {c.heads} heads, {c.layers} blocks, MLP {c.mlp}), batch {args.vit_batch}")
vfwd = jax.jit(lambda q: vit_reference.forward(q, vx, c, jnp.float32))
vjvp = jax.jit(lambda q, t: jax.jvp(lambda r: vit_reference.forward(r, vx, c, jnp.float32), (q,), (t,))[1])
reps = max(1, args.reps // 5)
t_fwd, t_jvp = ms(lambda: vfwd(vp), reps), ms(lambda: vjvp(vp, vv), reps)
row("forward (logits)", t_fwd, t_fwd, "forward")
row("jax.jvp of the logits", t_jvp, t_fwd, "forward")


def pinn_init(key, width):
    k = jax.random.split(key, 3)
    glorot = lambda ki, i, o: jax.random.normal(ki, (i, o), jnp.float32) * np.float32(math.sqrt(2.0 / (i + o)))
    return {"w1": glorot(k[0], 2, width), "b1": jnp.zeros((width,), jnp.float32), "w2": glorot(k[1], width, width),
            "b2": jnp.zeros((width,), jnp.float32), "w3": glorot(k[2], width, 1), "b3": jnp.zeros((1,), jnp.float32)}


def u(q, xy):
    h = jnp.tanh(xy @ q["w1"] + q["b1"])
    h = jnp.tanh(h @ q["w2"] + q["b2"])
    n = (h @ q["w3"] + q["b3"]).reshape(-1)
    a, b = xy[:, 0], xy[:, 1]
    return a * (1.0 - a) * b * (1.0 - b) * n


pp, pv = pinn_init(jax.random.key(0), 32), pinn_init(jax.random.key(9), 32)
g = (np.arange(32, dtype=np.float32) + 0.5) / 32
xy = jnp.asarray(np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2))
e0 = jnp.zeros_like(xy).at[:, 0].set(1.0)
print(f"PINN network (width 32) at {xy.shape[0]} points")
pfwd = jax.jit(lambda q: u(q, xy))
pjvp = jax.jit(lambda q, t: jax.jvp(lambda r: u(r, xy), (q,), (t,))[1])
grad_u = lambda pts: jax.grad(lambda r: u(pp, r).sum())(pts)
pgrad = jax.jit(grad_u)
plap = jax.jit(lambda pts: jax.jvp(grad_u, (pts,), (e0,))[1])
t_fwd, t_jvp = ms(lambda: pfwd(pp), args.reps), ms(lambda: pjvp(pp, pv), args.reps)
t_grad, t_lap = ms(lambda: pgrad(xy), args.reps), ms(lambda: plap(xy), args.reps)
row("forward (u)", t_fwd, t_fwd, "forward")
row("jax.jvp of u in the parameters", t_jvp, t_fwd, "forward")
row("grad of sum(u) in the points", t_grad, t_grad, "grad")
row("jvp of that grad along e0", t_lap, t_grad, "grad")
