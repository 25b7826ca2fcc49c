"""Property-based fuzz of the contract against the NumPy oracle: random shapes, routings (masked slots, repeated
experts in a token, skew, partial T), dtypes and rank counts, a fresh seed per case (printed, and in the test id's
failure output). A short run by default; --runslow runs many more cases."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
from support.helpers import BACKENDS, backend_mesh, check_roundtrip, random_routing, random_tokens, roundtrip

CASES = int(os.environ.get("JAX_MOE_FUZZ_CASES", "3"))
MANY = int(os.environ.get("JAX_MOE_FUZZ_MANY", "40"))  # test_fuzz_many's cases (--runslow)


def rank_choices(backend: str) -> list[int]:
    """The rank counts a case may draw: those this machine has devices for (a draw it cannot run would skip the case,
    and in test_fuzz_many every later case with it), else all (backend_mesh then skips with the reason)."""
    wanted = [1, 2] if backend == "cuda" else [1, 2, 4]
    try:
        have = len(jax.devices("gpu" if backend == "cuda" else "cpu"))
    except RuntimeError:  # no such platform here
        have = 0
    return [k for k in wanted if k <= have] or wanted


def fuzz_case(seed: int, backend: str):
    rng = np.random.default_rng(seed)
    n = int(rng.choice(rank_choices(backend)))
    l = int(rng.integers(1, 5))
    e = n * l
    r = int(rng.integers(1, min(e, 6) + 1))
    hidden = 128 * int(rng.integers(1, 3))
    max_tokens = int(rng.integers(1, 9))
    t = int(rng.integers(1, max_tokens + 1))  # partial T
    fp8 = bool(rng.random() < 0.3)
    x, scale = random_tokens(rng, n * t, hidden, fp8)
    idx = random_routing(rng, n, t, r, e, mask=float(rng.choice([0.0, 0.3, 0.9])), skew=bool(rng.random() < 0.3))
    if r > 1 and rng.random() < 0.5:  # repeated experts within a token: only the first counts
        rows = rng.random(n * t) < 0.3
        idx[rows, r - 1] = idx[rows, 0]
    w = rng.random((n * t, r)).astype(np.float32)
    cfg = jax_moe.MoEConfig(e, r, hidden, max_tokens, dispatch_dtype=jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
    return n, cfg, x, scale, idx, w


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(CASES))
def test_fuzz_against_oracle(backend, case):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"fuzz seed={seed} backend={backend}")
    n, cfg, x, scale, idx, w = fuzz_case(seed, backend)
    comm = jax_moe.Communicator(cfg, backend_mesh(backend, n), "ep", backend=backend, timeout_s=30)
    try:
        check_roundtrip(comm, n, x, idx, w, scale, roundtrip(comm, x, idx, w, scale, split_halves=case % 2 == 1))
    except AssertionError as err:
        raise AssertionError(f"fuzz seed {seed} ({backend}, {cfg}, N={n}): {err}") from None


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_fuzz_many(backend):
    for _ in range(MANY):
        test_fuzz_against_oracle(backend, 0)
