"""Flax NNX building blocks on jax_moe: the expert-parallel MoE layer and a small MoE transformer LM."""
from jax_moe.nn.config import MoELMConfig
from jax_moe.nn.model import KVCache, MoELM, lm_loss
from jax_moe.nn.moe import MoE, load_balancing_loss
from jax_moe.nn import checkpoint

__all__ = ["MoE", "MoELM", "MoELMConfig", "KVCache", "lm_loss", "load_balancing_loss", "checkpoint"]
