#!/usr/bin/env python3
"""examples/pinn_poisson in JAX + Optax: the same physics-informed network for -lap(u) = 2 pi^2 sin(pi x)
sin(pi y) on the unit square (u = 0 on the boundary, built in as u = x (1 - x) y (1 - y) N(x, y)), the same
initial parameters (Glorot-normal from jax.random.split(key(seed), 3), which tg::random draws bit for bit),
collocation points, loss (the Laplacian by jax.jvp of jax.grad, one unit direction per coordinate) and
optimizer (optax.adam over optax.join_schedules of a constant and an exponential decay).

  golden: writes the first loss, the first step's loss and the error at the initial parameters as JSON
          (examples/pinn_poisson/pinn_golden.json, which pinn_poisson --check-golden reads):
      python3 scripts/pinn_poisson_reference.py golden [--out examples/pinn_poisson/pinn_golden.json]
  run:    trains with the example's defaults, measuring the relative L2 error on the 101 x 101 grid every
          --eval-every steps, and prints one JSON line: the time (training only, the evaluations excluded,
          after one compiled warm-up step) to reach --target, the steps taken, the final error. Used by
          scripts/bench-pinn-vs-jax, beside the C++ example's own run:
      python3 scripts/pinn_poisson_reference.py run [--target 1e-3]

With JAX from PyPI (pip install jax optax); no test runs JAX. float32, JAX's default.
"""
import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("mode", choices=["golden", "run"])
ap.add_argument("--width", type=int, default=32)
ap.add_argument("--points", type=int, default=32, help="collocation grid: points x points cell centres")
ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--adam-steps", type=int, default=2000)
ap.add_argument("--decay-steps", type=int, default=3000)
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--grid", type=int, default=101)
ap.add_argument("--target", type=float, default=1e-3)
ap.add_argument("--eval-every", type=int, default=100)
ap.add_argument("--out", default="examples/pinn_poisson/pinn_golden.json")
args = ap.parse_args()


def init_params(key, width):
    k = jax.random.split(key, 3)
    glorot = lambda ki, i, o: jax.random.normal(ki, (i, o), jnp.float32) * np.float32(math.sqrt(2.0 / (i + o)))
    return {"w1": glorot(k[0], 2, width), "b1": jnp.zeros((width,), jnp.float32), "w2": glorot(k[1], width, width),
            "b2": jnp.zeros((width,), jnp.float32), "w3": glorot(k[2], width, 1), "b3": jnp.zeros((1,), jnp.float32)}


def u(p, xy):
    h = jnp.tanh(xy @ p["w1"] + p["b1"])
    h = jnp.tanh(h @ p["w2"] + p["b2"])
    n = (h @ p["w3"] + p["b3"]).reshape(-1)
    x, y = xy[:, 0], xy[:, 1]
    return x * (1.0 - x) * y * (1.0 - y) * n


def laplacian(p, xy, e0, e1):
    grad_u = lambda q: jax.grad(lambda r: u(p, r).sum())(q)
    h0 = jax.jvp(grad_u, (xy,), (e0,))[1]
    h1 = jax.jvp(grad_u, (xy,), (e1,))[1]
    return h0[:, 0] + h1[:, 1]


def loss(p, xy, f, e0, e1):
    return jnp.mean(jnp.square(laplacian(p, xy, e0, e1) + f))


def source(x, y):
    return 2 * math.pi ** 2 * np.sin(math.pi * x) * np.sin(math.pi * y)


# The collocation points: cell centres (i + 1/2) / n, row-major in (x, y), in float32; f from them in float64.
n = args.points
c = (np.arange(n, dtype=np.float32) + np.float32(0.5)) / np.float32(n)
xy = np.stack(np.meshgrid(c, c, indexing="ij"), -1).reshape(-1, 2).astype(np.float32)
f = source(xy[:, 0].astype(np.float64), xy[:, 1].astype(np.float64)).astype(np.float32)
e0 = np.tile(np.array([1, 0], np.float32), (n * n, 1))
e1 = np.tile(np.array([0, 1], np.float32), (n * n, 1))
k = args.grid
g = np.arange(k, dtype=np.float32) / np.float32(k - 1)
grid = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2).astype(np.float32)
exact = np.sin(math.pi * grid[:, 0].astype(np.float64)) * np.sin(math.pi * grid[:, 1].astype(np.float64))

optimizer = optax.adam(optax.join_schedules([optax.constant_schedule(args.lr), optax.exponential_decay(args.lr, args.decay_steps, 0.01)],
                                            [args.adam_steps]))


@jax.jit
def step(p, s):
    value, grads = jax.value_and_grad(loss)(p, xy, f, e0, e1)
    updates, s = optimizer.update(grads, s, p)
    return optax.apply_updates(p, updates), s, value


predict = jax.jit(u)


def rel_l2(p):
    d = np.asarray(predict(p, grid), np.float64)
    return float(np.linalg.norm(d - exact) / np.linalg.norm(exact))


params = init_params(jax.random.key(args.seed), args.width)
state = optimizer.init(params)
config = {"width": args.width, "points": args.points, "lr": args.lr, "adam_steps": args.adam_steps, "decay_steps": args.decay_steps,
          "seed": args.seed, "grid": args.grid}

if args.mode == "golden":
    first = float(jax.jit(loss)(params, xy, f, e0, e1))
    p1, _, _ = step(params, state)
    out = {"generated_by": "scripts/pinn_poisson_reference.py golden", "jax": jax.__version__, "optax": optax.__version__,
           "config": config, "first_loss": first, "loss_after_one_step": float(jax.jit(loss)(p1, xy, f, e0, e1)),
           "initial_rel_l2": rel_l2(params)}
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
        fh.write("\n")
    print(f"{args.out}: first loss {first!r}, after one step {out['loss_after_one_step']!r}")
else:
    total = args.adam_steps + args.decay_steps
    p1, s1, _ = step(params, state)  # compiles; then start again from the initial parameters
    jax.block_until_ready(p1)
    train_seconds, reached, err, steps = 0.0, None, rel_l2(params), 0
    while steps < total:
        t0 = time.perf_counter()
        for _ in range(min(args.eval_every, total - steps)):
            params, state, value = step(params, state)
            steps += 1
        jax.block_until_ready(params)
        train_seconds += time.perf_counter() - t0
        err = rel_l2(params)
        if reached is None and err <= args.target:
            reached = {"steps": steps, "seconds": train_seconds}
    print(json.dumps({"framework": "jax", "jax": jax.__version__, "backend": jax.default_backend(), "config": config,
                      "target": args.target, "reached": reached, "final_rel_l2": err, "steps": steps, "train_seconds": train_seconds,
                      "steps_per_sec": steps / train_seconds, "final_loss": float(value)}))
