"""TransferEngine in one process: input checking, errors, immediates, the pure helpers."""
import threading
import time

import numpy as np
import pytest

from support.fabric_mp import AVAILABLE

fabric = pytest.importorskip("jax_moe.fabric")
from jax_moe import _core  # noqa: E402

T = _core.fabric._testing
needs_tcp = pytest.mark.skipif("tcp" not in AVAILABLE, reason="libfabric tcp provider not available")


# --- pure helpers ---------------------------------------------------------------------------------

def test_imm_bit_layout():
    assert fabric.MAX_IMM == (1 << 32) - 1
    assert _core.fabric.MAX_PACKED_IMM == (1 << 20) - 1
    assert fabric.MAX_PEERS == 4096
    imm = T.imm_encode(4095, fabric.MAX_IMM)
    assert imm == 0xFFFFFFFF
    assert T.imm_decode(T.imm_encode(7, 12345)) == (7, 12345)


def test_descriptor_roundtrip_and_validation():
    d = T.descriptor_serialize(0xABC, 0x1000, 4096, 0, [11, 22])
    assert T.descriptor_parse(d) == {"owner": 0xABC, "base": 0x1000, "size": 4096, "flags": 0, "keys": [11, 22]}
    bad = bytearray(d)
    bad[0] ^= 1
    with pytest.raises(ValueError, match="magic"):
        T.descriptor_parse(bytes(bad))
    bad = bytearray(d)
    bad[4] = 9
    with pytest.raises(ValueError, match="version"):
        T.descriptor_parse(bytes(bad))
    with pytest.raises(ValueError, match="length"):
        T.descriptor_parse(d[:-1])
    with pytest.raises(ValueError, match="length"):
        T.descriptor_parse(d + b"\0")
    bad = bytearray(d)
    bad[24] ^= 1  # size field
    with pytest.raises(ValueError, match="checksum"):
        T.descriptor_parse(bytes(bad))
    with pytest.raises(ValueError, match="empty"):
        T.descriptor_parse(T.descriptor_serialize(1, 0x1000, 0, 0, [1]))
    with pytest.raises(ValueError, match="wraps"):
        T.descriptor_parse(T.descriptor_serialize(1, 2**64 - 10, 100, 0, [1]))
    with pytest.raises(ValueError, match="NIC count"):
        T.descriptor_parse(T.descriptor_serialize(1, 0x1000, 10, 0, []))


def test_imm_counter_banks_early_rounds():
    c = T.ImmCounter()
    # Round k+1 of peer 0 lands before round k of peer 1 was consumed.
    c.add(5, 0)
    c.add(5, 0)
    c.add(6, 1)
    assert c.banked(5) == 2
    ok, seen = c.wait(5, 3, 0.05)
    assert not ok and seen == {0: 2}
    c.add(5, 1)
    assert c.wait(5, 2, 1.0)[0]  # takes one from each source first
    assert c.banked(5) == 1
    ok, missing = c.wait_from(5, [0, 1], 0.05)
    assert not ok and missing == [1]  # peer 0's banked one is there, peer 1 owes one
    c.add(5, 1)
    assert c.wait_from(5, [0, 1], 1.0)[0]
    assert c.banked(5) == 0 and c.banked(6) == 1


def test_imm_counter_wakes_waiter():
    c = T.ImmCounter()
    result = {}
    th = threading.Thread(target=lambda: result.setdefault("r", c.wait(9, 2, 5.0)))
    th.start()
    time.sleep(0.05)
    c.add(9, 3)
    c.add(9, 4)
    th.join(5.0)
    assert result["r"][0]


# --- one process, two engines -----------------------------------------------------------------------

@pytest.fixture
def pair():
    if "tcp" not in AVAILABLE:
        pytest.skip("libfabric tcp provider not available")
    a, b = fabric.TransferEngine("tcp"), fabric.TransferEngine("tcp")
    yield a, b
    a.close()
    b.close()


def test_unknown_provider():
    with pytest.raises(ValueError, match="unknown provider"):
        fabric.TransferEngine("nope")
    with pytest.raises(ValueError):
        fabric.TransferEngine("tcp", num_nics=0)


def test_register_rejects_bad_arrays(pair):
    a, _ = pair
    with pytest.raises(ValueError, match="contiguous"):
        a.register(np.zeros((8, 8), np.float32)[:, ::2])
    ro = np.zeros(16, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        a.register(ro)
    with pytest.raises(ValueError, match="numpy"):
        a.register(bytearray(10))
    with pytest.raises(ValueError, match="empty"):
        a.register(np.zeros(0, np.uint8))
    with pytest.raises(ValueError):
        a.register_ptr(0, 10)
    mr = a.register(np.zeros((4, 4), np.float32))
    assert mr.nbytes == 64 and len(mr.descriptor()) == 52


def test_write_scatter_barrier_and_errors(pair):
    a, b = pair
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(8192, np.uint8)
    ma, mb = a.register(src), b.register(dst)
    p = a.connect(b.address(), 10)
    assert a.connect(b.address(), 10) == p  # idempotent
    q = b.connect(a.address(), 10)          # b already knows a from the handshake
    ps = a.peer_set([p], [mb.descriptor()])

    a.write(p, ma, 10, 100, mb.descriptor(), 500, imm=3)
    b.wait_imm(3, 1, 5)
    assert np.array_equal(dst[500:600], src[10:110])
    a.scatter(ps, ma, np.array([0]), np.array([4096]), np.array([4096]), 4)
    b.wait_imm(4, 1, 5)
    assert np.array_equal(dst[4096:], src)
    a.barrier(ps, 8)
    b.wait_imm(8, 1, 5)
    a.wait_sends(5)

    # Bad input never reaches the wire.
    with pytest.raises(ValueError, match="set has 1"):
        a.scatter(ps, ma, [0, 0], [1, 1], [0, 0], 1)
    with pytest.raises(ValueError, match="outside the remote region"):
        a.scatter(ps, ma, [0], [100], [8150], 1)
    with pytest.raises(ValueError, match="outside the source region"):
        a.scatter(ps, ma, [4000], [100], [0], 1)
    with pytest.raises(ValueError, match="negative"):
        a.scatter(ps, ma, [-1], [1], [0], 1)
    with pytest.raises(ValueError, match="integers"):
        a.scatter(ps, ma, [0.5], [1], [0], 1)
    with pytest.raises(ValueError, match="imm"):
        a.scatter(ps, ma, [0], [1], [0], a.max_imm + 1)
    with pytest.raises(ValueError, match="imm"):
        a.barrier(ps, -1)
    # Full 32-bit immediates (tcp carries 8 bytes of CQ data: the sender peer id rides in the upper half).
    assert a.max_imm == 0xFFFFFFFF
    a.barrier(ps, 0xFFFFFFFF)
    a.write(p, ma, 0, 1, mb.descriptor(), 0, imm=0x80000001)
    b.wait_imm(0xFFFFFFFF, 1, 5)
    b.wait_imm_from(0x80000001, [q], 5)
    with pytest.raises(ValueError, match="unknown peer set"):
        a.barrier(17, 1)
    with pytest.raises(ValueError, match="registered with this engine"):
        b.write(q, ma, 0, 1, a.register(np.zeros(8, np.uint8)).descriptor(), 0)
    with pytest.raises(ValueError, match="descriptors"):
        a.peer_set([p], [])
    with pytest.raises(ValueError, match="unknown peer"):
        a.peer_set([42], [mb.descriptor()])

    # Timeouts name the silent peer.
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=f"peer {q} "):
        b.wait_imm(77, 1, 0.2)
    assert time.monotonic() - t0 < 2
    with pytest.raises(TimeoutError, match="missing"):
        b.wait_imm_from(77, [q], 0.1)
    assert a.stats()["write_errors"] == 0

    # Non-blocking forms (what a proxy loop uses from C++).
    a.barrier(ps, 21)
    a.barrier(ps, 21)
    a.wait_sends(5)
    deadline = time.monotonic() + 5
    while b._eng.banked_imm(21) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not b._eng.try_consume_imm(21, 3)
    assert b._eng.try_consume_imm(21, 2) and b._eng.banked_imm(21) == 0
    assert a.sends_in_flight() == 0 and a.sends_in_flight(ps) == 0

    # Discarding a gone user's immediates: only the values that match, whatever their count.
    for imm in (0x105, 0x105, 0x205, 0x106):
        a.barrier(ps, imm)
    a.wait_sends(5)
    deadline = time.monotonic() + 5
    while ((b._eng.banked_imm(0x105), b._eng.banked_imm(0x205), b._eng.banked_imm(0x106)) != (2, 1, 1)
           and time.monotonic() < deadline):  # writes are not ordered: wait for each
        time.sleep(0.001)
    assert b.discard_imms(0xFF, 0x05) == 3
    assert b._eng.banked_imm(0x105) == 0 and b._eng.banked_imm(0x205) == 0 and b._eng.banked_imm(0x106) == 1
    assert b.discard_imms(0xFFFFFFFF, 0x106) == 1 and b.discard_imms(0, 0) == 0

    # A destroyed peer set is refused; another set of the same peer still works, and its id is new.
    ps2 = a.peer_set([p], [mb.descriptor()])
    assert ps2 != ps
    a.destroy_peer_set(ps)
    with pytest.raises(ValueError, match="unknown peer set"):
        a.barrier(ps, 1)
    with pytest.raises(ValueError, match="unknown peer set"):
        a._eng.sends_in_flight(ps)
    a.barrier(ps2, 22)
    b.wait_imm(22, 1, 5)


def test_connect_bad_address(pair):
    a, _ = pair
    with pytest.raises(ValueError, match="engine address"):
        a.connect(b"not an address", 1)
    with pytest.raises(ValueError):
        a.connect("str is not bytes", 1)


def test_closed_engine_raises(pair):
    a, _ = pair
    a.close()
    a.close()
    with pytest.raises(RuntimeError, match="closed"):
        a.address()
    with pytest.raises(RuntimeError, match="closed"):
        a.register(np.zeros(8, np.uint8))
    with pytest.raises(RuntimeError, match="closed"):
        a.wait_imm(1, 1, 0.1)


@needs_tcp
def test_bench_smoke(capsys):
    from jax_moe.bench import fabric as bench

    assert bench.main(["--providers", "tcp", "--peers", "2", "--sizes", "8K", "--warmup", "1", "--iters", "3",
                       "--timeout", "60"]) == 0
    assert "8 KB" in capsys.readouterr().out


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_connect_to_closed_engine_fails_in_time(provider):
    if provider not in AVAILABLE:
        pytest.skip(f"{provider} not available")
    a, b = fabric.TransferEngine(provider), fabric.TransferEngine(provider)
    addr = b.address()
    b.close()
    t0 = time.monotonic()
    with pytest.raises((TimeoutError, ConnectionError), match="peer"):
        a.connect(addr, 1.0)
    assert time.monotonic() - t0 < 3.0
    a.close()


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_engines_with_different_nic_counts(provider):
    """Engines with 1, 2 and 3 NICs scatter to each other (NIC i talks to the peer's NIC i % its count)."""
    if provider not in AVAILABLE:
        pytest.skip(f"{provider} not available")
    engs = [fabric.TransferEngine(provider, num_nics=k) for k in (1, 2, 3)]
    try:
        bufs = [np.zeros(3 * 4096, np.uint8) for _ in engs]
        srcs = [np.full(4096, i + 1, np.uint8) for i in range(3)]
        mrs = [e.register(b) for e, b in zip(engs, bufs)]
        msrc = [e.register(s) for e, s in zip(engs, srcs)]
        for i, e in enumerate(engs):
            others = [j for j in range(3) if j != i]
            ps = e.peer_set([e.connect(engs[j].address(), 10) for j in others], [mrs[j].descriptor() for j in others])
            e.scatter(ps, msrc[i], [0, 0], [4096, 4096], [i * 4096, i * 4096], 11)
        for i, e in enumerate(engs):
            e.wait_imm(11, 2, 10)
            e.wait_sends(10)
            for j in range(3):
                if j != i:
                    assert (bufs[i][j * 4096:(j + 1) * 4096] == j + 1).all(), (i, j)
        assert [len(e.stats()["imms_per_nic"]) for e in engs] == [1, 2, 3]
        assert engs[1].stats()["imms_per_nic"] == [1, 1]  # its two senders arrive on different NICs
    finally:
        for e in engs:
            e.close()


def test_concurrent_submitters_and_waiters(pair):
    """Several threads post and wait on one engine at once (the submission queue is shared)."""
    a, b = pair
    threads_n, per_thread, chunk = 4, 50, 256
    src = np.random.default_rng(1).integers(0, 256, threads_n * chunk, dtype=np.uint8)
    dst = np.zeros(threads_n * per_thread * chunk, np.uint8)
    ma, mb = a.register(src), b.register(dst)
    p = a.connect(b.address(), 10)
    q = b.connect(a.address(), 10)
    desc = mb.descriptor()
    ps = a.peer_set([p], [desc])
    errors = []

    def sender(t):
        try:
            for i in range(per_thread):
                off = (t * per_thread + i) * chunk
                if i % 2:
                    a.write(p, ma, t * chunk, chunk, desc, off, imm=1000 + t)
                else:
                    a.scatter(ps, ma, [t * chunk], [chunk], [off], 1000 + t)
            a.wait_sends(10)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def receiver(t):
        try:
            b.wait_imm_from(1000 + t, [q], 10) if t % 2 else b.wait_imm(1000 + t, per_thread, 10)
            if t % 2:
                b.wait_imm(1000 + t, per_thread - 1, 10)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=receiver, args=(t,)) for t in range(threads_n)]
    ts += [threading.Thread(target=sender, args=(t,)) for t in range(threads_n)]
    for th in ts:
        th.start()
    for th in ts:
        th.join(30)
    assert not any(th.is_alive() for th in ts)
    assert not errors, errors
    for t in range(threads_n):
        for i in range(per_thread):
            off = (t * per_thread + i) * chunk
            assert np.array_equal(dst[off:off + chunk], src[t * chunk:(t + 1) * chunk])


_STALE_SHM = """
import os
from jax_moe import fabric

pid = os.getpid()
# shm's default region names: <pid>:<uid>:<endpoint index>, the index counting from 0 in a fresh process.
stale = [f"/dev/shm/{pid}:{os.getuid()}:{i}" for i in range(2)]
made = [p for p in stale if not os.path.exists(p)]
try:
    for p in made:
        with open(p, "wb") as f:
            f.truncate(16 << 20)
    e = fabric.TransferEngine("shm", 2)
    assert f"fi_shm://{pid}:".encode() not in e.address(), e.address()
    e.close()
finally:
    for p in made:
        os.unlink(p)
print("opened")
"""


@pytest.mark.skipif("shm" not in AVAILABLE, reason="libfabric shm provider not available")
def test_shm_endpoint_opens_beside_a_stale_region_with_our_pid():
    """A process killed before closing its shm endpoint leaves /dev/shm/<pid>:...; a later process given the same pid
    must still open its endpoints (with shm's default names fi_enable failed with EBUSY, seen in CI). Run in a fresh
    process, whose endpoint indices start at 0 as a reused pid's would."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _STALE_SHM], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "opened" in p.stdout, p.stdout + p.stderr


def test_writes_of_a_destroyed_peer_set_are_dropped_not_posted(pair):
    """A peer set's user that goes (a Communicator of a shared engine) may free its memory once destroy_peer_set
    returns: its writes not yet posted are dropped, complete as done (no error for the engine's other users), and the
    engine goes on serving other sets."""
    a, b = pair
    ma, mb = a.register(np.zeros(1 << 16, np.uint8)), b.register(np.zeros(1 << 16, np.uint8))
    p = a.connect(b.address(), 5)
    rounds = 300
    for _ in range(rounds):
        ps = a.peer_set([p], [mb.descriptor()])
        a.scatter(ps, ma, [0], [4096], [0], 7)  # queued for the progress thread ...
        a.destroy_peer_set(ps)  # ... which, from now on, drops it instead of posting it
    deadline = time.monotonic() + 5
    while a.sends_in_flight() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert a.sends_in_flight() == 0 and a.stats()["write_errors"] == 0
    time.sleep(0.2)
    assert b._eng.banked_imm(7) < rounds  # most were never posted
    ps = a.peer_set([p], [mb.descriptor()])
    a.scatter(ps, ma, [0], [64], [0], 8)
    b.wait_imm(8, 1, 5)


@pytest.mark.skipif("shm" not in AVAILABLE, reason="libfabric shm provider not available")
@pytest.mark.parametrize("apart", ["default", "0"])
def test_shm_notice_follows_its_bytes(monkeypatch, apart):
    """shm: a write with a notice goes as its bytes, then a zero-byte notice once they completed, so that the sender
    copies them (ofi/notice_apart.h); the receiver finds every byte of the round when the notice arrives, whatever
    protocol shm picks for the size (inline, inject, CMA), round after round into the same place. A zero-byte barrier
    stays one write. JAX_MOE_FABRIC_NOTICE_APART=0 keeps the notice in the write."""
    if apart == "0":
        monkeypatch.setenv("JAX_MOE_FABRIC_NOTICE_APART", "0")
    else:
        monkeypatch.delenv("JAX_MOE_FABRIC_NOTICE_APART", raising=False)
    rng = np.random.default_rng()
    a, b = fabric.TransferEngine("shm"), fabric.TransferEngine("shm")
    try:
        size = 1 << 21
        src, dst = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
        ma, mb = a.register(src), b.register(dst)
        p = a.connect(b.address(), 10)
        ps = a.peer_set([p], [mb.descriptor()])
        writes = 0
        for round_ in range(40):
            n = int(rng.choice([1, 100, 4096, 4097, 65536, size]))
            src[:n] = rng.integers(0, 256, n, dtype=np.uint8)
            imm = 100 + round_
            if round_ % 2:
                a.write(p, ma, 0, n, mb.descriptor(), 0, imm=imm)
            else:
                a.scatter(ps, ma, [0], [n], [0], imm)
            writes += 1
            b.wait_imm(imm, 1, 10)
            assert np.array_equal(dst[:n], src[:n]), (round_, n)
            a.wait_sends(10)
        a.barrier(ps, 7)
        b.wait_imm(7, 1, 10)
        a.wait_sends(10)
        assert a.stats()["notices_apart"] == (writes if apart == "default" else 0)
        assert a.stats()["write_errors"] == 0 and b.stats()["notices_apart"] == 0
    finally:
        a.close()
        b.close()


def test_tcp_keeps_the_notice_in_the_write(pair):
    a, b = pair
    src, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, np.uint8)
    ma, mb = a.register(src), b.register(dst)
    p = a.connect(b.address(), 10)
    a.write(p, ma, 0, 4096, mb.descriptor(), 0, imm=5)
    b.wait_imm(5, 1, 10)
    assert np.array_equal(dst, src) and a.stats()["notices_apart"] == 0
