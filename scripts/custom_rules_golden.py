#!/usr/bin/env python3
"""Golden values of custom_vjp and custom_jvp to second order, from JAX (f64), for tests/test_custom.cpp:
writes tests/data/custom_rules_golden.txt, a line per quantity: its name, its size, its values (%.17g).

Each function here is written in tests/test_custom.cpp with tapegrad's ops; the test compares value, grad
and the Hessian by forward over reverse (jax.hessian = jacfwd(jacrev)) and reverse over reverse
(jacrev(jacrev)) at the same points, to 1e-13 relative.

    pip install jax==0.10.2   # any recent JAX gives the same numbers to ~1e-16
    python3 scripts/custom_rules_golden.py [--out tests/data/custom_rules_golden.txt]
"""
import argparse

import jax
import jax.numpy as jnp

jax.config.update("jax_enable_x64", True)

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="tests/data/custom_rules_golden.txt")
args = ap.parse_args()


# A gradient-reversal layer: the identity forward, -0.5 dy backward.
@jax.custom_vjp
def grl(z):
    return z


grl.defvjp(lambda z: (z, None), lambda _, dy: (-0.5 * dy,))


# A straight-through estimator: the sign forward (1 or -1), the identity backward.
@jax.custom_vjp
def ste(z):
    return jnp.where(z > 0, 1.0, -1.0)


ste.defvjp(lambda z: (jnp.where(z > 0, 1.0, -1.0), None), lambda _, dy: (dy,))


# Gradient clipping: the identity forward, the cotangent clipped to [-0.5, 0.5] backward.
@jax.custom_vjp
def clip_gradient(z):
    return z


clip_gradient.defvjp(lambda z: (z, None), lambda _, dy: (jnp.clip(dy, -0.5, 0.5),))


# softplus with a stable JVP rule whose y calls the custom function itself (JAX's documented pattern).
@jax.custom_jvp
def softplus(z):
    return jnp.log(1.0 + jnp.exp(z))


@softplus.defjvp
def softplus_jvp(primals, tangents):
    (z,), (t,) = primals, tangents
    return softplus(z), t * jax.nn.sigmoid(z)


# A rule that is not f's derivative (2 cos for sin), its y by calling itself: an outer level sees the rule.
@jax.custom_jvp
def sin2_self(z):
    return jnp.sin(z)


@sin2_self.defjvp
def sin2_self_jvp(primals, tangents):
    (z,), (t,) = primals, tangents
    return sin2_self(z), 2.0 * jnp.cos(z) * t


# The same rule with y computed by jnp.sin: an outer level differentiates sin.
@jax.custom_jvp
def sin2_plain(z):
    return jnp.sin(z)


@sin2_plain.defjvp
def sin2_plain_jvp(primals, tangents):
    (z,), (t,) = primals, tangents
    return jnp.sin(z), 2.0 * jnp.cos(z) * t


functions = {
    "grl": lambda x: jnp.sum(jnp.tanh(grl(x)) ** 2),
    "ste": lambda x: jnp.sum(ste(x) * x * x),
    "clip_gradient": lambda x: jnp.sum(jnp.sin(clip_gradient(x * x))),
    "softplus": lambda x: jnp.sum(softplus(x) * jnp.tanh(x)),
    "sin2_self": lambda x: jnp.sum(sin2_self(x) ** 2),
    "sin2_plain": lambda x: jnp.sum(sin2_plain(x) ** 2),
}
x = jnp.array([0.3, -1.2, 0.7], dtype=jnp.float64)

lines = ["# scripts/custom_rules_golden.py with JAX %s: name size values (f64), at x = [0.3, -1.2, 0.7]" % jax.__version__]
for name, f in functions.items():
    quantities = {
        "value": f(x),
        "grad": jax.grad(f)(x),
        "hessian_fwd_rev": jax.jacfwd(jax.jacrev(f))(x),
        "hessian_rev_rev": jax.jacrev(jax.jacrev(f))(x),
    }
    for what, v in quantities.items():
        flat = jnp.ravel(v)
        lines.append("%s.%s %d %s" % (name, what, flat.size, " ".join("%.17g" % float(e) for e in flat)))
# The number: hessian(sum(tanh(grl(x))^2)) at the scalar 0.3.
lines.append("grl.hessian_at_0.3 1 %.17g" % float(jax.hessian(lambda z: jnp.tanh(grl(z)) ** 2)(0.3)))
with open(args.out, "w") as out:
    out.write("\n".join(lines) + "\n")
print("wrote", args.out)
