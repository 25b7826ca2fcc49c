"""Block-scaled float8 (e4m3) quantisation: one float32 scale per `block` channels of a token."""
from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(x: jax.Array, block: int = 128) -> tuple[jax.Array, jax.Array]:
    """x [..., H] -> (x_fp8 [..., H] float8_e4m3fn, scale [..., H // block] float32), scale = amax / 448."""
    if x.shape[-1] % block:
        raise ValueError(f"quantize_fp8: last dim {x.shape[-1]} is not divisible by block {block}")
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    q = jnp.clip(blocks / scale[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(x.shape), scale


def dequantize_fp8(x: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Inverse of quantize_fp8 (up to fp8 rounding)."""
    block = x.shape[-1] // scale.shape[-1]
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], scale.shape[-1], block) * scale[..., None]
    return blocks.reshape(x.shape).astype(dtype)
