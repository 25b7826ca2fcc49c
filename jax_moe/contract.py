"""The dispatch/combine contract every backend shares: which (token, k) entries count, and per-rank typing.

Pure functions of the routing, no communication: the API uses them for the gradients, the backends for the row
layout of `Dispatched.expert_x`, which the contract fixes (not the backend).
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp


def sanitize_topk(topk_idx: jax.Array, num_experts: int) -> jax.Array:
    """Out-of-range ids and repeats of an expert within a token become masked (-1): never written anywhere."""
    idx = jnp.where((topk_idx >= 0) & (topk_idx < num_experts), topk_idx, -1)
    r = idx.shape[1]
    earlier = jnp.tril(jnp.ones((r, r), bool), k=-1)  # earlier[k, k'] = k' < k
    repeat = jnp.any((idx[:, :, None] == idx[:, None, :]) & earlier & (idx[:, :, None] >= 0), axis=-1)
    return jnp.where(repeat, -1, idx)


def valid_entries(topk_idx: jax.Array, num_experts: int) -> jax.Array:
    """[T, R] bool: the (token, k) entries that move a row (in range, first occurrence of their expert)."""
    return sanitize_topk(topk_idx, num_experts) >= 0


def poison_padding() -> bool:
    """JAX_MOE_POISON_PADDING=1 (read at trace time; for tests): backends fill expert_x's padding rows with NaN unless
    MoEConfig.zero_padding, so a test shows that nothing downstream reads them."""
    return os.environ.get("JAX_MOE_POISON_PADDING", "0") == "1"


def rows_per_peer(max_tokens: int, experts_per_token: int, local_experts: int) -> int:
    """The most rows one rank sends to one peer: each token reaches at most min(R, L) experts of a peer."""
    return max_tokens * min(experts_per_token, local_experts)


# --- per-rank values (shard_map's varying-manual-axes types) -----------------------------------------------------------
def vma(x: jax.Array) -> frozenset:
    """The manual axes x varies over (jax <= 0.10 keeps them in aval.mat.varying, later jax in aval.vma)."""
    aval = jax.typeof(x)
    axes = getattr(aval, "vma", None)
    if axes is None:
        axes = getattr(getattr(aval, "mat", None), "varying", None)
    return frozenset(axes or ())


def varying(x: jax.Array, axes: frozenset) -> jax.Array:
    """x, made varying over `axes` where it is not yet: results and cotangents of the halves are per rank."""
    missing = tuple(sorted(axes - vma(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x
