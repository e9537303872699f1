#!/usr/bin/env python3
"""JAX's side of scripts/bench-lm-vs-jax: benchmarks/lm_step.cpp's small transformer language model
(token embedding gathered with jnp.take, learned positions, pre-norm blocks with causal
jax.nn.dot_product_attention and a GELU MLP, the output projection tied to the embedding, next-token
cross-entropy) and its AdamW step (optax.adamw) under jax.jit with the parameters and state donated, at
the same sizes; prints the median sequences/sec as one JSON line. A reference tool run by hand
(pip install jax optax), never by a test.
  python3 scripts/bench_lm_jax.py [--batch B] [--length T] [--vocab V] [--dim E] [--layers L] [--runs R] [--steps S]
"""
import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import optax


def layer_norm(x, scale, bias, eps=1e-6):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + eps) * scale + bias


def main():
    ap = argparse.ArgumentParser()
    for name, default in (("batch", 16), ("length", 64), ("vocab", 2048), ("dim", 128), ("layers", 2), ("runs", 5), ("steps", 20)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    B, T, V, E, L, heads, mlp = a.batch, a.length, a.vocab, a.dim, a.layers, 4, 512
    hd = E // heads
    keys = iter(jax.random.split(jax.random.key(0), 4 + 4 * L))

    def dense(i, o):
        return {"w": jax.random.normal(next(keys), (i, o)) / jnp.sqrt(i), "b": jnp.zeros((o,))}

    def norm():
        return {"scale": jnp.ones((E,)), "bias": jnp.zeros((E,))}

    params = {"emb": jax.random.normal(next(keys), (V, E)) * 0.02, "pos": jax.random.normal(next(keys), (T, E)) * 0.02,
              "blocks": [{"ln1": norm(), "qkv": dense(E, 3 * E), "out": dense(E, E), "ln2": norm(), "fc1": dense(E, mlp), "fc2": dense(mlp, E)}
                         for _ in range(L)],
              "ln": norm()}
    ids = jax.random.randint(next(keys), (B, T + 1), 0, V, jnp.int32)
    tokens, targets = ids[:, :-1], ids[:, 1:]

    def loss(p, tok, tgt):
        h = jnp.take(p["emb"], tok, axis=0) + p["pos"]
        for b in p["blocks"]:
            x = layer_norm(h, **b["ln1"])
            qkv = (x @ b["qkv"]["w"] + b["qkv"]["b"]).reshape(B, T, 3, heads, hd)
            att = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
            h = h + att.reshape(B, T, E) @ b["out"]["w"] + b["out"]["b"]
            m = layer_norm(h, **b["ln2"])
            h = h + jax.nn.gelu(m @ b["fc1"]["w"] + b["fc1"]["b"], approximate=True) @ b["fc2"]["w"] + b["fc2"]["b"]
        logits = layer_norm(h, **p["ln"]) @ p["emb"].T
        return optax.softmax_cross_entropy_with_integer_labels(logits.reshape(-1, V), tgt.reshape(-1)).mean()

    opt = optax.adamw(1e-3, weight_decay=0.01)

    def step(p, s, x, y):
        l, g = jax.value_and_grad(loss)(p, x, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, l

    step = jax.jit(step, donate_argnums=(0, 1))
    state = opt.init(params)
    params, state, l = step(params, state, tokens, targets)
    l.block_until_ready()
    rates = []
    for _ in range(a.runs):
        t0 = time.perf_counter()
        for _ in range(a.steps):
            params, state, l = step(params, state, tokens, targets)
        l.block_until_ready()
        rates.append(a.steps * B / (time.perf_counter() - t0))
    print(json.dumps({"jax": jax.__version__, "sequences_per_sec": statistics.median(rates), "loss": float(l)}))


if __name__ == "__main__":
    main()
