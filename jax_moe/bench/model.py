"""`python -m jax_moe.bench model`: a latency model of decode dispatch/combine at EP 8 to 128 (docs/scale.md).

Per rank: T tokens of `hidden` channels, top-k of E experts routed uniformly, 8 GPUs per node joined by NVLink, nodes
joined by the GPUs' NICs. An operation costs

    2 kernel boundaries + doorbell + stage + messages x msg + off-node bytes / NIC bandwidth + flag (+ route stage)

where `stage` is a fabric's fixed cost of one network stage (post to remote completion of a small write, and the
proxy's work around it), `msg` the cost of one posted write (per remote peer and NIC: posting, the NIC's message
rate, counting its immediate), and the route stage pplx-garden's extra dispatch step (routes first, then the CPU
computes the layout and copies it to the GPU). On-node bytes go over NVLink at the same time as off-node ones.

A design says what moves: `pplx` (pplx-garden: each (token, expert) pair crosses once, routes in a stage of their own,
every write sharded over `nets` NICs) or `jax_moe` (each token once per destination rank, the counts in the same
write as the first rows, one NIC per GPU, and the host costs this project measured). The fabric parameters are
calibrated once against pplx-garden's published decode table (same design, their setup) with the NIC bandwidth
fixed at a physical value, and printed beside it; the same parameters then predict jax_moe.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, replace

import numpy as np


@dataclass(frozen=True)
class Fabric:
    name: str
    nic_gbps: float  # usable GB/s of one GPU's NICs, all of them (fixed from the hardware, not fitted)
    nets: int  # NICs per GPU in pplx-garden's published setup
    stage_us: float = 0.0  # one network stage: post -> remote completion of a small write, with the proxy around it
    msg_us: float = 0.0  # one posted write (per remote peer and NIC)
    route_us: float = 0.0  # pplx-garden's route stage (dispatch only): route imms waited for, layout on the CPU


FABRICS = {
    # p5en: 2 x 200 Gb/s EFA per H200 = 50 GB/s, ~85 % usable.
    "efa": Fabric("efa", nic_gbps=42.0, nets=2),
    # ConnectX-7 400 Gb/s per GPU = 50 GB/s, ~90 % usable.
    "cx7": Fabric("cx7", nic_gbps=45.0, nets=1),
}

# pplx-garden's published decode table (docs/fabric-lib.md; EP128 from the AWS rerun in
# awslabs/awsome-distributed-ai, pplx-garden-benchmark): us per operation, (dispatch, combine).
PUBLISHED = {
    "efa": {16: (214.8, 241.5), 32: (229.1, 335.0), 64: (266.7, 391.2), 128: (424.5, 588.5)},
    "cx7": {16: (110.2, 185.5), 32: (153.9, 266.3), 64: (187.5, 309.1)},
}


@dataclass(frozen=True)
class Costs:
    nvlink_gbps: float = 395.0  # measured peer-write bandwidth between two H200 (docs/benchmarks.md)
    kernel_us: float = 4.0  # one kernel boundary (2.7 in CUDA graphs)
    doorbell_us: float = 1.4  # kernel done -> proxy sees the doorbell (half a host-mapped flag round trip, 2.7 us)
    flag_us: float = 1.4  # proxy raises the flag -> kernel sees it
    proxy_post_us: float = 0.0  # extra host cost per stage beyond the fabric's (bell seen -> posted, measured)


@dataclass(frozen=True)
class Memory:
    """Where jax_moe's fabric areas live, and what an off-node byte then costs beyond the wire: GB/s of the step before
    the post (out) and of the step after the arrival (in), per operation; 0 = free. Serial with the wire: a round is
    posted once its whole region is out, and flagged once it is all in. Measured on one H200 shared by two processes
    under MPS (half the SMs each, one PCIe link for both), decode, shm, 2026-12-03 (docs/benchmarks.md): a GPU of
    one's own may do better, so these rows bound the path as built from above."""
    name: str
    dispatch: tuple = (0.0, 0.0)
    combine: tuple = (0.0, 0.0)


MEMORIES = {
    # The NIC reads and writes HBM; the kernels read HBM at 1.8 TB/s: nothing beyond the wire (not run: no RDMA NIC).
    "device": Memory("device"),
    # A copy engine HBM -> pinned host before the post (bell seen -> posted: 32.4 us for 0.94 MB, 54.5 us for
    # 1.82 MB) and pinned host -> HBM after the arrival (post -> flag less the engine's one-way: 37 and 28 us).
    "staged": Memory("staged", dispatch=(29.0, 25.0), combine=(33.0, 66.0)),
    # The kernels write and read pinned host memory over PCIe: dispatch_send 59 us beyond EP1 for 0.94 MB, combine_send
    # 47 us beyond EP1 for 1.82 MB (the evening's call); dispatch_recv reads at 2.4 GB/s, combine_recv reads and sums
    # at 14 (the afternoon's trace, docs/scale.md).
    "host": Memory("host", dispatch=(16.0, 2.4), combine=(40.0, 14.0)),
}


@dataclass(frozen=True)
class Shape:
    tokens: int = 128
    hidden: int = 7168
    experts: int = 256
    topk: int = 8
    per_node: int = 8


def distinct(e: int, k: int, n: int) -> float:
    """Expected number of distinct ranks among a token's k experts (uniform, without replacement), E/N per rank."""
    l = e // n
    miss = math.comb(e - l, k) / math.comb(e, k) if e - l >= k else 0.0
    return n * (1.0 - miss)


def traffic(design: str, n: int, s: Shape, reduce: bool = False) -> dict:
    """Rows per rank that leave the node / stay on it, and their sizes, for dispatch and combine."""
    remote = max(0, n - s.per_node) / n  # fraction of ranks on other nodes
    near = (min(n, s.per_node) - 1) / n  # on this node, not this rank
    scale = 4 * (s.hidden // 128)
    if design == "pplx":  # one row per (token, expert); record: data + scales + 16 spare bytes, 16-aligned
        x_row = -(-s.hidden // 16) * 16 + -(-scale // 16) * 16 + 16
        per_token = float(s.topk)
    else:  # one record per (token, destination rank): data + scales, 16-aligned
        x_row = -(-(s.hidden + scale) // 16) * 16
        per_token = distinct(s.experts, s.topk, n)
    y_per_token = distinct(s.experts, s.topk, n) if reduce else float(s.topk)
    t = s.tokens
    return {"dispatch": (t * per_token * remote, t * per_token * near, x_row),
            "combine": (t * y_per_token * remote, t * y_per_token * near, 2 * s.hidden)}


def op_time(rows_off: float, rows_on: float, row: int, peers: int, nets: int, f: Fabric, c: Costs,
            route: bool, staging: tuple = (0.0, 0.0)) -> dict:
    b_off, b_on = rows_off * row, rows_on * row
    t_nic = b_off / (f.nic_gbps * 1e3)  # bytes / (GB/s) in us
    t_nvl = b_on / (c.nvlink_gbps * 1e3)
    t_stage = sum(b_off / (g * 1e3) for g in staging if g > 0)  # before the post and after the arrival (Memory)
    fixed = 2 * c.kernel_us
    if peers:
        fixed += c.doorbell_us + c.flag_us + f.stage_us + c.proxy_post_us + peers * nets * f.msg_us
        fixed += f.route_us if route else 0.0
    return {"bytes_off_node": b_off, "bytes_on_node": b_on, "transfer_us": max(t_nic, t_nvl), "fixed_us": fixed,
            "staging_us": t_stage, "total_us": fixed + max(t_nic + t_stage, t_nvl)}


def model(design: str, n: int, s: Shape, f: Fabric, c: Costs, nets: int, reduce: bool = False,
          memory: Memory = MEMORIES["device"]) -> dict:
    tr = traffic(design, n, s, reduce)
    peers = max(0, n - s.per_node)
    return {"ep": n, "nodes": math.ceil(n / s.per_node), "design": design, "memory": memory.name,
            "dispatch": op_time(*tr["dispatch"], peers, nets, f, c, route=design == "pplx", staging=memory.dispatch),
            "combine": op_time(*tr["combine"], peers, nets, f, c, route=False, staging=memory.combine)}


def calibrate(f: Fabric, s: Shape, c: Costs, published: dict) -> Fabric:
    """Least squares of (stage_us, msg_us, route_us) on the published pplx-garden table, the bandwidth held fixed."""
    rows, rhs = [], []
    base = replace(f, stage_us=0.0, msg_us=0.0, route_us=0.0)
    for n, (d, cmb) in published.items():
        m = model("pplx", n, s, base, c, f.nets)
        msgs = max(0, n - s.per_node) * f.nets
        rows += [[1.0, msgs, 1.0], [1.0, msgs, 0.0]]
        rhs += [d - m["dispatch"]["total_us"], cmb - m["combine"]["total_us"]]
    x, *_ = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)
    return replace(f, stage_us=float(x[0]), msg_us=float(x[1]), route_us=float(x[2]))


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
    ap.add_argument("--nets", type=int, default=None,
                    help="NICs per GPU jax_moe drives in the prediction (default: all of the setup's; each NIC carries "
                         "nic_gbps / nets)")
    ap.add_argument("--kernel-us", type=float, default=Costs.kernel_us)
    ap.add_argument("--proxy-post-us", type=float, default=1.9,
                    help="jax_moe's measured host cost per stage: bell seen -> posted (1.6-1.9 us at decode, "
                         "docs/benchmarks.md)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    s = Shape(args.tokens, args.hidden, args.experts, args.topk, args.ranks_per_node)
    costs = Costs(kernel_us=args.kernel_us)
    ours = replace(costs, proxy_post_us=args.proxy_post_us)
    eps = [int(v) for v in args.ep.split(",")]
    for n in eps:
        if args.experts % n:
            raise SystemExit(f"bench model: {args.experts} experts do not split over EP {n}")
    out: dict = {"costs": asdict(costs), "jax_moe_costs": asdict(ours), "shape": asdict(s), "fabrics": {}}
    print(f"decode model: T={s.tokens} hidden={s.hidden} E={s.experts} top-{s.topk}, fp8 dispatch, bf16 combine, "
          f"{s.per_node} GPUs per node; us per operation")
    for name in args.fabric.split(","):
        if name not in FABRICS:
            raise SystemExit(f"bench model: unknown fabric {name!r} (known: {', '.join(FABRICS)})")
        f = FABRICS[name]
        if args.nic_gbps:
            f = replace(f, nic_gbps=args.nic_gbps)
        pub = PUBLISHED[name]
        f = calibrate(f, s, costs, pub)
        print(f"\n{name}: {f.nic_gbps:g} GB/s per GPU (fixed), {f.nets} NIC(s) per GPU in pplx-garden's setup; "
              f"calibrated on its table: stage {f.stage_us:.1f} us, {f.msg_us:.2f} us per write, "
              f"route stage {f.route_us:.1f} us")
        print(f"{'EP':>4}{'nodes':>6} | {'pplx dispatch':>14}{'published':>10}{'err':>6} | {'pplx combine':>13}"
              f"{'published':>10}{'err':>6} | {'jax_moe disp':>13}{'combine':>9}{'reduced':>9}{'MB off d/c':>12}")
        rows = []
        nets = args.nets or f.nets
        mine = replace(f, nic_gbps=f.nic_gbps * nets / f.nets)
        for n in eps:
            p = model("pplx", n, s, f, costs, f.nets)
            j = model("jax_moe", n, s, mine, ours, nets)
            by_memory = {m: model("jax_moe", n, s, mine, ours, nets, reduce=True, memory=mem)
                         for m, mem in MEMORIES.items()}
            jr = by_memory["device"]  # the reduced combine, GPU memory on the wire
            ref = pub.get(n)
            err = [None, None] if ref is None else [p["dispatch"]["total_us"] / ref[0] - 1,
                                                    p["combine"]["total_us"] / ref[1] - 1]
            rows.append({"ep": n, "pplx": p, "published": ref, "error": err, "jax_moe": j,
                         "jax_moe_reduced": jr["combine"], "jax_moe_by_memory": by_memory})
            refs = ("", "", "", "") if ref is None else (f"{ref[0]:.1f}", f"{100 * err[0]:+.0f}%", f"{ref[1]:.1f}",
                                                          f"{100 * err[1]:+.0f}%")
            print(f"{n:>4}{p['nodes']:>6} | {p['dispatch']['total_us']:>14.1f}{refs[0]:>10}{refs[1]:>6} | "
                  f"{p['combine']['total_us']:>13.1f}{refs[2]:>10}{refs[3]:>6} | {j['dispatch']['total_us']:>13.1f}"
                  f"{j['combine']['total_us']:>9.1f}{jr['combine']['total_us']:>9.1f}"
                  f"{j['dispatch']['bytes_off_node'] / 1e6:>6.2f}/{j['combine']['bytes_off_node'] / 1e6:.2f}")
        print(f"jax_moe by where its areas live (reduced combine; {', '.join(MEMORIES)}): dispatch / combine us")
        for r in rows:
            cells = "".join(f"{m:>8} {v['dispatch']['total_us']:7.1f} / {v['combine']['total_us']:7.1f}"
                            for m, v in r["jax_moe_by_memory"].items())
            print(f"{r['ep']:>4}{r['pplx']['nodes']:>6} |{cells}")
        errs = [abs(e) for r in rows for e in r["error"] if e is not None]
        print(f"largest error against the published table: {100 * max(errs):.0f}% (bound: 25%)")
        out["fabrics"][name] = {"fabric": asdict(f), "rows": rows, "max_error": max(errs)}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
