#!/usr/bin/env python3
"""JAX's side of scripts/bench-take-vs-jax: jnp.take of token ids from an embedding table, and its gradient
(jax.grad of sum(take(table, ids) * w)), each under jax.jit, at the same sizes and with the same kind of
ids as bench_take (uniform over the vocabulary); prints the medians in ms as one JSON line. A reference
tool run by hand (pip install jax), never by a test.
  python3 scripts/bench_take_jax.py [--vocab V] [--tokens T] [--dim D] [--runs R]
"""
import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp


def median_ms(f, reps, runs):
    f().block_until_ready()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = f()
        out.block_until_ready()
        times.append((time.perf_counter() - t0) / reps * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--runs", type=int, default=7)
    a = ap.parse_args()
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    table = jax.random.normal(k1, (a.vocab, a.dim), jnp.float32)
    ids = jax.random.randint(k2, (a.tokens,), 0, a.vocab, jnp.int32)
    w = jax.random.normal(k3, (a.tokens, a.dim), jnp.float32)
    # ids and w are arguments, not constants of the traced function: XLA would fold a 25 MB constant
    forward = jax.jit(lambda t, i: jnp.take(t, i, axis=0))
    backward = jax.jit(jax.grad(lambda t, i, w: jnp.sum(jnp.take(t, i, axis=0) * w)))
    print(json.dumps({"jax": jax.__version__, "forward_ms": median_ms(lambda: forward(table, ids), 20, a.runs),
                      "forward_backward_ms": median_ms(lambda: backward(table, ids, w), 5, a.runs)}))


if __name__ == "__main__":
    main()
