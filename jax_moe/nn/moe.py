"""MoE: a Flax NNX expert-parallel Mixture-of-Experts FFN on top of jax_moe dispatch/combine.

Per call, inside one jax.shard_map over the EP axis (tokens sharded over it, one slice of experts per rank):
router (float32) -> top-k -> softmax over the selected logits -> dispatch_send -> [shared expert] -> dispatch_recv ->
grouped GEMMs with jax.lax.ragged_dot on the dispatched rows -> combine. The shared expert sits between the two
dispatch halves so that the later backends overlap it with the transfer.
"""
from __future__ import annotations

import functools
import itertools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe

ACTIVATIONS = ("swiglu", "gelu")


_layer_ids = itertools.count()


@functools.lru_cache(maxsize=None)
def communicator_for(layer_id: int, num_experts: int, experts_per_token: int, hidden: int, max_tokens: int,
                     mesh: Any, axis_name: str, backend: str) -> jax_moe.Communicator:
    """One Communicator per (layer, per-rank token count), reused by every trace: a Communicator serves one MoE
    layer (native backends keep per-layer buffers and sequence state in it)."""
    cfg = jax_moe.MoEConfig(num_experts, experts_per_token, hidden, max_tokens)
    return jax_moe.Communicator(cfg, mesh, axis_name=axis_name, backend=backend)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype: Any) -> jax.Array:
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)


def expert_ffn(x: jax.Array, group_sizes: jax.Array, w_in: jax.Array, w_out: jax.Array,
               w_up: Optional[jax.Array]) -> jax.Array:
    """Rows of x grouped by expert (group_sizes rows each, the rest padding) through each group's FFN.

    ragged_dot leaves rows past sum(group_sizes) at zero, so the padding needs no masking.
    """
    h = jax.lax.ragged_dot(x, w_in, group_sizes)
    h = jax.nn.silu(h) * jax.lax.ragged_dot(x, w_up, group_sizes) if w_up is not None else jax.nn.gelu(h)
    return jax.lax.ragged_dot(h, w_out, group_sizes)


def dense_ffn(x: jax.Array, w_in: jax.Array, w_out: jax.Array, w_up: Optional[jax.Array]) -> jax.Array:
    h = x @ w_in
    h = jax.nn.silu(h) * (x @ w_up) if w_up is not None else jax.nn.gelu(h)
    return h @ w_out


def load_balancing_loss(probs: jax.Array, topk_idx: jax.Array, axis_name: Any) -> jax.Array:
    """Switch-Transformer loss E * sum_e f_e * P_e over the global batch (psum over the EP axis).

    f_e: fraction of the (token, k) assignments that go to expert e (sums to 1); P_e: mean router probability of e.
    Perfect balance gives 1.0.
    """
    e = probs.shape[-1]
    assigned = jnp.sum(jax.nn.one_hot(topk_idx, e, dtype=jnp.float32), axis=(0, 1))  # [E]
    n_assign = jax.lax.psum(jnp.float32(topk_idx.size), axis_name)
    f = jax.lax.psum(assigned, axis_name) / n_assign
    p = jax.lax.psum(jnp.sum(probs, axis=0), axis_name) / jax.lax.psum(jnp.float32(probs.shape[0]), axis_name)
    return e * jnp.sum(f * p)


class DenseFFN(nnx.Module):
    """The shared expert: one FFN every token goes through, replicated weights."""

    def __init__(self, hidden: int, ffn: int, activation: str, dtype: Any, rngs: nnx.Rngs):
        self.w_in = nnx.Param(_normal(rngs, (hidden, ffn), hidden ** -0.5, dtype))
        self.w_up = nnx.Param(_normal(rngs, (hidden, ffn), hidden ** -0.5, dtype)) if activation == "swiglu" else None
        self.w_out = nnx.Param(_normal(rngs, (ffn, hidden), ffn ** -0.5, dtype))


class MoE(nnx.Module):
    """Expert-parallel MoE FFN: x [B, ..., hidden] with B sharded over `axis_name` -> (y like x, aux_loss scalar).

    hidden, ffn: model and per-expert FFN widths; num_experts E (divisible by the EP size), experts_per_token R.
    mesh / axis_name / backend: where the experts live; the layer builds its own Communicator per per-rank
      token count (cached).
    communicator: use this one instead (its mesh, axis and config win; T per rank must stay <= its max_tokens).
    shared_ffn: width of an always-on dense expert (0 = none). activation: "swiglu" (gate+up) or "gelu".
    dtype: compute and output dtype; the wire is bf16 both ways.
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, experts_per_token: int, *, mesh: Any = None,
                 axis_name: str = "ep", backend: str = "auto",
                 communicator: Optional[jax_moe.Communicator] = None, shared_ffn: int = 0,
                 activation: str = "swiglu", dtype: Any = jnp.float32, rngs: nnx.Rngs):
        if activation not in ACTIVATIONS:
            raise ValueError(f"MoE: activation must be one of {ACTIVATIONS}, got {activation!r}")
        if communicator is not None:
            c = communicator.cfg
            if (c.num_experts, c.experts_per_token, c.hidden) != (num_experts, experts_per_token, hidden):
                raise ValueError(f"MoE: communicator is for {c.describe()}, the layer has E={num_experts} "
                                 f"R={experts_per_token} hidden={hidden}")
            if c.is_fp8:
                raise ValueError("MoE: the layer dispatches bf16 (fp8 dispatch has no gradients)")
            mesh, axis_name = communicator.mesh, communicator.axis_name
        if mesh is None:
            raise ValueError("MoE: pass a mesh (or a communicator)")
        if not isinstance(axis_name, str):
            raise ValueError(f"MoE: axis_name must be one mesh axis, got {axis_name!r}")
        n = int(mesh.shape[axis_name])
        if num_experts % n:
            raise ValueError(f"MoE: num_experts ({num_experts}) is not divisible by the {n} ranks of {axis_name!r}")
        self.hidden, self.ffn = hidden, ffn
        self.num_experts, self.experts_per_token = num_experts, experts_per_token
        self.mesh, self.axis_name, self.backend = mesh, axis_name, backend
        self.communicator = communicator
        self.layer_id = next(_layer_ids)
        self.activation, self.dtype = activation, dtype

        def expert_param(shape: tuple[int, int, int], fan_in: int) -> nnx.Param:
            # The sharding metadata (with the mesh) lets optimizers build their state with the same layout.
            return nnx.Param(_normal(rngs, shape, fan_in ** -0.5, dtype), out_sharding=P(axis_name, None, None),
                             mesh=mesh)

        with jax.set_mesh(mesh):  # eager sharding: experts split over the axis, everything else replicated
            self.router = nnx.Param(_normal(rngs, (hidden, num_experts), 0.02, jnp.float32))
            self.w_in = expert_param((num_experts, hidden, ffn), hidden)
            self.w_up = expert_param((num_experts, hidden, ffn), hidden) if activation == "swiglu" else None
            self.w_out = expert_param((num_experts, ffn, hidden), ffn)
            self.shared = DenseFFN(hidden, shared_ffn, activation, dtype, rngs) if shared_ffn else None

    @property
    def num_ranks(self) -> int:
        return int(self.mesh.shape[self.axis_name])

    def comm_for(self, tokens_per_rank: int) -> jax_moe.Communicator:
        if self.communicator is not None:
            return self.communicator
        return communicator_for(self.layer_id, self.num_experts, self.experts_per_token, self.hidden,
                                tokens_per_rank, self.mesh, self.axis_name, self.backend)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        n = self.num_ranks
        if x.shape[-1] != self.hidden or x.ndim < 2 or x.shape[0] % n:
            raise ValueError(f"MoE: x must be [B, ..., {self.hidden}] with B divisible by {n}, got {x.shape}")
        comm = self.comm_for(x.size // (self.hidden * n))
        axis, r, out_dtype = self.axis_name, self.experts_per_token, self.dtype
        ep = P(axis, None, None)
        params, specs = {"router": self.router[...]}, {"router": P()}
        for name in ("w_in", "w_up", "w_out"):
            if getattr(self, name) is not None:
                params[name], specs[name] = getattr(self, name)[...], ep
        if self.shared is not None:
            for name in ("w_in", "w_up", "w_out"):
                if getattr(self.shared, name) is not None:
                    params["shared_" + name], specs["shared_" + name] = getattr(self.shared, name)[...], P()

        def body(x: jax.Array, p: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
            xt = x.reshape(-1, x.shape[-1])
            logits = jnp.dot(xt.astype(jnp.float32), p["router"], precision=jax.lax.Precision.HIGHEST)
            top_logits, topk_idx = jax.lax.top_k(logits, r)
            weights = jax.nn.softmax(top_logits, axis=-1)                      # float32 [T, R]
            aux = load_balancing_loss(jax.nn.softmax(logits, axis=-1), topk_idx, axis)
            handle = comm.dispatch_send(xt.astype(jnp.bfloat16), topk_idx.astype(jnp.int32))
            y_shared = None
            if "shared_w_in" in p:  # independent of the transfer: the later backends overlap it
                y_shared = dense_ffn(xt.astype(out_dtype), p["shared_w_in"], p["shared_w_out"], p.get("shared_w_up"))
            d = comm.dispatch_recv(handle)
            expert_y = expert_ffn(d.expert_x.astype(p["w_in"].dtype), d.expert_counts, p["w_in"], p["w_out"],
                                  p.get("w_up"))
            y = comm.combine(expert_y.astype(jnp.bfloat16), weights, d).astype(out_dtype)
            if y_shared is not None:
                y = y + y_shared.astype(out_dtype)
            return y.reshape(x.shape[:-1] + (y.shape[-1],)), aux

        tokens = P(axis)
        if getattr(self.mesh, "are_all_axes_explicit", False):
            # Explicit meshes make shard_map reject inputs laid out otherwise (e.g. a replicated x): move them.
            x = jax.sharding.reshard(x, NamedSharding(self.mesh, tokens))
            params = {k: jax.sharding.reshard(v, NamedSharding(self.mesh, specs[k])) for k, v in params.items()}
        fn = jax.shard_map(body, mesh=self.mesh, in_specs=(tokens, specs), out_specs=(tokens, P()))
        return fn(x, params)
