"""Backend "cuda" on GPUs: what only this backend has (the error flag, command-buffer mode, epochs across many
calls, buffer sizes, one process per GPU). The contract itself (bit-exact rows against the NumPy oracle, fp8
scales, masked ids, skewed loads, gradients) runs on "cuda" from tests/test_reference.py and test_grad.py, whose
backend lists include it. Skipped where there is no CUDA build or no GPU."""
from __future__ import annotations

import gc
import re
import time

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
    from support.helpers import (bits, check_roundtrip, expert_fn, mesh_of, random_routing, random_tokens, roundtrip,
                                 run, shard)
    from support.multiprocess import free_port, launch


def gpu_mesh(n: int):
    return mesh_of(n, platform="gpu")


def comm_of(cfg, n, backend="cuda", **options):
    return jax_moe.Communicator(cfg, gpu_mesh(n), "ep", backend=backend, **options)


def test_out_of_range_ids_are_masked_then_reported(rng):
    """Bad ids move nothing (like the reference) and raise the device error, which the next recv half on that device
    reports exactly once (its own call's recv half when the send kernel has ended by then), however many bad ids the
    call had; a later bad call is reported again. One rank: with several, the others would then wait for the failed
    one until the timeout (docs/cuda.md)."""
    e, r, hidden, t = 8, 3, 128, 6
    comm = comm_of(jax_moe.MoEConfig(e, r, hidden, t), 1)
    x, _ = random_tokens(rng, t, hidden, False)
    idx = random_routing(rng, 1, t, r, e, mask=0.0)
    bad = idx.copy()
    bad[0, 0], bad[t - 1, 2] = e, 1 << 30  # two bad ids in one launch: still one report
    clean = np.where((bad >= 0) & (bad < e), bad, -1).astype(np.int32)
    w = rng.random((t, r)).astype(np.float32)
    for _ in range(2):  # the second round needs the first report acknowledged
        reported = 0
        got = None
        for ids in (bad, clean):
            try:
                outs = roundtrip(comm, x, ids, w)
                jax.block_until_ready(outs)
                got = outs if got is None else got
            except Exception as err:  # noqa: BLE001 - JaxRuntimeError
                assert "outside [0, num_experts)" in str(err), str(err)
                assert "expert id 8 " in str(err) or f"expert id {1 << 30} " in str(err), str(err)
                reported += 1
        assert reported == 1
        assert comm.errors() == []  # nothing left over for a later call
        if got is not None:  # the first call that completed (the bad one, if it did): rows equal the masked ones
            check_roundtrip(comm, 1, x, clean, w, None, got)
    want = roundtrip(comm, x, clean, w)
    check_roundtrip(comm, 1, x, clean, w, None, want)


def test_command_buffer_mode_is_exact_and_reports_errors(rng, monkeypatch):
    """JAX_MOE_CUDA_COMMAND_BUFFERS=1 picks the handlers marked command-buffer compatible (XLA may then replay them
    from CUDA graphs without calling the handler). Repeated calls stay bit-exact (epochs live on the device), and a
    bad id is reported: by comm.errors() when the handler was not called again, else by the call itself."""
    monkeypatch.setenv("JAX_MOE_CUDA_COMMAND_BUFFERS", "1")
    n = min(2, len(jax.devices("gpu")))
    e, r, hidden, t = 4 * n, 3, 128, 6
    comm = comm_of(jax_moe.MoEConfig(e, r, hidden, t), n)
    f = jax.jit(jax.shard_map(lambda x, i: comm.dispatch(x, i).expert_x, mesh=comm.mesh, in_specs=(P("ep"),) * 2,
                              out_specs=P("ep")))
    sh = NamedSharding(comm.mesh, P("ep"))
    text = f.lower(jax.ShapeDtypeStruct((n * t, hidden), jnp.bfloat16, sharding=sh),
                   jax.ShapeDtypeStruct((n * t, r), jnp.int32, sharding=sh)).as_text()
    assert "jax_moe_cuda_dispatch_graph" in text  # the one-shot dispatch: both halves from one handler
    for _ in range(3):
        x, _ = random_tokens(rng, n * t, hidden, False)
        idx = random_routing(rng, n, t, r, e, mask=0.2)
        w = rng.random((n * t, r)).astype(np.float32)
        check_roundtrip(comm, n, x, idx, w, None, roundtrip(comm, x, idx, w))
    assert comm.errors() == []
    # The error path on one rank: with several, a rank whose call raised would leave the others waiting.
    one = comm_of(jax_moe.MoEConfig(e, r, hidden, t), 1)
    x, _ = random_tokens(rng, t, hidden, False)
    bad = random_routing(rng, 1, t, r, e, mask=0.0)
    bad[0, 0] = e + 5
    w = rng.random((t, r)).astype(np.float32)
    messages = []
    try:
        jax.block_until_ready(roundtrip(one, x, bad, w))
    except Exception as err:  # noqa: BLE001 - JaxRuntimeError from a handler that did run
        messages.append(str(err))
    messages += one.errors()
    assert any(f"expert id {e + 5}" in m for m in messages), messages


def test_long_rounds_match_the_oracle(rng):
    """Prefill-sized rounds on this machine's GPUs over NVLink (EP1 on one GPU): dispatch_send's list scan takes one
    tile of 256 tokens a pass up to 256 tokens and four tiles beyond (the last pass partial), against the oracle with
    masked entries, repeated experts, skewed loads, fp8 and both places for the weights."""
    n = min(2, len(jax.devices("gpu")))
    e, r, hidden = 16, 8, 128
    comm = {fp8: comm_of(jax_moe.MoEConfig(e, r, hidden, 2100, dispatch_dtype=jnp.float8_e4m3fn if fp8 else
                                           jnp.bfloat16), n) for fp8 in (False, True)}
    for t in (256, 257, int(rng.integers(258, 1024)), 1024, int(rng.integers(1025, 2101))):  # partial and whole passes
        fp8 = bool(rng.integers(2))
        x, scale = random_tokens(rng, n * t, hidden, fp8)
        idx = random_routing(rng, n, t, r, e, mask=0.2, skew=bool(rng.integers(2)))
        again = rng.random(len(idx)) < 0.3
        idx[again, 2] = idx[again, 1]  # a repeated expert: only its first entry counts
        w = rng.random((n * t, r)).astype(np.float32)
        for at_dispatch in (False, True):
            outs = roundtrip(comm[fp8], x, idx, w, scale, split_halves=at_dispatch, weights_at_dispatch=at_dispatch)
            check_roundtrip(comm[fp8], n, x, idx, w, scale, outs)


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


def test_a_list_out_of_token_order_is_reported(rng):
    """A list out of token order (what a faulty peer could write: every entry in bounds) is bad peer data: its rows
    are dropped and the receive reports it, rather than the route table's searches missing rows silently. The
    Communicator stays usable (one rank), and the next round is exact."""
    e, r, hidden, t = 4, 2, 128, 8
    comm = comm_of(jax_moe.MoEConfig(e, r, hidden, t), 1)
    x, _ = random_tokens(rng, t, hidden, False)
    idx = random_routing(rng, 1, t, r, e, mask=0.0)
    idx[:, 0] = 0  # every token names expert 0 first: its list is [0, R, 2R, ...]
    idx[:, 1] = rng.integers(1, e, t)
    spec = dict(mesh=comm.mesh, in_specs=(P("ep"),) * 2, out_specs=P("ep"))
    send = jax.jit(jax.shard_map(lambda x, i: comm.dispatch_send(x, i), **spec))
    recv = jax.jit(jax.shard_map(lambda h: comm.dispatch_recv(h).expert_x, mesh=comm.mesh, in_specs=(P("ep"),),
                                 out_specs=P("ep")))
    xs, ids = shard(comm.mesh, x, idx)
    handle = jax.block_until_ready(send(xs, ids))
    order = list(range(t))
    i, j = sorted(rng.choice(t, 2, replace=False))
    order[i], order[j] = order[j], order[i]  # two entries swapped: still a permutation of valid entries
    comm.backend._mod.testing_write_list(comm.backend.native_id, 0, 0, 0, [k * r for k in order])
    w = rng.random((t, r)).astype(np.float32)
    reported = []
    # The receive kernel raises the report; the recv half that runs after it ends returns it (this call's own or,
    # when the handler runs first, the next call's).
    for call in (lambda: recv(handle), lambda: roundtrip(comm, x, idx, w)):
        try:
            jax.block_until_ready(call())
        except Exception as err:  # noqa: BLE001 - JaxRuntimeError
            reported.append(str(err))
    reported += comm.errors()
    assert len(reported) == 1 and "rank 0" in reported[0] and "out of token order" in reported[0], reported
    check_roundtrip(comm, 1, x, idx, w, None, roundtrip(comm, x, idx, w))


def test_a_silent_peer_times_out_and_the_communicator_stays_failed(rng):
    """Rank 0 dispatches alone (rank 1 never calls): its recv kernel gives up after the Communicator's timeout_s. The next
    call names rank 1, and so does every call after it: once epochs are out of step no result may come back as if
    valid. Dropping the Communicator then frees its buffers without waiting for rank 1 again."""
    if len(jax.devices("gpu")) < 2:
        pytest.skip("needs 2 GPUs")
    e, r, hidden, t = 4, 2, 128, 4
    comm = comm_of(jax_moe.MoEConfig(e, r, hidden, t), 2, timeout_s=0.5)
    b = comm.backend
    solo = jax.sharding.Mesh(np.array([comm.mesh.devices.flat[0]]), ("ep",))  # rank 0's GPU only
    f = jax.jit(jax.shard_map(lambda x, i: b.dispatch_recv(b.dispatch_send(x, None, i))[0], mesh=solo,
                              in_specs=(P("ep"),) * 2, out_specs=P("ep")))
    x, _ = random_tokens(rng, t, hidden, False)
    idx = random_routing(rng, 1, t, r, e, mask=0.0)
    errors = []
    for _ in range(3):
        try:
            jax.block_until_ready(f(x, idx))
        except Exception as err:  # noqa: BLE001 - JaxRuntimeError
            errors.append(str(err))
    # The first call's handler ran before its kernel timed out; the two after it must both fail, naming rank 1.
    assert len(errors) >= 2, errors
    assert all(re.search(r"rank 1 \(process \d+ on host [^,]+, GPU \d+\) did not send its dispatched tokens", m)
               and "build a new Communicator" in m and "DEADLINE_EXCEEDED" in m for m in errors), errors
    # Teardown, as dropping the Communicator does it (its finalizer then finds nothing left): rank 1 never
    # acknowledges rank 0's send, so the wait for it ends at the 0.5 s bound instead of hanging or being skipped.
    t0 = time.monotonic()
    b.module().destroy_comm(b.native_id)
    assert time.monotonic() - t0 < 5
    del f, b, comm
    gc.collect()  # the finalizer's destroy_comm then finds the Communicator gone and frees nothing twice


def test_buffer_bytes_of_a_communicator():
    comm = comm_of(jax_moe.MoEConfig(8, 2, 128, 4), 1)
    assert comm.bytes_allocated == buffer_bytes(comm.cfg, 1)  # one GPU in this process


def test_hidden_must_be_16_byte_rows():
    with pytest.raises(ValueError, match="multiple of 16"):
        comm_of(jax_moe.MoEConfig(4, 2, 36, 4), 1)


@pytest.mark.multiprocess
def test_one_process_per_gpu(rng):
    """Every GPU of the machine in its own process (2 on nvidia-h200-x2, 4 or 8 on the larger kinds): buffers shared
    through CUDA IPC and the jax.distributed key-value store; the shared multi-process worker's checks."""
    n = len(jax.devices("gpu"))
    if n < 2:
        pytest.skip("needs 2 GPUs")
    port, seed = free_port(), int(rng.integers(1 << 30))
    outs = launch("mp_worker.py", [(i, n, port, 1, "cuda", seed) for i in range(n)], timeout_s=300)
    for i, out in enumerate(outs):
        assert f"OK process {i}/{n} devices={n} backend=cuda" in out, out[-3000:]


def test_flax_layer_with_poisoned_padding_matches_xla(monkeypatch):
    """The Flax MoE layer on "cuda" with NaN in every padding row of expert_x (JAX_MOE_POISON_PADDING=1, written by
    dispatch_recv's kernel): ragged_dot masks them, so the output and every gradient are finite and equal to the
    layer on the reference backend; weights travel with dispatch and combine sums at the experts."""
    from flax import nnx

    from jax_moe.nn import MoE

    monkeypatch.setenv("JAX_MOE_POISON_PADDING", "1")
    n = min(2, len(jax.devices("gpu")))
    mesh = gpu_mesh(n)
    x = jax.device_put(np.random.default_rng(1).standard_normal((4 * n, 6, 64)).astype(np.float32),
                       NamedSharding(mesh, P("ep")))
    results = {}
    for backend in ("cuda", "xla"):
        m = MoE(64, 128, 8, 2, mesh=mesh, backend=backend, activation="swiglu", rngs=nnx.Rngs(0))

        def loss(m, x):
            y, aux = m(x)
            return jnp.sum(y * jnp.cos(x)) + aux

        value, grads = nnx.jit(nnx.value_and_grad(loss))(m, x)
        flat = {"_".join(map(str, p)): np.asarray(v.get_value(), np.float32) for p, v in nnx.to_flat_state(grads)}
        assert np.isfinite(float(value)) and all(np.isfinite(g).all() for g in flat.values()), backend
        results[backend] = (float(value), flat)
    (v_cuda, g_cuda), (v_xla, g_xla) = results["cuda"], results["xla"]
    np.testing.assert_allclose(v_cuda, v_xla, rtol=2e-2)
    for name, g in g_xla.items():
        err = np.linalg.norm(g_cuda[name] - g) / max(np.linalg.norm(g), 1e-12)
        assert err < 3e-2, (name, err)


def test_a_dropped_handle_puts_the_rounds_out_of_step_and_is_reported(rng):
    """One dispatch_send whose handle is dropped (a program returns without receiving it): "cuda" holds two rounds,
    so the next send is accepted, and its receive would read the dropped round. The receive kernel compares its
    handle's round with the one it is due and raises a sticky error; every later call fails, naming the cause."""
    e, r, hidden, t = 4, 2, 128, 4
    comm = comm_of(jax_moe.MoEConfig(e, r, hidden, t), 1)
    x, _ = random_tokens(rng, t, hidden, False)
    idx = random_routing(rng, 1, t, r, e)
    w = rng.random((t, r)).astype(np.float32)
    spec = dict(mesh=comm.mesh, in_specs=(P("ep"),) * 2, out_specs=P("ep"))
    leak = jax.jit(jax.shard_map(lambda x, i: (comm.dispatch_send(x, i), x)[1], **spec))
    jax.block_until_ready(leak(*shard(comm.mesh, x, idx)))
    reported = []
    for _ in range(3):
        try:
            jax.block_until_ready(roundtrip(comm, x, idx, w, split_halves=True))
        except Exception as err:  # noqa: BLE001 - JaxRuntimeError
            reported.append(str(err))
    assert reported and all("handle of another round" in m or "was never received" in m for m in reported), reported
    assert any("handle of another round" in m for m in reported + comm.errors()), reported
