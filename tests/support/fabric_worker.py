"""One process of a multi-process fabric test (run by fabric_mp.run_world; not collected by pytest).

usage: fabric_worker.py <dir> <rank> <world> <provider> <num_nics> <scenario> [rounds]
Addresses and descriptors are exchanged through files in <dir>; the result goes to <dir>/result.<rank>
as JSON. Every wait is bounded; any failure exits non-zero with the traceback on stderr.
"""
import json
import os
import signal
import struct
import sys
import time
import traceback

import numpy as np

from jax_moe import fabric

SLOT = 1 << 20          # receive slot per (parity, sender)
SEND_BYTES = 4 << 20    # send buffer
GUARD = 64 << 10        # unregistered bytes after the receive region: must stay zero
WAIT = 20.0             # generous per-wait bound; the parent enforces the overall deadline


def publish(d, name, data: bytes):
    tmp = os.path.join(d, f".{name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.rename(tmp, os.path.join(d, name))


def fetch(d, name, timeout=30.0):
    path = os.path.join(d, name)
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{name} never appeared")
        time.sleep(0.01)
    with open(path, "rb") as f:
        return f.read()


def send_pattern(rank):
    return np.random.default_rng(1000 + rank).integers(0, 256, SEND_BYTES, dtype=np.uint8)


def plan(sender, receiver, rnd, big):
    """Length, source offset and offset inside the receiver's slot of one write (both sides agree)."""
    rng = np.random.default_rng([sender, receiver, rnd])
    maxlen = SLOT if big else 24 << 10
    length = int(rng.integers(0, maxlen)) if rnd % 7 else 0  # every 7th round: zero-length writes
    src = int(rng.integers(0, SEND_BYTES - length + 1))
    dst = int(rng.integers(0, SLOT - length + 1))
    return length, src, dst


class World:
    def __init__(self, d, rank, n, provider, num_nics):
        self.d, self.rank, self.n = d, rank, n
        self.eng = fabric.TransferEngine(provider, num_nics)
        self.recv_all = np.zeros(2 * n * SLOT + GUARD, np.uint8)
        self.recv = self.recv_all[:-GUARD]
        self.send = send_pattern(rank)
        self.mr_recv = self.eng.register(self.recv)
        self.mr_send = self.eng.register(self.send)
        publish(d, f"addr.{rank}", self.eng.address())
        publish(d, f"desc.{rank}", self.mr_recv.descriptor())
        self.others = [r for r in range(n) if r != rank]
        self.addr = {r: fetch(d, f"addr.{r}") for r in self.others}
        self.desc = {r: fetch(d, f"desc.{r}") for r in self.others}
        # Connect in a staggered order so both sides of a pair race through the handshake.
        self.peer = {r: self.eng.connect(self.addr[r], WAIT) for r in sorted(self.others, key=lambda r: (r - rank) % n)}
        self.peer_set = self.eng.peer_set([self.peer[r] for r in self.others], [self.desc[r] for r in self.others])

    def round(self, rnd, big=False, check=True):
        par = rnd % 2
        plans = [plan(self.rank, r, rnd, big) for r in self.others]
        lengths = np.array([p[0] for p in plans], np.int64)
        src = np.array([p[1] for p in plans], np.int64)
        dst = np.array([(par * self.n + self.rank) * SLOT + p[2] for p in plans], np.int64)
        imm = 0xC0DE0000 + rnd % 4  # full 32-bit values: the sender peer id travels beside them
        self.eng.scatter(self.peer_set, self.mr_send, src, lengths, dst, imm)
        self.eng.wait_imm(imm, self.n - 1, WAIT)
        if check:
            for r in self.others:
                length, s, o = plan(r, self.rank, rnd, big)
                base = (par * self.n + r) * SLOT + o
                got = self.recv[base:base + length]
                want = PATTERNS[r][s:s + length]
                if not np.array_equal(got, want):
                    bad = int(np.flatnonzero(got != want)[0])
                    raise AssertionError(f"round {rnd}: data from rank {r} differs at byte {bad} of {length}")

    def barrier(self, imm=999):
        self.eng.barrier(self.peer_set, imm)
        self.eng.wait_imm(imm, self.n - 1, WAIT)


PATTERNS = {}


def scenario_rounds(w, rounds):
    for r in range(w.n):
        PATTERNS[r] = send_pattern(r)
    t0 = time.monotonic()
    for rnd in range(4):
        w.round(rnd, big=True)
    w.barrier(990)
    for rnd in range(4, 4 + rounds):
        w.round(rnd)
    w.barrier()
    w.eng.wait_sends(WAIT)
    st = w.eng.stats()
    return {"seconds": time.monotonic() - t0, "stats": st, "guard_clean": bool(not w.recv_all[-GUARD:].any())}


def scenario_killed(w, rounds):
    for r in range(w.n):
        PATTERNS[r] = send_pattern(r)
    w.round(0)
    w.barrier()
    victim = 0  # first member of every survivor's peer set: its stuck writes must not hold back the others
    # The victim dies only once every survivor has its barrier message: our barrier returning says the
    # others' messages reached us, not that ours reached them (a kill right away once lost one over tcp).
    if w.rank == victim:
        w.eng.wait_sends(WAIT)
        for r in w.others:
            fetch(w.d, f"passed.{r}", WAIT)
        publish(w.d, f"finished.{victim}", b"1")
        os.kill(os.getpid(), signal.SIGKILL)
    publish(w.d, f"passed.{w.rank}", b"1")
    fetch(w.d, f"finished.{victim}", WAIT)
    time.sleep(0.5)  # let it die
    t0 = time.monotonic()
    out = {"victim_peer": w.peer[victim]}
    try:
        w.eng.scatter(w.peer_set, w.mr_send, np.zeros(w.n - 1, np.int64), np.full(w.n - 1, 1024, np.int64),
                      np.full(w.n - 1, w.rank * SLOT, np.int64), 55)
        w.eng.wait_imm(55, w.n - 1, 3.0)
        out["wait_imm"] = "ok"
    except Exception as e:  # noqa: BLE001 - the test inspects the type and message
        out["wait_imm"] = f"{type(e).__name__}: {e}"
    out["wait_imm_seconds"] = time.monotonic() - t0
    t1 = time.monotonic()
    try:
        w.eng.wait_sends(3.0)
        out["wait_sends"] = "ok"
    except Exception as e:  # noqa: BLE001
        out["wait_sends"] = f"{type(e).__name__}: {e}"
    out["wait_sends_seconds"] = time.monotonic() - t1
    return out


def fnv1a64(b: bytes) -> int:
    h = 1469598103934665603
    for x in b:
        h = ((h ^ x) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def reseal(body: bytes) -> bytes:
    return body + struct.pack("<Q", fnv1a64(body))


def scenario_forged(w, rounds):
    """Rank 0 tries forged descriptors against rank 1; rank 1 checks its memory stayed intact."""
    out = {}
    if w.rank == 0:
        real = w.desc[1]
        p1 = w.peer[1]

        def attempt(name, desc, fn="peer_set"):
            try:
                if fn == "peer_set":
                    w.eng.peer_set([p1], [desc])
                else:
                    w.eng.write(p1, w.mr_send, 0, 64, desc, 0, imm=5)
                out[name] = "accepted"
            except Exception as e:  # noqa: BLE001
                out[name] = f"{type(e).__name__}: {e}"

        corrupt = bytearray(real)
        corrupt[20] ^= 0xFF
        attempt("corrupt", bytes(corrupt))
        attempt("truncated", real[:-3])
        attempt("garbage", b"\x00" * len(real))
        attempt("other_owner", w.desc[2] if w.n > 2 else w.mr_recv.descriptor())
        attempt("write_corrupt", bytes(corrupt), fn="write")
        # Out of range against the genuine descriptor: rejected before posting.
        try:
            w.eng.write(p1, w.mr_send, 0, 4096, real, len(w.recv) - 100, imm=5)
            out["out_of_range"] = "accepted"
        except Exception as e:  # noqa: BLE001
            out["out_of_range"] = f"{type(e).__name__}: {e}"
        # Well-formed forgeries (valid checksum): a larger region, a shifted base, another key. Only the
        # owner knows they are false; the engine asks it before the first use.
        magic, ver, nics, owner, base, size, flags = struct.unpack_from("<IHHQQQI", real)
        keys = real[36:36 + 8 * nics]
        head = "<IHHQQQI"
        forgeries = {
            "oversized": struct.pack(head, magic, ver, nics, owner, base, size * 2, flags) + keys,
            "shifted": struct.pack(head, magic, ver, nics, owner, base + 4096, size, flags) + keys,
            "other_key": struct.pack(head, magic, ver, nics, owner, base, size, flags) + bytes(8 * nics),
        }
        for name, body in forgeries.items():
            try:
                w.eng.write(p1, w.mr_send, 0, 4096, reseal(body), size - 100 if name == "oversized" else 0, imm=6)
                w.eng.wait_sends(5.0)
                out[name] = "completed"
            except Exception as e:  # noqa: BLE001
                out[name] = f"{type(e).__name__}: {e}"
            try:
                w.eng.peer_set([p1], [reseal(body)])
                out[name + "_peer_set"] = "accepted"
            except Exception as e:  # noqa: BLE001
                out[name + "_peer_set"] = f"{type(e).__name__}: {e}"
        # The genuine descriptor still works after all that.
        w.eng.write(p1, w.mr_send, 0, 0, real, 0, imm=7)
        w.eng.wait_sends(5.0)
        out["genuine"] = "ok"
        publish(w.d, "forged.done", b"1")
    else:
        fetch(w.d, "forged.done", 60)
        if w.rank == 1:
            w.eng.wait_imm(7, 1, WAIT)  # the genuine zero-byte write arrived
    # Everyone: the registered region and the guard behind it were never written.
    out["recv_untouched"] = bool(not w.recv_all.any())
    return out


def main():
    d, rank, n, provider, num_nics, scenario = sys.argv[1:7]
    rounds = int(sys.argv[7]) if len(sys.argv) > 7 else 0
    rank, n, num_nics = int(rank), int(n), int(num_nics)
    try:
        w = World(d, rank, n, provider, num_nics)
        out = globals()[f"scenario_{scenario}"](w, rounds)
        publish(d, f"result.{rank}", json.dumps(out).encode())
        publish(d, f"finished.{rank}", b"1")
        # Stay alive until every rank finished, so late writes to us still have a target.
        for r in range(n):
            try:
                fetch(d, f"finished.{r}", 30)
            except TimeoutError:
                pass
        w.eng.close()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
