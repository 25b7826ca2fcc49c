"""Backend "cuda" on GPUs: the contract checks of tests/test_reference.py and test_grad.py, bit-exact against the
NumPy oracle and the "xla" backend, plus what only this backend has (error flag, epochs across many calls, buffer
sizes, one process per GPU). Skipped where there is no CUDA build or no GPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe
from jax_moe.backends.cuda import CudaBackend, buffer_bytes

_why = CudaBackend.unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_why is not None, reason=f"backend 'cuda': {_why}")]

if _why is None:
    from helpers import bits, expert_fn, mesh_of, random_routing, random_tokens, run, split
    from multiprocess import free_port, launch
    from test_grad import dense_loss, moe_loss_fn
    from test_reference import check_roundtrip, check_two_layers, roundtrip


def gpu_mesh(n: int):
    return mesh_of(n, platform="gpu")


def comm_of(cfg, n, backend="cuda"):
    return jax_moe.Communicator(cfg, gpu_mesh(n), "ep", backend=backend)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("case", ["random", "skewed", "partial"])
def test_roundtrip_matches_oracle_and_xla(rng, n, fp8, case):
    e, r, hidden, max_tokens = 16, 4, 256, 12
    t = 5 if case == "partial" else max_tokens
    cfg = jax_moe.MoEConfig(e, r, hidden, max_tokens, dispatch_dtype=jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
    comm = comm_of(cfg, n)
    assert comm.backend_name == "cuda"
    x, scale = random_tokens(rng, n * t, hidden, fp8)
    idx = random_routing(rng, n, t, r, e, mask=0.25, skew=case == "skewed")
    w = rng.random((n * t, r)).astype(np.float32)
    got = roundtrip(comm, x, idx, w, scale)
    check_roundtrip(comm, n, x, idx, w, scale, got)
    ref = roundtrip(comm_of(cfg, n, "xla"), x, idx, w, scale)
    counts = split(np.asarray(got[2]), n)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(ref[2]))
    for q in range(n):
        rows = int(counts[q].sum())
        for a, b in zip(got[:2], ref[:2]):
            if a is not None:
                np.testing.assert_array_equal(bits(split(np.asarray(a), n)[q][:rows]), bits(split(np.asarray(b), n)[q][:rows]))
    np.testing.assert_allclose(np.asarray(got[3], np.float32), np.asarray(ref[3], np.float32), rtol=1e-2, atol=1e-2)


def test_every_token_to_one_expert_fills_max_recv_rows(rng):
    n = min(2, len(jax.devices("gpu")))
    e, r, hidden, t = 8, 4, 128, 6
    comm = comm_of(jax_moe.MoEConfig(e, r, hidden, t), n)
    x, _ = random_tokens(rng, n * t, hidden, False)
    idx = np.stack([rng.permutation(e // n)[:r] for _ in range(n * t)]).astype(np.int32)  # all on rank 0
    w = rng.random((n * t, r)).astype(np.float32)
    outs = roundtrip(comm, x, idx, w)
    assert np.asarray(outs[2]).reshape(n, -1)[0].sum() == comm.max_recv_rows
    check_roundtrip(comm, n, x, idx, w, None, outs)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_split_halves_equal_one_shot(rng, fp8):
    n = min(2, len(jax.devices("gpu")))
    e, r, hidden, t = 8, 2, 128, 7
    cfg = jax_moe.MoEConfig(e, r, hidden, t, dispatch_dtype=jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
    comm = comm_of(cfg, n)
    x, scale = random_tokens(rng, n * t, hidden, fp8)
    idx = random_routing(rng, n, t, r, e)
    w = rng.random((n * t, r)).astype(np.float32)
    one = roundtrip(comm, x, idx, w, scale)
    two = roundtrip(comm, x, idx, w, scale, split_halves=True)
    for a, b in zip(one, two):
        if a is not None:
            cnt = np.asarray(one[2]).reshape(n, -1).sum(-1)
            if a.shape[0] == n * comm.max_recv_rows:
                for q in range(n):
                    np.testing.assert_array_equal(bits(split(np.asarray(a), n)[q][: cnt[q]]),
                                                  bits(split(np.asarray(b), n)[q][: cnt[q]]))
            else:
                np.testing.assert_array_equal(bits(a), bits(b))


def test_out_of_range_ids_are_masked_then_reported(rng):
    """Bad ids move nothing (like the reference) and raise the device error flag, which the next recv half on that
    device reports (its own call's recv half when the host reads the flag late enough). One rank: with several, the
    others would then wait for the failed one until the timeout (docs/cuda.md)."""
    e, r, hidden, t = 8, 3, 128, 6
    comm = comm_of(jax_moe.MoEConfig(e, r, hidden, t), 1)
    x, _ = random_tokens(rng, t, hidden, False)
    idx = random_routing(rng, 1, t, r, e, mask=0.0)
    bad = idx.copy()
    bad[0, 0], bad[t - 1, 2] = e, 1 << 30
    clean = np.where((bad >= 0) & (bad < e), bad, -1).astype(np.int32)
    w = rng.random((t, r)).astype(np.float32)
    reported = 0
    got = None
    for ids in (bad, clean):
        try:
            outs = roundtrip(comm, x, ids, w)
            jax.block_until_ready(outs)
            got = outs if got is None else got
        except Exception as err:  # noqa: BLE001 - JaxRuntimeError
            assert "outside [0, num_experts)" in str(err), str(err)
            reported += 1
    assert reported == 1
    want = roundtrip(comm, x, clean, w)  # the flag was cleared by the report
    check_roundtrip(comm, 1, x, clean, w, None, want)
    if got is not None:  # the bad call itself completed: its rows equal the masked ones
        check_roundtrip(comm, 1, x, clean, w, None, got)


def test_command_buffer_mode_is_exact_and_reports_errors(rng, monkeypatch):
    """JAX_MOE_CUDA_COMMAND_BUFFERS=1 picks the handlers marked command-buffer compatible (XLA may then replay them
    from CUDA graphs without calling the handler). Repeated calls stay bit-exact (epochs live on the device), and a
    bad id is reported: by take_errors() when the handler was not called again, else by the call itself."""
    monkeypatch.setenv("JAX_MOE_CUDA_COMMAND_BUFFERS", "1")
    n = min(2, len(jax.devices("gpu")))
    e, r, hidden, t = 4 * n, 3, 128, 6
    comm = comm_of(jax_moe.MoEConfig(e, r, hidden, t), n)
    f = jax.jit(jax.shard_map(lambda x, i: comm.dispatch(x, i).expert_x, mesh=comm.mesh, in_specs=(P("ep"),) * 2,
                              out_specs=P("ep")))
    sh = NamedSharding(comm.mesh, P("ep"))
    text = f.lower(jax.ShapeDtypeStruct((n * t, hidden), jnp.bfloat16, sharding=sh),
                   jax.ShapeDtypeStruct((n * t, r), jnp.int32, sharding=sh)).as_text()
    assert "jax_moe_cuda_dispatch_send_graph" in text and "jax_moe_cuda_dispatch_recv_graph" in text
    for _ in range(3):
        x, _ = random_tokens(rng, n * t, hidden, False)
        idx = random_routing(rng, n, t, r, e, mask=0.2)
        w = rng.random((n * t, r)).astype(np.float32)
        check_roundtrip(comm, n, x, idx, w, None, roundtrip(comm, x, idx, w))
    assert comm.backend.take_errors() == []
    bad = random_routing(rng, n, t, r, e, mask=0.0)
    bad[0, 0] = e + 5
    messages = []
    try:
        jax.block_until_ready(roundtrip(comm, x, bad, w))
    except Exception as err:  # noqa: BLE001 - JaxRuntimeError from a handler that did run
        messages.append(str(err))
    messages += comm.backend.take_errors()
    assert any(f"expert id {e + 5}" in m for m in messages), messages


def test_many_calls_in_one_jit_and_dispatch_only_loops(rng):
    """Epochs: repeated dispatches without combine (acks hold the senders back) and several round trips per program."""
    n = min(2, len(jax.devices("gpu")))
    e, r, hidden, t = 8, 2, 128, 9
    comm = comm_of(jax_moe.MoEConfig(e, r, hidden, t), n)
    x, _ = random_tokens(rng, n * t, hidden, False)
    idx = random_routing(rng, n, t, r, e)
    w = rng.random((n * t, r)).astype(np.float32)

    def body(x, idx, w):
        acc = jnp.zeros((), jnp.float32)
        for _ in range(5):  # dispatch only
            d = comm.dispatch(x, idx)
            acc = acc + jnp.sum(d.expert_counts).astype(jnp.float32)
        h = x
        for _ in range(3):  # chained round trips
            d = comm.dispatch(h, idx)
            h = comm.combine(expert_fn(d.expert_x, d.expert_counts, comm), w, d)
        return h, acc[None]

    out, acc = run(comm, body, x, idx, w, out_specs=(P("ep"), P("ep")))
    h = x
    for _ in range(3):
        h = np.asarray(roundtrip(comm_of(comm.cfg, n, "xla"), h, idx, w)[3])
    np.testing.assert_allclose(np.asarray(out, np.float32), h.astype(np.float32), rtol=2e-2, atol=2e-2)
    for _ in range(20):  # many programs back to back
        out2, _ = run(comm, body, x, idx, w, out_specs=(P("ep"), P("ep")))
    np.testing.assert_array_equal(bits(np.asarray(out2)), bits(np.asarray(out)))


def test_two_layers_in_one_jit(rng):
    n = min(2, len(jax.devices("gpu")))
    hidden, t = 128, 5
    c1 = comm_of(jax_moe.MoEConfig(8, 2, hidden, t), n)
    c2 = comm_of(jax_moe.MoEConfig(16, 3, hidden, t), n)
    check_two_layers(rng, c1, c2, n, hidden, t)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("split_halves", [False, True], ids=["one-shot", "halves"])
def test_gradients_match_dense_reference(rng, n, split_halves):
    e, r, hidden, t = 8, 3, 64, 6
    comm = comm_of(jax_moe.MoEConfig(e, r, hidden, t), n)
    x = rng.standard_normal((n * t, hidden)).astype(jnp.bfloat16)
    idx = random_routing(rng, n, t, r, e, mask=0.2)
    w = rng.random((n * t, r)).astype(np.float32)
    a = (1 + 0.5 * rng.standard_normal((e, hidden))).astype(np.float32)
    b = (0.1 * rng.standard_normal((e, hidden))).astype(np.float32)
    g = rng.standard_normal((n * t, hidden)).astype(np.float32)
    sh = NamedSharding(comm.mesh, P("ep"))
    args = [jax.device_put(v, sh) for v in (x, idx, w, a, b, g)]
    got = jax.block_until_ready(moe_loss_fn(comm, split_halves)(*args))
    assert comm.backend.take_errors() == []
    ref = moe_loss_fn(comm_of(comm.cfg, n, "xla"), split_halves)(*args)
    close = {name: bool(np.allclose(np.asarray(gv, np.float32), np.asarray(rv, np.float32), rtol=1e-2, atol=1e-2))
             for name, gv, rv in zip(("x", "topk_weights", "a", "b"), got, ref)}
    assert all(close.values()), f"cuda vs xla gradients agree: {close}"
    want = jax.grad(dense_loss, argnums=(0, 2, 3, 4))(jnp.asarray(x), idx, w, a, b, g, e)
    for name, gv, wv in zip(("x", "topk_weights", "a", "b"), got, want):
        gv, wv = np.asarray(gv, np.float32), np.asarray(wv, np.float32)
        np.testing.assert_allclose(gv, wv, rtol=2e-2, atol=2e-2 * (np.abs(wv).max() + 1e-6), err_msg=name)
    assert np.all(np.asarray(got[1])[idx < 0] == 0)


def test_buffer_bytes_reported():
    cfg = jax_moe.MoEConfig(256, 8, 7168, 128, dispatch_dtype=jnp.float8_e4m3fn)
    decode = buffer_bytes(cfg, 2)
    # per sender 128 token records of 7168 + 56 * 4 bytes and 128 x 128 list entries, 2 senders, plus 2 channels of
    # 1024 combine rows of 14336 bytes
    floor = 2 * 128 * 7392 + 2 * 128 * 128 * 4 + 2 * 1024 * 14336
    assert floor <= decode < floor + (1 << 20)
    comm = comm_of(jax_moe.MoEConfig(8, 2, 128, 4), 1)
    assert comm.backend.bytes_per_device == buffer_bytes(comm.cfg, 1)


def test_hidden_must_be_16_byte_rows():
    with pytest.raises(ValueError, match="multiple of 16"):
        comm_of(jax_moe.MoEConfig(4, 2, 36, 4), 1)


@pytest.mark.multiprocess
def test_two_processes_one_gpu_each(rng):
    if len(jax.devices("gpu")) < 2:
        pytest.skip("needs 2 GPUs")
    port, seed = free_port(), int(rng.integers(1 << 30))
    outs = launch("mp_worker.py", [(i, 2, port, 1, "cuda", seed) for i in range(2)], timeout_s=300)
    for i, out in enumerate(outs):
        assert f"OK process {i}/2 devices=2 backend=cuda" in out, out[-3000:]

