"""The native backends' shared set-up (jax_moe.backends.bootstrap) without a second process: the rank table, the
config fingerprint, and the key-value exchange against a stand-in for jax.distributed's client."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
from jax_moe.backends import bootstrap


def test_rank_table_numbers_ranks_over_the_ep_axes_and_groups_over_the_others():
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"), devices=jax.devices("cpu")[:8])
    for axes in (("b",), ("c", "a"), ("a", "b", "c")):
        table = bootstrap.RankTable.of(mesh, axes)
        devices = np.asarray(mesh.devices)
        src = [mesh.axis_names.index(a) for a in axes]
        by_group = np.moveaxis(devices, src, list(range(3 - len(axes), 3))).reshape(-1, 2 ** len(axes))
        got = [[e.device_id for e in group] for group in table.groups()]
        assert got == [[int(d.id) for d in row] for row in by_group], axes
        assert [e.process for e in table.entries] == [0] * 8 and table.processes == (0,)
        assert table.local(0) == [e for group in table.groups() for e in group]


def _options(**changes) -> bootstrap.NativeOptions:
    base = dict(backend="cuda", comm_id=7, axes=("ep",), num_ranks=2, num_experts=8, local_experts=4,
                experts_per_token=2, hidden=128, max_tokens=4, x_itemsize=2, num_scales=0, y_itemsize=2,
                timeout_s=3.0, fabric_provider=None)
    return bootstrap.NativeOptions(**(base | changes))


def test_fingerprint_ignores_what_may_differ_between_processes():
    assert _options().fingerprint() == _options(comm_id=8, timeout_s=60.0).fingerprint()
    assert _options().fingerprint() != _options(max_tokens=8).fingerprint()
    comm = jax_moe.Communicator(jax_moe.MoEConfig(8, 2, 128, 4, dispatch_dtype=jnp.float8_e4m3fn),
                                jax.make_mesh((2,), ("ep",), devices=jax.devices("cpu")[:2]), backend="xla")
    o = bootstrap.NativeOptions.of(comm, "cpu", uses_fabric=True)
    assert (o.x_itemsize, o.num_scales, o.fabric_provider, o.comm_id) == (1, 1, comm.fabric_provider, comm.id)
    assert o.shape() == dict(num_ranks=2, num_experts=8, local_experts=4, experts_per_token=2, hidden=128,
                             max_tokens=4, x_itemsize=1, num_scales=1)


class FakeClient:
    """jax.distributed's key-value store, as far as the bootstrap uses it."""

    def __init__(self):
        self.kv: dict[str, bytes] = {}

    def key_value_set_bytes(self, key: str, value: bytes) -> None:
        assert key not in self.kv
        self.kv[key] = value

    def blocking_key_value_get_bytes(self, key: str, timeout_ms: int) -> bytes:
        if key not in self.kv:
            raise TimeoutError(f"{key} not set within {timeout_ms} ms")
        return self.kv[key]


def _two_processes() -> bootstrap.RankTable:
    return bootstrap.RankTable((bootstrap.RankEntry(0, 0, 0, 0, 0), bootstrap.RankEntry(1, 1, 0, 0, 1)))


def _publish(client: FakeClient, options: bootstrap.NativeOptions, process: int, record) -> None:
    client.kv[f"jax_moe/{options.backend}/{options.comm_id}/{process}"] = json.dumps(
        {"config": options.fingerprint(), "host": "peer-host", "record": record}).encode()


def test_exchange_reads_every_peer_and_refuses_another_config_at_once(monkeypatch):
    client = FakeClient()
    monkeypatch.setattr(bootstrap, "_client", lambda: client)
    table, options = _two_processes(), _options()
    _publish(client, options, 1, {"1": "abcd"})
    peers = bootstrap.exchange(options, table, lambda: {"0": "ef01"})
    assert peers.records == {1: {"1": "abcd"}} and peers.hosts[1] == "peer-host" and peers.hosts[0]
    assert json.loads(client.kv["jax_moe/cuda/7/0"])["record"] == {"0": "ef01"}

    client = FakeClient()
    monkeypatch.setattr(bootstrap, "_client", lambda: client)
    _publish(client, _options(max_tokens=8), 1, {})
    with pytest.raises(ValueError, match=r"process 1 built it with another config \(max_tokens: 8 there, 4 here\)"):
        bootstrap.exchange(options, table, lambda: {})


def test_one_process_needs_no_key_value_store(monkeypatch):
    monkeypatch.setattr(bootstrap, "_client", lambda: pytest.fail("no exchange within one process"))
    table = bootstrap.RankTable((bootstrap.RankEntry(0, 0, 0, 0, 0), bootstrap.RankEntry(1, 0, 1, 0, 1)))
    peers = bootstrap.exchange(_options(), table, lambda: pytest.fail("no record within one process"))
    assert peers.records == {} and len(peers.hosts) == 1


def test_nodes_are_hosts_unless_ranks_per_node_forces_blocks():
    group = [bootstrap.RankEntry(i, process=p, local_id=0, group=0, rank=i) for i, p in enumerate([0, 0, 1, 2])]
    hosts = ["a", "b", "a"]  # processes 0 and 2 share a host
    assert bootstrap.nodes(group, hosts, None) == [0, 0, 1, 0]
    assert bootstrap.nodes(group, hosts, 1) == [0, 1, 2, 3]
    assert bootstrap.nodes(group, hosts, 2) == [0, 0, 1, 1]
    assert _options().fingerprint() != _options(ranks_per_node=1).fingerprint()


def test_ranks_per_node_must_divide_the_ranks(monkeypatch):
    mesh = jax.make_mesh((4,), ("ep",), devices=jax.devices("cpu")[:4])
    cfg = jax_moe.MoEConfig(8, 2, 128, 4)
    assert jax_moe.Communicator(cfg, mesh, backend="xla", ranks_per_node=2).ranks_per_node == 2
    for bad in (0, 3, -1, 1.5, True):
        with pytest.raises(ValueError, match="ranks_per_node"):
            jax_moe.Communicator(cfg, mesh, backend="xla", ranks_per_node=bad)
    monkeypatch.setenv("JAX_MOE_RANKS_PER_NODE", "x")
    with pytest.raises(ValueError, match="JAX_MOE_RANKS_PER_NODE"):
        jax_moe.Communicator(cfg, mesh, backend="xla")
    monkeypatch.setenv("JAX_MOE_RANKS_PER_NODE", "4")
    assert jax_moe.Communicator(cfg, mesh, backend="xla").ranks_per_node == 4
