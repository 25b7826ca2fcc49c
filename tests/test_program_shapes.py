"""Any number of rounds of one Communicator in one program, in whatever order XLA would schedule them (issue 11):
loops of 1 to 64 rounds, one-shot and split, forward and backward (gradient accumulation over micro-batches that are
separate shard_map calls), checked against the oracle; patterns a backend cannot run are refused at trace time."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe
from support.helpers import BACKENDS, backend_mesh, ranks_for, shard
from support.program_shapes import run_all


def make(backend: str, n: int, fp8: bool = False, t: int = 4) -> jax_moe.Communicator:
    dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    cfg = jax_moe.MoEConfig(4 * n, 2, 128, t, dispatch_dtype=dtype)
    return jax_moe.Communicator(cfg, backend_mesh(backend, n), "ep", backend=backend, timeout_s=30)


NATIVE = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # backends with per-round buffers ("xla" has none)
ROUNDS = [("xla", 1), ("xla", 5)] + [(b, r) for b in ("cpu",) for r in (1, 5, 16)] + [
    pytest.param("cuda", r, marks=pytest.mark.gpu) for r in (1, 5, 16)]


@pytest.mark.parametrize("backend,rounds", ROUNDS)
def test_rounds_of_one_communicator_in_one_program(rng, backend, rounds):
    comm = make(backend, ranks_for(backend, 4))
    run_all(comm, rng, rounds, fp8=False, micro=5 if rounds == 5 else None)


@pytest.mark.parametrize("backend", NATIVE)
def test_fp8_rounds(rng, backend):
    run_all(make(backend, ranks_for(backend, 2), fp8=True), rng, 5, fp8=True)


@pytest.mark.slow
@pytest.mark.parametrize("backend", NATIVE)
def test_64_rounds_and_16_micro_batches(rng, backend):
    comm = make(backend, ranks_for(backend, 2), t=2)
    run_all(comm, rng, 64, fp8=False, micro=16)


def sends_then_receives(comm, k: int):
    def body(x, i):
        handles = [comm.dispatch_send(x, i) for _ in range(k)]
        return sum(comm.dispatch_recv(h).expert_x.astype(jnp.float32).sum() for h in handles)[None]

    return jax.jit(jax.shard_map(body, mesh=comm.mesh, in_specs=(P("ep"),) * 2, out_specs=P("ep")))


@pytest.mark.parametrize("backend", BACKENDS)
def test_more_open_rounds_than_buffers_are_refused_at_trace_time(rng, backend):
    comm = make(backend, ranks_for(backend, 2))
    limit = comm.backend.rounds_in_flight
    n, t = comm.num_ranks, comm.cfg.max_tokens
    x, i = shard(comm.mesh, rng.standard_normal((n * t, 128)).astype(jnp.bfloat16),
                 np.zeros((n * t, 2), np.int32))
    if limit is None:
        assert np.isfinite(np.asarray(sends_then_receives(comm, 6)(x, i))).all()
        return
    with pytest.raises(RuntimeError, match=f"holds {limit} at a time.*dispatch_recv on an earlier handle"):
        sends_then_receives(comm, limit + 1).lower(x, i)
    # up to the limit it runs, and the Communicator is still good afterwards
    want = float(np.asarray(sends_then_receives(comm, 1)(x, i)).sum())
    assert float(np.asarray(sends_then_receives(comm, limit)(x, i)).sum()) == pytest.approx(limit * want)


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("nest", ["jit", "cond"])
def test_rounds_opened_in_a_nested_trace_count_with_the_enclosing_ones(rng, backend, nest):
    """Rounds open in the enclosing function hold buffers while a nested jit or a cond branch runs: opening more
    there is refused at trace time with that cause (not at run time, which would end the Communicator), and up to the
    limit the same program runs."""
    comm = make(backend, ranks_for(backend, 2))
    limit = comm.backend.rounds_in_flight
    n, t = comm.num_ranks, comm.cfg.max_tokens
    x, i = shard(comm.mesh, rng.standard_normal((n * t, 128)).astype(jnp.bfloat16),
                 np.zeros((n * t, 2), np.int32))

    def program(outer: int, inner: int):
        def body(x, i):
            handles = [comm.dispatch_send(x, i) for _ in range(outer)]
            if nest == "jit":  # the nested function opens rounds and returns their handles
                handles += list(jax.jit(lambda x, i: tuple(comm.dispatch_send(x, i) for _ in range(inner)))(x, i))
                total = sum(comm.dispatch_recv(h).expert_x.astype(jnp.float32).sum() for h in handles)
            else:  # both branches open and receive one round (every rank must run the same rounds)
                one = jax.lax.cond(x[0, 0] > 0, lambda: comm.dispatch(x, i).expert_x.astype(jnp.float32).sum(),
                                   lambda: -comm.dispatch(x, i).expert_x.astype(jnp.float32).sum())
                total = one + sum(comm.dispatch_recv(h).expert_x.astype(jnp.float32).sum() for h in handles)
            return jnp.asarray(total)[None]

        return jax.jit(jax.shard_map(body, mesh=comm.mesh, in_specs=(P("ep"),) * 2, out_specs=P("ep")))

    outer, inner = (1, limit) if nest == "jit" else (limit, 1)  # at least one round open outside, on every backend
    in_order = getattr(comm.backend, "receives_in_order", False)
    # a backend that receives in send order refuses the cond's one-shot call while outer rounds are open: its receive
    # would come first
    match = "in the order they were sent" if in_order and nest == "cond" else \
        f"already open here and in the functions this one is nested in.*holds {limit} at a time"
    with pytest.raises(RuntimeError, match=match):
        program(outer, inner).lower(x, i)
    if in_order and nest == "cond" and limit > 1:
        with pytest.raises(RuntimeError, match="in the order they were sent"):
            program(limit - 1, 1).lower(x, i)
        return
    assert np.isfinite(np.asarray(program(limit - 1, 1)(x, i))).all()  # within the limit it runs


@pytest.mark.parametrize("backend", NATIVE)
def test_rounds_received_out_of_send_order(rng, backend):
    """Send A, send B, receive B, receive A: a backend whose receives name their round ("cpu": the ticket) returns
    each round's own rows; one whose receives take the oldest open round ("cuda") refuses it at trace time."""
    comm = make(backend, ranks_for(backend, 2))
    if (comm.backend.rounds_in_flight or 2) < 2:
        pytest.skip("holds one round at a time")
    n, t = comm.num_ranks, comm.cfg.max_tokens
    xa, xb = (rng.standard_normal((n * t, 128)).astype(jnp.bfloat16) for _ in range(2))
    ia, ib = (rng.integers(0, comm.cfg.num_experts, (n * t, 2)).astype(np.int32) for _ in range(2))

    def swapped(xa, ia, xb, ib):
        ha, hb = comm.dispatch_send(xa, ia), comm.dispatch_send(xb, ib)
        db = comm.dispatch_recv(hb)
        da = comm.dispatch_recv(ha)
        return da.expert_x.astype(jnp.float32).sum()[None], db.expert_x.astype(jnp.float32).sum()[None]

    def one(x, i):
        return comm.dispatch(x, i).expert_x.astype(jnp.float32).sum()[None]

    spec = P("ep")
    f = jax.jit(jax.shard_map(swapped, mesh=comm.mesh, in_specs=(spec,) * 4, out_specs=(spec, spec)))
    args = shard(comm.mesh, xa, ia) + shard(comm.mesh, xb, ib)
    if getattr(comm.backend, "receives_in_order", False):
        with pytest.raises(RuntimeError, match="dispatch_send #1 of this Communicator is still open"):
            f.lower(*args)
        return
    g = jax.jit(jax.shard_map(one, mesh=comm.mesh, in_specs=(spec,) * 2, out_specs=spec))
    got_a, got_b = (np.asarray(v) for v in f(*args))
    np.testing.assert_array_equal(got_a, np.asarray(g(*args[:2])))
    np.testing.assert_array_equal(got_b, np.asarray(g(*args[2:])))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_handle_received_twice_is_refused(rng, backend):
    comm = make(backend, ranks_for(backend, 2))

    def body(x, i):
        h = comm.dispatch_send(x, i)
        return (comm.dispatch_recv(h).expert_x.sum() + comm.dispatch_recv(h).expert_x.sum())[None]

    f = jax.jit(jax.shard_map(body, mesh=comm.mesh, in_specs=(P("ep"),) * 2, out_specs=P("ep")))
    n, t = comm.num_ranks, comm.cfg.max_tokens
    x, i = shard(comm.mesh, np.ones((n * t, 128), jnp.bfloat16), np.zeros((n * t, 2), np.int32))
    with pytest.raises(RuntimeError, match="already received"):
        f.lower(x, i)
    run_all(comm, rng, 2, fp8=False)  # the refused trace left nothing behind


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("rounds", [2, 3])
def test_cuda_two_and_three_rounds(rng, n, fp8, rounds):
    """The pattern that hung on 2 GPUs: several rounds of one Communicator in one program, one-shot then split."""
    run_all(make("cuda", n, fp8=fp8), rng, rounds, fp8=fp8, micro=rounds)


@pytest.mark.parametrize("backend", ["xla", "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_handle_carried_through_a_loop_is_received_there(rng, backend):
    """Software pipelining: round i+1 is sent before round i's results are used, the handle carried by a scan; the
    receive inside the loop body closes the round opened outside it, so the layers after the loop are not refused."""
    comm = make(backend, 2)
    n, t, hidden = comm.num_ranks, comm.cfg.max_tokens, comm.cfg.hidden
    steps = 3
    x = rng.standard_normal((steps + 1, n * t, hidden)).astype(jnp.bfloat16)
    idx = np.stack([np.tile(np.arange(2, dtype=np.int32), (n * t, 1)) for _ in range(steps + 1)])

    def body(xs, ids):
        def step(h, i):
            d = comm.dispatch_recv(h)
            nxt = comm.dispatch_send(xs[i + 1], ids[i + 1])
            return nxt, d.expert_x.astype(jnp.float32).sum()

        for _ in range(5):  # five pipelined layers: more than any backend's buffers if their rounds stayed open
            h = comm.dispatch_send(xs[0], ids[0])
            h, sums = jax.lax.scan(step, h, jnp.arange(steps))
            last = comm.dispatch_recv(h).expert_x.astype(jnp.float32).sum()
        again = comm.dispatch(xs[0], ids[0]).expert_x.astype(jnp.float32).sum()  # a later layer: not refused
        return jnp.concatenate([sums, last[None], again[None]])[None]

    f = jax.jit(jax.shard_map(body, mesh=comm.mesh, in_specs=(P(None, "ep"), P(None, "ep")), out_specs=P("ep")))
    got = np.asarray(f(*[jax.device_put(a, NamedSharding(comm.mesh, P(None, "ep"))) for a in (x, idx)]))
    assert got.shape == (n, steps + 2) and np.isfinite(got).all()
    np.testing.assert_allclose(got[:, -1], got[:, 0], rtol=1e-6)  # round 0 and the later layer moved the same rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_micro_batches_in_flight_give_the_sequential_results(rng, backend):
    """Micro-batch B's dispatch sent before A's experts run, A's combine in flight while B's experts run (the schedule
    of `bench overlap --micro-batches`, one round per direction open at a time): bit-exact with A then B."""
    comm = make(backend, ranks_for(backend, 2), t=8)
    n, t = comm.num_ranks, comm.cfg.max_tokens
    x = rng.standard_normal((n * t, 128)).astype(jnp.bfloat16)
    idx = np.stack([rng.permutation(comm.cfg.num_experts)[:2] for _ in range(n * t)]).astype(np.int32)
    w = rng.random((n * t, 2)).astype(np.float32)

    def expert(rows):
        return (rows.astype(jnp.float32) * 1.5 + 0.25).astype(jnp.bfloat16)

    def sequential(x, i, w):
        h = t // 2
        return jnp.concatenate([comm.combine(expert(d.expert_x), None, d) for d in
                                (comm.dispatch(x[s:s + h], i[s:s + h], topk_weights=w[s:s + h]) for s in (0, h))])

    def two(x, i, w):
        h = t // 2
        da = comm.dispatch(x[:h], i[:h], topk_weights=w[:h])
        hb = comm.dispatch_send(x[h:], i[h:], topk_weights=w[h:])
        ya = expert(da.expert_x)
        db = comm.dispatch_recv(hb)
        ca = comm.combine_send(ya, da)
        yb = expert(db.expert_x)
        return jnp.concatenate([comm.combine_recv(ca), comm.combine(yb, None, db)])

    run = [jax.jit(jax.shard_map(f, mesh=comm.mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
           for f in (sequential, two)]
    args = [jax.device_put(a, NamedSharding(comm.mesh, P("ep"))) for a in (x, idx, w)]
    want, got = (np.asarray(f(*args)) for f in run)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
