"""Trace-time checks of user input: each error names the argument and what was expected."""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.types import Dispatched
from jax_moe.backends.base import CommView



def _dt(a: Any) -> str:
    return np.dtype(a.dtype).name


def check_axis(comm: CommView, op: str) -> None:
    """The call must run per rank inside shard_map over the Communicator's axis."""
    try:
        size = jax.lax.axis_size(comm.axis_name)
    except NameError:
        raise RuntimeError(
            f"jax_moe.{op} must be called inside jax.shard_map over axis {comm.axis_name!r} with per-rank arrays "
            f"(the axis is not bound here)") from None
    if size != comm.num_ranks:
        raise ValueError(f"jax_moe.{op}: axis {comm.axis_name!r} has size {size} here, but the Communicator was "
                         f"built for {comm.num_ranks} ranks")
    # jax.vmap(..., axis_name=...) binds the name too, but only shard_map runs one program per rank.
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    manual = getattr(get_mesh(), "manual_axes", None) if get_mesh is not None else None
    axes = (comm.axis_name,) if isinstance(comm.axis_name, str) else tuple(comm.axis_name)
    if manual is not None and not set(axes) <= set(manual):
        raise RuntimeError(
            f"jax_moe.{op} must be called inside jax.shard_map over axis {comm.axis_name!r}; here the axis is bound "
            f"but is not a shard_map (manual) axis (jax.vmap with axis_name is not supported)")


def check_array(op: str, name: str, a: Any, shape: tuple, dtype: Any = None, kind: Optional[str] = None) -> None:
    """shape entries of None match any size."""
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"jax_moe.{op}: {name} must be an array, got {type(a).__name__}")
    if len(a.shape) != len(shape) or any(want is not None and got != want for got, want in zip(a.shape, shape)):
        want_s = "[" + ", ".join("?" if w is None else str(w) for w in shape) + "]"
        raise ValueError(f"jax_moe.{op}: {name} has shape {list(a.shape)}, expected {want_s}")
    if dtype is not None and np.dtype(a.dtype) != np.dtype(dtype):
        raise TypeError(f"jax_moe.{op}: {name} has dtype {_dt(a)}, expected {np.dtype(dtype).name}")
    if kind == "float" and not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(f"jax_moe.{op}: {name} has dtype {_dt(a)}, expected a floating dtype")


def check_dispatch(comm: CommView, op: str, x: Any, topk_idx: Any, x_scale: Any) -> None:
    cfg = comm.cfg
    check_axis(comm, op)
    check_array(op, "x", x, (None, cfg.hidden))
    t = x.shape[0]
    if t == 0:
        raise ValueError(f"jax_moe.{op}: x has 0 tokens on this rank; pass at least one (a token whose topk_idx "
                         f"row is all -1 is sent nowhere)")
    if t > cfg.max_tokens:
        raise ValueError(f"jax_moe.{op}: x has {t} tokens on this rank, more than max_tokens={cfg.max_tokens}")
    if np.dtype(x.dtype) != cfg.dispatch_dtype:
        raise TypeError(f"jax_moe.{op}: x has dtype {_dt(x)}, expected dispatch_dtype {cfg.dispatch_dtype.name}"
                        + (" (use jax_moe.quantize_fp8 to make fp8 rows and scales)" if cfg.is_fp8 else ""))
    check_array(op, "topk_idx", topk_idx, (t, cfg.experts_per_token), jnp.int32)
    if cfg.is_fp8:
        if x_scale is None:
            raise ValueError(f"jax_moe.{op}: fp8 dispatch needs x_scale [{t}, {cfg.num_scales}] float32")
        check_array(op, "x_scale", x_scale, (t, cfg.num_scales), jnp.float32)
    elif x_scale is not None:
        raise ValueError(f"jax_moe.{op}: x_scale is only for float8_e4m3fn dispatch; this config dispatches "
                         f"{cfg.dispatch_dtype.name}")


def check_expert_y(comm: CommView, op: str, expert_y: Any, d: Dispatched) -> None:
    check_axis(comm, op)
    if not isinstance(d, Dispatched):
        raise TypeError(f"jax_moe.{op}: expected the Dispatched returned by dispatch, got {type(d).__name__}")
    check_comm(comm, op, d._comm_id, "Dispatched")
    if d._route is None or d._topk_idx is None:
        raise ValueError(f"jax_moe.{op}: this Dispatched was not made by dispatch (it has no routing state)")
    check_array(op, "expert_y", expert_y, (comm.max_recv_rows, comm.cfg.hidden), comm.cfg.combine_dtype)


def check_weights(comm: CommView, op: str, topk_weights: Any, topk_idx: jax.Array) -> None:
    check_array(op, "topk_weights", topk_weights, tuple(topk_idx.shape), kind="float")


def check_recv_weights(op: str, topk_weights: Any, d: Dispatched, reduced: bool) -> None:
    """combine_recv's weights against what its combine_send promised the backend."""
    if reduced and topk_weights is not None and topk_weights is not d._topk_weights:
        raise ValueError(
            f"jax_moe.{op}: this round's rows were summed at the experts with the weights given to dispatch_send, so "
            f"other topk_weights cannot apply; pass topk_weights=None (or those same weights), or dispatch without "
            f"topk_weights")
    if not reduced and topk_weights is None:
        raise TypeError(f"jax_moe.{op}: topk_weights is needed, since dispatch was given none (pass them to "
                         f"combine, or to dispatch)")


def check_comm(comm: CommView, op: str, comm_id: int, what: str) -> None:
    if comm_id != comm.id:
        raise ValueError(f"jax_moe.{op}: this {what} was made by another Communicator")
