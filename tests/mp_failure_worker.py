"""Failure scenarios across processes: `python mp_failure_worker.py MODE PROC NPROC PORT`.

kill:     process 1 exits right after set-up; the others must report an error naming rank 1 within the timeout.
mismatch: process 1 builds its Communicator with another max_tokens; set-up must fail with a clear error.
Each process prints one line saying what happened and exits 0 (the test reads the lines).
"""
from __future__ import annotations

import os
import sys
import time

import jax

mode, proc, nproc, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
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
        comm = jax_moe.Communicator(cfg, mesh, "ep", backend="cpu", timeout_s=5.0 if mode == "kill" else 20.0)
    except Exception as e:  # noqa: BLE001 - the message is the result
        finish(f"SETUP ERROR {type(e).__name__}: {e}")
    if mode == "kill" and proc == 1:
        finish("EXITING on purpose")
    sharding = NamedSharding(mesh, P("ep"))
    t = 4
    x = jax.make_array_from_callback((n * t, 128), sharding, lambda i: np.ones((t, 128), jnp.bfloat16))
    idx = jax.make_array_from_callback((n * t, 2), sharding,
                                       lambda i: np.tile(np.array([[0, 2 * n - 1]], np.int32), (t, 1)))
    f = jax.jit(jax.shard_map(lambda x, i: comm.dispatch(x, i).expert_x, mesh=mesh, in_specs=(P("ep"), P("ep")),
                              out_specs=P("ep")))
    start = time.monotonic()
    try:
        jax.block_until_ready(f(x, idx))
    except Exception as e:  # noqa: BLE001
        finish(f"ERROR after {time.monotonic() - start:.1f} s: {e}")
    finish(f"NO ERROR after {time.monotonic() - start:.1f} s")


main()
