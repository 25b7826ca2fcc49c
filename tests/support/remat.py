"""MoE layers the way training stacks write them: wrapped in jax.checkpoint with a policy, scanned over stacked layer
parameters (MaxText's scan_layers + remat policy), plus counting the native calls of a lowered program. Shared by
tests/test_remat.py and the multi-process worker."""
from __future__ import annotations

import collections
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_moe
from support.grads import grad_program, moe_layer
from support.helpers import random_routing

# name -> the policy (None: no checkpoint at all; "default": jax.checkpoint's own, everything recomputed).
POLICIES: dict[str, object] = {
    "plain": None,
    "checkpoint": "default",
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "save_only_names": jax.checkpoint_policies.save_only_these_names(jax_moe.DISPATCH_NAME, jax_moe.COMBINE_NAME),
}


def with_policy(layer: Callable, variant: str) -> Callable:
    policy = POLICIES[variant]
    if policy is None:
        return layer
    return jax.checkpoint(layer) if policy == "default" else jax.checkpoint(layer, policy=policy)


def remat_problem(rng, n: int, t: int, r: int, e: int, hidden: int, layers: int):
    """(x, topk_idx, topk_weights, a [layers, e, hidden], b, g)."""
    x = rng.standard_normal((n * t, hidden)).astype(jnp.bfloat16)
    idx = random_routing(rng, n, t, r, e, mask=0.2)
    w = (rng.random((n * t, r)) / r).astype(np.float32)  # summing to <= 1: values stay O(1) through the layers
    a = (1 + 0.3 * rng.standard_normal((layers, e, hidden))).astype(np.float32)
    b = (0.1 * rng.standard_normal((layers, e, hidden))).astype(np.float32)
    g = rng.standard_normal((n * t, hidden)).astype(np.float32)
    return x, idx, w, a, b, g


def remat_grad_fn(comm: jax_moe.Communicator, variant: str, layers: int, split: bool = False,
                  collective: bool = True):
    """jit(grad) of the loss of `layers` MoE layers (one: called directly; more: lax.scan over the stacked a, b), each
    wrapped as `variant` says, over (x, topk_weights, a, b) (collective: see grads.grad_program)."""
    axis = comm.axis_name
    layer = with_policy(moe_layer(comm, split), variant)

    def loss(x, idx, w, a, b, g):
        if layers == 1:
            out = layer(x, idx, w, a[0], b[0])
        else:
            out, _ = jax.lax.scan(lambda h, ab: (layer(h, idx, w, ab[0], ab[1]), None), x, (a, b))
        return jnp.sum(out.astype(jnp.float32) * g)

    specs = (P(axis), P(axis), P(axis), P(None, axis), P(None, axis), P(axis))
    return grad_program(comm, loss, specs, collective)


def scanned_sharded_grad_fn(comm: jax_moe.Communicator, variant: str):
    """The other layout of scan_layers (MaxText, nnx.scan over the stacked blocks): lax.scan over the layers in the
    global view, each step one shard_map'ed layer, wrapped as `variant` says. jit(grad) over (x, topk_weights, a, b).
    The backward pass of such a program carries residuals from one shard_map body into another."""
    axis = comm.axis_name
    layer = with_policy(moe_layer(comm, split_halves=False), variant)
    step = jax.shard_map(layer, mesh=comm.mesh, in_specs=(P(axis),) * 5, out_specs=P(axis))

    def loss(x, idx, w, a, b, g):
        out, _ = jax.lax.scan(lambda h, ab: (step(h, idx, w, ab[0], ab[1]), None), x, (a, b))
        return jnp.sum(out.astype(jnp.float32) * g)

    return jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4)))


def dense_remat_loss(x, idx, w, a, b, g, num_experts: int):
    """The same loss with no communication: each layer sums w * (x * a[e] + b[e]) over a token's unmasked experts,
    rounding where the layer does (expert outputs and the combined rows to bf16)."""
    valid = (idx >= 0) & (idx < num_experts)
    safe = jnp.where(valid, idx, 0)
    h = x
    for layer in range(a.shape[0]):
        y = (h.astype(jnp.float32)[:, None, :] * a[layer][safe] + b[layer][safe]).astype(jnp.bfloat16)
        h = jnp.sum(jnp.where(valid[..., None], w[..., None] * y.astype(jnp.float32), 0.0), axis=1)
        h = h.astype(jnp.bfloat16)
    return jnp.sum(h.astype(jnp.float32) * g)


def native_calls(fn, *args) -> collections.Counter:
    """The jax_moe custom calls of fn's lowered program, by target (a scan body counts once)."""
    return collections.Counter(re.findall(r"jax_moe_(?:cpu|cuda)_[a-z_]+", fn.lower(*args).as_text()))


def dense_grads(problem, num_experts: int):
    """The dense reference's gradients (x, topk_weights, a, b) of dense_remat_loss."""
    x, idx, w, a, b, g = problem
    return jax.grad(dense_remat_loss, argnums=(0, 2, 3, 4))(jnp.asarray(x), idx, w, a, b, g, num_experts)
