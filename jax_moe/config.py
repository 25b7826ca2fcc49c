"""MoEConfig: the static description of one MoE layer's communication."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

DISPATCH_DTYPES = (jnp.bfloat16, jnp.float8_e4m3fn)
COMBINE_DTYPES = (jnp.bfloat16,)


def _dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


def _as_dtype(field: str, value: Any) -> np.dtype:
    try:
        return np.dtype(value)
    except TypeError:
        raise TypeError(f"MoEConfig.{field} must be a dtype (jnp.bfloat16 or jnp.float8_e4m3fn), got {value!r}") \
            from None


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Shapes and wire dtypes of dispatch/combine; identical on every rank.

    num_experts: E, the global expert count (rank r owns experts [r*L, (r+1)*L), L = E / N).
    experts_per_token: R, the top-k of the router.
    hidden: channels of a token row.
    max_tokens: the most tokens one rank dispatches in one call (buffers are sized for it).
    dispatch_dtype: bfloat16, or float8_e4m3fn with one float32 scale per `scale_block` channels.
    combine_dtype: bfloat16 (the expert outputs; the weighted sum is accumulated in float32).
    zero_padding: write zeros into the padding rows of `Dispatched.expert_x` (rows at or after sum(expert_counts)).
      By default they are unspecified (backend "cuda" leaves whatever its output buffer held, possibly NaN): masked
      computations (jax.lax.ragged_dot, `jnp.where(d.valid_rows()[:, None], ...)`) never see them. Set it for an
      expert that reads every row unmasked and reduces over rows in its gradient (a NaN times a zero cotangent is NaN).
    """

    num_experts: int
    experts_per_token: int
    hidden: int
    max_tokens: int
    dispatch_dtype: Any = jnp.bfloat16
    combine_dtype: Any = jnp.bfloat16
    scale_block: int = 128
    zero_padding: bool = False

    def __post_init__(self) -> None:
        for name in ("num_experts", "experts_per_token", "hidden", "max_tokens", "scale_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"MoEConfig.experts_per_token ({self.experts_per_token}) exceeds num_experts ({self.num_experts})")
        dispatch = _as_dtype("dispatch_dtype", self.dispatch_dtype)
        combine = _as_dtype("combine_dtype", self.combine_dtype)
        if dispatch not in [np.dtype(d) for d in DISPATCH_DTYPES]:
            raise ValueError(f"MoEConfig.dispatch_dtype must be bfloat16 or float8_e4m3fn, got {dispatch.name}")
        if combine not in [np.dtype(d) for d in COMBINE_DTYPES]:
            raise ValueError(f"MoEConfig.combine_dtype must be bfloat16, got {combine.name}")
        object.__setattr__(self, "dispatch_dtype", dispatch)
        object.__setattr__(self, "combine_dtype", combine)
        if self.is_fp8 and self.hidden % self.scale_block:
            raise ValueError(
                f"MoEConfig.hidden ({self.hidden}) must be divisible by scale_block ({self.scale_block}) "
                "for float8_e4m3fn dispatch")

    @property
    def is_fp8(self) -> bool:
        return self.dispatch_dtype == np.dtype(jnp.float8_e4m3fn)

    @property
    def num_scales(self) -> int:
        """float32 scales per token row (0 for bf16 dispatch)."""
        return self.hidden // self.scale_block if self.is_fp8 else 0

    def describe(self) -> str:
        return (f"E={self.num_experts} R={self.experts_per_token} hidden={self.hidden} "
                f"max_tokens={self.max_tokens} dispatch={_dtype_name(self.dispatch_dtype)} "
                f"combine={_dtype_name(self.combine_dtype)}")
