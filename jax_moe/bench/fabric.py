"""`python -m jax_moe.bench fabric`: TransferEngine scatter latency and bandwidth on localhost.

One sender scatters `size` bytes to each of N peers (one write per peer, imm 1); every peer waits for
its immediate and answers with a zero-byte write (imm 2); the sender's clock stops when all N answers
are in. Latency is that round (p50/p99 over the timed rounds, after warm-up); bandwidth is N * size /
p50. Peers are separate processes that exchange addresses through files in a temporary directory.
--exchange times what an all-to-all between two nodes does instead: both ranks write `size` bytes to each other at
once, and each sends its next round when the other's last one is in, so the two run in step. A round is the time
between two arrivals at rank 0 (not send -> arrival: the ranks' phases differ by up to a one-way, which would move
time between the two ends of a round): a one-way time with both directions loaded, beside the default's one
direction alone (a provider driven by CPUs, like tcp and shm, shares them between the two directions).
--memory cuda puts every buffer in GPU memory (rank r on GPU r % --gpus, registered with its dmabuf where the driver
exports one); the JSON says how the engine registered it ("<provider>_registration").
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import numpy as np

DEFAULT_SIZES = "8K,64K,512K,4M"
WAIT = 30.0


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s[:-1] if s[-1:] in "KMG" else s) * mult


def _fmt_size(n: int) -> str:
    for unit, m in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}B"
    return f"{n} B"


def _publish(d, name, data: bytes):
    tmp = os.path.join(d, f".{name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.rename(tmp, os.path.join(d, name))


def _fetch(d, name, timeout=60.0) -> bytes:
    path = os.path.join(d, name)
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"bench: {name} did not appear within {timeout}s")
        time.sleep(0.005)
    with open(path, "rb") as f:
        return f.read()


def _rounds_for(size: int, warmup: int, iters: int) -> tuple[int, int]:
    # Fewer rounds for the largest sizes keep the whole suite within a couple of minutes on 2 cores.
    if size >= (1 << 22):
        return max(2, warmup // 4), max(10, iters // 4)
    if size >= (1 << 19):
        return max(2, warmup // 2), max(20, iters // 2)
    return warmup, iters


MEMORIES = ("host", "cuda")


def cuda_module() -> Any:
    """jax_moe._core.cuda (GPU memory for --memory cuda), or RuntimeError saying why there is none."""
    from jax_moe import _core

    mod = getattr(_core, "cuda", None)
    if mod is None or not hasattr(mod, "DeviceMemory"):
        raise RuntimeError("--memory cuda: this build of jax_moe._core has no cuda module (built without CUDA); "
                           "use --memory host")
    return mod


def _buffer(eng: Any, nbytes: int, memory: str, ordinal: int, fill: bool) -> tuple[Any, Any]:
    """A registered buffer of `nbytes`: (region, owner); the owner must outlive the region."""
    if memory == "cuda":
        mem = cuda_module().DeviceMemory(nbytes, ordinal)  # zeroed: the bytes' values do not matter on the wire
        return eng.register_ptr(mem.ptr, mem.nbytes, device=ordinal, dmabuf_fd=mem.dmabuf_fd), mem
    buf = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8) if fill else np.zeros(nbytes, np.uint8)
    return eng.register(buf), buf


def _row(size: int, seconds: list[float], moved: int, memory: str, registration: str, **extra: Any) -> dict:
    """One size's result: p50 / p99 of the timed rounds (s), and GB/s for the `moved` bytes of a p50 round."""
    t = np.array(seconds)
    p50, p99 = float(np.percentile(t, 50)), float(np.percentile(t, 99))
    return {"size": size, "rounds": len(t), "p50_us": p50 * 1e6, "p99_us": p99 * 1e6, "gbps": moved / p50 / 1e9,
            "memory": memory, "registration": registration, **extra}


def _worker(d: str, rank: int, peers: int, provider: str, sizes: list[int], warmup: int, iters: int,
            memory: str = "host", gpus: int = 1, exchange: bool = False) -> None:
    try:
        if exchange:
            _exchange(d, rank, provider, sizes, warmup, iters, memory, gpus)
        else:
            _serve(d, rank, peers, provider, sizes, warmup, iters, memory, gpus)
    except Exception as e:  # the launcher reports it: a worker's traceback alone is easy to lose
        _publish(d, f"error.{rank}", f"rank {rank}: {type(e).__name__}: {e}".encode())
        raise


def _serve(d: str, rank: int, peers: int, provider: str, sizes: list[int], warmup: int, iters: int, memory: str,
           gpus: int) -> None:
    from jax_moe import fabric

    eng = fabric.TransferEngine(provider)
    biggest = max(max(sizes), 1)
    mr, owner = _buffer(eng, peers * biggest if rank == 0 else biggest, memory, rank % gpus, fill=rank == 0)
    _publish(d, f"addr.{rank}", eng.address())
    _publish(d, f"desc.{rank}", mr.descriptor())
    if rank == 0:
        ids = [eng.connect(_fetch(d, f"addr.{r}"), WAIT) for r in range(1, peers + 1)]
        ps = eng.peer_set(ids, [_fetch(d, f"desc.{r}") for r in range(1, peers + 1)])
        results = []
        for size in sizes:
            w, n = _rounds_for(size, warmup, iters)
            src = np.arange(peers, dtype=np.int64) * size
            lengths = np.full(peers, size, np.int64)
            dst = np.zeros(peers, np.int64)
            times = []
            for r in range(w + n):
                t0 = time.perf_counter()
                eng.scatter(ps, mr, src, lengths, dst, 1)
                eng.wait_imm(2, peers, WAIT)
                t1 = time.perf_counter()
                eng.wait_sends(WAIT)
                if r >= w:
                    times.append(t1 - t0)
            results.append(_row(size, times, peers * size, memory, mr.registration))
        _publish(d, "results", json.dumps(results).encode())
    else:
        sender = eng.connect(_fetch(d, "addr.0"), WAIT)
        ps = eng.peer_set([sender], [_fetch(d, "desc.0")])
        for size in sizes:
            w, n = _rounds_for(size, warmup, iters)
            for _ in range(w + n):
                eng.wait_imm(1, 1, WAIT)
                eng.barrier(ps, 2)
        eng.wait_sends(WAIT)
        _fetch(d, "results", 120)  # keep the endpoint alive until the sender is done
    del mr  # the registration goes before the engine, and both before the memory (a dmabuf's fd stays open till then)
    eng.close()
    del owner


def _exchange(d: str, rank: int, provider: str, sizes: list[int], warmup: int, iters: int, memory: str,
              gpus: int) -> None:
    """Two ranks write `size` bytes to each other every round (imm 1); a round ends when the other's write is in.
    Rank 0 publishes the p50 / p99 of the intervals between its arrivals."""
    from jax_moe import fabric

    eng = fabric.TransferEngine(provider)
    other = 1 - rank
    biggest = max(max(sizes), 1)
    mr, owner = _buffer(eng, 2 * biggest, memory, rank % gpus, fill=True)  # sent from the first half, into the second
    _publish(d, f"addr.{rank}", eng.address())
    _publish(d, f"desc.{rank}", mr.descriptor())
    ps = eng.peer_set([eng.connect(_fetch(d, f"addr.{other}"), WAIT)], [_fetch(d, f"desc.{other}")])
    results = []
    for size in sizes:
        w, n = _rounds_for(size, warmup, iters)
        src, dst, length = np.zeros(1, np.int64), np.full(1, biggest, np.int64), np.full(1, size, np.int64)
        arrivals = []
        for _ in range(w + n + 1):
            eng.scatter(ps, mr, src, length, dst, 1)
            eng.wait_imm(1, 1, WAIT)
            arrivals.append(time.perf_counter())
            eng.wait_sends(WAIT)  # as the scatter rounds do: no write of ours outlives its round
        results.append(_row(size, list(np.diff(arrivals[w:])), 2 * size, memory, mr.registration,
                            pattern="exchange"))
    eng.barrier(ps, 2)  # neither closes its endpoint while the other may still write into it
    eng.wait_imm(2, 1, WAIT)
    eng.wait_sends(WAIT)
    if rank == 0:
        _publish(d, "results", json.dumps(results).encode())
    del mr
    eng.close()
    del owner


def run_workers(module: str, rank_args: list[list[str]], what: str, timeout: float):
    """Runs `python -m module --worker DIR *rank_args[r]` for every rank in a fresh directory and returns the JSON the
    workers publish there as "results". Any worker failing, or all of them running past `timeout`, raises; workers
    still running are killed."""
    with tempfile.TemporaryDirectory(prefix="jax_moe_bench_") as d:
        cmd = [sys.executable, "-m", module, "--worker", d]
        procs = []
        try:
            for args in rank_args:
                procs.append(subprocess.Popen(cmd + args))
            end = time.monotonic() + timeout
            while any(p.poll() is None for p in procs):
                if time.monotonic() > end or any(p.poll() not in (None, 0) for p in procs):
                    break
                time.sleep(0.05)
            if any(p.poll() != 0 for p in procs):
                errors = [_fetch(d, name, 0).decode() for name in sorted(os.listdir(d)) if name.startswith("error.")]
                raise RuntimeError(f"{what}: workers failed or exceeded {timeout}s"
                                   + "".join(f"; {e}" for e in errors))
            return json.loads(_fetch(d, "results", 1))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)


def _run(provider: str, peers: int, sizes: list[int], warmup: int, iters: int, timeout: float, memory: str = "host",
         gpus: int = 1, exchange: bool = False) -> list[dict]:
    args = [str(peers), provider, ",".join(map(str, sizes)), str(warmup), str(iters), memory, str(gpus),
            "exchange" if exchange else "scatter"]
    return run_workers("jax_moe.bench.fabric", [[str(rank)] + args for rank in range(2 if exchange else peers + 1)],
                       f"bench fabric ({provider})", timeout)


def fi_pingpong_us(provider: str, size: int, iters: int = 2000, timeout: float = 60.0) -> Optional[float]:
    """libfabric's own `fi_pingpong -e rdm` between two local processes: its usec/xfer at `size` bytes, or None
    when the tool is missing or fails. The reference the engine's and the proxy's round trips are compared with."""
    exe = shutil.which("fi_pingpong")
    if exe is None:
        return None
    args = [exe, "-p", provider, "-e", "rdm", "-S", str(size), "-I", str(iters)]
    port = str(_free_port())
    server = subprocess.Popen(args + ["-B", port], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(0.3)
        client = subprocess.run(args + ["-P", port, "127.0.0.1"], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if server.poll() is None:
            server.kill()
        server.wait(10)
    for line in client.stdout.splitlines():  # bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec
        fields = line.split()
        if len(fields) == 8 and fields[0] == str(size):
            try:
                return float(fields[6])
            except ValueError:
                return None
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        d, rank, peers, provider, sizes, warmup, iters, memory, gpus, pattern = argv[1:11]
        _worker(d, int(rank), int(peers), provider, [int(s) for s in sizes.split(",")], int(warmup), int(iters),
                memory, int(gpus), pattern == "exchange")
        return 0
    ap = argparse.ArgumentParser(prog="python -m jax_moe.bench fabric", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--providers", default="tcp,shm", help="comma-separated libfabric providers")
    ap.add_argument("--peers", type=int, default=3, help="receivers (processes besides the sender)")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="bytes per peer, e.g. 8K,64K,512K,4M")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=300.0, help="per provider, seconds")
    ap.add_argument("--memory", choices=MEMORIES, default="host",
                    help="where the buffers live: host memory (numpy), or GPU memory (jax_moe._core.cuda)")
    ap.add_argument("--gpus", type=int, default=1, help="--memory cuda: rank r's buffer is on GPU r %% gpus")
    ap.add_argument("--exchange", action="store_true",
                    help="two ranks write to each other at once (--peers is then 1); a round ends when the other's "
                         "bytes are in: one-way with both directions loaded")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.exchange:
        args.peers = 1
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    if args.memory == "cuda":
        try:
            cuda_module()
        except RuntimeError as e:
            print(f"bench fabric: {e}", file=sys.stderr)
            return 2
    what = ("TransferEngine exchange (2 ranks write to each other at once; round: the other's bytes in)"
            if args.exchange else f"TransferEngine scatter round (1 -> {args.peers} peers, ack by zero-byte write)")
    print(f"{what}, {args.memory} memory, {platform.node()} ({os.cpu_count()} CPUs)")
    print(f"{'provider':<9}{'per peer':>10}{'rounds':>8}{'p50 us':>11}{'p99 us':>11}{'GB/s':>8}")
    all_results = {}
    for provider in args.providers.split(","):
        try:
            res = _run(provider, args.peers, sizes, args.warmup, args.iters, args.timeout, args.memory,
                       max(1, args.gpus), args.exchange)
        except RuntimeError as e:
            print(f"bench fabric: {e}", file=sys.stderr)
            return 1
        all_results[provider] = res
        all_results[f"{provider}_registration"] = res[0]["registration"] if res else None
        for r in res:
            print(f"{provider:<9}{_fmt_size(r['size']):>10}{r['rounds']:>8}{r['p50_us']:>11.1f}{r['p99_us']:>11.1f}"
                  f"{r['gbps']:>8.2f}  ({r['registration']})")
        ref_size = min((s for s in sizes if s), default=64)  # fi_pingpong has no empty message
        ref = fi_pingpong_us(provider, ref_size)
        all_results[f"{provider}_fi_pingpong_us"] = ref
        all_results[f"{provider}_fi_pingpong_round_trip_us"] = None if ref is None else 2 * ref
        print(f"{provider:<9}{_fmt_size(ref_size):>10}  fi_pingpong -e rdm (libfabric's own, same run): "
              + (f"{ref:.1f} us/xfer one way, {2 * ref:.1f} us round trip" if ref is not None else "unavailable"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
