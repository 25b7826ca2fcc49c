"""Rows as raw bytes, so that every backend moves data bit-exactly whatever its dtype (fp8, bf16, float32 scales)."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np


def to_bytes(a: jax.Array) -> jax.Array:
    """[..., n] of any dtype -> uint8 [..., n * itemsize]."""
    if a.dtype == jnp.uint8:
        return a
    b = jax.lax.bitcast_convert_type(a, jnp.uint8)
    return b.reshape(*a.shape[:-1], -1) if np.dtype(a.dtype).itemsize > 1 else b


def from_bytes(b: jax.Array, dtype, n: int) -> jax.Array:
    """uint8 [..., n * itemsize] -> dtype [..., n]."""
    itemsize = np.dtype(dtype).itemsize
    if itemsize == 1:
        return jax.lax.bitcast_convert_type(b, dtype)
    return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], n, itemsize), dtype)


def pack_rows(x: jax.Array, x_scale: Optional[jax.Array]) -> jax.Array:
    """Token rows and their scales side by side: uint8 [..., hidden*itemsize + num_scales*4]."""
    parts = [to_bytes(x)] + ([to_bytes(x_scale)] if x_scale is not None else [])
    return jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]


def unpack_rows(b: jax.Array, dtype, hidden: int, num_scales: int) -> tuple[jax.Array, Optional[jax.Array]]:
    nx = hidden * np.dtype(dtype).itemsize
    x = from_bytes(b[..., :nx], dtype, hidden)
    scale = from_bytes(b[..., nx:], jnp.float32, num_scales) if num_scales else None
    return x, scale
