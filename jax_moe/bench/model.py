"""`python -m jax_moe.bench model`: a latency model of decode dispatch/combine at EP 8 to 128 (docs/scale.md).

Per rank: T tokens of `hidden` channels, top-k of E experts routed uniformly, ranks_per_node GPUs per node joined by
NVLink, nodes joined by one NIC per GPU. Dispatch sends each token once per destination rank (fp8: hidden bytes plus
one float32 scale per 128 channels); combine sends one bf16 row per (token, k) back (as today) or, with sender-side
reduction, one per (token, rank). Off-node bytes go through the proxy and the NIC, on-node bytes over NVLink, both
at once; an operation costs its fixed latencies plus the slower of the two transfers plus a posting cost per remote
peer. Every parameter is an option, so the model can be refitted to measurements.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Fabric:
    name: str
    nic_gbps: float  # usable GB/s of one GPU's NIC(s)
    wire_us: float  # one write's latency, post to remote completion, small message
    post_us: float  # proxy cost of one posted write (per remote peer and operation)


FABRICS = {
    # p5en: 2 x 200 Gb/s EFA per H200 (50 GB/s, ~85 % usable); SRD small-write latency ~15 us.
    "efa": Fabric("efa", nic_gbps=42.0, wire_us=15.0, post_us=0.5),
    # ConnectX-7 400 Gb/s per GPU, RC: ~3 us small-write latency.
    "cx7": Fabric("cx7", nic_gbps=45.0, wire_us=3.0, post_us=0.3),
}


@dataclass(frozen=True)
class Costs:
    nvlink_gbps: float = 395.0  # measured peer-write bandwidth between two H200 (docs/benchmarks.md)
    kernel_us: float = 4.0  # one kernel boundary (2.7 in CUDA graphs)
    doorbell_us: float = 1.4  # kernel done -> proxy sees the doorbell (half a host-mapped flag round trip, 2.7 us)
    flag_us: float = 1.4  # proxy raises the flag -> kernel sees it


def distinct(e: int, k: int, n: int) -> float:
    """Expected number of distinct ranks among a token's k experts (uniform, without replacement), E/N per rank."""
    l = e // n
    miss = math.comb(e - l, k) / math.comb(e, k) if e - l >= k else 0.0
    return n * (1.0 - miss)


def model(n: int, per_node: int, t: int, hidden: int, e: int, k: int, fabric: Fabric, c: Costs,
          reduce: bool) -> dict:
    d = distinct(e, k, n)
    off = d * max(0, n - per_node) / n  # destination ranks per token on other nodes
    on = d * (min(n, per_node) - 1) / n  # on this node, not this rank
    x_row = hidden + 4 * (hidden // 128)  # fp8 + scales
    y_row = 2 * hidden
    y_off, y_on = (off, on) if reduce else (k * max(0, n - per_node) / n, k * (min(n, per_node) - 1) / n)
    remote_peers = max(0, n - per_node)

    def op(rows_off: float, rows_on: float, row: int) -> dict:
        b_off, b_on = t * rows_off * row, t * rows_on * row
        t_nic = b_off / (fabric.nic_gbps * 1e3)  # bytes / (GB/s) in us
        t_nvl = b_on / (c.nvlink_gbps * 1e3)
        fixed = 2 * c.kernel_us
        if remote_peers:
            fixed += c.doorbell_us + fabric.wire_us + c.flag_us + remote_peers * fabric.post_us
        return {"bytes_off_node": b_off, "bytes_on_node": b_on, "transfer_us": max(t_nic, t_nvl),
                "fixed_us": fixed, "total_us": fixed + max(t_nic, t_nvl)}

    return {"ep": n, "nodes": math.ceil(n / per_node), "dispatch": op(off, on, x_row),
            "combine": op(y_off, y_on, y_row)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m jax_moe.bench model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ep", default="8,16,32,64,128")
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank (decode)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--fabric", default="efa,cx7", help=f"comma list of {', '.join(FABRICS)}")
    ap.add_argument("--nic-gbps", type=float, default=None, help="override the fabric's usable NIC GB/s")
    ap.add_argument("--wire-us", type=float, default=None, help="override the fabric's small-write latency")
    ap.add_argument("--kernel-us", type=float, default=Costs.kernel_us)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    costs = Costs(kernel_us=args.kernel_us)
    out = []
    print(f"decode model: T={args.tokens} hidden={args.hidden} E={args.experts} top-{args.topk}, fp8 dispatch, "
          f"bf16 combine, {args.ranks_per_node} GPUs per node; us per operation")
    print(f"{'fabric':<6}{'EP':>5}{'nodes':>6}{'disp MB off':>12}{'dispatch':>10}{'comb MB off':>12}{'combine':>9}"
          f"{'combine reduced':>17}")
    for name in args.fabric.split(","):
        f = FABRICS[name]
        f = Fabric(f.name, args.nic_gbps or f.nic_gbps, args.wire_us if args.wire_us is not None else f.wire_us,
                   f.post_us)
        for n in (int(v) for v in args.ep.split(",")):
            if args.experts % n:
                raise SystemExit(f"bench model: {args.experts} experts do not split over EP {n}")
            now = model(n, args.ranks_per_node, args.tokens, args.hidden, args.experts, args.topk, f, costs, False)
            red = model(n, args.ranks_per_node, args.tokens, args.hidden, args.experts, args.topk, f, costs, True)
            out.append({"fabric": asdict(f), **now, "combine_reduced": red["combine"]})
            print(f"{name:<6}{n:>5}{now['nodes']:>6}{now['dispatch']['bytes_off_node'] / 1e6:>12.2f}"
                  f"{now['dispatch']['total_us']:>10.1f}{now['combine']['bytes_off_node'] / 1e6:>12.2f}"
                  f"{now['combine']['total_us']:>9.1f}{red['combine']['total_us']:>17.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"costs": asdict(costs), "rows": out}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
