"""jax_moe: expert-parallel dispatch/combine for Mixture-of-Experts models in JAX.

    cfg = jax_moe.MoEConfig(num_experts, experts_per_token, hidden, max_tokens)
    comm = jax_moe.Communicator(cfg, mesh, axis_name="ep")
    # inside jax.shard_map over "ep":
    d = comm.dispatch(x, topk_idx, topk_weights=topk_weights)  # d.expert_x, d.expert_x_scale, d.expert_counts
    out = comm.combine(expert_y, d=d)                 # sums with the dispatched weights (or pass other weights)
"""
from jax_moe.api import (COMBINE_NAME, DISPATCH_NAME, combine, combine_recv, combine_send, dispatch, dispatch_recv,
                         dispatch_send)
from jax_moe.backends import BackendUnavailable
from jax_moe.communicator import Communicator
from jax_moe.config import MoEConfig
from jax_moe.fp8 import dequantize_fp8, quantize_fp8
from jax_moe.types import CombineHandle, Dispatched, DispatchHandle

__version__ = "0.1.0"

__all__ = [
    "MoEConfig", "Communicator", "Dispatched", "DispatchHandle", "CombineHandle", "BackendUnavailable",
    "dispatch", "combine", "dispatch_send", "dispatch_recv", "combine_send", "combine_recv",
    "quantize_fp8", "dequantize_fp8", "DISPATCH_NAME", "COMBINE_NAME",
]
