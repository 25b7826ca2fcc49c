"""Backend "cuda" without a GPU: its set-up against a stand-in for jax_moe._core.cuda (what it allocates, connects,
reports and frees) and the programs its halves trace to (FFI targets, attributes, shapes, gradients). The GPU suite
(tests/gpu/) runs the kernels; this keeps the Python side checked on every machine."""
from __future__ import annotations

import gc
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe
from jax_moe.backends import bootstrap
from jax_moe.backends.cuda import CudaBackend
from support.helpers import mesh_of


class FakeCuda:
    """Records what the backend asks of _core.cuda."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, *args))
            if name == "take_error":
                return "rank 1 timed out" if args[1] == 1 else ""  # (comm_id, ordinal)
            return {"export_buffer": b"\x01\x02", "buffer_bytes": 1000, "trace_shape": (2, 3),
                    "read_trace": np.zeros(6, np.uint64)}.get(name)

        return call


@pytest.fixture
def fake(monkeypatch):
    mod = FakeCuda()
    monkeypatch.setattr(CudaBackend, "module", classmethod(lambda cls: mod))
    monkeypatch.setattr(CudaBackend, "register_targets", classmethod(lambda cls: None))
    return mod


def cuda_comm(n: int, cfg=None) -> jax_moe.Communicator:
    """A Communicator over n CPU devices whose backend is "cuda" (built as on GPUs; its calls only trace here)."""
    comm = jax_moe.Communicator(cfg or jax_moe.MoEConfig(4 * n, 2, 128, 4), mesh_of(n), "ep", backend="xla")
    comm.platform = "gpu"
    comm.backend = CudaBackend(comm)
    return comm


def test_set_up_report_and_teardown(fake):
    comm = cuda_comm(2)
    gid = comm.id
    assert [c[0] for c in fake.calls] == ["create_comm", "connect", "connect"]
    create = fake.calls[0]
    assert create[1:10] == (gid, 2, 4, 2, 4, 128, 2, 0, 2) and create[10] == [(0, 0), (1, 1)]
    assert create[11] == comm.timeout_s
    assert [c[2] for c in fake.calls[1:]] == [0, 1]  # one connect per local GPU, peers in rank order
    assert [s[:4] for s in fake.calls[1][3]] == [(0, 0, -1, b""), (1, 1, 1, b"")]
    assert comm.bytes_allocated == 2000 and comm.errors() == ["rank 1 timed out"]
    assert set(comm.backend.read_trace()) == {0, 1}
    fake.calls.clear()
    del comm
    gc.collect()
    assert fake.calls == [("destroy_comm", gid)]


def test_a_failed_set_up_frees_what_it_allocated(fake, monkeypatch):
    monkeypatch.setattr(CudaBackend, "_connect", lambda self, peers: (_ for _ in ()).throw(RuntimeError("peer")))
    with pytest.raises(RuntimeError, match="peer"):
        cuda_comm(2)
    gc.collect()
    assert [c[0] for c in fake.calls] == ["create_comm", "destroy_comm"]


def test_config_checks_come_before_any_allocation(fake):
    with pytest.raises(ValueError, match="multiple of 16"):
        cuda_comm(1, jax_moe.MoEConfig(4, 2, 36, 4))
    assert fake.calls == []


def specs(comm, *shapes) -> list[jax.ShapeDtypeStruct]:
    """Abstract per-rank-sharded arguments of the given (shape, dtype)."""
    sharding = NamedSharding(comm.mesh, P("ep"))
    return [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes]


def ffi_calls(jaxpr) -> list[dict]:
    """The jax_moe FFI calls of a jaxpr and the jaxprs nested in it, in order: target, attributes, result shapes."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "jax_moe_call":
            out.append(dict(eqn.params["attrs"], target=eqn.params["target"],
                            shapes=[tuple(a.shape) for a in eqn.params["result_avals"]]))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                if hasattr(sub, "eqns"):
                    out += ffi_calls(sub)
    return out


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_halves_trace_to_the_cuda_handlers(fake, monkeypatch, fp8):
    monkeypatch.setenv("JAX_MOE_CUDA_COMMAND_BUFFERS", "1" if fp8 else "0")
    n, t = 2, 4
    cfg = jax_moe.MoEConfig(8, 2, 128, t, dispatch_dtype=jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
    comm = cuda_comm(n, cfg)
    m, suffix = comm.max_recv_rows, "_graph" if fp8 else ""

    def body(x, s, idx, w):
        d = comm.dispatch_recv(comm.dispatch_send(x, idx, x_scale=s if fp8 else None))
        return comm.combine_recv(comm.combine_send(d.expert_x.astype(jnp.bfloat16), d), w)

    def one_shot(x, s, idx, w):
        d = comm.dispatch(x, idx, x_scale=s if fp8 else None)
        return comm.combine(d.expert_x.astype(jnp.bfloat16), w, d)

    args = specs(comm, ((n * t, 128), cfg.dispatch_dtype), ((n * t, 1), jnp.float32), ((n * t, 2), jnp.int32),
                 ((n * t, 2), jnp.float32))
    trace = lambda fn: ffi_calls(jax.make_jaxpr(jax.shard_map(fn, mesh=comm.mesh, in_specs=(P("ep"),) * 4,
                                                              out_specs=P("ep")))(*args).jaxpr)
    calls = trace(body)
    assert [c["target"] for c in calls] == [f"jax_moe_cuda_{h}{suffix}" for h in
                                            ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")]
    assert all(c["comm_id"] == comm.id for c in calls)
    assert calls[0]["has_scale"] == fp8 and calls[1]["has_scale"] == fp8
    route = m + 2 + comm.cfg.num_experts + n + 2 * n * t * 2  # + tokens per sender, the (sender, entry) row table, weights
    assert calls[1]["shapes"] == [(m, 128), (m, 1) if fp8 else (1, 1), (comm.num_local_experts,), (route,)]
    assert calls[2]["channel"] == 0 and calls[3]["channel"] == 0 and calls[3]["shapes"] == [(t, 128)]
    assert not calls[0]["has_weights"] and calls[2]["mode"] == 0 and calls[3]["mode"] == 0  # weights at combine
    assert calls[1]["padding"] == 0  # padding rows are not written
    # The one-shot calls run both halves from one handler each (no gap between two custom calls).
    fused = trace(one_shot)
    assert [c["target"] for c in fused] == [f"jax_moe_cuda_{h}{suffix}" for h in ("dispatch", "combine")]
    assert fused[0]["shapes"] == [(4,)] + calls[1]["shapes"] and fused[1]["shapes"] == [(4,), (t, 128)]
    assert fused[1]["mode"] == 0 and fused[0]["has_scale"] == fp8
    monkeypatch.setenv("JAX_MOE_CUDA_FUSE_ONE_SHOT", "0")
    assert [c["target"] for c in trace(one_shot)] == [c["target"] for c in calls]


def test_weights_at_dispatch_trace_the_summed_combine(fake):
    """Weights given to dispatch travel with the tokens: combine_send sums a token's rows at the expert rank (mode 1)
    and the transpose of dispatch always does, with unit weights (mode 2, channel 1)."""
    comm = cuda_comm(2)

    def loss(x, idx, w):
        d = comm.dispatch(x, idx, topk_weights=w)
        return jax.lax.psum(jnp.sum(comm.combine(d.expert_x, None, d).astype(jnp.float32)), "ep")

    f = jax.grad(jax.shard_map(loss, mesh=comm.mesh, in_specs=(P("ep"),) * 3, out_specs=P()), argnums=(0, 2))
    args = specs(comm, ((8, 128), jnp.bfloat16), ((8, 2), jnp.int32), ((8, 2), jnp.float32))
    calls = ffi_calls(jax.make_jaxpr(f)(*args).jaxpr)
    sends = [c for c in calls if c["target"].startswith("jax_moe_cuda_dispatch")]
    combines = [(c["channel"], c["mode"]) for c in calls if c["target"].startswith("jax_moe_cuda_combine")]
    assert sends and all(c["has_weights"] for c in sends)
    assert (0, 1) in combines and (1, 2) in combines and (0, 0) not in combines, combines


def test_gradients_trace_dispatch_backward_on_channel_1(fake):
    comm = cuda_comm(2)

    def loss(x, idx, w):
        d = comm.dispatch(x, idx)
        return jax.lax.psum(jnp.sum(comm.combine(d.expert_x, w, d).astype(jnp.float32)), "ep")

    f = jax.grad(jax.shard_map(loss, mesh=comm.mesh, in_specs=(P("ep"),) * 3, out_specs=P()), argnums=(0, 2))
    args = specs(comm, ((8, 128), jnp.bfloat16), ((8, 2), jnp.int32), ((8, 2), jnp.float32))
    calls = ffi_calls(jax.make_jaxpr(f)(*args).jaxpr)
    channels = [(c["target"].removeprefix("jax_moe_cuda_"), c.get("channel")) for c in calls]
    assert ("combine", 1) in channels  # both halves in one call, as the one-shot forward's
    assert channels.count(("combine", 0)) == 1  # the forward's; combine's backward runs the reference maps


def test_cuda_peers_from_the_exchange(monkeypatch):
    """What backend "cuda" hands _core.cuda.connect: itself, local GPUs by ordinal, other processes' GPUs by the
    IPC handle they published, ranks of other nodes as remote (then their fabric endpoints are exchanged and
    connected); a node spanning two hosts is refused."""
    connected, fabric = [], []
    backend = object.__new__(CudaBackend)
    backend.native_id = 7
    backend.options = SimpleNamespace(ranks_per_node=None, fabric_provider="tcp", fabric_memory="host")
    opened = []
    backend._mod = SimpleNamespace(
        connect=lambda *a: connected.append(a),
        open_fabric=lambda gid, ordinal, provider, memory, held, nodes: (
            opened.append((memory, held, nodes)) or (b"addr%d" % ordinal, [b"d0", b"d1", b"d2"])),
        connect_fabric=lambda *a: fabric.append(a),
        fabric_info=lambda gid, ordinal: {"staged": staged})
    staged = False
    backend.table = bootstrap.RankTable((bootstrap.RankEntry(10, 0, 0, 0, 0), bootstrap.RankEntry(11, 0, 1, 0, 1),
                                         bootstrap.RankEntry(12, 1, 0, 0, 2)))
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    monkeypatch.setattr("socket.gethostname", lambda: "here")
    backend._connect(bootstrap.Peers(["here", "here"], {1: {"12": b"ipc".hex()}}))
    assert [(gid, ordinal, [spec[:4] for spec in specs]) for gid, ordinal, specs in connected] == [
        (7, 0, [(0, 0, -1, b""), (1, 1, 1, b""), (2, 2, -1, b"ipc")]),
        (7, 1, [(0, 1, 0, b""), (1, 0, -1, b""), (2, 2, -1, b"ipc")])]
    assert connected[0][2][2][4] == "process 1 on host here, GPU 0"
    assert fabric == []
    # Rank 2 on another host: another node, reached through the proxy.
    published = {1: {"12": ["aa", ["01", "02", "03"]]}}
    stages = []
    monkeypatch.setattr(bootstrap, "exchange",
                        lambda options, table, record, stage="": stages.append((stage, record()))
                        or bootstrap.Peers([], published))
    monkeypatch.setattr(bootstrap, "barrier", lambda options, name: stages.append((name, None)))
    connected.clear()
    backend._connect(bootstrap.Peers(["here", "there"], {1: {"12": b"ipc".hex()}}))
    assert [[spec[:2] for spec in specs] for _, _, specs in connected] == [[(0, 0), (1, 1), (2, 3)],
                                                                           [(0, 1), (1, 0), (2, 3)]]
    assert connected[0][2][2][4] == "process 1 on host there, GPU 0, node 1"
    # each GPU's fabric opened with the Communicator's fabric_memory; held: the plain handlers (no command buffers);
    # every rank's node, so that the areas hold regions for the ranks on other nodes only
    assert opened == [("host", True, [0, 0, 1]), ("host", True, [0, 0, 1])]
    assert stages[0] == ("fabric", {"10": [b"addr0".hex(), ["6430", "6431", "6432"]],
                                    "11": [b"addr1".hex(), ["6430", "6431", "6432"]]})
    assert stages[1] == ("fabric", None)
    assert fabric == [(7, 0, [(2, b"\xaa", [b"\x01", b"\x02", b"\x03"])]),
                      (7, 1, [(2, b"\xaa", [b"\x01", b"\x02", b"\x03"])])]
    # Command-buffer handlers do not hold the host back: the fabric is opened unheld ("auto" then never stages).
    monkeypatch.setenv("JAX_MOE_CUDA_COMMAND_BUFFERS", "1")
    opened.clear()
    backend.options = SimpleNamespace(ranks_per_node=None, fabric_provider="tcp", fabric_memory="auto")
    backend._connect(bootstrap.Peers(["here", "there"], {1: {"12": b"ipc".hex()}}))
    assert opened == [("auto", False, [0, 0, 1]), ("auto", False, [0, 0, 1])] and not backend._auto_staged
    monkeypatch.delenv("JAX_MOE_CUDA_COMMAND_BUFFERS")
    opened.clear()
    staged = True  # held, and the native side chose staged: a later switch to command buffers is refused (below)
    backend._connect(bootstrap.Peers(["here", "there"], {1: {"12": b"ipc".hex()}}))
    assert opened == [("auto", True, [0, 0, 1]), ("auto", True, [0, 0, 1])] and backend._auto_staged
    # A forced node across two hosts cannot map its GPUs' memory.
    backend.options = SimpleNamespace(ranks_per_node=3, fabric_provider="tcp", fabric_memory="auto")
    with pytest.raises(ValueError, match="cannot map each other's memory"):
        backend._connect(bootstrap.Peers(["here", "there"], {1: {"12": b"ipc".hex()}}))


def test_the_record_a_process_publishes(fake):
    comm = cuda_comm(2)
    assert json.loads(json.dumps(comm.backend._record())) == {"0": "0102", "1": "0102"}


def test_command_buffers_set_after_auto_chose_staged_are_refused_at_trace_time(monkeypatch):
    """"auto" stages only for the plain handlers (they hold the host back): a Communicator whose "auto" chose staged
    areas refuses to trace a call once JAX_MOE_CUDA_COMMAND_BUFFERS=1 is set, naming the variable and the way out."""
    backend = object.__new__(CudaBackend)
    backend._auto_staged = True
    monkeypatch.setenv("JAX_MOE_CUDA_COMMAND_BUFFERS", "1")
    with pytest.raises(ValueError, match=r"COMMAND_BUFFERS=1 was set after .* staged areas .* fabric_memory=.host"):
        backend._call("dispatch_send", None)
    backend._auto_staged = False  # host areas (or staged asked for explicitly): the call goes on to the FFI
    monkeypatch.setattr("jax_moe.backends.native.NativeBackend._call", lambda self, name, results, *a, **k: name)
    assert backend._call("dispatch_send", None) == "dispatch_send"
