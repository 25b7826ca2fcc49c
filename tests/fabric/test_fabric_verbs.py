"""The ibverbs backend's device-independent logic: handshake encoding, WR templates, connection states.

No RDMA NIC is needed: these run the pure code the backend sequences its ibv_* calls around.
"""
import os

import pytest

_core = pytest.importorskip("jax_moe._core")
T = _core.fabric._testing
pytestmark = pytest.mark.skipif(not T.HAVE_VERBS, reason="built without libibverbs")

GID = bytes(range(16))


def test_ud_address_roundtrip_and_checks():
    raw = T.verbs_ud_address(GID, 7, 0x1234, 0x4A4D4F45, 1, 3)
    assert T.verbs_ud_address_parse(raw) == {"gid": GID, "lid": 7, "qpn": 0x1234, "qkey": 0x4A4D4F45,
                                             "port": 1, "gid_index": 3}
    with pytest.raises(ValueError, match="length"):
        T.verbs_ud_address_parse(raw + b"x")
    with pytest.raises(ValueError, match="magic"):
        T.verbs_ud_address_parse(b"\0" + raw[1:])
    with pytest.raises(ValueError, match="QP number"):
        T.verbs_ud_address_parse(T.verbs_ud_address(GID, 7, 1 << 24, 1, 1, 0))
    with pytest.raises(ValueError, match="QP number"):
        T.verbs_ud_address_parse(T.verbs_ud_address(GID, 7, 0, 1, 1, 0))


def test_connect_blob_roundtrip_and_checks():
    nics = [(0x11, 0x22, 0x33, 0x44, 3), (0xFFFFFF, 0, 1, 2, 5)]
    raw = T.verbs_blob(nics)
    assert T.verbs_blob_parse(raw) == nics
    bad = bytearray(raw)
    bad[10] ^= 0x40
    with pytest.raises(ValueError, match="checksum"):
        T.verbs_blob_parse(bytes(bad))
    with pytest.raises(ValueError, match="truncated"):
        T.verbs_blob_parse(raw[:-1])
    with pytest.raises(ValueError, match="24 bits"):
        T.verbs_blob_parse(T.verbs_blob([(1 << 24, 0, 1, 0, 3)]))
    with pytest.raises(ValueError, match="MTU"):
        T.verbs_blob_parse(T.verbs_blob([(1, 0, 1, 0, 9)]))
    with pytest.raises(ValueError, match="NIC count"):
        T.verbs_blob_parse(T.verbs_blob([]))


def test_write_template_single():
    (chain,) = T.verbs_write_chains(rkey=0xAB, remote_base=0x10000, lkey=0xCD, max_chunk=1 << 30, local=0x5000,
                                    length=4096, remote_offset=256, imm=0x00300007, wr_id=0x7770)
    (wr,) = chain
    assert wr["opcode"] == "write_imm" and wr["imm"] == 0x00300007
    assert (wr["addr"], wr["length"], wr["lkey"]) == (0x5000, 4096, 0xCD)
    assert (wr["remote_addr"], wr["rkey"]) == (0x10000 + 256, 0xAB)
    assert wr["signaled"] and wr["wr_id"] == 0x7770


def test_write_template_chunks_imm_on_last_only():
    posts = T.verbs_write_chains(rkey=1, remote_base=0x1000, lkey=2, max_chunk=100, local=0x9000, length=950,
                                 remote_offset=50, imm=5, wr_id=0x40)
    # 10 chunks of <= 100 bytes, at most 4 per chain -> 3 posts.
    assert [len(p) for p in posts] == [4, 4, 2]
    wrs = [w for p in posts for w in p]
    assert [w["length"] for w in wrs] == [100] * 9 + [50]
    assert [w["addr"] for w in wrs] == [0x9000 + 100 * i for i in range(10)]
    assert [w["remote_addr"] for w in wrs] == [0x1000 + 50 + 100 * i for i in range(10)]
    assert [w["opcode"] for w in wrs] == ["write"] * 9 + ["write_imm"]
    assert [w["signaled"] for w in wrs] == [False] * 9 + [True]  # one completion per write
    assert wrs[-1]["wr_id"] == 0x40 and wrs[-1]["imm"] == 5


def test_write_template_zero_length_and_no_imm():
    ((wr,),) = T.verbs_write_chains(1, 0x1000, 2, 1 << 30, 0x9000, 0, 0, 9, 0x10)
    assert wr["opcode"] == "write_imm" and wr["num_sge"] == 0 and wr["signaled"]
    ((wr,),) = T.verbs_write_chains(1, 0x1000, 2, 1 << 30, 0x9000, 64, 0, None, 0x10)
    assert wr["opcode"] == "write"


def test_template_chain_lengths():
    # 35 bytes in 10-byte chunks fill exactly one 4-WR chain; a short write needs one WR.
    first = T.verbs_write_chains(1, 0, 2, 10, 0, 35, 0, 3, 0x20)
    assert [len(p) for p in first] == [4]
    second = T.verbs_write_chains(1, 0, 2, 10, 0, 5, 0, None, 0x30)
    assert len(second) == 1 and len(second[0]) == 1 and second[0][0]["opcode"] == "write"


def test_rc_state_machine_connect_and_flush():
    c = T.RcConnection()
    assert c.state == "idle"
    assert not c.submit(1) and not c.submit(2)  # parked until connected
    a = c.create_local()
    assert a["create_local_qps"] and c.state == "local-ready"
    assert not c.create_local()["create_local_qps"]  # idempotent
    a = c.remote_info(0x10, 0x11)
    assert a["connect_qps"] and a["flush_parked"] and not a["create_local_qps"]
    assert c.state == "connected" and c.take_parked() == [1, 2]
    assert c.submit(3)  # posts directly now
    # A duplicate handshake (both sides connected at once) changes nothing.
    assert not any(c.remote_info(0x10, 0x11).values())
    # Different QPs from the same peer: it restarted; fail instead of mixing connections.
    c.remote_info(0x99, 0x11)
    assert c.state == "failed" and "restarted" in c.failure


def test_rc_state_remote_first_and_failure():
    c = T.RcConnection()
    a = c.remote_info(5, 6)  # the peer's hello arrived before we connected
    assert a["create_local_qps"] and a["connect_qps"] and c.state == "connected"
    d = T.RcConnection()
    d.submit(7)
    a = d.fail("timeout")
    assert a["fail_parked"] and d.state == "failed" and d.take_parked() == [7]
    assert not any(d.remote_info(1, 2).values())  # stays failed


@pytest.mark.skipif(os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband")),
                    reason="this host has an RDMA device")
def test_verbs_provider_without_device_is_unavailable():
    fabric = pytest.importorskip("jax_moe.fabric")
    with pytest.raises(RuntimeError, match="verbs"):
        fabric.TransferEngine("verbs")
