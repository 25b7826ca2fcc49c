"""Diagnostics for gradients with backend "cuda" on 2 GPUs: which pieces of the gradient program disagree with "xla".

Run on a machine with 2 GPUs: `python tests/gpu/diag_grad.py`. Prints one line per variant.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_moe  # noqa: E402
from helpers import random_routing  # noqa: E402
from test_grad import local_expert_of_rows  # noqa: E402

n, e, r, hidden, t = 2, 8, 3, 64, 6
mesh = jax.make_mesh((n,), ("ep",), devices=jax.devices("gpu")[:n])
rng = np.random.default_rng(0)
x = rng.standard_normal((n * t, hidden)).astype(jnp.bfloat16)
idx = random_routing(rng, n, t, r, e, mask=0.2)
w = rng.random((n * t, r)).astype(np.float32)
a = (1 + 0.5 * rng.standard_normal((e, hidden))).astype(np.float32)
b = (0.1 * rng.standard_normal((e, hidden))).astype(np.float32)
g = rng.standard_normal((n * t, hidden)).astype(np.float32)
sh = NamedSharding(mesh, P("ep"))
args = [jax.device_put(v, sh) for v in (x, idx, w, a, b, g)]


def loss_fn(comm, extra_a2a=False):
    def body(x, idx, w, a, b, g):
        d = comm.dispatch(x, idx)
        ee = local_expert_of_rows(d.expert_counts, d.expert_x.shape[0])
        y = (d.expert_x.astype(jnp.float32) * a[ee] + b[ee]).astype(jnp.bfloat16)
        out = comm.combine(y, w, d)
        loss = jnp.sum(out.astype(jnp.float32) * g)
        if extra_a2a:
            loss = loss + 0 * jnp.sum(jax.lax.all_to_all(g, "ep", 0, 0, tiled=True))
        return jax.lax.psum(loss, "ep")

    return jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 6, out_specs=P())


def run(backend, argnums, extra=False, bwd="cuda"):
    comm = jax_moe.Communicator(jax_moe.MoEConfig(e, r, hidden, t), mesh, "ep", backend=backend)
    if backend == "cuda":
        comm.backend.backward_combine = bwd
    if backend == "xla" and bwd == "recompute":  # the reference backend recomputing its route in the backward pass
        from jax_moe.backends.xla import XlaBackend

        ref = XlaBackend(comm)
        comm.backend.dispatch_slots = lambda rows, route, i: ref.dispatch_slots(rows, None, i)
        comm.backend.combine_slots = lambda y, route, i: ref.combine_slots(y, None, i)
    f = loss_fn(comm, extra)
    if argnums is None:
        return [jax.jit(f)(*args)]
    return list(jax.jit(jax.grad(f, argnums=argnums))(*args))


for label, argnums, extra, bwd in (("loss", None, False, "cuda"), ("loss+a2a", None, True, "cuda"),
                                   ("grad a,b", (3, 4), False, "cuda"), ("grad w", (2,), False, "cuda"),
                                   ("grad x", (0,), False, "cuda"), ("grad x ref-bwd", (0,), False, "reference"),
                                   ("grad all", (0, 2, 3, 4), False, "cuda"),
                                   ("xla recompute vs xla", (0, 2, 3, 4), False, "xla-recompute")):
    cu = run("xla", argnums, extra, "recompute") if bwd == "xla-recompute" else run("cuda", argnums, extra, bwd)
    xl = run("xla", argnums, extra)
    diffs = [float(np.max(np.abs(np.asarray(c, np.float32) - np.asarray(q, np.float32)))) for c, q in zip(cu, xl)]
    scale = [float(np.max(np.abs(np.asarray(q, np.float32)))) for q in xl]
    print(f"DIAG {label:16s} max|cuda-xla| {['%.3g' % v for v in diffs]} of max|xla| {['%.3g' % v for v in scale]}",
          flush=True)
