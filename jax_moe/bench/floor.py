"""Floors of the moe benchmark's operations between nodes (`--processes N --ranks-per-node R`, backend cuda).

    floor(op) = p50 of the same operation and shape at EP1 (the benchmark again in one process, one rank)
              + p50 of the TransferEngine's one-way time for the bytes the operation sends to a remote rank
                (`bench fabric`, on the provider and the memory, GPU or pinned host, of the run's `fabric_info()`)

all measured in the same invocation, after the multi-process run (or, with `--floor-cache`, once per sitting: the
benchmarks of several area memories share the EP1 run, those of one provider and memory the engine's one-way). A send
half only packs and rings its proxy's bell: the bytes travel while the receive half waits, so the one-way time goes into
the receive halves and the totals, and a send half's floor is its EP1 time. Target: p50 <= 1.5 * floor + 10 us. A floor
that cannot be measured reads "n/a (why)"; it never costs the run its own results.

Beside it, not in it: "both ways", the engine's one-way for the same bytes with both directions loaded at once
(`bench fabric --exchange`), as the ranks of an all-to-all load them; the floor's one-way loads one direction.
"x both" is p50 / (EP1 + both ways): how far an operation is from the wire it actually shares.

Beside it too, where the processes share a GPU (more processes than GPUs, as when one GPU plays two nodes): "EP1
twin", the EP1 run again as that many processes at once (started together, each at its own share under MPS), the mean
of their p50s. One GPU's processes contend for its HBM, L2 and copy engines, which two nodes' GPUs would not: "x twin"
= p50 / (EP1 twin + one-way) says how far an operation is from its parts under the same contention. Not in FLOOR.

Also beside it where the run's areas are staged (fabric_memory="staged": pinned host memory on the wire, HBM for the
kernels): "x +copies" is p50 / (FLOOR + the two copies staging adds, the sender's out of HBM and the receiver's into
it, each the bytes at the host-to-device copy rate the run measured (its peer bandwidth; the way out taken as the
same)). The floor above has no such copies: it is the wire alone, so a staged operation's miss of the target shows
there how much of it is those copies. A staged run that measured no copy rate reads "n/a" there (the table's first
line says why, once).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional, Union

from jax_moe.bench import processes
from jax_moe.bench.floor_runs import Unavailable, cached_run, cached_twin, ep1_command, ep1_env, fabric_command

OPS = ("dispatch_send", "dispatch_recv", "dispatch", "combine_send", "combine_recv", "combine")
WIRE = {"dispatch_send": None, "dispatch_recv": "dispatch", "dispatch": "dispatch",  # whose bytes an op waits for
        "combine_send": None, "combine_recv": "combine", "combine": "combine"}
TARGET_FACTOR, TARGET_SLACK_US = 1.5, 10.0
TARGET = f"p50 <= {TARGET_FACTOR} * floor + {TARGET_SLACK_US:g} us"
NO_COPY_RATE = "no copy rate measured"  # why a staged run has no x +copies
DEFINITION = ("EP1 p50 of the same operation and shape + TransferEngine one-way p50 (bench fabric, same provider and "
              "memory) for the bytes it sends to a remote rank; send halves: EP1 only")

Ep1 = Union[dict, str]    # (shape, tokens, backend) -> {op: p50}, or why there is none
Wire = Union[dict, str]   # bytes -> one-way p50 us, or why there is none (also: both ways at once)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--floor-timeout", type=float, default=600.0,
                   help="ranks on other nodes: seconds allowed to each run the floors take (EP1, bench fabric); "
                        "0 skips the floors")
    p.add_argument("--floor-cache", default=os.environ.get("JAX_MOE_FLOOR_CACHE") or None,
                   help="a folder where the floors' runs keep their results, keyed by their command: a later "
                        "benchmark of the same sitting with the same EP1 run (or the same provider, memory and sizes) "
                        "reuses them instead of measuring again (default $JAX_MOE_FLOOR_CACHE; none)")


# --- arithmetic ------------------------------------------------------------------------------------------------------
def one_way_us(round_us: float, empty_round_us: float) -> float:
    """`bench fabric`'s round is S bytes out and a zero-byte answer back; the answer costs half an empty round (zero
    bytes each way), so one way = round(S) - round(0) / 2. Clamped at 0: at tiny S the two p50s' noise may cross."""
    return max(0.0, round_us - empty_round_us / 2)


def target_us(floor: float) -> float:
    return TARGET_FACTOR * floor + TARGET_SLACK_US


def staging_us(nbytes: int, copy_gbps: float) -> float:
    """The two copies a staged round adds for `nbytes`: out of HBM at the sender, into it at the receiver."""
    return 2 * nbytes / (copy_gbps * 1e3)


def op_floor(p50: Optional[float], ep1: Union[float, str], wire: Union[tuple[int, float], str, None],
             both_ways_us: Optional[float] = None, copy_gbps: Union[float, str, None] = None,
             ep1_twin: Optional[float] = None) -> dict:
    """One operation's entry: `ep1` is the EP1 p50 or why it is missing; `wire` is (bytes, one-way p50 us), why it is
    missing, or None for a send half (no bytes waited for); `both_ways_us` the same bytes' one-way with both directions
    loaded (reported beside the floor, not in it), where measured; `copy_gbps` the host-to-device copy rate of a
    staged run (the floor plus its copies, beside the floor), why a staged run has none, or None (not staged);
    `ep1_twin` the EP1 p50 with the processes sharing the GPU all running it at once (beside the floor), where
    measured."""
    for why in (ep1, wire):
        if isinstance(why, str):
            return {"n/a": why}
    nbytes, wire_us = wire if wire is not None else (0, 0.0)
    floor = float(ep1) + wire_us
    out: dict[str, Any] = {"floor_us": floor, "ep1_p50_us": float(ep1), "wire_bytes": nbytes,
                           "wire_one_way_us": wire_us, "target_us": target_us(floor), "p50_us": p50}
    if both_ways_us is not None:
        out["wire_both_ways_us"] = both_ways_us
        if p50 is not None and float(ep1) + both_ways_us > 0:
            out["ratio_both_ways"] = p50 / (float(ep1) + both_ways_us)
    if ep1_twin is not None:
        out["ep1_twin_p50_us"] = ep1_twin
        if p50 is not None and ep1_twin + wire_us > 0:
            out["ratio_twin"] = p50 / (ep1_twin + wire_us)
    if wire is not None and copy_gbps is not None:
        if isinstance(copy_gbps, str) or copy_gbps <= 0:
            out["staging_n/a"] = copy_gbps if isinstance(copy_gbps, str) else NO_COPY_RATE
        else:
            out["staging_us"] = staging_us(nbytes, copy_gbps)
            if p50 is not None:
                with_copies = floor + out["staging_us"]
                out["ratio_with_copies"] = p50 / with_copies if with_copies > 0 else None
    if p50 is not None:
        out["ratio"] = p50 / floor if floor > 0 else None
        out["meets_target"] = p50 <= target_us(floor)
    return out


def wire_bytes(rec: dict) -> dict[str, int]:
    """Bytes per rank that a record's dispatch and combine send to remote ranks (what the moe run counted as sent)."""
    return {"dispatch": round(rec.get("remote_dispatch_bytes_sent", rec["remote_dispatch_bytes"])),
            "combine": round(rec.get("remote_combine_bytes_sent", rec["remote_combine_bytes"]))}


def rec_key(rec: dict) -> tuple[str, int, str]:
    """(shape, tokens, backend): what a moe record is matched by across runs."""
    return rec["shape"], int(rec["tokens"]), rec["backend"]


def rec_floors(rec: dict, ep1: Ep1, wire: Wire, both: Wire = "not measured",
               copy_gbps: Union[float, str, None] = None, twin: Ep1 = "not measured") -> dict[str, dict]:
    """Every operation of a moe record beside its floor (and `both`, the one-way with both directions loaded; with
    `copy_gbps`, a staged run's copies, or why it has none; `twin`, the EP1 run with the GPU's processes all running
    it at once: see op_floor)."""
    key = rec_key(rec)
    mine = ep1 if isinstance(ep1, str) else ep1.get(key, f"the EP1 run has no {key[0]} T={key[1]} {key[2]}")
    twins = {} if isinstance(twin, str) else twin.get(key, {})
    nbytes = wire_bytes(rec)
    out = {}
    for op in OPS:
        e = mine if isinstance(mine, str) else mine.get(op)
        if e is None:
            e = f"the EP1 run did not time {op}"
        w: Union[tuple[int, float], str, None] = None
        b2: Optional[float] = None
        if WIRE[op] is not None:
            b = nbytes[WIRE[op]]
            w = wire if isinstance(wire, str) else ((b, wire[b]) if b in wire else f"bench fabric has no {b} B round")
            b2 = None if isinstance(both, str) else both.get(b)
        out[op] = op_floor(rec["stats"][op]["p50"], e, w, b2, copy_gbps, twins.get(op))
    return out


# --- the runs' JSON -------------------------------------------------------------------------------------------------
def parse_ep1(doc: dict) -> dict:
    """EP1 p50 per operation by (shape, tokens, backend), from the moe benchmark's results.json."""
    return {rec_key(r): {op: (r["stats"].get(op) or {}).get("p50") for op in OPS}
            for r in doc["results"]}


def parse_twin(docs: list[dict]) -> dict:
    """The EP1 runs made at once: per (shape, tokens, backend) and operation, the mean of their p50s (None where one
    of them did not time it). Unavailable where one of them has no record of a shape another has (a run that failed
    there, say out of memory beside the others)."""
    runs = [parse_ep1(d) for d in docs]
    keys = set().union(*runs)
    for i, r in enumerate(runs):
        if keys - set(r):
            key = sorted(keys - set(r))[0]
            raise Unavailable(f"run {i} of {len(runs)} measured no {key[0]} T={key[1]} {key[2]} (floor_ep1_twin{i}.log)")
    out: dict = {}
    for key in keys:
        vals = {op: [r[key][op] for r in runs] for op in OPS}
        out[key] = {op: None if any(v is None for v in vs) else sum(vs) / len(vs) for op, vs in vals.items()}
    return out


def twin_overlap(docs: list[dict]) -> Optional[float]:
    """How much the runs made at once ran together: per record, the time all of them ran over the longest one's
    (records' "wall", compile included); the least over the records, None where a run did not say."""
    spans: dict = {}
    for d in docs:
        for r in d["results"]:
            if "wall" not in r:
                return None
            spans.setdefault(rec_key(r), []).append(r["wall"])
    if not spans:
        return None
    least = 1.0
    for walls in spans.values():
        together = min(w[1] for w in walls) - max(w[0] for w in walls)
        longest = max(w[1] - w[0] for w in walls)
        least = min(least, max(0.0, together) / longest if longest > 0 else 0.0)
    return least


def parse_fabric(doc: dict, provider: str) -> tuple[dict[int, float], str]:
    """One-way p50 us per size from `bench fabric --json` (whose sizes include 0), and how the memory was registered."""
    rows = doc.get(provider)
    if not rows:
        raise Unavailable(f"bench fabric wrote no rows for {provider}")
    rounds = {int(r["size"]): float(r["p50_us"]) for r in rows}
    if 0 not in rounds:
        raise Unavailable("bench fabric timed no empty round (size 0)")
    registration = doc.get(f"{provider}_registration") or rows[0].get("registration") or "?"
    return {s: one_way_us(v, rounds[0]) for s, v in rounds.items()}, str(registration)


def parse_exchange(doc: dict, provider: str) -> dict[int, float]:
    """The p50 us per size of `bench fabric --exchange --json`: a round there is already one way (no answer leg)."""
    rows = doc.get(provider)
    if not rows:
        raise Unavailable(f"bench fabric --exchange wrote no rows for {provider}")
    return {int(r["size"]): float(r["p50_us"]) for r in rows}


def attach(doc: dict, args: argparse.Namespace, work: str) -> Optional[dict]:
    """Measures the floors of `doc`'s records with remote ranks (EP1 run, then bench fabric; files under `work`) and
    writes them into the records ("floor") and the meta ("floor"); returns that meta, None without such records."""
    recs = [r for r in doc["results"] if r.get("fabric")]
    if not recs:
        return None
    info = next(iter(recs[0]["fabric"].values()))
    provider, on_gpu = str(info["provider"]), bool(info["on_gpu"])
    memory = "cuda" if on_gpu else "host"
    timeout = float(args.floor_timeout)
    meta: dict[str, Any] = {"definition": DEFINITION, "target": TARGET, "provider": provider,
                            "on_gpu": on_gpu, "run_memory": info.get("memory")}

    shapes = list(dict.fromkeys(r["shape"] for r in recs))
    backends = list(dict.fromkeys(r["backend"] for r in recs))
    ep1_out = os.path.join(work, "floor_ep1")
    cmd = ep1_command(args, backends, shapes, ep1_out)
    started = time.perf_counter()
    print(f"[moe] floors: EP1 run ({' '.join(cmd[4:])})", flush=True)
    cache = getattr(args, "floor_cache", None)
    try:
        doc_ep1, reused = cached_run(cache, cmd, os.path.join(ep1_out, "results.json"), timeout,
                                     os.path.join(work, "floor_ep1.log"), ep1_env())
        ep1: Ep1 = parse_ep1(doc_ep1)
        meta["ep1"] = {"command": cmd, "seconds": time.perf_counter() - started, "reused": reused}
    except Unavailable as e:
        ep1 = f"EP1 run: {e}"
        meta["ep1"] = {"command": cmd, "error": ep1}

    gpus = processes.gpu_count()
    twin: Ep1 = "not measured"
    copies = -(-int(getattr(args, "processes", 1)) // gpus)  # processes sharing one GPU
    if copies > 1 and "cuda" in backends and not isinstance(ep1, str):
        started = time.perf_counter()
        print(f"[moe] floors: EP1 run, {copies} at once (the processes share a GPU)", flush=True)
        try:
            # each allocates what it uses, as the launcher's processes do: two preallocating 75 % cannot share a GPU
            docs, reused = cached_twin(cache, cmd, copies, work, timeout,
                                       dict(ep1_env(), XLA_PYTHON_CLIENT_PREALLOCATE="false"))
            twin = parse_twin(docs)
            meta["ep1_twin"] = {"copies": copies, "seconds": time.perf_counter() - started, "reused": reused,
                                "overlap": twin_overlap(docs)}
        except Unavailable as e:
            twin = f"EP1 run, {copies} at once: {e}"
            meta["ep1_twin"] = {"copies": copies, "error": twin}

    sizes = sorted({b for r in recs for b in wire_bytes(r).values()})
    path = os.path.join(work, "floor_fabric.json")
    cmd = fabric_command(provider, memory, sizes, gpus, path)
    print(f"[moe] floors: bench fabric ({' '.join(cmd[4:])})", flush=True)
    try:
        doc_fabric, reused = cached_run(cache, cmd, path, timeout, os.path.join(work, "floor_fabric.log"))
        wire, registration = parse_fabric(doc_fabric, provider)
        meta["fabric"] = {"command": cmd, "memory": memory, "registration": registration, "reused": reused,
                          "one_way_p50_us": {str(k): v for k, v in wire.items()}}
    except Unavailable as e:
        wire = f"bench fabric ({provider}, {memory} memory): {e}"
        meta["fabric"] = {"command": cmd, "memory": memory, "error": wire}

    path = os.path.join(work, "floor_exchange.json")
    cmd = fabric_command(provider, memory, sizes, gpus, path, exchange=True)
    print(f"[moe] floors: bench fabric, both ways ({' '.join(cmd[4:])})", flush=True)
    both: Wire
    try:
        doc_both, reused = cached_run(cache, cmd, path, timeout, os.path.join(work, "floor_exchange.log"))
        both = parse_exchange(doc_both, provider)
        meta["exchange"] = {"command": cmd, "reused": reused, "both_ways_p50_us": {str(k): v for k, v in both.items()}}
    except Unavailable as e:
        both = f"bench fabric --exchange: {e}"
        meta["exchange"] = {"command": cmd, "error": both}
    copy_gbps: Union[float, str, None] = None
    if info.get("staged"):  # the run's own measure of the copy engine's rate (moe's peer bandwidth)
        rate = (doc["meta"].get("peer_bandwidth") or {}).get("h2d_copy_GBps")
        copy_gbps = float(rate) if rate and rate > 0 else NO_COPY_RATE
        meta["staged"] = True
        meta["staging_copy_GBps"] = copy_gbps if isinstance(copy_gbps, float) else None
    for rec in recs:
        rec["floor"] = rec_floors(rec, ep1, wire, both, copy_gbps, twin)
    doc["meta"]["floor"] = meta
    return meta


# --- output ---------------------------------------------------------------------------------------------------------
def _num(v: Optional[float]) -> str:
    return f"{'-':>9s}" if v is None else (f"{v:9.1f}" if v < 1e5 else f"{v:9.2e}")


def _copies_legend(meta: dict) -> str:
    """The x +copies column's part of the table's first line: its rate, why there is none, or nothing (not staged)."""
    rate = meta.get("staging_copy_GBps")
    if rate:
        return f"; x +copies: p50 / (FLOOR + the two staging copies at {rate:.3g} GB/s)"
    if meta.get("staged") or "staging_copy_GBps" in meta:
        return f"; x +copies: n/a ({NO_COPY_RATE})"
    return ""


def _twin_legend(meta: dict) -> str:
    """The twin columns' part of the table's first line: how many ran at once, why there is none, or nothing."""
    twin = meta.get("ep1_twin")
    if not twin:
        return ""
    if "error" in twin:
        return f"; EP1 twin: n/a ({twin['error']})"
    overlap = twin.get("overlap")
    ran = "" if overlap is None else f", which ran {100 * overlap:.0f} % of the time together"
    return (f"; EP1 twin: the EP1 run as {twin['copies']} processes at once on the shared GPU (mean p50{ran}), "
            f"x twin: p50 / (EP1 twin + one-way)")


def table(results: list[dict], meta: dict) -> list[str]:
    """Each operation of the records with floors: p50, p99, FLOOR (= EP1 + one-way), measured / floor, target."""
    fab = meta.get("fabric", {})
    lines = [f"[moe] FLOOR = EP1 p50 (same op and shape) + TransferEngine one-way p50 ({meta['provider']}, "
             f"{fab.get('memory')} memory, registered as {fab.get('registration', 'n/a')}) for the bytes sent to the "
             f"remote rank (send halves: EP1 only, their bytes travel during the receive half); us; target {TARGET}; "
             f"both ways: the same bytes' one-way with both directions loaded at once (bench fabric --exchange), "
             f"not in FLOOR; x both: p50 / (EP1 + both ways)"
             + _copies_legend(meta) + _twin_legend(meta),
             f"{'shape':8s} {'T':>5s} {'backend':10s} {'op':13s} {'p50':>9s} {'p99':>9s} {'FLOOR':>9s} {'EP1':>9s} "
             f"{'one-way':>9s} {'bytes':>9s} {'x floor':>8s}  {'target':17s} {'both ways':>9s} {'x both':>7s} "
             f"{'x +copies':>9s} {'EP1 twin':>9s} {'x twin':>7s}"]
    for rec in results:
        for op, f in rec.get("floor", {}).items():
            st = rec["stats"][op]
            row = (f"{rec['shape']:8s} {rec['tokens']:5d} {rec['backend']:10s} {op:13s} {_num(st['p50'])} "
                   f"{_num(st['p99'])}")
            if "n/a" in f:
                lines.append(f"{row} {'n/a':>9s} ({f['n/a']})")
                continue
            wire = f["wire_one_way_us"] if WIRE[op] else None
            ratio, ratio_both, ratio_copies = f.get("ratio"), f.get("ratio_both_ways"), f.get("ratio_with_copies")
            copies = "n/a" if "staging_n/a" in f else "-" if ratio_copies is None else f"{ratio_copies:9.2f}"
            met = f.get("meets_target")
            verdict = "-" if met is None else f"{'yes' if met else 'NO'} (<= {f['target_us']:.1f})"
            lines.append(f"{row} {_num(f['floor_us'])} {_num(f['ep1_p50_us'])} {_num(wire)} "
                         f"{f['wire_bytes'] if WIRE[op] else '-':>9} {'-' if ratio is None else f'{ratio:8.2f}':>8}"
                         f"  {verdict:17s} {_num(f.get('wire_both_ways_us'))} "
                         f"{'-' if ratio_both is None else f'{ratio_both:7.2f}':>7} "
                         f"{copies:>9} {_num(f.get('ep1_twin_p50_us'))} "
                         f"{'-' if f.get('ratio_twin') is None else format(f['ratio_twin'], '7.2f'):>7}")
    return lines


def wanted(args: argparse.Namespace) -> bool:
    """A launcher of ranks on other nodes whose backends include cuda (the default ones on GPU do)."""
    return (args.processes > 1 and args.ranks_per_node is not None and args.floor_timeout > 0
            and (args.backend is None or "cuda" in args.backend))


def report(args: argparse.Namespace, started: float) -> None:
    """In the launcher, after the processes: the floors of the results they wrote, where wanted(args)."""
    if wanted(args):
        report_file(os.path.join(args.out, "results.json"), args, started)


def report_file(path: str, args: argparse.Namespace, started: float) -> None:
    """The floors of the moe results at `path` (written at or after `started`, a time.time()), printed and written
    into it; the runs' files go beside it. Never raises."""
    try:
        if os.path.getmtime(path) < started:
            raise OSError(f"{path} is from an earlier run")
        with open(path) as f:
            doc = json.load(f)
        meta = attach(doc, args, os.path.dirname(path) or ".")
        if meta is None:
            print("[moe] floors: n/a (no result with ranks on other nodes)")
            return
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
    except Exception as e:  # noqa: BLE001 - the floors must never cost the run its results
        print(f"[moe] floors: n/a ({type(e).__name__}: {e})", file=sys.stderr)
        return
    print("\n" + "\n".join(table(doc["results"], meta)))
    print(f"[moe] floors written to {path}")
