"""`python -m jax_moe.bench pump`: round trip through the GPU proxy path (src/proxy/pump.h) on localhost.

Two processes, each a rank whose main thread plays the GPU: rank 0 writes a region of `size` bytes into its send
area and rings; its pump posts it; rank 1's pump counts the arrival and raises the flag; rank 1's "GPU" sees it,
frees the lane and answers with its own region the same way. Rank 0's clock runs from its ring to the flag of the
answer: everything a GPU rank's round trip through two proxies costs, without the kernels. libfabric's own
`fi_pingpong -e rdm` runs in the same sitting as the reference (usec/xfer).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from jax_moe.bench.fabric import _fetch, _publish, fi_pingpong_us, run_workers

LANES, T, HIDDEN, WAIT = 4, 16, 64, 30.0


def _spin(pr, word: int, value: int) -> None:
    from jax_moe import _core

    end = time.monotonic() + WAIT
    while pr.bell(word) < value:
        if pr.bell(_core.proxy_testing.ERROR) or time.monotonic() > end:
            raise RuntimeError(f"bench pump: {pr.error() or 'no progress'}")


def _worker(d: str, rank: int, provider: str, size: int, warmup: int, iters: int, own_thread: bool) -> None:
    from jax_moe import _core

    pt = _core.proxy_testing
    pr = pt.PumpRank(provider, rank, 2, LANES, T, HIDDEN, 1, WAIT, busy_poll=True)  # a GPU's proxy spins
    size = min(size, pr.region_bytes)
    _publish(d, f"addr.{rank}", pr.address())
    _publish(d, f"desc.{rank}", pr.descriptor())
    other = 1 - rank
    pr.connect([(_fetch(d, f"addr.{other}"), _fetch(d, f"desc.{other}"))])
    pr.start(own_thread=own_thread)
    payload = bytes(np.random.default_rng(rank).integers(0, 256, size, dtype=np.uint8))
    times = []
    for k in range(1, warmup + iters + 1):
        if rank == 1:
            _spin(pr, pt.ARRIVED, k)
            pr.ring(pt.READ, k)
        _spin(pr, pt.SENT, k - LANES)
        pr.write_region(k, other, payload)
        pr.set_bytes(k, other, size)
        t0 = time.perf_counter()
        pr.ring(pt.RUNG, k)
        if rank == 0:
            _spin(pr, pt.ARRIVED, k)
            t1 = time.perf_counter()
            pr.ring(pt.READ, k)
            if k > warmup:
                times.append(t1 - t0)
    if rank == 0:
        t = np.array(times) * 1e6
        _publish(d, "results", json.dumps({"size": size, "rounds": iters, "p50_us": float(np.percentile(t, 50)),
                                           "p99_us": float(np.percentile(t, 99))}).encode())
    else:
        _fetch(d, "results", 120)  # keep the endpoint alive until rank 0 is done
    pr.close()


def _run(provider: str, size: int, warmup: int, iters: int, timeout: float, own_thread: bool) -> dict:
    args = [provider, str(size), str(warmup), str(iters), str(int(own_thread))]
    return run_workers("jax_moe.bench.pump", [[str(r)] + args for r in range(2)], f"bench pump ({provider})", timeout)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        d, rank, provider, size, warmup, iters, own_thread = argv[1:8]
        _worker(d, int(rank), provider, int(size), int(warmup), int(iters), own_thread == "1")
        return 0
    ap = argparse.ArgumentParser(prog="python -m jax_moe.bench pump", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--providers", default="tcp,shm", help="comma-separated libfabric providers")
    ap.add_argument("--size", type=int, default=64, help="bytes per region")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--timeout", type=float, default=300.0, help="per provider, seconds")
    ap.add_argument("--own-thread", action="store_true",
                    help="run each pump on a thread of its own instead of the engine's progress thread")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    print(f"proxy round trip: ring -> pump -> remote pump -> remote 'GPU' -> back ({os.cpu_count()} CPUs)")
    print(f"{'provider':<9}{'bytes':>7}{'rounds':>8}{'p50 us':>9}{'p99 us':>9}{'fi_pingpong us':>16}{'x':>8}")
    out = {}
    for provider in args.providers.split(","):
        res = _run(provider, args.size, args.warmup, args.iters, args.timeout, args.own_thread)
        ref = fi_pingpong_us(provider, res["size"])
        res["fi_pingpong_us"] = ref
        out[provider] = res
        ratio = f"{res['p50_us'] / ref:8.1f}" if ref else f"{'-':>8}"
        print(f"{provider:<9}{res['size']:>7}{res['rounds']:>8}{res['p50_us']:>9.1f}{res['p99_us']:>9.1f}"
              f"{(f'{ref:.1f}' if ref is not None else 'n/a'):>16}{ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
