"""What train_moe.py and decode_moe.py share: processes and devices, the mesh, per-process data, the vocabulary."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Runnable from a checkout without installing: the repository root goes first on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Printable ASCII plus newline and tab: every machine's stdlib text maps onto it; anything else becomes "?".
VOCAB = "\n\t" + "".join(chr(c) for c in range(32, 127))

# Set in an srun step of a SLURM job and by Open MPI's mpirun: jax.distributed.initialize() reads the cluster from
# them. (A plain `python` inside salloc has SLURM_JOB_ID but no step, and runs as one process.)
CLUSTER_ENV = (("SLURM_JOB_ID", "SLURM_STEP_NODELIST"), ("OMPI_COMM_WORLD_SIZE",))
TOTAL_CPU_DEVICES = 4  # simulated CPU devices of a run, split over its processes unless --local-devices says


def add_process_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several processes / hosts (see examples/launch.py)")
    g.add_argument("--coordinator", help="HOST:PORT of process 0's jax.distributed coordinator")
    g.add_argument("--num-processes", type=int, default=None, help="processes in the run (default 1, or what "
                   "SLURM / Open MPI say when launched by them)")
    g.add_argument("--process-id", type=int, default=None, help="this process's index, 0 .. N-1")
    g.add_argument("--local-devices", type=int, default=None,
                   help=f"simulated CPU devices per process (default {TOTAL_CPU_DEVICES} / processes, 1 under "
                   "SLURM / Open MPI; no effect on GPUs)")
    g.add_argument("--local-device-ids", default=None,
                   help="comma-separated GPU ids this process drives (default: all it sees); one process per GPU: "
                   "process i gets --local-device-ids i")
    g.add_argument("--fabric-provider", choices=("auto", "tcp", "shm", "efa", "verbs"), default=None,
                   help="transport of backend 'cpu' between processes (default $JAX_MOE_FABRIC_PROVIDER or auto)")


def init_devices(args: argparse.Namespace) -> list:
    """Join the run's processes (if several), then return the global devices: the GPUs when there are any, else the
    simulated CPUs. Must run before anything else touches jax's devices."""
    n = args.num_processes
    explicit = n is not None and n > 1
    cluster = n is None and any(all(v in os.environ for v in names) for names in CLUSTER_ENV)
    if explicit and (args.coordinator is None or args.process_id is None):
        raise SystemExit("--num-processes > 1 needs --coordinator HOST:PORT and --process-id")
    if n is None and args.coordinator is not None:
        raise SystemExit("--coordinator needs --num-processes")
    default = TOTAL_CPU_DEVICES // n if explicit else 1 if cluster else TOTAL_CPU_DEVICES
    # The CPU client reads this when it is created, which initialize() does: it must come first.
    jax.config.update("jax_num_cpu_devices", max(1, args.local_devices or default))
    if args.fabric_provider:  # read by backend "cpu" when a Communicator is made
        os.environ["JAX_MOE_FABRIC_PROVIDER"] = args.fabric_provider
    ids = None if args.local_device_ids is None else [int(v) for v in args.local_device_ids.split(",")]
    if explicit:
        jax.distributed.initialize(args.coordinator, n, args.process_id, local_device_ids=ids)
    elif cluster:
        jax.distributed.initialize(local_device_ids=ids)  # auto-detects coordinator, size and rank
    return jax.devices()


def finish() -> None:
    """Leave together: a process that exits early takes the coordination service (process 0) or its peers'
    transfers down with it."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("jax_moe examples: done")
        jax.distributed.shutdown()


def is_writer() -> bool:
    """Process 0 writes files and prints; the others compute along."""
    return jax.process_index() == 0


def make_mesh(devices: list, ep: Optional[int]) -> jax.sharding.Mesh:
    ep = len(devices) if ep is None else ep
    if not 1 <= ep <= len(devices):
        raise SystemExit(f"--ep {ep}: this run has {len(devices)} {devices[0].platform} devices")
    if jax.process_count() > 1 and ep != len(devices):
        raise SystemExit(f"--ep {ep}: with several processes the mesh spans all {len(devices)} devices")
    return jax.make_mesh((ep,), ("ep",), devices=devices[:ep])


def local_rows(mesh: jax.sharding.Mesh, global_rows: int) -> int:
    """How many rows of a batch sharded over "ep" live on this process's devices."""
    return global_rows // mesh.devices.size * len(mesh.local_devices)


def batch_array(mesh: jax.sharding.Mesh, local: np.ndarray, global_rows: int) -> jax.Array:
    """This process's rows (local_rows of them) as its part of the global batch, sharded over "ep"."""
    return jax.make_array_from_process_local_data(NamedSharding(mesh, P("ep")), local,
                                                  (global_rows, *local.shape[1:]))


def to_host(x: jax.Array) -> np.ndarray:
    """The whole value on every process: arrays spread over several processes are gathered (a collective: call it
    on every process)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def encode(text: str, vocab: str = VOCAB) -> "list[int]":
    index = {c: i for i, c in enumerate(vocab)}
    unknown = index["?"]
    return [index.get(c, unknown) for c in text]


def decode(ids: "list[int]", vocab: str = VOCAB) -> str:
    return "".join(vocab[i] for i in ids)
