"""`python -m jax_moe.bench pump`: round trip through the GPU proxy path (src/proxy/pump.h) on localhost.

Two processes, each a rank whose main thread plays the GPU (a C++ loop: no interpreter on the measured path): rank 0 writes a region of `size` bytes into its send
area and rings; its pump posts it; rank 1's pump counts the arrival and raises the flag; rank 1's "GPU" sees it,
frees the lane and answers with its own region the same way. Rank 0's clock runs from its ring to the flag of the
answer: everything a GPU rank's round trip through two proxies costs, without the kernels. The pumps' and devices'
time stamps (one host clock) split each one-way trip into: bell -> the pump sees it, the post, post -> the other
pump flags the arrival, flag -> the device sees it. libfabric's own `fi_pingpong -e rdm` runs in the same sitting as
the reference: its usec/xfer is one way, so its round trip is twice that.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from jax_moe.bench.fabric import _fetch, _publish, fi_pingpong_us, run_workers

LANES, T, HIDDEN, WAIT = 4, 16, 64, 30.0


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
    before = np.array(pr.pass_profile(), np.float64)
    device = np.array(pr.ping_pong(other, size, warmup, iters, rank == 0), np.int64)  # (rung, seen) per round
    passes, ns, poll, hooks, post = np.array(pr.pass_profile(), np.float64) - before
    pump = np.array(pr.trace(warmup + iters), np.int64)[warmup:]  # (seen, posted, flagged) per round
    # The progress thread's passes during the run: how long one takes, and where it goes.
    profile = {"pass_ns": ns / max(passes, 1), "poll": poll / max(ns, 1), "hooks": hooks / max(ns, 1),
               "post": post / max(ns, 1)}
    mine = {"device": device.tolist(), "pump": pump.tolist(), "pass": profile}
    if rank == 1:
        _publish(d, "rank1", json.dumps(mine).encode())
        _fetch(d, "results", 120)  # keep the endpoint alive until rank 0 is done
    else:
        theirs = json.loads(_fetch(d, "rank1", 120))
        other_pass = theirs.pop("pass")
        theirs = {k: np.array(v, np.int64) for k, v in theirs.items()}
        _publish(d, "results", json.dumps({"size": size, "rounds": iters, "progress_pass": [profile, other_pass],
                                           **breakdown(device, pump, theirs)}).encode())
    pr.close()


def breakdown(dev0: np.ndarray, pump0: np.ndarray, other: dict) -> dict:
    """p50/p99 of the round trip and p50 of its steps, in us. Rank 0 rings round k, rank 1 answers it: each one-way
    trip is bell -> its pump sees it -> posted -> the other pump flags the arrival -> the other device sees the flag."""
    dev1, pump1 = other["device"], other["pump"]
    us = lambda a: np.asarray(a, np.float64) / 1e3  # noqa: E731
    rt = us(dev0[:, 1] - dev0[:, 0])
    steps = {
        "bell_to_proxy": np.concatenate([us(pump0[:, 0] - dev0[:, 0]), us(pump1[:, 0] - dev1[:, 0])]),
        "proxy_post": np.concatenate([us(pump0[:, 1] - pump0[:, 0]), us(pump1[:, 1] - pump1[:, 0])]),
        "post_to_remote_flag": np.concatenate([us(pump1[:, 2] - pump0[:, 1]), us(pump0[:, 2] - pump1[:, 1])]),
        "flag_to_device": np.concatenate([us(dev1[:, 1] - pump1[:, 2]), us(dev0[:, 1] - pump0[:, 2])]),
        "device_turnaround": us(dev1[:, 0] - dev1[:, 1]),
    }
    return {"p50_us": float(np.percentile(rt, 50)), "p99_us": float(np.percentile(rt, 99)),
            "steps_p50_us": {k: float(np.percentile(v, 50)) for k, v in steps.items()}}


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
    print(f"{'provider':<9}{'bytes':>7}{'rounds':>8}{'p50 us':>9}{'p99 us':>9}{'fi_pingpong RT us':>19}{'x':>7}"
          f"  steps, p50 us: bell->proxy, post, post->remote flag, flag->device (per one-way trip)")
    out = {}
    for provider in args.providers.split(","):
        res = _run(provider, args.size, args.warmup, args.iters, args.timeout, args.own_thread)
        xfer = fi_pingpong_us(provider, res["size"])
        ref = None if xfer is None else 2 * xfer  # its usec/xfer is one way: a round trip is two transfers
        res["fi_pingpong_us_per_xfer"] = xfer
        res["fi_pingpong_round_trip_us"] = ref
        out[provider] = res
        ratio = f"{res['p50_us'] / ref:7.1f}" if ref else f"{'-':>7}"
        st = res["steps_p50_us"]
        print(f"{provider:<9}{res['size']:>7}{res['rounds']:>8}{res['p50_us']:>9.1f}{res['p99_us']:>9.1f}"
              f"{(f'{ref:.2f}' if ref is not None else 'n/a'):>19}{ratio}  {st['bell_to_proxy']:.2f}, "
              f"{st['proxy_post']:.2f}, {st['post_to_remote_flag']:.2f}, {st['flag_to_device']:.2f} "
              f"(rank 1's device answers in {st['device_turnaround']:.2f})")
        for r, pp in enumerate(res["progress_pass"]):
            print(f"{'':<9}rank {r}'s progress thread: {pp['pass_ns']:.0f} ns per pass: {100 * pp['poll']:.0f} % "
                  f"polling completions, {100 * pp['hooks']:.0f} % in the pump, {100 * pp['post']:.0f} % posting")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
