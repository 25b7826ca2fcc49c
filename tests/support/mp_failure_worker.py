"""Failure scenarios across processes: `python mp_failure_worker.py MODE PROC NPROC PORT [TIMEOUT_S]`.

kill:     process 1 is SIGKILLed right after set-up; the others must report an error naming it within the timeout.
exit:     process 1 exits (os._exit) right after set-up; likewise.
stall:    process 1 stays alive but never calls; likewise.
badid:    process 1 routes a token to expert id E; every process must report that id and rank at once.
mismatch: process 1 builds its Communicator with another max_tokens; set-up must fail with a clear error.
Each surviving process prints one line saying what happened and exits 0 (the test reads the lines).
TIMEOUT_S is the Communicator's timeout; the provider comes from JAX_MOE_FABRIC_PROVIDER.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import jax

mode, proc, nproc, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
TIMEOUT_S = float(sys.argv[5]) if len(sys.argv) > 5 else 5.0
# MP_FAILURE_BACKEND=cuda: one GPU per process (MP_WORKER_GPUS GPUs shared round-robin), every rank its own node
# (JAX_MOE_RANKS_PER_NODE=1 from the test), so the failure crosses the host proxy. A device error surfaces at the
# call after the one that timed out (the kernel ends without a result), so that backend calls twice.
BACKEND = os.environ.get("MP_FAILURE_BACKEND", "cpu")
if BACKEND == "cuda":
    jax.distributed.initialize(f"127.0.0.1:{port}", nproc, proc, initialization_timeout=60,
                               local_device_ids=[proc % int(os.environ.get("MP_WORKER_GPUS", "1"))])
else:
    jax.config.update("jax_num_cpu_devices", 1)
    jax.distributed.initialize(f"127.0.0.1:{port}", nproc, proc, initialization_timeout=60)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_moe  # noqa: E402


def finish(line: str) -> None:
    print(line, flush=True)
    if proc == 0:  # process 0 hosts jax.distributed's coordination service: give the others time to report first
        time.sleep(8)
    os._exit(0)  # skip jax.distributed's shutdown barrier: a peer is gone on purpose


def main() -> None:
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("ep",))
    max_tokens = 8 if (mode == "mismatch" and proc == 1) else 4
    cfg = jax_moe.MoEConfig(2 * n, 2, 128, max_tokens)
    try:
        comm = jax_moe.Communicator(cfg, mesh, "ep", backend=BACKEND, timeout_s=TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - the message is the result
        finish(f"SETUP ERROR {type(e).__name__}: {e}")
    sharding = NamedSharding(mesh, P("ep"))
    t = 4
    x = jax.make_array_from_callback((n * t, 128), sharding, lambda i: np.ones((t, 128), jnp.bfloat16))
    bad = mode == "badid" and proc == 1
    idx = jax.make_array_from_callback((n * t, 2), sharding,
                                       lambda i: np.tile(np.array([[0, 2 * n if bad else 2 * n - 1]], np.int32),
                                                         (t, 1)))
    jitted = jax.jit(jax.shard_map(lambda x, i: comm.dispatch(x, i).expert_x, mesh=mesh,
                                   in_specs=(P("ep"), P("ep")), out_specs=P("ep")))
    f = jitted.lower(x, idx).compile()  # the time below is the call's alone
    from jax._src import distributed  # a barrier without a device collective (NCCL refuses processes sharing a GPU)
    distributed.global_state.client.wait_at_barrier("mp_failure_worker/compiled", 60_000)
    if proc == 1 and mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if proc == 1 and mode == "exit":
        os._exit(0)
    if proc == 1 and mode == "stall":
        time.sleep(TIMEOUT_S + 20)  # alive, silent; the others are done by then
        os._exit(0)
    start = time.monotonic()
    try:
        jax.block_until_ready(f(x, idx))
        if BACKEND == "cuda":  # (a compiled object with ordered effects runs once: the second call goes through jit)
            jax.block_until_ready(jitted(x, idx))
    except Exception as e:  # noqa: BLE001
        finish(f"ERROR after {time.monotonic() - start:.1f} s: {e}")
    finish(f"NO ERROR after {time.monotonic() - start:.1f} s")


main()
