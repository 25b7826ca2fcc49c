"""MoELMConfig: the hyperparameters of the small MoE transformer LM (saved next to its checkpoints as JSON)."""
from __future__ import annotations

import dataclasses
import json
from typing import Any


REMAT_POLICIES = ("none", "full", "dots", "moe")


@dataclasses.dataclass(frozen=True)
class MoELMConfig:
    """vocab_size: tokens (characters) of the LM. hidden: model width. num_layers blocks of attention + MoE.
    num_heads: attention heads (hidden % num_heads == 0). ffn: per-expert FFN width. num_experts E (divisible by the
    EP size), experts_per_token R. shared_ffn: width of the shared expert (0 = none). activation: "swiglu" | "gelu".
    tie_embeddings: the head reuses the embedding matrix. aux_loss_coef: weight of the load-balancing loss.
    rope_base: rotary position embedding base. dtype: compute/param dtype name ("float32" or "bfloat16").
    remat: what a block keeps for the backward pass in training (nnx.remat around each block, as large training stacks
    do): "none" (no remat: everything), "full" (nothing_saveable: recompute the block), "dots" (dots_saveable: keep
    matmul outputs), "moe" (save_only_these_names(jax_moe.DISPATCH_NAME, jax_moe.COMBINE_NAME): keep what dispatch
    and combine returned, recompute the rest). Dispatch and combine themselves run once whatever the policy.
    scan_layers: run the blocks in training as one jax.lax.scan over their stacked parameters (MaxText's scan_layers:
    one traced block, compile time independent of num_layers), remat'ed inside the scan as `remat` says.
    """

    vocab_size: int
    hidden: int = 64
    num_layers: int = 2
    num_heads: int = 4
    ffn: int = 128
    num_experts: int = 8
    experts_per_token: int = 2
    shared_ffn: int = 0
    activation: str = "swiglu"
    tie_embeddings: bool = True
    aux_loss_coef: float = 0.01
    rope_base: float = 10000.0
    dtype: str = "float32"
    remat: str = "none"
    scan_layers: bool = False

    def __post_init__(self) -> None:
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"MoELMConfig: remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
        if self.hidden % self.num_heads or (self.hidden // self.num_heads) % 2:
            raise ValueError(f"MoELMConfig: hidden ({self.hidden}) must split into {self.num_heads} heads of an "
                             "even size (rotary embeddings)")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MoELMConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
