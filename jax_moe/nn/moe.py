"""MoE: a Flax NNX expert-parallel Mixture-of-Experts FFN on top of jax_moe dispatch/combine.

Per call, inside one jax.shard_map over the EP axis (tokens sharded over it, one slice of experts per rank):
router (float32) -> top-k -> softmax over the selected logits -> dispatch_send (rows and weights) -> [shared expert] ->
dispatch_recv -> grouped GEMMs with jax.lax.ragged_dot on the dispatched rows -> combine (with the dispatched weights,
so the expert ranks may sum a token's rows before sending them back). The shared expert sits between the two
dispatch halves so that the later backends overlap it with the transfer.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe
from jax_moe.backends import deferred

ACTIVATIONS = ("swiglu", "gelu")


_layer_ids = itertools.count()


# --- Communicator lifetime ------------------------------------------------------------------------------------------
# A layer builds one Communicator per per-rank token count (a Communicator serves one MoE layer: native backends keep
# per-layer buffers and round state in it). They live while some MoE object of the layer does: the layer itself and
# the copies nnx.merge, nnx.jit (inside its trace) and nnx.clone make of it, which carry its layer_id. Not as an
# attribute of the layer: nnx puts every attribute into the layer's GraphDef, and jax's tracing caches keep GraphDefs
# (thousands of them) long after the layer is gone, which kept every Communicator, and its native buffers, alive.
class _LayerComms:
    """The Communicators of one layer, by per-rank token count."""

    def __init__(self) -> None:
        self.by_tokens: dict[int, jax_moe.Communicator] = {}
        self.anchored = False  # held by an object that is not a trace-time copy
        weakref.finalize(self, _retire, self.by_tokens).atexit = False


def _retire(by_tokens: dict) -> None:
    """The layer is gone. Programs launched before (jax dispatches asynchronously) may still call its native
    Communicators: let them finish, then drop the Communicators (their backends release what they hold). Inside a
    collection: at the next safe point (jax_moe.backends.deferred)."""
    if any(c.backend_name != "xla" for c in by_tokens.values()):
        deferred.after_programs(by_tokens.clear)
    else:
        by_tokens.clear()


_lock = threading.Lock()
_by_layer: "weakref.WeakValueDictionary[int, _LayerComms]" = weakref.WeakValueDictionary()
_held: dict[int, _LayerComms] = {}  # id(MoE object) -> its layer's Communicators; the entry goes with the object
_pinned: list[_LayerComms] = []  # layers that only trace-time copies carried when they got a Communicator


def _is_traced(layer: "MoE") -> bool:
    router = getattr(layer, "router", None)
    return isinstance(router.get_value() if isinstance(router, nnx.Variable) else router, jax.core.Tracer)


def _attach(layer: "MoE") -> _LayerComms:
    """The Communicators of `layer`'s layer, now held by `layer` too."""
    key = id(layer)
    with _lock:
        comms = _held.get(key)
        if comms is None:
            comms = _by_layer.get(layer.layer_id)
            if comms is None:
                comms = _by_layer[layer.layer_id] = _LayerComms()
            _held[key] = comms
            weakref.finalize(layer, _held.pop, key, None).atexit = False
        if not comms.anchored and not _is_traced(layer):
            comms.anchored = True
    return comms


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype: Any) -> jax.Array:
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)


def expert_ffn(x: jax.Array, group_sizes: jax.Array, w_in: jax.Array, w_out: jax.Array,
               w_up: Optional[jax.Array]) -> jax.Array:
    """Rows of x grouped by expert (group_sizes rows each, the rest padding) through each group's FFN.

    The padding rows are unspecified (possibly NaN: Dispatched.expert_x); ragged_dot masks its rows by group_sizes
    (its output there is zero and no padding value reaches the gradients: tests/test_nn_moe.py poisons them), so
    they need no masking here.
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
      token count, kept while the layer (or a copy of it: nnx.merge, nnx.jit, nnx.clone) is alive.
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
        if communicator is None:
            _attach(self)

    # Copies of a layer hold its Communicators too: the ones nnx.merge makes (also nnx.jit's, inside and after its
    # trace, and nnx.clone's), the ones jax makes of the layer as a pytree, and copy/pickle's.
    def _graph_node_init(self, attributes):
        super()._graph_node_init(attributes)
        if vars(self).get("communicator", True) is None:
            _attach(self)

    @classmethod
    def _pytree__unflatten(cls, static, node_attrs):
        layer = super()._pytree__unflatten(static, node_attrs)
        if vars(layer).get("communicator", True) is None:
            _attach(layer)
        return layer

    def __setstate__(self, state):
        super().__setstate__(state)
        if vars(self).get("communicator", True) is None:
            _attach(self)

    @property
    def num_ranks(self) -> int:
        return int(self.mesh.shape[self.axis_name])

    def comm_for(self, tokens_per_rank: int) -> jax_moe.Communicator:
        """This layer's Communicator for `tokens_per_rank` tokens per rank: built on first use, then the same one (in
        every copy of the layer) until the layer is gone."""
        if self.communicator is not None:
            return self.communicator
        comms = _attach(self)
        comm = comms.by_tokens.get(tokens_per_rank)
        if comm is None:
            cfg = jax_moe.MoEConfig(self.num_experts, self.experts_per_token, self.hidden, tokens_per_rank)
            comm = jax_moe.Communicator(cfg, self.mesh, axis_name=self.axis_name, backend=self.backend)
            comms.by_tokens[tokens_per_rank] = comm
            if not comms.anchored:
                # Only trace-time copies carry the layer (say, a GraphDef merged inside jit after the layer was
                # deleted): the compiled program calls the Communicator after they are gone, so keep it for good.
                with _lock:
                    _pinned.append(comms)
        return comm

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        n = self.num_ranks
        if x.shape[-1] != self.hidden or x.ndim < 2 or x.shape[0] % n:
            raise ValueError(f"MoE: x must be [B, ..., {self.hidden}] with B divisible by {n}, got {x.shape}")
        comm = self.comm_for(x.size // (self.hidden * n))
        if self.communicator is None:
            # The program only borrows the layer's Communicator: jax caches the jaxprs of a jitted function (for as
            # long as the function lives), and a strong reference in them (custom_vjp keeps its non-differentiable
            # arguments) would keep every layer's Communicator, and its native buffers, alive after the layer.
            comm = weakref.proxy(comm)
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
            handle = jax_moe.dispatch_send(comm, xt.astype(jnp.bfloat16), topk_idx.astype(jnp.int32),
                                           topk_weights=weights)
            y_shared = None
            if "shared_w_in" in p:  # independent of the transfer: the later backends overlap it
                y_shared = dense_ffn(xt.astype(out_dtype), p["shared_w_in"], p["shared_w_out"], p.get("shared_w_up"))
            d = jax_moe.dispatch_recv(comm, handle)
            expert_y = expert_ffn(d.expert_x.astype(p["w_in"].dtype), d.expert_counts, p["w_in"], p["w_out"],
                                  p.get("w_up"))
            y = jax_moe.combine(comm, expert_y.astype(jnp.bfloat16), None, d).astype(out_dtype)  # d's weights
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
