"""One rank of the GPU proxy path, with this process's main thread playing the GPU (tests/test_pump.py).

usage: pump_worker.py DIR RANK N PROVIDER ROUNDS MODE
MODE: ok (every round checked), kill (the last rank exits after round 2), forge (rank 1 announces more rows than a
region holds in round 2), overflow (rank 1's device announces more bytes than a region holds in round 2), shared (two
Communicators per rank, whose pumps share the rank's engine, rung in an order that changes every round), slow (the
device side's hooks say "not yet" 200 times a round before each post and each arrival flag, as a GPU's copy engine),
stuck (rank 0's arrival hook never says yes: its pump must stop, saying why). Ranks exchange engine addresses through
files in DIR; each writes DIR/result.RANK (JSON).
straggler (the ranks of $PUMP_STRAGGLER, comma-separated, read their first rounds, as many as $PUMP_STRAGGLER_READS
says for each (default 1), then hold their credits until the others have finished every round, which they can only
where a late receiver holds back its own regions and not the others'). In this mode every rank rings all its rounds
first, and the others start reading 0.5 s later.
$PUMP_NODES ("0,0,1,2": every rank's node; modes ok and slow): the buffers hold regions for the ranks on other nodes
only, as a GPU's do, and only those ranks exchange rounds (same-node ranks are the GPU's business over NVLink); the
result then also gives the regions per lane of this rank's receive buffer ("slots").
"""
import json
import os
import struct
import sys
import time

import numpy as np

from jax_moe import _core

MAGIC, COMM_ID, LANES, T, HIDDEN, TIMEOUT_S = 0x4A4D4F45, 7, 3, 16, 64, 5.0


def region(pr, round_, sender, dest, rows=None, comm=COMM_ID):
    """The region `sender` sends `dest` in `round_`: a real region header, then `rows` random bf16 rows."""
    rng = np.random.default_rng([round_, sender, dest, comm])
    real = int(rng.integers(0, T + 1))
    rows = real if rows is None else rows
    head = struct.pack("<IIqiiqii", MAGIC, comm, round_, sender, 0, 0, rows, 0) + struct.pack("<i", rows)
    head = head.ljust(pr.header_bytes, b"\0")
    return head + rng.integers(0, 256, real * 2 * HIDDEN, dtype=np.uint8).tobytes()


def wait(pr, word, value, what):
    deadline = time.monotonic() + 3 * TIMEOUT_S
    while pr.bell(word) < value:
        if pr.bell(_core.proxy_testing.ERROR):
            raise RuntimeError(pr.error())
        if time.monotonic() > deadline:
            raise RuntimeError(f"the pump never raised {what} {value}")
        time.sleep(0.0002)


def nodes_of(n):
    """Every rank's node from $PUMP_NODES, or [] (every rank its own node, a region per rank)."""
    nodes = [int(v) for v in os.environ.get("PUMP_NODES", "").split(",") if v]
    assert not nodes or len(nodes) == n, f"PUMP_NODES names {len(nodes)} nodes for {n} ranks"
    return nodes


def remote_ranks(rank, n, nodes):
    return [q for q in range(n) if q != rank and (not nodes or nodes[q] != nodes[rank])]


def check_arrivals(pr, k, rank, n, result, comm=COMM_ID, nodes=()):
    """Round k's regions from every remote rank: checked as the recv kernel checks them before it follows any count
    (a bad one is recorded), then compared with what the sender wrote."""
    for s in remote_ranks(rank, n, nodes):
        problem = pr.check_region(k, s)
        if problem:
            result["bad_regions"].append(problem)
            continue
        want = region(pr, k, s, rank, comm=comm)
        if pr.read_region(k, s, len(want)) != want:
            raise AssertionError(f"round {k}: the region from rank {s} of Communicator {comm} differs")


def save(d, rank, result):
    """DIR/result.RANK: what the test reads back."""
    with open(os.path.join(d, f"result.{rank}"), "w") as f:
        json.dump(result, f)


def exchange(d, rank, n, mine):
    """Publishes this rank's JSON-able `mine` in DIR and returns every other rank's, in rank order."""
    with open(os.path.join(d, f"addr.{rank}.tmp"), "w") as f:
        json.dump(mine, f)
    os.rename(os.path.join(d, f"addr.{rank}.tmp"), os.path.join(d, f"addr.{rank}"))
    theirs = []
    for q in range(n):
        if q == rank:
            continue
        path = os.path.join(d, f"addr.{q}")
        while not os.path.exists(path):
            time.sleep(0.01)
        with open(path) as f:
            theirs.append(json.load(f))
    return theirs


def main():
    d, rank, n, provider, rounds, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], \
        int(sys.argv[5]), sys.argv[6]
    pt = _core.proxy_testing
    if mode == "shared":
        return shared(d, rank, n, provider, rounds)
    nodes = nodes_of(n)
    remote = remote_ranks(rank, n, nodes)
    pr = pt.PumpRank(provider, rank, n, LANES, T, HIDDEN, COMM_ID, TIMEOUT_S, nodes=nodes)
    others = exchange(d, rank, n, [pr.address().hex(), pr.descriptor().hex()])  # every other rank's, in rank order
    pr.connect([(bytes.fromhex(a), bytes.fromhex(desc)) for q, (a, desc) in zip([q for q in range(n) if q != rank],
                                                                                 others) if q in remote])
    pr.start(not_ready={"slow": 200, "stuck": -1 if rank == 0 else 0}.get(mode, 0))
    result = {"rank": rank, "rounds": 0, "error": "", "bad_regions": []}
    stragglers = [int(q) for q in os.environ.get("PUMP_STRAGGLER", "").split(",") if q] if mode == "straggler" else []
    reads = [int(q) for q in os.environ.get("PUMP_STRAGGLER_READS", "").split(",") if q] or [1] * len(stragglers)
    straggler = rank in stragglers
    assert mode != "straggler" or rounds <= 2 * LANES, "straggler mode rings every round before reading any"
    holds_after = reads[stragglers.index(rank)] if straggler else rounds
    if nodes:
        result["slots"] = pr.buffer_bytes // (LANES * pr.region_bytes)
    try:
        for k in range(1, rounds + 1):
            if mode == "kill" and rank == n - 1 and k == 3:
                wait(pr, pt.SENT, k - 1, "sent")  # its round 2 has left (so the others fail at round 3, not 2)
                os._exit(0)  # dies without a word: the others must fail within the timeout, naming it
            wait(pr, pt.SENT, k - LANES, "sent")  # the send lane of round k is free again
            for p in remote:
                forged = mode == "forge" and rank == 1 and k == 2
                data = region(pr, k, rank, p, rows=T + 5 if forged else None)
                pr.write_region(k, p, data)
                overflow = mode == "overflow" and rank == 1 and k == 2
                pr.set_bytes(k, p, pr.region_bytes + 64 if overflow else len(data))
            pr.ring(pt.RUNG, k)
            if mode == "straggler":
                continue  # every round rung first, read below (so at most 2 * LANES rounds: no credit comes before)
            receive(pr, k, rank, n, result, nodes)
        if mode == "straggler":
            if not straggler:
                time.sleep(0.5)  # the stragglers' last credits come first: their pumps settle while we give none
            for k in range(1, holds_after + 1):
                receive(pr, k, rank, n, result, nodes)
        if mode == "straggler" and not straggler:  # every round, but not to the straggler past round 1 + LANES
            result["sent"] = pr.bell(pt.SENT)
        if straggler:  # the others must finish without our credits for the rounds after holds_after
            others_done(d, rank, n, deadline=time.monotonic() + 3 * TIMEOUT_S, skip=stragglers)
            for k in range(holds_after + 1, rounds + 1):
                receive(pr, k, rank, n, result, nodes)
    except RuntimeError as e:
        result["error"] = str(e)
    save(d, rank, result)
    if mode == "overflow" and rank == 1:
        # Stay connected until the others have given up: a closed endpoint would fail their round-2 writes
        # ("broken pipe") before their timeout names this rank, and which comes first would be a race.
        others_done(d, rank, n, deadline=time.monotonic() + 30.0)
    pr.close()


def receive(pr, k, rank, n, result, nodes):
    """As the recv kernel: wait for round k's arrival, check it, give the credit; count it done."""
    wait(pr, _core.proxy_testing.ARRIVED, k, "arrived")
    check_arrivals(pr, k, rank, n, result, nodes=nodes)
    pr.ring(_core.proxy_testing.READ, k)
    result["rounds"] = k


def others_done(d, rank, n, deadline, skip=()):
    while time.monotonic() < deadline and not all(os.path.exists(os.path.join(d, f"result.{q}"))
                                                  for q in range(n) if q != rank and q not in skip):
        time.sleep(0.01)


def shared(d, rank, n, provider, rounds):
    """Two Communicators (ids 7 and 8) per rank on one engine: two pumps as two hooks of its progress thread, each
    counting only its own arrivals and writes."""
    pt = _core.proxy_testing
    comms = [COMM_ID, COMM_ID + 1]
    prs = [pt.PumpRank(provider, rank, n, LANES, T, HIDDEN, comms[0], TIMEOUT_S)]
    prs.append(pt.PumpRank(provider, rank, n, LANES, T, HIDDEN, comms[1], TIMEOUT_S, share_engine_of=prs[0]))
    assert prs[0].address() == prs[1].address()
    peers = exchange(d, rank, n, [prs[0].address().hex()] + [pr.descriptor().hex() for pr in prs])
    for i, pr in enumerate(prs):
        pr.connect([(bytes.fromhex(a), bytes.fromhex(descs[i])) for a, *descs in peers])
        pr.start()
    result = {"rank": rank, "rounds": 0, "error": "", "bad_regions": []}
    try:
        for k in range(1, rounds + 1):
            order = [0, 1] if (k + rank) % 2 else [1, 0]
            for i in order:
                pr = prs[i]
                wait(pr, pt.SENT, k - LANES, "sent")
                for p in range(n):
                    if p != rank:
                        data = region(pr, k, rank, p, comm=comms[i])
                        pr.write_region(k, p, data)
                        pr.set_bytes(k, p, len(data))
                pr.ring(pt.RUNG, k)
            for i in reversed(order):
                pr = prs[i]
                wait(pr, pt.ARRIVED, k, "arrived")
                check_arrivals(pr, k, rank, n, result, comm=comms[i])
                pr.ring(pt.READ, k)
            result["rounds"] = k
    except RuntimeError as e:
        result["error"] = str(e)
    save(d, rank, result)
    prs[1].close()
    prs[0].close()


if __name__ == "__main__":
    main()
