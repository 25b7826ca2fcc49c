"""Shared test plumbing: meshes, random routings, running the API per rank and checking it against the oracle."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe
from jax_moe import multihost
from jax_moe.backends.cuda import CudaBackend
from support import oracle

CPU_BACKENDS = ["xla", "cpu"]
BACKENDS = CPU_BACKENDS + [pytest.param("cuda", marks=pytest.mark.gpu)]  # every backend runs the same checks


def cpu_module():
    """jax_moe._core.cpu, or a skip where this build has no backend "cpu"."""
    try:
        jax_moe.backends.load("cpu")
    except jax_moe.BackendUnavailable as e:
        pytest.skip(str(e))
    from jax_moe import _core
    return _core.cpu


def mesh_of(n: int, axis: str = "ep", platform: str = "cpu") -> jax.sharding.Mesh:
    """A 1-D mesh of n devices of `platform` (CPU by default, also on machines with GPUs)."""
    devices = jax.devices(platform)
    if len(devices) < n:
        pytest.skip(f"needs {n} {platform} devices, this machine has {len(devices)}")
    return jax.make_mesh((n,), (axis,), devices=devices[:n])


def backend_mesh(backend: str, n: int, axis: str = "ep") -> jax.sharding.Mesh:
    """The mesh a backend runs on: GPUs for "cuda" (skipped where it is unavailable), CPU devices otherwise."""
    if backend == "cuda":
        why = CudaBackend.unavailable_reason()
        if why is not None:
            pytest.skip(f"backend 'cuda': {why}")
        return mesh_of(n, axis, platform="gpu")
    return mesh_of(n, axis)


def random_routing(rng: np.random.Generator, n: int, t: int, r: int, e: int, *, mask: float = 0.2,
                   skew: bool = False) -> np.ndarray:
    """[n*t, r] int32: distinct experts per token, some masked (-1); skew sends every token to expert 0."""
    idx = np.stack([rng.permutation(e)[:r] for _ in range(n * t)]).astype(np.int32)
    if skew:
        idx[:, 0] = 0
        for row in idx:  # keep experts distinct after forcing expert 0 into slot 0
            rest = [v for v in row[1:] if v != 0]
            extra = [v for v in rng.permutation(np.arange(1, e)) if v not in rest]
            row[1:] = (rest + extra)[: r - 1]
    idx[rng.random(idx.shape) < mask] = -1
    return idx


def random_tokens(rng: np.random.Generator, rows: int, hidden: int, fp8: bool, block: int = 128):
    x = (rng.standard_normal((rows, hidden)) * 3).astype(np.float32)
    if not fp8:
        return np.asarray(x.astype(jnp.bfloat16)), None
    q, s = jax_moe.quantize_fp8(jnp.asarray(x), block)
    return np.asarray(q), np.asarray(s)


def shard(mesh, *arrays):
    sh = NamedSharding(mesh, P(mesh.axis_names[0]))
    return [None if a is None else multihost.place(a, sh) for a in arrays]


def split(a: np.ndarray, n: int) -> list[np.ndarray]:
    return list(np.asarray(a).reshape(n, -1, *a.shape[1:]))


def bits(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def check_dispatch(comm, n, x, idx, scale, expert_x, expert_scale, counts) -> dict:
    """Compare per-rank dispatch results with the oracle; returns the oracle's row map for combine checks."""
    e = comm.cfg.num_experts
    ref, row_of = oracle.dispatch(split(x, n), split(idx, n), e, None if scale is None else split(scale, n))
    ex, cnt = split(expert_x, n), split(counts, n)
    es = None if expert_scale is None else split(expert_scale, n)
    for q in range(n):
        rows, srows, c = ref[q]
        np.testing.assert_array_equal(cnt[q], c, err_msg=f"expert_counts on rank {q}")
        assert ex[q].shape == (comm.max_recv_rows, comm.cfg.hidden)
        np.testing.assert_array_equal(bits(ex[q][: len(rows)]), bits(rows), err_msg=f"expert_x rows on rank {q}")
        if scale is not None:
            np.testing.assert_array_equal(bits(es[q][: len(rows)]), bits(srows), err_msg=f"scales on rank {q}")
    return row_of


def run(comm: jax_moe.Communicator, fn, *args, out_specs=None):
    """jit(shard_map(fn)) over the comm's axis with every argument sharded on its first dim."""
    mesh, axis = comm.mesh, comm.axis_name
    specs = tuple(None if a is None else P(axis) for a in args)
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out_specs or P(axis)))
    sh = NamedSharding(mesh, P(axis))
    # Across processes each takes its own shards (jax_moe.multihost): processes may share a GPU.
    return f(*[None if a is None else multihost.place(a, sh) for a in args])


def expert_fn(expert_x: jax.Array, counts: jax.Array, comm: jax_moe.Communicator) -> jax.Array:
    """A cheap per-expert transform so that combine results depend on the expert: y = x * (1 + e/8) - e/16."""
    l = comm.num_local_experts
    starts = jnp.cumsum(counts) - counts
    rows = jnp.arange(expert_x.shape[0])
    e = jnp.sum(rows[:, None] >= starts[None, :], axis=1) - 1
    e = jnp.clip(e, 0, l - 1).astype(jnp.float32) + jax.lax.axis_index(comm.axis_name) * l
    return (expert_x.astype(jnp.float32) * (1 + e[:, None] / 8) - e[:, None] / 16).astype(comm.cfg.combine_dtype)


def oracle_expert(rows: np.ndarray, counts: np.ndarray, rank: int, l: int, scale: Optional[np.ndarray] = None):
    e = np.repeat(np.arange(l) + rank * l, counts).astype(np.float32)[:, None]
    x = rows.astype(np.float32)
    return (x * (1 + e / 8) - e / 16).astype(jnp.bfloat16)


def ranks_for(backend: str, n: int) -> int:
    """n ranks, or 2 for "cuda" (the largest GPU machine lent here)."""
    return 2 if backend == "cuda" else n


WEIGHTS_AT = pytest.mark.parametrize("weights_at_dispatch", [False, True], ids=["w@combine", "w@dispatch"])


def roundtrip(comm, x, idx, w, scale=None, split_halves=False, weights_at_dispatch: bool = False):
    """dispatch -> per-expert transform -> combine, per rank; returns global arrays. weights_at_dispatch: w goes to
    dispatch (the expert ranks may sum a token's rows) and combine gets None."""

    def body(x, idx, w, scale):
        wd, wc = (w, None) if weights_at_dispatch else (None, w)
        if split_halves:
            d = comm.dispatch_recv(comm.dispatch_send(x, idx, x_scale=scale, topk_weights=wd))
        else:
            d = comm.dispatch(x, idx, x_scale=scale, topk_weights=wd)
        y = expert_fn(d.expert_x, d.expert_counts, comm)
        out = comm.combine_recv(comm.combine_send(y, d), wc) if split_halves else comm.combine(y, wc, d)
        return (*received(d), d.expert_counts, out)

    return run(comm, body, x, idx, w, scale, out_specs=P(comm.axis_name))


def received(d):
    """(expert_x, expert_x_scale) with the padding rows zeroed: the contract leaves them unspecified, so results
    compared bit for bit (between runs, between backends) hold only the rows received."""
    keep = d.valid_rows()[:, None]
    x = jnp.where(keep, d.expert_x, jnp.zeros((), d.expert_x.dtype))
    return x, None if d.expert_x_scale is None else jnp.where(keep, d.expert_x_scale, 0.0)


def check_roundtrip(comm, n, x, idx, w, scale, outs):
    """The results of roundtrip (gathered) against the oracle: dispatch bit for bit, combine within bf16 rounding."""
    expert_x, expert_scale, counts, out = outs
    row_of = check_dispatch(comm, n, x, idx, scale, expert_x, expert_scale, counts)
    l = comm.num_local_experts
    ex, cnt = split(expert_x, n), split(counts, n)
    ys = [oracle_expert(ex[q][: cnt[q].sum()], cnt[q], q, l) for q in range(n)]
    ref = oracle.combine(ys, split(w, n), split(idx, n), row_of, comm.cfg.num_experts)
    got = split(np.asarray(out).astype(np.float32), n)
    assert np.asarray(out).dtype == jnp.bfloat16
    for s in range(n):
        np.testing.assert_allclose(got[s], ref[s], rtol=1e-2, atol=1e-2 * np.abs(ref[s]).max(),
                                   err_msg=f"combine on rank {s}")
