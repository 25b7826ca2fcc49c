"""MoELM: a small causal transformer LM whose FFNs are expert-parallel MoE layers.

Embeddings and attention are data-parallel over the EP axis (batch sharded, parameters replicated); each block's
MoE runs dispatch -> experts -> combine inside shard_map over the same axis. Decoding goes one token per sequence per
step through a KV cache and the same MoE layers, so the decode batch must be a multiple of the EP size.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe
from jax_moe.nn.config import MoELMConfig
from jax_moe.nn.moe import MoE


def remat_policy(name: str) -> Any:
    """MoELMConfig.remat -> a jax.checkpoint policy (None for "none": no remat)."""
    cp = jax.checkpoint_policies
    return {"none": None, "full": cp.nothing_saveable, "dots": cp.dots_saveable,
            "moe": cp.save_only_these_names(jax_moe.DISPATCH_NAME, jax_moe.COMBINE_NAME)}[name]


class KVCache(NamedTuple):
    k: jax.Array  # [B, max_len, heads, head_dim]
    v: jax.Array


def rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotary embedding of x [B, S, heads, d] at positions [S] (rotate-half convention)."""
    d = x.shape[-1] // 2
    freq = base ** (-jnp.arange(d, dtype=jnp.float32) / d)
    angle = positions.astype(jnp.float32)[:, None] * freq[None, :]       # [S, d]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = x[..., :d].astype(jnp.float32), x[..., d:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: MoELMConfig, dtype: Any, rngs: nnx.Rngs):
        h, n = cfg.hidden, cfg.num_heads
        self.num_heads, self.head_dim, self.rope_base = n, h // n, cfg.rope_base
        self.qkv = nnx.Param((jax.random.normal(rngs.params(), (h, 3, n, h // n)) * h ** -0.5).astype(dtype))
        self.out = nnx.Param((jax.random.normal(rngs.params(), (n, h // n, h)) * h ** -0.5).astype(dtype))

    def __call__(self, x: jax.Array, cache: Optional[KVCache], pos: jax.Array
                 ) -> tuple[jax.Array, Optional[KVCache]]:
        s = x.shape[1]
        q, k, v = jnp.einsum("bsh,hcnd->cbsnd", x, self.qkv[...])
        positions = pos + jnp.arange(s)
        q, k = rope(q, positions, self.rope_base), rope(k, positions, self.rope_base)
        if cache is None:
            keys, values = k, v
            mask = jnp.tril(jnp.ones((s, s), bool))
        else:  # write this step's keys at `pos`, attend to everything up to it
            keys = jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (0, pos, 0, 0))
            values = jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (0, pos, 0, 0))
            cache = KVCache(keys, values)
            mask = jnp.arange(keys.shape[1])[None, :] <= positions[:, None]
        scores = jnp.einsum("bqnd,bknd->bnqk", q, keys).astype(jnp.float32) * self.head_dim ** -0.5
        probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1).astype(values.dtype)
        o = jnp.einsum("bnqk,bknd->bqnd", probs, values)
        return jnp.einsum("bqnd,ndh->bqh", o, self.out[...]), cache


class Block(nnx.Module):
    def __init__(self, cfg: MoELMConfig, mesh: Any, axis_name: str, backend: str, dtype: Any, rngs: nnx.Rngs):
        self.norm1 = nnx.RMSNorm(cfg.hidden, dtype=dtype, rngs=rngs)
        self.attn = Attention(cfg, dtype, rngs)
        self.norm2 = nnx.RMSNorm(cfg.hidden, dtype=dtype, rngs=rngs)
        self.moe = MoE(cfg.hidden, cfg.ffn, cfg.num_experts, cfg.experts_per_token, mesh=mesh, axis_name=axis_name,
                       backend=backend, shared_ffn=cfg.shared_ffn, activation=cfg.activation, dtype=dtype,
                       rngs=rngs)

    def __call__(self, x: jax.Array, cache: Optional[KVCache], pos: jax.Array
                 ) -> tuple[jax.Array, jax.Array, Optional[KVCache]]:
        a, cache = self.attn(self.norm1(x), cache, pos)
        x = x + a
        m, aux = self.moe(self.norm2(x))
        return x + m, aux, cache


class MoELM(nnx.Module):
    """Causal char/token LM. `model(tokens [B, S]) -> (logits [B, S, V] float32, aux_loss)`, B sharded over the axis.

    Decoding: `cache = model.init_cache(B, max_len)`, then `logits, cache = model.decode_step(tokens [B], cache, pos)`
    once per position pos = 0, 1, ... (B a multiple of the EP size).
    """

    def __init__(self, cfg: MoELMConfig, mesh: Any, *, axis_name: str = "ep", backend: str = "auto",
                 rngs: nnx.Rngs):
        self.cfg, self.mesh, self.axis_name = cfg, mesh, axis_name
        dtype = jnp.dtype(cfg.dtype)
        with jax.set_mesh(mesh):  # replicated parameters live on every device of the mesh
            self.embed = nnx.Param((jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden)) * 0.02
                                    ).astype(dtype))
            self.blocks = nnx.List([Block(cfg, mesh, axis_name, backend, dtype, rngs)
                                    for _ in range(cfg.num_layers)])
            self.final_norm = nnx.RMSNorm(cfg.hidden, dtype=dtype, rngs=rngs)
            self.head = (None if cfg.tie_embeddings else
                         nnx.Param((jax.random.normal(rngs.params(), (cfg.hidden, cfg.vocab_size))
                                    * cfg.hidden ** -0.5).astype(dtype)))

    @property
    def num_ranks(self) -> int:
        return int(self.mesh.shape[self.axis_name])

    def _forward(self, tokens: jax.Array, caches: Optional[list[KVCache]], pos: jax.Array
                 ) -> tuple[jax.Array, jax.Array, Optional[list[KVCache]]]:
        # one-hot matmul instead of a gather: its sharding follows the batch in Explicit and Auto meshes alike
        # (cheap for character vocabularies).
        embed = self.embed[...]
        x = jax.nn.one_hot(tokens, embed.shape[0], dtype=embed.dtype) @ embed
        aux_total = jnp.float32(0.0)
        new_caches = [] if caches is not None else None
        policy = remat_policy(self.cfg.remat) if caches is None else None  # decoding keeps nothing for a backward
        if caches is None and self.cfg.scan_layers:
            x, aux_total = self._scan_blocks(x, pos, policy)
            return self._head(x), aux_total / len(self.blocks), None
        for i, block in enumerate(self.blocks):
            if policy is not None:
                x, aux = nnx.remat(lambda blk, h: blk(h, None, pos)[:2], policy=policy)(block, x)
                c = None
            else:
                x, aux, c = block(x, None if caches is None else caches[i], pos)
            aux_total = aux_total + aux
            if new_caches is not None:
                new_caches.append(c)
        return self._head(x), aux_total / len(self.blocks), new_caches

    def _head(self, x: jax.Array) -> jax.Array:
        x = self.final_norm(x)
        head = self.embed[...].T if self.head is None else self.head[...]
        return jnp.einsum("bsh,hv->bsv", x, head).astype(jnp.float32)

    def _scan_blocks(self, x: jax.Array, pos: jax.Array, policy: Any) -> tuple[jax.Array, jax.Array]:
        """The blocks as one lax.scan over their stacked states, each step (remat'ed with `policy`) one block: the
        first block's structure with that layer's parameters. Every step runs the first block's MoE layer object, so
        one Communicator serves the scanned layers, round after round, in order."""
        graphdef, _ = nnx.split(self.blocks[0])
        stacked = jax.tree.map(lambda *v: jnp.stack(v), *[nnx.state(b) for b in self.blocks])

        def step(h: jax.Array, state: Any) -> tuple[jax.Array, jax.Array]:
            h, aux, _ = nnx.merge(graphdef, state)(h, None, pos)
            return h, aux

        if policy is not None:
            step = jax.checkpoint(step, policy=policy)
        x, auxs = jax.lax.scan(step, x, stacked)
        return x, jnp.sum(auxs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits, aux, _ = self._forward(tokens, None, jnp.int32(0))
        return logits, aux

    def init_cache(self, batch: int, max_len: int) -> list[KVCache]:
        if batch % self.num_ranks:
            raise ValueError(f"MoELM.init_cache: batch ({batch}) must be a multiple of the EP size "
                             f"({self.num_ranks}); pad the prompts")
        shape = (batch, max_len, self.cfg.num_heads, self.cfg.hidden // self.cfg.num_heads)
        sharding = NamedSharding(self.mesh, P(self.axis_name))
        zeros = jax.device_put(jnp.zeros(shape, jnp.dtype(self.cfg.dtype)), sharding)
        return [KVCache(zeros, zeros) for _ in range(self.cfg.num_layers)]

    def decode_step(self, tokens: jax.Array, caches: list[KVCache], pos: jax.Array
                    ) -> tuple[jax.Array, list[KVCache]]:
        """tokens [B] at position pos (same for every row, < the cache's max_len) -> next-token logits [B, V] and
        the updated caches."""
        logits, _, caches = self._forward(tokens[:, None], caches, jnp.asarray(pos, jnp.int32))
        return logits[:, 0], caches


def lm_loss(model: MoELM, tokens: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token cross entropy on tokens [B, S+1] plus aux_loss_coef * load-balancing loss."""
    logits, aux = model(tokens[:, :-1])
    # One-hot instead of a gather of the label's logit: the gather's transpose is a scatter whose output sharding
    # newer jax (0.11) cannot infer on a mesh with explicit axes; the one-hot product shards like the batch.
    labels = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1], dtype=logits.dtype)
    ce = -(labels * jax.nn.log_softmax(logits, axis=-1)).sum(-1).mean()
    return ce + model.cfg.aux_loss_coef * aux, {"ce": ce, "aux": aux}
