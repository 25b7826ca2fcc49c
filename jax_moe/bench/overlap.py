"""`python -m jax_moe.bench overlap`: how much of dispatch and combine the send/recv split hides behind compute.

Per rank and operation (dispatch, then combine), three programs, each timed by stamps inside it (the device clock on
GPU, the host clock on CPU; the slowest rank per iteration):
- comm:    send -> recv;
- gemm:    the GEMM alone: the received rows' worth of tokens (T x top-k rows of `hidden`) times a [hidden, F] bf16
           matrix, F chosen so that the GEMM alone takes a little longer than the communication, 1.1x (scaled from a
           probe width, and once more from the chosen width where that GEMM took under 1.0x or over 1.3x the comm;
           nothing checks the second width, so a GEMM can still come out outside 1.0-1.3x: "g/c" prints its ratio).
           A GEMM shorter than the communication leaves the difference exposed however well the two overlap: the
           measure would be the GEMM's length, not the overlap (until 2026-12-04 F aimed at 1.0x and took 0.9x-1.25x;
           at 0.9x the receive after the GEMM still waited for the wire);
- overlap: send -> GEMM -> recv, the GEMM pinned between the halves by the stamps around it (its input waits for
           the send's handle, the recv's handle waits for its output).
Hidden fraction = (t_comm + t_gemm - t_overlap) / t_comm (1: all of the communication hidden, 0: none); the GEMM's
slowdown = its time inside the overlap program / its time alone - 1. p50s; the same options as `bench moe`.
"hidden as run" takes the GEMM's time inside the overlap program instead of alone: (t_comm + t_gemm_in - t_overlap)
/ t_comm, the communication that the overlap program's own GEMM did not cover. The two differ where the GEMM runs
faster or slower beside the communication than alone ("gemm slowed"): "hidden" counts a GEMM that ran faster inside
the overlap program as hidden communication, "hidden as run" does not. Why a GEMM ran faster there is not known
(5-8 % in 8 of 12 runs of two processes sharing one H200 under MPS, 2026-12-04): one guess, that the processes' GEMMs
overlap less there because their sends are far apart, does not fit the runs whose sends were 21-27 us apart and whose
GEMMs also ran 5-7 % faster.

On GPUs, as in `bench moe`, --unroll rounds run in one program after ~10 ms of matrix products, each round starting
once the one before has ended: the host enqueues the program while the GPU is busy, so the rounds are paced by the
GPU and the ranks stay in step. With one round per program, each process's rounds would start when its own host
launched them, and a receive would also wait out how far apart two hosts launch (measured at ~500 us between two
processes on one H200, 2026-12-04, where the same dispatch took ~270 us in `bench moe`).

What occupies the device while data is in flight: every half is its own kernel (or host call), none stays resident
between send and recv, so the GEMM has the whole GPU. On the NVLink path the send kernel itself moves the bytes (a
receiver only waits for flags), on the proxy path and the "cpu" backend a host thread does.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

import jax_moe
from jax_moe.backends import cpu as cpu_backend
from jax_moe.backends import cuda as cuda_backend
from jax_moe import multihost
from jax_moe.communicator import FABRIC_PROVIDERS
from jax_moe.bench import diagnostics, micro_batches, processes
from jax_moe.bench.moe import SHAPES
from jax_moe.bench.programs import busy, make_inputs, program
from jax_moe.types import CombineHandle, DispatchHandle


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m jax_moe.bench overlap", description=__doc__.split("\n")[0])
    p.add_argument("--backend", default=None, help="comma list of cuda, cpu, xla (default: cuda on GPU, cpu on CPU)")
    p.add_argument("--shape", default=None, help="comma list of small, decode, prefill (default: decode on GPU, "
                                                 "small on CPU)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 200 on GPU, 20 on CPU)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--unroll", type=int, default=10,
                   help="rounds per program on GPU (one on CPU); a program's first round also holds how far apart the "
                        "processes launched it, so keep several")
    p.add_argument("--cpu-devices", type=int, default=4, help="simulated CPU devices (CPU platform only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--micro-batches", action="store_true",
                   help="also time two micro-batches in one layer, B's dispatch in flight while A's experts run "
                        "(jax_moe/bench/micro_batches.py)")
    p.add_argument("--processes", type=int, default=1,
                   help="run the ranks in this many processes of this host (GPUs shared round-robin), as `bench moe`")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per node: with fewer than all, ranks of other nodes go through the host proxy")
    p.add_argument("--provider", default=None, choices=FABRIC_PROVIDERS,
                   help="TransferEngine provider between nodes, or between processes for the cpu backend")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


def _stamper(gpu: bool) -> Callable:
    """stamp(a, dep) -> (a, t): t a uint32 [2] (CPU) or uint64 [1] (GPU) time stamp, converted by _ns."""
    return cuda_backend.timestamp if gpu else cpu_backend.timestamp


def _ns(words: np.ndarray, gpu: bool) -> np.ndarray:
    """[..., k, 1|2] stamps -> [..., k] ns as int64."""
    if gpu:
        return words[..., 0].astype(np.int64)
    w = words.astype(np.int64)
    return w[..., 0] | (w[..., 1] << 32)


def _programs(comm, op: str, stamp, gemm_f: int):
    """The per-rank bodies of the three programs of `op` ("dispatch" or "combine"): each returns (its stamps, x as it
    passed x on), for rounds() to give the next round."""
    r = comm.cfg.experts_per_token

    def gemm(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    def operands(x):
        rows = x.shape[0] * r
        a = jnp.full((rows, x.shape[1]), 0.01, jnp.bfloat16) * x[:1, :1].astype(jnp.bfloat16)
        b = jnp.full((x.shape[1], gemm_f), 0.01, jnp.bfloat16)
        return a, b

    def timed_op(x, xs, idx, w, mid, dep=None):
        """stamp (once `dep` is ready) -> send -> mid(handle) -> recv of `op`: (start stamp, output, x as passed on).
        mid returns the handle it was given, tied to whatever it did. Combine's input is a dispatch before the stamp,
        not timed."""
        if op == "dispatch":
            x, t0 = stamp(x, idx if dep is None else dep)  # not (x, x): XLA would copy x to stamp it (programs.py)
            h = comm.dispatch_send(x, idx, x_scale=xs, topk_weights=w)
            d = comm.dispatch_recv(DispatchHandle(h._x, h._x_scale, h._topk_idx, mid(h._handle), h._comm_id,
                                                  h._topk_weights))
            return t0, d.expert_x, x
        d = comm.dispatch(x, idx, x_scale=xs, topk_weights=w)  # weights at dispatch: the expert ranks may sum
        y = d.expert_x.astype(comm.cfg.combine_dtype)
        y, t0 = stamp(y, idx if dep is None else dep)  # not (y, y), as above
        c = comm.combine_send(y, d)
        return t0, comm.combine_recv(CombineHandle(c._expert_y, c._dispatched, mid(c._handle), c._comm_id,
                                                   c._reduced)), x

    def comm_body(x, xs, idx, w):
        t0, out, x = timed_op(x, xs, idx, w, lambda h: h)
        out, t1 = stamp(out, t0)  # waits for out, its operand (stamp(out, out) made XLA copy out inside the window)
        return jnp.stack([t0, t1])[None], x

    def gemm_body(x, xs, idx, w):
        a, b = operands(x)
        a, t0 = stamp(a, b)
        g = gemm(a, b)
        g, t1 = stamp(g, t0)  # as comm_body's end
        return jnp.stack([t0, t1])[None], x

    def overlap_body(x, xs, idx, w):
        a, b = operands(x)
        stamps = {}

        def mid(handle):
            # Stamps order the GEMM: it starts once the send's handle exists, and the recv's handle passes through a
            # stamp that waits for the GEMM's output (XLA drops optimization barriers before it schedules).
            leaves, tree = jax.tree_util.tree_flatten(handle)
            a2, stamps["g0"] = stamp(a, leaves[0])  # the first leaf is what the send wrote (its ticket)
            g = gemm(a2, b)
            leaves[0], stamps["g1"] = stamp(leaves[0], g)
            stamps["g"] = g
            return jax.tree_util.tree_unflatten(tree, leaves)

        t0, out, x = timed_op(x, xs, idx, w, mid, dep=a)
        out, t1 = stamp(out, stamps["g"])
        return jnp.stack([t0, stamps["g0"], stamps["g1"], t1])[None], x

    return comm_body, gemm_body, overlap_body


Body = Callable[..., tuple[jax.Array, jax.Array]]  # (x, xs, idx, w) -> (one round's stamps [1, k, words], x passed on)


def rounds(body: Body, unroll: int, gpu: bool, stamp: Callable) -> Callable:
    """`body` run `unroll` times in one program, each round after the one before has ended; on GPU after `busy` (see
    the module's docstring). Each round gets the x the round before passed on, not the program's own: a stamp passes x
    on in place, and XLA copies a buffer that a later call still reads before it lets a call write it (a copy of x per
    round; see programs._api_iteration). Returns [1, unroll, k, words]."""
    def f(x, xs, idx, w):
        dep = busy(x) if gpu else None  # CPU: the first round waits for nothing
        out = []
        for _ in range(unroll):
            if dep is not None:
                x, _ = stamp(x, dep)  # x, once `busy` or the previous round's last stamp exists
            s, x = body(x, xs, idx, w)
            out.append(s[0])
            dep = out[-1]
        return jnp.stack(out)[None]
    return f


def stamps_only(body: Body) -> Callable:
    """`body` as a program of one round: its stamps alone."""
    return lambda x, xs, idx, w: body(x, xs, idx, w)[0]


def _run(body: Body, mesh, inputs, iters: int, warmup: int, gpu: bool, stamps: bool = False, unroll: int = 1):
    """[rounds, k] us between successive stamps, the max over ranks per round; with `stamps`, also the stamps
    themselves, [n, rounds, k + 1] ns. Rounds `unroll` at a time in one program (rounds()): at least `iters`, whole
    programs."""
    unroll = max(1, min(unroll, iters))
    f, args = program(rounds(body, unroll, gpu, _stamper(gpu)) if unroll > 1 else stamps_only(body), mesh, inputs,
                      place=multihost.place)
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    runs = [f(*args) for _ in range(-(-iters // unroll))]
    runs = [multihost.gather(r) for r in runs]  # each [n, (unroll,) k, words], in every process
    ns = _ns(np.concatenate(runs, axis=1) if unroll > 1 else np.stack(runs, axis=1), gpu)  # [n, iters', k]
    steps = np.diff(ns, axis=-1).max(axis=0) / 1e3  # us
    return (steps, ns) if stamps else steps


def sends_apart_us(ns: np.ndarray) -> float:
    """p50 over iterations of how far apart the ranks' first stamps (their sends' starts) were, us. A receive waits
    for its slowest peer's send, so this is the part of `recv after the GEMM` that no overlap can hide. Meaningful
    where the ranks share a clock: one GPU's (its processes under MPS) or one host's (the cpu backend); `bench overlap
    --processes` runs on one host."""
    first = ns[..., 0]  # [n, iters]
    return float(np.median(first.max(axis=0) - first.min(axis=0)) / 1e3)


GEMM_OVER_COMM = 1.1  # the GEMM's length the width aims at, in units of the communication's (see the docstring)
GEMM_OVER_COMM_RANGE = (1.0, 1.3)  # a width whose GEMM falls outside is scaled once more


def measure(comm, mesh, inputs, op: str, iters: int, warmup: int, gpu: bool, unroll: int = 1) -> dict:
    run = functools.partial(_run, unroll=unroll)
    stamp = _stamper(gpu)
    hidden = inputs[0].shape[1]
    comm_body, _, _ = _programs(comm, op, stamp, 128)
    t_comm = float(np.median(run(comm_body, mesh, inputs, iters, warmup, gpu)[:, 0]))
    # F so that the GEMM alone takes GEMM_OVER_COMM x t_comm: time a probe width, then scale (GEMM time is ~linear
    # in F).
    probe = 1024
    t_probe = float(np.median(run(_programs(comm, op, stamp, probe)[1], mesh, inputs, max(5, iters // 4), warmup,
                                   gpu)[:, 0]))

    def width(t_f: float, f0: int) -> int:  # the F that scales a GEMM of width f0 timed at t_f to the target
        return int(np.clip(round(f0 * GEMM_OVER_COMM * t_comm / max(t_f, 1e-3) / 128) * 128, 128, 1 << 17))

    def gemm_at(f: int):  # the overlap program of width f, and the GEMM alone's p50 at that width
        _, gemm_body, overlap_body = _programs(comm, op, stamp, f)
        return overlap_body, float(np.median(run(gemm_body, mesh, inputs, iters, warmup, gpu)[:, 0]))

    f = width(t_probe, probe)
    overlap_body, t_gemm = gemm_at(f)
    if not GEMM_OVER_COMM_RANGE[0] <= t_gemm / max(t_comm, 1e-3) <= GEMM_OVER_COMM_RANGE[1] and width(t_gemm, f) != f:
        # The probe's scale missed (GEMM time is not quite linear in F, and a shared GPU varies): once more from the
        # width just timed. A GEMM shorter than the communication could not hide all of it however well they overlap.
        f = width(t_gemm, f)
        overlap_body, t_gemm = gemm_at(f)
    ov, ov_ns = run(overlap_body, mesh, inputs, iters, warmup, gpu, stamps=True)  # [iters, 3]: send, gemm, recv
    # JAX_MOE_CUDA_TRACE=1: the halves' device timeline in the overlap program (is the recv after the GEMM still
    # waiting for its peers, or working?).
    trace = diagnostics.trace_summary(comm, (op,))
    t_total = float(np.median(ov.sum(axis=1)))
    t_gemm_in = float(np.median(ov[:, 1]))
    return {"op": op, "comm_us": t_comm, "gemm_us": t_gemm, "gemm_f": f, "gemm_rows": inputs[0].shape[0]
            // mesh.size * comm.cfg.experts_per_token, "gemm_hidden": hidden, "overlap_us": t_total,
            "gemm_in_overlap_us": t_gemm_in, "send_us": float(np.median(ov[:, 0])),
            "recv_after_gemm_us": float(np.median(ov[:, 2])), "sends_apart_us": sends_apart_us(ov_ns),
            "hidden_fraction": (t_comm + t_gemm - t_total) / t_comm if t_comm > 0 else None,
            "hidden_fraction_as_run": (t_comm + t_gemm_in - t_total) / t_comm if t_comm > 0 else None,
            "gemm_slowdown": t_gemm_in / t_gemm - 1 if t_gemm > 0 else None,
            "min_step_us": float(ov.min()),  # stamps in program order: never negative
            "device_trace": trace}


def sms_in_flight(comm, op: str, tokens: int) -> dict:
    """What our kernels occupy while the bytes move: "cuda" pushes them from the send kernel itself (its blocks on
    min(blocks, SMs) SMs; with ranks on other nodes block 0 and the pack blocks come first, so a grid can exceed two an SM), and
    launches nothing between the halves, so the GEMM has every SM (ranks on other nodes: the host proxy moves the
    bytes, no SM). Other backends: no GPU kernels (None)."""
    shapes = getattr(comm.backend, "launch_shapes", None)
    if shapes is None:
        return {"sms_in_flight": None, "send_kernel": None, "sms_between_halves": None}
    s = shapes(tokens)
    blocks, threads = s[f"{op}_send"]
    return {"sms_in_flight": min(blocks, s["sms"]), "send_kernel": [blocks, threads], "sms_between_halves": 0}


def _percent(fraction: Optional[float], width: int) -> str:
    """A fraction as a right-aligned percent cell, "-" where there is none (no communication or GEMM time)."""
    return f"{'-':>{width}}" if fraction is None else f"{100 * fraction:>{width - 1}.0f}%"


def main(argv) -> int:
    args = _parse(list(argv))
    if args.processes > 1 and not os.environ.get(processes.PROC_ENV):
        return processes.launch(list(argv), args.processes, suite="overlap")
    joined = processes.join()
    leader = joined is None or joined[0] == 0
    if not leader:  # the others run the same programs; process 0 prints and writes
        sys.stdout = open(os.devnull, "w")
    try:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    except RuntimeError:
        pass
    gpu = jax.default_backend() == "gpu"
    backends = (args.backend or ("cuda" if gpu else "cpu")).split(",")
    shapes = (args.shape or ("decode" if gpu else "small")).split(",")
    iters = args.iters or (200 if gpu else 20)
    unroll = args.unroll if gpu else 1  # CPU: the host clock is the device's, no launch gap to hide
    devices = jax.devices()
    n = len(devices)
    mesh = jax.make_mesh((n,), ("ep",), devices=devices)
    rng = np.random.default_rng(args.seed)
    nodes = "" if args.ranks_per_node is None else f" ranks_per_node={args.ranks_per_node} provider={args.provider}"
    print(f"[overlap] platform={jax.default_backend()} ranks={n}{nodes} devices={devices[0].device_kind} "
          f"backends={backends} shapes={shapes}; us, p50 of the slowest rank", flush=True)
    print(f"{'shape':<8}{'backend':<8}{'op':<9}{'comm':>9}{'gemm':>9}{'g/c':>6}{'both':>9}{'hidden':>8}{'as run':>8}"
          f"{'gemm slowed':>12}{'GEMM':>22}  SMs of our send kernel (none between the halves); in `both`: send, recv "
          f"after the GEMM, the ranks' sends apart")
    results = []
    for shape in shapes:
        if shape not in SHAPES:
            print(f"[overlap] unknown shape {shape!r}", file=sys.stderr)
            return 2
        t, hidden, e, r, fp8 = SHAPES[shape]
        if e % n:
            print(f"[overlap] skip {shape}: {e} experts not divisible by {n} ranks")
            continue
        cfg = jax_moe.MoEConfig(e, r, hidden, t, dispatch_dtype=jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
        inputs = make_inputs(rng, n, t, hidden, e, r, fp8)
        for backend in backends:
            try:
                comm = jax_moe.Communicator(cfg, mesh, "ep", backend=backend, ranks_per_node=args.ranks_per_node,
                                            fabric_provider=args.provider)  # None: the Communicator's defaults
            except (jax_moe.BackendUnavailable, ValueError) as err:
                print(f"[overlap] skip backend {backend}: {err}")
                continue
            if args.micro_batches:
                mb = {"shape": shape, "backend": backend, "ranks": n, "op": "two micro-batches",
                      **micro_batches.measure(comm, mesh, inputs, iters, args.warmup, gpu,
                                                              functools.partial(_run, unroll=unroll),
                                                              _stamper(gpu))}
                results.append(mb)
                print(f"{shape:<8}{backend:<8}two micro-batches: comm {mb['comm_us']:.1f}, one after the other "
                      f"{mb['sequential_us']:.1f}, two in flight {mb['two_us']:.1f} us: "
                      f"{100 * mb['hidden_fraction']:.0f}% of B's dispatch and A's combine hidden "
                      f"(experts' width {mb['expert_width']})", flush=True)
                if mb["both_open_us"] is not None:
                    print(f"{shape:<8}{backend:<8}two micro-batches, both rounds open: {mb['both_open_us']:.1f} us: "
                          f"{100 * mb['both_open_hidden_fraction']:.0f}% hidden", flush=True)
            for op in ("dispatch", "combine"):
                res = {"shape": shape, "backend": backend, "ranks": n,
                       **measure(comm, mesh, inputs, op, iters, args.warmup, gpu, unroll), **sms_in_flight(comm, op, t)}
                results.append(res)
                print(f"{shape:<8}{backend:<8}{op:<9}{res['comm_us']:>9.1f}{res['gemm_us']:>9.1f}"
                      f"{res['gemm_us'] / max(res['comm_us'], 1e-3):>6.2f}{res['overlap_us']:>9.1f}"
                      f"{_percent(res['hidden_fraction'], 8)}{_percent(res['hidden_fraction_as_run'], 8)}"
                      f"{_percent(res['gemm_slowdown'], 12)}"
                      f"{res['gemm_rows']:>7}x{hidden}x{res['gemm_f']:<8}  "
                      f"{'-' if res['sms_in_flight'] is None else res['sms_in_flight']:>4}  "
                      f"{res['send_us']:.1f}, {res['recv_after_gemm_us']:.1f}, {res['sends_apart_us']:.1f}",
                      flush=True)
            del comm
    if args.json and leader:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"platform": jax.default_backend(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
