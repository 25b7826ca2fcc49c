"""What `bench moe` reports besides the timings: the host proxies' view of the rounds, the cuda backend's device
trace (JAX_MOE_CUDA_TRACE=1), the GPU's copy and host-read bandwidths, and on request a profile of the timed runs
(JAX_MOE_BENCH_PROFILE=DIR: jax.profiler's trace, every kernel and copy on the GPU, one folder per process)."""
from __future__ import annotations

import contextlib
import os
import sys
from typing import ContextManager, Optional

import jax
import numpy as np

from jax_moe import multihost
from jax_moe.backends.native import native_module


def profiled(process: int) -> ContextManager:
    """Around a timed run: jax.profiler's trace into $JAX_MOE_BENCH_PROFILE/p<process> (perfetto_trace.json.gz beside
    XLA's own files) where that is set, else nothing; then prints the GPU's kernels and copies by duration
    (kernel_table). The device trace records one kernel per half; this shows every kernel of a half (across nodes a
    send half is a pack kernel and a send kernel)."""
    where = os.environ.get("JAX_MOE_BENCH_PROFILE")
    if not where:
        return contextlib.nullcontext()
    return _profiled(os.path.join(where, f"p{process}"))


def _traces(folder: str) -> set[str]:
    import glob

    return set(glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True))


@contextlib.contextmanager
def _profiled(folder: str):
    before = _traces(folder)  # a folder used before (another shape, another run) keeps its traces: not this run's
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        yield
    table = kernel_table(folder, paths=sorted(_traces(folder) - before))
    print(f"[moe] GPU activity of the timed runs ({folder}):\n{table}", flush=True)


def _short_name(name: str) -> str:
    """A kernel's name without namespaces, template arguments or parameters."""
    name = name.replace("(anonymous namespace)::", "").removeprefix("void ")
    for stop in ("(", "<"):
        name = name.split(stop, 1)[0]
    return name.rsplit("::", 1)[-1].strip() or "?"


def kernel_table(folder: str, rows: int = 16, paths: Optional[list[str]] = None) -> str:
    """The GPU's activities (kernels, copies) in the perfetto traces under `folder` (or the traces `paths`), by short
    name: count, p50 and p99 duration in us, and the p50 gap before each: from the end of the activity before it on
    the same stream (tid) to its start, the launch latency a stamp-to-stamp timing holds beside the kernels' own
    time; the `rows` with the most time in all."""
    import gzip
    import json

    durs: dict[str, list[float]] = {}
    gaps: dict[str, list[float]] = {}
    for path in sorted(_traces(folder)) if paths is None else paths:
        with gzip.open(path, "rt") as f:
            events = json.load(f).get("traceEvents", [])
        gpu = {e.get("pid") for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
               and "GPU" in str(e.get("args", {}).get("name", ""))}
        streams: dict[tuple, list[tuple[float, float, str]]] = {}  # (pid, tid) -> [(start, duration, name)]
        for e in events:
            if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e:
                name = _short_name(str(e.get("name", "")))
                durs.setdefault(name, []).append(float(e["dur"]))
                if "ts" in e:
                    streams.setdefault((e["pid"], e.get("tid")), []).append((float(e["ts"]), float(e["dur"]), name))
        for acts in streams.values():
            acts.sort()
            for (ts, dur, _), (next_ts, _, name) in zip(acts, acts[1:]):
                gaps.setdefault(name, []).append(next_ts - (ts + dur))
    if not durs:
        return "  (no GPU activity in the trace)"
    lines = [f"  {'activity':40s} {'count':>6s} {'p50 us':>9s} {'p99 us':>9s} {'gap p50':>9s}"]
    for name, d in sorted(durs.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        a = np.asarray(d)
        g = f"{np.percentile(gaps[name], 50):9.1f}" if name in gaps else f"{'-':>9s}"
        lines.append(f"  {name[:40]:40s} {a.size:6d} {np.percentile(a, 50):9.1f} {np.percentile(a, 99):9.1f} {g}")
    return "\n".join(lines)


def fabric_breakdown(comm, rounds: int) -> Optional[dict]:
    """The host proxies' view of the dispatch and the combine rounds: {"dispatch": ..., "combine": ...} (see
    _breakdown), None without remote ranks."""
    if not hasattr(comm.backend, "fabric_trace"):
        return None
    out = {op: _breakdown(comm, rounds, stream) for stream, op in enumerate(("dispatch", "combine"))}
    return out if any(out.values()) else None


def _breakdown(comm, rounds: int, stream: int) -> Optional[dict]:
    """One stream's rounds (every process's trace, steady clock, one host): bell seen -> posted on the sender, sender
    posted -> arrival flagged on the receiver (the wire, the remote completion and the receiving proxy's pass), and
    the skew of the rounds' bells between GPUs (how much later the last GPU's device rang). Median us over rounds."""
    traces = multihost.share(comm.backend.fabric_trace(rounds, stream))  # per process: {gpu: [(seen, posted, flagged)]}
    per_gpu = [np.asarray(t, np.int64) for proc in traces for t in proc.values() if len(t)]
    if len(per_gpu) < 2:
        return None
    k = min(len(t) for t in per_gpu)
    tr = np.stack([t[:k] for t in per_gpu])  # [gpu, round, (seen, posted, flagged)]
    ok = (tr > 0).all(axis=(0, 2))
    tr = tr[:, ok]
    if not tr.shape[1]:
        return None
    post = (tr[:, :, 1] - tr[:, :, 0]) / 1e3
    # A round arrives once the latest other sender's region is in.
    others = np.stack([np.delete(tr[:, :, 1], i, axis=0).max(axis=0) for i in range(tr.shape[0])])
    arrive = (tr[:, :, 2] - others) / 1e3
    return {"rounds": int(tr.shape[1]), "bell_seen_to_posted_us": float(np.median(post)),
            "posted_to_remote_flag_us": float(np.median(arrive)),
            "posted_to_remote_flag_p99_us": float(np.percentile(arrive, 99)),
            "bell_skew_us": float(np.median((tr[:, :, 0].max(axis=0) - tr[:, :, 0].min(axis=0)) / 1e3))}


def _traced(comm) -> bool:
    """Whether comm's kernels record the device trace (JAX_MOE_CUDA_TRACE=1 and a backend that has one)."""
    return os.environ.get("JAX_MOE_CUDA_TRACE") == "1" and hasattr(comm.backend, "read_trace")


_TRACE_HALVES = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")
# kernels/moe_layout.h's TracePoint; the last four are the send halves' fabric phases (ranks on other nodes)
_TRACE_POINTS = ("start", "waited", "work", "end", "indexed", "free", "written", "bell")


def trace_summary(comm, ops: tuple = ("dispatch", "combine")) -> Optional[dict]:
    """Median device-side timeline of an iteration per GPU (JAX_MOE_CUDA_TRACE=1): every half of `ops`, its start, end
    of its waits on peers, end of its block 0's work, and end, and any other point of _TRACE_POINTS the kernels record
    (the send halves' fabric phases), in us after that GPU's start of the first op's send half (rounds where every
    half of `ops` ran). (GPUs' clocks are not synchronised: only times on one GPU are compared.)"""
    if not _traced(comm):
        return None
    halves = [i for i, h in enumerate(_TRACE_HALVES) if h.split("_")[0] in ops]
    traces = comm.backend.read_trace()
    out = {}
    for ordinal in sorted(traces):
        tr = traces[ordinal][:, halves, :].astype(np.int64)  # [ring, half, point], channel 0 only
        used = (tr[:, :, 0] > 0).all(axis=1)
        if not used.any():
            continue
        rounds = tr[used]
        rel = (rounds - rounds[:, :1, :1]) / 1e3
        recorded = (rounds > 0).all(axis=0)  # a point the half does not record stays 0
        out[ordinal] = {f"{_TRACE_HALVES[h]}.{p}": float(np.median(rel[:, i, j]))
                        for i, h in enumerate(halves) for j, p in enumerate(_TRACE_POINTS[:tr.shape[2]])
                        if recorded[i, j]}
    for ordinal, row in out.items():
        print(f"[moe] trace gpu{ordinal}: " + " ".join(f"{k}={v:.1f}" for k, v in row.items()), flush=True)
    return out


# Each half's stamp window in a split iteration (programs._api_iteration: stamps k and k + 1) and its trace half.
_STAMP_WINDOWS = (("dispatch_send", 0, 0), ("dispatch_recv", 1, 1), ("combine_send", 3, 2), ("combine_recv", 4, 3))


def stamp_gaps(comm, stamps: np.ndarray) -> Optional[dict]:
    """Where each half's stamp-to-stamp time goes on each of this process's GPUs (JAX_MOE_CUDA_TRACE=1; `stamps`:
    gpu_run's [ranks, iters, 6] %globaltimer ns of a split run, read before any other run overwrites the trace's ring):
    p50 in us of `before` (the stamp before -> the kernel's traced start: the launch, until part 0 runs), `kernel`
    (traced start -> end, the last part's arrival) and `after` (end -> the stamp after: the last part's signals, the
    kernel's exit, the next launch). Each window is matched with the trace round whose start lies in it (one GPU's
    clock), so only the last rounds the ring holds count. {ordinal: {half: {"before", "kernel", "after", "rounds"}}}."""
    if not _traced(comm):
        return None
    ranks = {e.local_id: e.rank for e in comm.backend.table.local(jax.process_index())}
    out = {}
    for ordinal, tr in comm.backend.read_trace().items():
        if ranks.get(ordinal) is None:
            continue
        st = np.asarray(stamps[ranks[ordinal]], np.int64)  # [iters, 6]
        row = {}
        for half, k, h in _STAMP_WINDOWS:
            start, end = tr[:, h, 0].astype(np.int64), tr[:, h, 3].astype(np.int64)
            keep = (start > 0) & (end >= start)
            order = np.argsort(start[keep])
            start, end = start[keep][order], end[keep][order]
            if not start.size:
                continue
            t0, t1 = st[:, k], st[:, k + 1]
            j = np.minimum(np.searchsorted(start, t0), start.size - 1)  # the first round starting at or after t0
            hit = (start[j] >= t0) & (start[j] <= t1) & (end[j] <= t1)
            if hit.sum() < 3:
                continue
            s, e, a, b = start[j][hit], end[j][hit], t0[hit], t1[hit]
            row[half] = {"before": float(np.median(s - a)) / 1e3, "kernel": float(np.median(e - s)) / 1e3,
                         "after": float(np.median(b - e)) / 1e3, "rounds": int(hit.sum())}
        if row:
            out[ordinal] = row
            print(f"[moe] stamp gaps gpu{ordinal} (us, p50 before / kernel / after): " + "  ".join(
                f"{h} {v['before']:.1f} / {v['kernel']:.1f} / {v['after']:.1f}" for h, v in row.items()), flush=True)
    return out or None


def peer_bandwidth(platform, n):
    if platform != "gpu":
        return None
    try:
        mod, _ = native_module("cuda")
        if mod is None:
            return None
        devs = jax.local_devices(backend="gpu")
        size = 256 << 20
        res = {"d2d_local_GBps": mod.peer_copy_bandwidth(devs[0].local_hardware_id, devs[0].local_hardware_id,
                                                           size, 20) / 1e9}
        # How the GPU reads pinned host memory: the receive kernels of ranks on other nodes read it in place.
        copy, read, fresh = mod.host_read_bandwidth(devs[0].local_hardware_id, 64 << 20, 10)
        res["h2d_copy_GBps"], res["h2d_kernel_read_GBps"] = copy / 1e9, read / 1e9
        res["h2d_kernel_read_after_cpu_write_GBps"] = fresh / 1e9
        if n > 1 and len(devs) > 1:
            res["peer_GBps"] = mod.peer_copy_bandwidth(devs[0].local_hardware_id, devs[1].local_hardware_id,
                                                       size, 20) / 1e9
        return res
    except Exception as e:  # noqa: BLE001 - a missing number must not stop the benchmark
        print(f"[moe] peer bandwidth not measured: {e}", file=sys.stderr)
        return None
