"""Backend "cpu" beyond the shared contract tests: bit-equality with "xla", long runs, and its failure modes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe
from support.helpers import bits, mesh_of, random_routing, random_tokens, roundtrip
from support.multiprocess import free_port, launch


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_identical_to_xla(rng, fp8):
    n, e, r, hidden, t = 4, 16, 4, 256, 9
    cfg = jax_moe.MoEConfig(e, r, hidden, t, dispatch_dtype=jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
    mesh = mesh_of(n)
    x, scale = random_tokens(rng, n * t, hidden, fp8)
    idx = random_routing(rng, n, t, r, e, mask=0.3)
    w = rng.random((n * t, r)).astype(np.float32)
    got = roundtrip(jax_moe.Communicator(cfg, mesh, "ep", backend="cpu"), x, idx, w, scale)
    want = roundtrip(jax_moe.Communicator(cfg, mesh, "ep", backend="xla"), x, idx, w, scale)
    for name, a, b in zip(("expert_x", "expert_x_scale", "expert_counts"), got[:3], want[:3]):
        if b is not None:
            np.testing.assert_array_equal(bits(a), bits(b), err_msg=name)  # padding rows included: both zero them
    np.testing.assert_allclose(np.asarray(got[3], np.float32), np.asarray(want[3], np.float32), rtol=1e-2, atol=1e-2)


def test_auto_is_cpu_on_cpu():
    comm = jax_moe.Communicator(jax_moe.MoEConfig(8, 2, 128, 4), mesh_of(2), "ep")
    assert comm.backend_name == "cpu"
    assert comm.bytes_allocated > 0 and comm.errors() == []


def test_thousand_rounds(rng):
    """1000 dispatch/combine rounds back to back (10 calls x 100 loop steps), each checked exactly.

    x holds small integers, the experts are the identity and each token's R = 2 weights are 0.5, so combine returns x
    exactly whatever the order of the float32 sum; x + 1 per round makes every round's data distinct and the routing
    rotates so the traffic pattern changes too.
    """
    n, e, r, hidden, t, rounds = 4, 8, 2, 128, 6, 100
    comm = jax_moe.Communicator(jax_moe.MoEConfig(e, r, hidden, t), mesh_of(n), "ep", backend="cpu")
    idx0 = random_routing(rng, n, t, r, e, mask=0.0)
    w = np.full((n * t, r), 0.5, np.float32)

    def body(x, idx, w):
        def step(i, x):
            d = comm.dispatch(x, (idx + i) % e)
            return (comm.combine(d.expert_x, w, d).astype(jnp.float32) + 1).astype(jnp.bfloat16)

        return jax.lax.fori_loop(0, rounds, step, x)

    sh = NamedSharding(comm.mesh, P("ep"))
    f = jax.jit(jax.shard_map(body, mesh=comm.mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
    x0 = rng.integers(0, 64, (n * t, hidden)).astype(jnp.bfloat16)
    args = [jax.device_put(a, sh) for a in (x0, idx0, w)]
    outs = [f(*args) for _ in range(10)]
    for out in outs:
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(x0, np.float32) + rounds)


@pytest.mark.multiprocess
@pytest.mark.parametrize("provider", ["tcp", "shm"])
@pytest.mark.parametrize("nproc, per_proc", [(2, 2), (4, 1)])
def test_processes_over_the_fabric(rng, provider, nproc, per_proc):
    port, seed = free_port(), int(rng.integers(1 << 30))
    outs = launch("mp_worker.py", [(i, nproc, port, per_proc, "cpu", seed) for i in range(nproc)],
                  env={"JAX_MOE_FABRIC_PROVIDER": provider})
    for i, out in enumerate(outs):
        assert f"OK process {i}/{nproc} devices={nproc * per_proc} backend=cpu" in out, out[-3000:]


@pytest.mark.multiprocess
def test_config_mismatch_detected_at_bootstrap():
    port = free_port()
    outs = launch("mp_failure_worker.py", [("mismatch", i, 2, port) for i in range(2)], timeout_s=120)
    assert any("built it with another config" in out for out in outs), outs
