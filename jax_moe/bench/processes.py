"""The moe benchmark in several processes of one host: the launcher, the join (jax.distributed on a local port) and
the GPU count both use (process i takes GPU i % count)."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from typing import Optional

PROC_ENV = "JAX_MOE_BENCH_PROC"  # "process,count,port,gpus" in a process started by launch()
# JAX_MOE_BENCH_ENV_<i>="KEY=VALUE ...": settings for process i only, over the launcher's environment. Two processes
# of one GPU stand for two nodes: a setting on one of them tells its side (sender or receiver) from the other's.
RANK_ENV = "JAX_MOE_BENCH_ENV_"
ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # an environment variable's name (also bench ab's variants)


def process_settings() -> dict[str, str]:
    """Every JAX_MOE_BENCH_ENV_<i> of this environment, as set (for the results' meta)."""
    return {k: v for k, v in os.environ.items() if k.startswith(RANK_ENV)}


def process_env(i: int) -> dict[str, str]:
    """The settings JAX_MOE_BENCH_ENV_<i> gives process i (space-separated KEY=VALUE; empty where unset)."""
    name = f"{RANK_ENV}{i}"
    spec = os.environ.get(name, "")
    out = {}
    for item in spec.split():
        key, sep, value = item.partition("=")
        if not sep or not ENV_KEY.fullmatch(key):
            raise ValueError(f"{name}={spec!r}: {item!r} is not KEY=VALUE; give space-separated KEY=VALUE settings, "
                             f"e.g. {name}='JAX_MOE_STAGE_PIECES=1'")
        if key in out:  # as bench ab refuses it: which of the two was meant is unknowable
            raise ValueError(f"{name}={spec!r}: {key} is set twice; keep one of its values")
        out[key] = value
    return out


def gpu_count() -> int:
    """GPUs of this host by `nvidia-smi -L` (1 where it is missing: the processes share whatever there is)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return 1
    return max(1, len(out.split("\n")) - 1)


def launch(argv: list[str], processes: int, suite: str = "moe") -> int:
    """Runs `python -m jax_moe.bench suite *argv` in `processes` processes of this host; process 0 prints and writes
    the results. Returns process 0's exit status (the others' failures are printed), or 2 where a process's own
    settings (JAX_MOE_BENCH_ENV_<i>) are malformed or name no process."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    gpus = gpu_count()
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
    # The launcher starts the processes, so it can choose CUDA's module loading before they first use CUDA (a library
    # cannot, for its own process): eager, unless set, so that fabric_memory "auto" stages the areas of ranks on other
    # nodes through HBM, the fastest path that runs (docs/cuda.md). JAX_MOE_FABRIC_MEMORY=host measures the other.
    env.setdefault("CUDA_MODULE_LOADING", "EAGER")
    try:  # every process's settings checked before any starts
        own = [process_env(i) for i in range(processes)]
    except ValueError as e:
        print(f"[{suite}] {e}", file=sys.stderr)
        return 2
    stray = sorted(set(process_settings()) - {f"{RANK_ENV}{i}" for i in range(processes)})
    if stray:
        print(f"[{suite}] {', '.join(stray)}: no such process (there are {processes}, 0..{processes - 1}); unset it "
              "or start more processes", file=sys.stderr)
        return 2
    procs = []
    for i in range(processes):
        env_i = {**env, **own[i], PROC_ENV: f"{i},{processes},{port},{gpus}"}
        procs.append(subprocess.Popen([sys.executable, "-m", "jax_moe.bench", suite, *argv], env=env_i,
                                      stdout=None if i == 0 else subprocess.PIPE,
                                      stderr=None if i == 0 else subprocess.STDOUT, text=True))
    rc = procs[0].wait()
    for i, p in enumerate(procs[1:], 1):
        out, _ = p.communicate()
        if p.returncode:
            print(f"[{suite}] process {i} exited with {p.returncode}:\n{out[-3000:]}", file=sys.stderr)
            rc = rc or p.returncode
    return rc


def join() -> Optional[tuple[int, int, int]]:
    """In a process started by launch(): joins the others (one GPU each, round-robin). (process, count, gpus)."""
    spec = os.environ.get(PROC_ENV)
    if not spec:
        return None
    import jax

    proc, nproc, port, gpus = (int(v) for v in spec.split(","))
    jax.distributed.initialize(f"127.0.0.1:{port}", nproc, proc, local_device_ids=[proc % gpus],
                               initialization_timeout=120)
    return proc, nproc, gpus
