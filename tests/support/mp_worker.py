"""One process of a multi-process run: `python mp_worker.py PROC NPROC PORT DEVICES_PER_PROC BACKEND SEED`
(started by support.multiprocess.launch).

Every process builds the same global inputs from SEED, runs dispatch -> experts -> combine (three rounds: random
routing, fewer tokens than max_tokens, skewed; epochs across processes) and its gradient over all processes'
devices, gathers the results and checks them against the NumPy oracle. Prints OK on success. BACKEND "cuda" runs on GPUs, one per process (GPU PROC); the others on CPU devices.
"""
from __future__ import annotations

import faulthandler
import os
import re
import sys

import jax

faulthandler.dump_traceback_later(int(os.environ.get("MP_WORKER_HANG_S", "150")), exit=True)  # a hang shows where every thread is, then the process ends

proc, nproc, port, per_proc, backend, seed = sys.argv[1:7]
# MP_WORKER_GPUS=k: the processes share k GPUs round-robin (several processes on one GPU: then results are gathered
# through the key-value store, since NCCL refuses two ranks on one GPU).
SHARED_GPUS = int(os.environ.get("MP_WORKER_GPUS", "0"))
if backend == "cuda":
    assert per_proc == "1", "backend cuda: one GPU per process"
    gpu = int(proc) % SHARED_GPUS if SHARED_GPUS else int(proc)
    jax.distributed.initialize(f"127.0.0.1:{port}", int(nproc), int(proc), local_device_ids=[gpu],
                               initialization_timeout=60)
else:
    jax.config.update("jax_num_cpu_devices", int(per_proc))
    jax.distributed.initialize(f"127.0.0.1:{port}", int(nproc), int(proc), initialization_timeout=60)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `support`

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_moe  # noqa: E402
from jax_moe import multihost  # noqa: E402
from support.grads import check_against, check_grads, grad_problem, moe_loss_fn  # noqa: E402
from support.helpers import (check_roundtrip, expert_fn, random_routing, random_tokens, received,  # noqa: E402
                             roundtrip)
from support.remat import dense_grads, remat_grad_fn, remat_problem  # noqa: E402
from support.program_shapes import run_all  # noqa: E402


def gather(a):
    if a is None:
        return None
    if SHARED_GPUS:  # through the key-value store: NCCL refuses processes sharing a GPU
        return multihost.gather(a, timeout_s=120)
    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def check_transpose(comm, problem, n: int, t: int, e: int) -> None:
    """dispatch's transpose of expert_x itself: every token comes back once per valid entry."""
    x, idx = problem[0], problem[1]
    mesh, spec = comm.mesh, jax.sharding.PartitionSpec("ep")

    def body(x, idx):
        d = comm.dispatch(x, idx)
        return comm.backend.dispatch_transpose(d.expert_x.astype(comm.cfg.combine_dtype), d._route, idx)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
    sharding = jax.sharding.NamedSharding(mesh, spec)
    got = gather(f(*[jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i]) for v in (x, idx)]))
    valid = ((idx >= 0) & (idx < e)).astype(np.float32)
    valid = valid * np.array([[idx[i, k] not in idx[i, :k] for k in range(idx.shape[1])] for i in range(len(idx))])
    want = valid.sum(1)[:, None] * np.asarray(x, np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2)


def check_queue_ahead(comm, rng, n: int, programs: int, unroll: int) -> None:
    """`programs` programs of `unroll` round trips each, enqueued back to back without waiting, as a training loop or
    the benchmark does: the host runs hundreds of launches ahead of the GPU (with "staged" across nodes this stopped
    the proxy's copies, docs/cuda.md "Found and mended"). Every round trip of every program against the oracle."""
    cfg = comm.cfg
    t, r, e = cfg.max_tokens, cfg.experts_per_token, cfg.num_experts
    x, _ = random_tokens(rng, n * t, cfg.hidden, False)
    idx = random_routing(rng, n, t, r, e, mask=0.2, skew=True)
    w = rng.random((n * t, r)).astype(np.float32)

    def body(x, idx, w):
        outs = []
        for _ in range(unroll):
            d = comm.dispatch(x, idx, topk_weights=w)
            outs.append(comm.combine(expert_fn(d.expert_x, d.expert_counts, comm), None, d))
        return (*received(d), d.expert_counts, jnp.stack(outs, axis=1))

    spec = P("ep")
    f = jax.jit(jax.shard_map(body, mesh=comm.mesh, in_specs=(spec, spec, spec), out_specs=spec))
    sharding = jax.sharding.NamedSharding(comm.mesh, spec)
    args = [multihost.place(v, sharding) for v in (x, idx, w)]
    results = [f(*args) for _ in range(programs)]  # no wait between them
    for res in results:
        expert_x, expert_scale, counts, outs = (gather(v) for v in res)
        for i in range(unroll):
            check_roundtrip(comm, n, x, idx, w, None, (expert_x, expert_scale, counts, outs[:, i]))
    print(f"QUEUE-AHEAD process {jax.process_index()}: {programs} programs of {unroll} round trips", flush=True)


def check_channel1_refusal(comm, rng, n: int) -> None:
    """Combine channel 1 (dispatch's transpose) carries summed rows only across nodes (its regions hold one row per
    token): rows per (t, k) on it are refused by the handler, naming the channel, on every rank alike."""
    cfg = comm.cfg
    x, _ = random_tokens(rng, n * cfg.max_tokens, cfg.hidden, False)
    idx = random_routing(rng, n, cfg.max_tokens, cfg.experts_per_token, cfg.num_experts, mask=0.2)

    def body(x, idx):
        d = comm.dispatch(x, idx)
        h = comm.backend.combine_send(d.expert_x, d._route, idx, channel=1, mode=0)  # 0: rows per (t, k)
        return comm.backend.combine_recv(h, jnp.ones(idx.shape, jnp.float32), idx)

    spec = P("ep")
    f = jax.jit(jax.shard_map(body, mesh=comm.mesh, in_specs=(spec, spec), out_specs=spec))
    sharding = jax.sharding.NamedSharding(comm.mesh, spec)
    try:
        jax.block_until_ready(f(*[multihost.place(v, sharding) for v in (x, idx)]))
    except Exception as err:  # noqa: BLE001 - the refusal is what this checks
        assert "channel 1" in str(err) and "summed rows" in str(err), err
        print(f"REFUSED process {jax.process_index()}: {err}", flush=True)
        return
    raise AssertionError("rows per (t, k) on combine channel 1 across nodes were not refused")


def check_fabric_memory(comm) -> None:
    """MP_EXPECT_FABRIC_ON_GPU=1/0: the cuda areas of remote ranks must be in GPU memory / host memory (unset: any);
    prints where they are either way."""
    info = getattr(comm.backend, "fabric_info", lambda: {})()
    for ordinal, i in info.items():
        print(f"FABRIC process {jax.process_index()} device {ordinal}: {i.get('provider')}, {i.get('memory')}, "
              f"visibility: {i.get('visibility')}, fallback: {i.get('fallback') or '-'}, NUMA node: "
              f"{i.get('numa_node')}, areas on node {i.get('areas_numa_node')}, {i.get('bytes')} bytes, "
              f"{i.get('regions_per_lane')} regions a lane for {i.get('remote_ranks')} remote ranks", flush=True)
    asked = os.environ.get("JAX_MOE_FABRIC_MEMORY", "auto")
    for i in info.values():  # "auto" on host memory says why; an explicit choice fell back from nothing
        if asked == "auto" and not i["on_gpu"]:
            assert i.get("fallback"), f"fabric_memory auto kept host memory without saying why: {info}"
        elif asked != "auto":
            assert not i.get("fallback"), f"fabric_memory={asked} reports a fallback: {info}"
        stages = asked == "staged" or (asked == "auto" and os.environ.get("CUDA_MODULE_LOADING") == "EAGER"
                                       and os.environ.get("JAX_MOE_CUDA_COMMAND_BUFFERS", "0") != "1")
        assert bool(i.get("staged")) == stages, f"fabric_memory={asked}: staged is {i.get('staged')}: {info}"
        # the areas hold a region per rank on another node, none for this node's ranks: the count from the topology
        # the test set (equal nodes of ranks_per_node consecutive ranks), and at least that many bytes allocated (a
        # send and a receive area per stream, each mirrored in HBM when staged)
        assert i["regions_per_lane"] == i["remote_ranks"] > 0, f"areas not sized by the remote ranks: {info}"
        per_node, ranks = comm.backend.options.ranks_per_node, comm.backend.options.num_ranks
        if per_node:
            assert i["regions_per_lane"] == ranks - per_node, \
                f"{ranks} ranks in nodes of {per_node}: {info}"
        areas = 2 * i["lanes"] * i["regions_per_lane"] * sum(i["region_bytes"]) * (2 if i["staged"] else 1)
        assert i["bytes"] >= areas, f"{i['bytes']} bytes allocated, less than the areas' {areas}: {info}"
        if asked == "auto":  # and says which way it went
            assert ("staged through HBM instead" if stages else "not staged: ") in i["fallback"], info
        # where the preference was granted (mbind may be refused, a cpuset may exclude the node) and the kernel says
        if not i["on_gpu"] and i.get("areas_numa_node_granted", -1) >= 0 and i["areas_numa_node"] >= 0:
            assert i["areas_numa_node"] == i["areas_numa_node_granted"] == i["numa_node"], \
                f"pinned areas off the GPU's NUMA node: {info}"
    want = os.environ.get("MP_EXPECT_FABRIC_ON_GPU")
    if want is not None and info:
        got = {o: bool(i["on_gpu"]) for o, i in info.items()}
        assert all(v == (want == "1") for v in got.values()), f"fabric areas on the GPU: {got}, wanted {want}: {info}"


def main() -> None:
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("ep",))
    rng = np.random.default_rng(int(seed))
    e, r, hidden, t = 2 * n, 3, 128, 5
    comms = []  # Communicators are collective: keep them until every process is done with them
    if os.environ.get("MP_CHANNEL1_REFUSAL"):  # only check_channel1_refusal
        comm = jax_moe.Communicator(jax_moe.MoEConfig(e, r, hidden, t), mesh, "ep", backend=backend)
        check_channel1_refusal(comm, rng, n)
        print(f"OK process {proc}/{nproc} devices={n} backend={comm.backend_name}", flush=True)
        return
    refused = os.environ.get("MP_EXPECT_REFUSAL")  # a pattern: the Communicator must be refused with it
    if refused:
        try:
            jax_moe.Communicator(jax_moe.MoEConfig(e, r, hidden, t), mesh, "ep", backend=backend)
        except Exception as err:  # noqa: BLE001 - what the caller asked to see
            assert re.search(refused, str(err)), f"refused with {err!r}, wanted /{refused}/"
            print(f"REFUSED process {jax.process_index()}: {err}", flush=True)
            print(f"OK process {jax.process_index()}/{jax.process_count()} devices={n} backend={backend}")
            return
        raise AssertionError(f"the Communicator was built; wanted a refusal matching /{refused}/")
    ahead = os.environ.get("MP_QUEUE_AHEAD")  # "programs,unroll": only check_queue_ahead
    if ahead:
        comm = jax_moe.Communicator(jax_moe.MoEConfig(e, r, hidden, t), mesh, "ep", backend=backend)
        check_fabric_memory(comm)
        check_queue_ahead(comm, rng, n, *(int(v) for v in ahead.split(",")))
        print(f"OK process {proc}/{nproc} devices={n} backend={comm.backend_name}", flush=True)
        return
    for fp8 in (False, True):
        cfg = jax_moe.MoEConfig(e, r, hidden, t, dispatch_dtype=jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
        comm = jax_moe.Communicator(cfg, mesh, "ep", backend=backend)
        comms.append(comm)
        check_fabric_memory(comm)
        for variant in ("random", "partial", "skewed"):  # successive rounds: epochs too
            tt = t - 2 if variant == "partial" else t  # fewer tokens than max_tokens
            x, scale = random_tokens(rng, n * tt, hidden, fp8)
            idx = random_routing(rng, n, tt, r, e, mask=0.2, skew=variant == "skewed")
            w = rng.random((n * tt, r)).astype(np.float32)
            for at_dispatch in (False, True):  # rows per (t, k), or summed per (token, rank) at the experts
                outs = [gather(o) for o in roundtrip(comm, x, idx, w, scale, weights_at_dispatch=at_dispatch)]
                check_roundtrip(comm, n, x, idx, w, scale, outs)
        if not fp8:  # rows over 2 KiB and over 64 tokens: the summed combine's later pieces, several table jobs
            big = jax_moe.Communicator(jax_moe.MoEConfig(e, r, 1536, 80), mesh, "ep", backend=backend)
            comms.append(big)
            xb, _ = random_tokens(rng, n * 70, 1536, False)
            ib = random_routing(rng, n, 70, r, e, mask=0.2, skew=True)
            wb = rng.random((n * 70, r)).astype(np.float32)
            for at_dispatch in (False, True):
                outs = [gather(o) for o in roundtrip(big, xb, ib, wb, None, weights_at_dispatch=at_dispatch)]
                check_roundtrip(big, n, xb, ib, wb, None, outs)
        if not fp8 and backend == "cuda":
            # The remote ranks' index takes chunks of 32 tokens, 8 a block: 256 tokens fit one block (dispatch_send's
            # pack blocks each derive the index alone), 257 and 2050 have a rank's pack blocks derive it together
            # (several blocks, some with no chunk, the last chunk partial). Rows repeat an expert (only the first
            # counts).
            long = jax_moe.Communicator(jax_moe.MoEConfig(e, r, 128, 2100), mesh, "ep", backend=backend)
            comms.append(long)
            for tl in (256, 257, 2050):
                xl, _ = random_tokens(rng, n * tl, 128, False)
                il = random_routing(rng, n, tl, r, e, mask=0.2, skew=True)
                again = rng.random(len(il)) < 0.3
                il[again, 2] = il[again, 1]
                wl = rng.random((n * tl, r)).astype(np.float32)
                for at_dispatch in (False, True):
                    outs = [gather(o) for o in roundtrip(long, xl, il, wl, None, weights_at_dispatch=at_dispatch)]
                    check_roundtrip(long, n, xl, il, wl, None, outs)
        # Several rounds in one program, forward and backward (micro-batch accumulation sums the weights' gradients
        # with an all-reduce: not where processes share a GPU).
        run_all(comm, rng, 3, fp8, gather=gather, micro=None if SHARED_GPUS else 2)

    comm = jax_moe.Communicator(jax_moe.MoEConfig(e, r, hidden, t), mesh, "ep", backend=backend)
    problem = grad_problem(rng, n, t, r, e, hidden)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("ep"))
    args = [jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i]) for v in problem]
    if SHARED_GPUS < n:
        # The gradients take XLA's all-to-all for the per-entry path, which NCCL refuses on a shared GPU: check the
        # one part of them our kernels carry alone, dispatch's transpose (combine channel 1), against the oracle.
        check_transpose(comm, problem, n, t, e)
    else:
        grads = moe_loss_fn(comm, split_halves=True, collective=not SHARED_GPUS)(*args)
        check_grads([gather(v) for v in grads], problem, e)
        # Scan over three remat'ed layers (MaxText's scan_layers + a remat policy), across the processes.
        rp = remat_problem(rng, n, t, r, e, hidden, 3)
        specs = [P("ep"), P("ep"), P("ep"), P(None, "ep"), P(None, "ep"), P("ep")]
        rargs = [jax.make_array_from_callback(v.shape, jax.sharding.NamedSharding(mesh, sp), lambda i, v=v: v[i])
                 for v, sp in zip(rp, specs)]
        got = remat_grad_fn(comm, "nothing_saveable", 3, collective=not SHARED_GPUS)(*rargs)
        check_against([gather(v) for v in got], dense_grads(rp, e), "scan over remat'ed layers")
    print(f"OK process {proc}/{nproc} devices={n} backend={comm.backend_name}", flush=True)


if __name__ == "__main__":
    main()
    jax.distributed.shutdown()
