"""`python -m jax_moe.bench moe`: dispatch/combine latency of jax_moe backends against XLA doing the same job.

On GPUs every iteration is timed on the device: a tiny FFI op stamps %globaltimer (it passes its input through,
aliased, so it sits in the data-dependency chain). Iterations are unrolled inside one program so the ranks stay in
step; p50/p99 over >= 1000 iterations after a warm-up. Each jax_moe backend runs twice: the dispatch and combine
totals come from a run stamped only around each operation, the send/recv halves from a run also stamped between
them (a stamp is one more custom call). With JAX_MOE_CUDA_TRACE=1 the cuda backend's device trace (every kernel's
start, waits, work and end) is summarised too. On CPUs (backends "cpu" and "xla") the halves are
timed by the host clock with the same stamps (a CPU FFI op), one iteration per program. Besides the jax_moe backends, "xla-ragged" is MaxText's way on GPU:
sort by expert, `ragged_all_to_all`, local permute, and back. Prints a table; writes results.json and moe.png to --out.
Run in several processes with ranks on other nodes (--processes, --ranks-per-node), the launcher then prints each
operation of those ranks beside its floor (EP1 kernel + TransferEngine one-way time, bench/floor.py).
JAX_MOE_BENCH_ENV_<i>="KEY=VALUE ..." sets KEY for process i only (e.g. a staging knob on the sender's side alone);
the floors' runs do not take it. results.json's meta keeps what was set.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe
from jax_moe.backends import cuda as cuda_backend
from jax_moe.communicator import FABRIC_PROVIDERS
from jax_moe.bench import diagnostics, floor, processes, report
from jax_moe.bench.programs import make_inputs, count_remote_tokens, count_remote_rows, program, gpu_run, cpu_run

SHAPES = {  # name: (tokens per rank, hidden, experts, top-k, fp8 dispatch)
    "small": (64, 512, 32, 4, True),
    "decode": (128, 7168, 256, 8, True),
    "prefill": (4096, 7168, 256, 8, True),
    "decode-big": (128, 7168, 256, 8, True),  # decode's tokens on buffers sized for prefill (BUFFER_TOKENS)
}
BUFFER_TOKENS = {"decode-big": 4096}  # max_tokens of a shape's Communicator where it is not the tokens sent
SWEEP = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096)
PHASES = report.PHASES


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m jax_moe.bench moe", description=__doc__.split("\n")[0])
    p.add_argument("--backend", default=None,
                   help="comma list of cuda, cpu, xla, xla-ragged (default: by platform); cuda-entry / cpu-entry: the "
                        "same backend with the weights given to combine instead of dispatch (rows per (t, k))")
    p.add_argument("--shape", default=None,
                   help="comma list of small, decode, prefill, decode-big (decode's 128 tokens on buffers sized for "
                        "4096), sweep (default: by platform)")
    p.add_argument("--ranks", type=int, default=None, help="EP ranks (default: every device of the platform)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 1000 on GPU, 20 on CPU)")
    p.add_argument("--sweep-iters", type=int, default=None, help="iterations per sweep point (default iters / 4)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up programs before timing")
    p.add_argument("--unroll", type=int, default=25, help="iterations per program on GPU")
    p.add_argument("--out", default="bench_out", help="folder for results.json and moe.png")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-devices", type=int, default=4, help="simulated CPU devices (CPU platform only)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="cuda: ranks per node (default one node per host); ranks of other nodes go through the host "
                        "proxy and the TransferEngine")
    p.add_argument("--provider", default=None, choices=FABRIC_PROVIDERS,
                   help="TransferEngine provider between nodes, or between processes for the cpu backend (tcp, shm, "
                        "efa, verbs)")
    p.add_argument("--processes", type=int, default=1,
                   help="run the ranks in this many processes on this host (jax.distributed; GPU: GPUs shared "
                        "round-robin, XLA's collectives skipped where two processes share a GPU, NCCL refuses that; "
                        "CPU: --cpu-devices ranks per process)")
    floor.add_args(p)
    return p.parse_args(argv)


# --- inputs -------------------------------------------------------------------------------------------------------
def main(argv) -> int:
    args = _parse(list(argv))
    if args.processes > 1 and not os.environ.get(processes.PROC_ENV):
        started = time.time()
        rc = processes.launch(list(argv), args.processes)
        floor.report(args, started)  # ranks on other nodes: each operation beside its floor
        return rc
    joined = processes.join()
    leader = joined is None or joined[0] == 0
    try:  # only takes effect before JAX starts its backends; harmless on GPU machines
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    except RuntimeError:
        pass
    platform = jax.default_backend()
    gpu = platform == "gpu"
    shared = gpu and joined is not None and joined[1] > joined[2]  # processes share a GPU: no NCCL
    backends = (args.backend or ("cuda,xla,xla-ragged" if gpu else "cpu,xla")).split(",")
    shapes = (args.shape or ("decode,prefill,sweep" if gpu else "small")).split(",")
    iters = args.iters or (1000 if gpu else 20)
    sweep_iters = args.sweep_iters or max(50, iters // 4)
    devices = jax.devices()
    n = args.ranks or len(devices)
    if n > len(devices):
        print(f"[moe] --ranks {n}: only {len(devices)} {platform} devices", file=sys.stderr)
        return 2
    mesh = jax.make_mesh((n,), ("ep",), devices=devices[:n])
    rng = np.random.default_rng(args.seed)
    bw = diagnostics.peer_bandwidth(platform, n) if leader else None
    print(f"[moe] platform={platform} ranks={n} devices={devices[0].device_kind} backends={backends} "
          f"shapes={shapes} peer bandwidth={bw}", flush=True)

    points = []
    for s in shapes:
        if s == "sweep":
            t_list = [t for t in SWEEP if gpu or t <= 256]
            base = SHAPES["decode"] if gpu else SHAPES["small"]
            points += [("sweep", t, base[1:], sweep_iters) for t in t_list]
        elif s in SHAPES:
            points.append((s, SHAPES[s][0], SHAPES[s][1:], iters))
        else:
            print(f"[moe] unknown shape {s!r}", file=sys.stderr)
            return 2

    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "platform": platform,
            "device_kind": devices[0].device_kind, "ranks": n, "jax": jax.__version__, "argv": list(argv),
            "peer_bandwidth": bw, "times_in": "microseconds; per iteration the max over ranks",
            "processes": 1 if joined is None else joined[1], "ranks_per_node": args.ranks_per_node,
            "provider": args.provider, "process_settings": processes.process_settings()}
    results = []
    skipped = set()
    for shape, t, (hidden, e, r, fp8), its in points:
        if e % n:
            print(f"[moe] skip {shape}: {e} experts not divisible by {n} ranks")
            continue
        l = e // n
        cfg = jax_moe.MoEConfig(e, r, hidden, BUFFER_TOKENS.get(shape, t),
                                dispatch_dtype=jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
        inputs = make_inputs(rng, n, t, hidden, e, r, fp8)
        remote_rows = count_remote_rows(inputs[2], n, t, l)
        disp_bytes = remote_rows * (hidden * (1 if fp8 else 2) + cfg.num_scales * 4)
        remote_tokens = count_remote_tokens(inputs[2], n, t, l)
        token_bytes = remote_tokens * (hidden * (1 if fp8 else 2) + cfg.num_scales * 4)
        comb_bytes = remote_rows * hidden * 2
        # cuda with the weights at dispatch sums a token's rows per rank (over NVLink and across nodes alike): one row
        # per (token, other rank) comes back
        comb_summed = remote_tokens * hidden * 2
        for backend in backends:
            native = backend.removesuffix("-entry")  # "-entry": weights given to combine, rows per (t, k)
            summed = native == "cuda" and not backend.endswith("-entry")
            if backend in skipped:
                continue
            comm = None
            try:
                if shared and backend.startswith("xla"):
                    raise jax_moe.BackendUnavailable("processes share a GPU: NCCL refuses XLA's collectives there")
                if backend == "xla-ragged":
                    if not gpu:
                        raise jax_moe.BackendUnavailable("ragged_all_to_all needs GPU (XLA:CPU lacks it)")
                    limit = int(os.environ.get("JAX_MOE_BENCH_RAGGED_MAX_ROWS", "0"))
                    if limit and t * r > limit:
                        print(f"[moe] skip xla-ragged at T={t}: above JAX_MOE_BENCH_RAGGED_MAX_ROWS={limit}")
                        continue
                else:  # None: the Communicator's defaults
                    comm = jax_moe.Communicator(cfg, mesh, "ep", backend=native, ranks_per_node=args.ranks_per_node,
                                                fabric_provider=args.provider)
            except (jax_moe.BackendUnavailable, ValueError) as err:
                print(f"[moe] skip backend {backend}: {err}")
                skipped.add(backend)
                continue
            started, wall_from = time.perf_counter(), time.time()
            gaps = None
            try:
                if gpu:
                    with diagnostics.profiled(0 if joined is None else joined[0]):
                        samples = gpu_run(backend, comm, mesh, n, l, inputs, its, min(args.unroll, its),
                                           args.warmup)
                    stamps = samples.pop("stamps")
                    # before the next run overwrites the trace's ring
                    gaps = diagnostics.stamp_gaps(comm, stamps) if native == "cuda" and comm is not None else None
                    if backend != "xla-ragged":
                        # Totals without the stamps between the halves (each stamp is one more custom call on
                        # the stream); the halves stay from the split run.
                        whole = gpu_run(backend, comm, mesh, n, l, inputs, its, min(args.unroll, its),
                                         args.warmup, split=False)
                        for k in ("dispatch", "combine"):
                            samples[f"{k}_split"] = samples[k]
                            samples[k] = whole[k]
                else:
                    samples = cpu_run(comm, mesh, inputs, its, args.warmup,
                                       weights_at_dispatch=not backend.endswith("-entry"))
            except Exception as err:  # noqa: BLE001 - report and go on with the other backends
                print(f"[moe] {backend} {shape} T={t} failed: {type(err).__name__}: {str(err)[:400]}")
                continue
            stats = report.summary(samples)
            fabric = comm.backend.fabric_info() if native == "cuda" else {}
            rec = {"shape": shape, "tokens": t, "hidden": hidden, "experts": e, "topk": r, "fp8": fp8,
                   "ranks": n, "backend": backend, "stats": stats, "remote_dispatch_bytes": disp_bytes,
                   "remote_combine_bytes": comb_bytes, "seconds": time.perf_counter() - started,
                   "wall": [wall_from, time.time()]}  # when it ran (compile included): runs made at once overlap
            if summed:
                rec["remote_combine_bytes_sent"] = comb_summed
            if comm is not None and native == "cuda":
                rec["buffer_bytes_per_device"] = cuda_backend.buffer_bytes(comm.cfg, comm.num_ranks)
            if native == "cuda":  # moves each token once per rank: the bytes on NVLink
                rec["remote_dispatch_bytes_sent"] = token_bytes
                rec["launch"] = comm.backend.launch_shapes(t)  # (blocks, threads) per half, and the GPU's SMs
                print(f"[moe] launch (blocks, threads) {rec['launch']}", flush=True)
                trace = diagnostics.trace_summary(comm)
                if trace:
                    rec["trace_us"] = trace
                if gaps:
                    rec["stamp_gaps_us"] = {str(k): v for k, v in gaps.items()}
                if fabric:  # ranks on other nodes: which provider and memory, and the proxies' timeline
                    rec["fabric"] = {str(k): v for k, v in fabric.items()}
                    rec["fabric_breakdown"] = diagnostics.fabric_breakdown(comm, 4096)
                    print(f"[moe] fabric {rec['fabric']} breakdown {rec['fabric_breakdown']}", flush=True)
            sent = token_bytes if native == "cuda" else disp_bytes
            comb_sent = comb_summed if summed else comb_bytes
            for phase, nbytes in (("dispatch_send", sent), ("combine_send", comb_sent)):
                p50 = stats[phase]["p50"]
                if p50:
                    rec[f"{phase}_GBps"] = nbytes / (p50 * 1e-6) / 1e9
            if bw and "peer_GBps" in bw:
                rec["floor_dispatch_us"] = disp_bytes / (bw["peer_GBps"] * 1e9) * 1e6
                rec["floor_combine_us"] = comb_bytes / (bw["peer_GBps"] * 1e9) * 1e6
                rec["floor_dispatch_sent_us"] = sent / (bw["peer_GBps"] * 1e9) * 1e6
                rec["floor_combine_sent_us"] = comb_sent / (bw["peer_GBps"] * 1e9) * 1e6
            results.append(rec)
            if leader:
                report.write(args.out, meta, results)  # as we go: a run cut short still leaves its numbers
            print(f"[moe] {shape:8s} T={t:5d} {backend:10s} dispatch p50 {report.fmt(stats['dispatch']['p50'])} us  "
                  f"combine p50 {report.fmt(stats['combine']['p50'])} us  ({rec['seconds']:.1f} s)", flush=True)
            del comm

    # speed-up of each backend over the faster XLA path on the same point
    for rec in results:
        xla = [o for o in results if o["shape"] == rec["shape"] and o["tokens"] == rec["tokens"]
               and o["backend"].startswith("xla")]
        for phase in ("dispatch", "combine"):
            best = min((o["stats"][phase]["p50"] for o in xla if o["stats"][phase]["p50"]), default=None)
            if best and rec["stats"][phase]["p50"]:
                rec[f"{phase}_speedup_vs_xla"] = best / rec["stats"][phase]["p50"]

    if not leader:
        return 0
    header = (f"{'shape':8s} {'T':>5s} {'backend':10s} " + " ".join(f"{p + ' p50/p99':>22s}" for p in PHASES)
              + f" {'disp GB/s':>9s} {'comb GB/s':>9s} {'x vs xla':>9s}")
    print("\n" + header)
    for rec in results:
        st = rec["stats"]
        cells = " ".join(f"{report.fmt(st[p]['p50'])}/{report.fmt(st[p]['p99'])}".rjust(22) for p in PHASES)
        gbd = rec.get("dispatch_send_GBps")
        gbc = rec.get("combine_send_GBps")
        sp = rec.get("dispatch_speedup_vs_xla")
        print(f"{rec['shape']:8s} {rec['tokens']:5d} {rec['backend']:10s} {cells} "
              f"{'-' if gbd is None else f'{gbd:9.1f}':>9s} {'-' if gbc is None else f'{gbc:9.1f}':>9s} "
              f"{'-' if sp is None else f'{sp:9.1f}':>9s}")
    report.write(args.out, meta, results)
    if results:
        report.plot(results, os.path.join(args.out, "moe.png"))
    print(f"[moe] wrote {args.out}/results.json and moe.png")
    return 0
