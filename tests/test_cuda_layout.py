"""The cuda backend's buffer sizes, from the native layout: needs a CUDA build, not a GPU (so CI checks it)."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

import jax_moe
from jax_moe.backends import cuda
from jax_moe.backends.native import native_module

_mod, _why = native_module("cuda")
pytestmark = pytest.mark.skipif(_mod is None, reason=f"no CUDA build: {_why}")


@pytest.mark.parametrize("n", [1, 2, 8])
def test_buffer_bytes_hold_the_worst_case_and_little_more(n):
    t, r, hidden, e = 128, 8, 7168, 256
    cfg = jax_moe.MoEConfig(e, r, hidden, t, dispatch_dtype=jnp.float8_e4m3fn)
    l = e // n
    # per round slot (two: rounds_in_flight) and sender: t token records (7168 fp8 + 56 float32 scales + 8 router
    # weights) and l x t list entries; 2 combine channels of t x r bf16 rows plus their int32 "self" index
    slots = cuda.CudaBackend.rounds_in_flight
    floor = slots * (n * t * (hidden + 56 * 4 + r * 4) + n * l * t * 4 + 2 * t * r * (hidden * 2 + 4))
    got = cuda.buffer_bytes(cfg, n)
    assert floor <= got < floor + (1 << 20), (got, floor)


def test_bf16_dispatch_rows_are_twice_as_wide():
    fp8 = jax_moe.MoEConfig(16, 2, 256, 32, dispatch_dtype=jnp.float8_e4m3fn)
    bf16 = jax_moe.MoEConfig(16, 2, 256, 32)
    extra = cuda.buffer_bytes(bf16, 2) - cuda.buffer_bytes(fp8, 2)
    # token records, in each round slot: 2 senders x 32 tokens, 512 + 2 router weights x 4 rounded up to 528 bytes
    # (bf16) instead of 256 + 2 scales x 4 + 2 x 4 rounded up to 272
    slots = cuda.CudaBackend.rounds_in_flight
    assert abs(extra - slots * 2 * 32 * (528 - 272)) < 4096
