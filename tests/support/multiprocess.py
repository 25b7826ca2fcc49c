"""Launching several Python processes on localhost for a test, with a bounded wait and no stray children."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from jax_moe import shm_regions


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, argv_per_proc: Sequence[Sequence[str]], timeout_s: float = 240,
           env: dict | None = None, may_fail: Sequence[int] = ()) -> list[str]:
    """Runs `script` (a worker in tests/support/) once per argv; returns their outputs; fails (and kills all) on error
    or timeout. Processes in `may_fail` may end with any exit status (a test's victim)."""
    here = os.path.dirname(os.path.abspath(__file__))
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    full_env.pop("XLA_FLAGS", None)
    # In a directory of their own: what an aborted worker leaves in its working directory goes with it (libpsm2, which
    # Debian's libfabric loads for its psm2 provider, writes <exe>.<...>,<host>.btr backtraces there when
    # jax.distributed aborts a process whose peer died).
    scratch = tempfile.TemporaryDirectory(prefix="jax_moe_workers_")
    procs = [subprocess.Popen([sys.executable, os.path.join(here, script), *map(str, argv)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=full_env, cwd=scratch.name)
             for argv in argv_per_proc]
    deadline = time.monotonic() + timeout_s
    outputs: list[str] = []
    try:
        for i, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                raise AssertionError(f"process {i} of {script} did not finish within {timeout_s} s; its output:\n"
                                     f"{out[-4000:]}") from None
            outputs.append(out)
            if p.returncode != 0 and i not in may_fail:
                raise AssertionError(f"process {i} of {script} exited with {p.returncode}:\n{out[-6000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        keep = os.environ.get("JAX_MOE_TEST_LOGS")  # a directory: every worker's whole output is written there
        if keep:
            os.makedirs(keep, exist_ok=True)
            for i, p in enumerate(procs):
                out = outputs[i] if i < len(outputs) else (p.stdout.read() if p.stdout else "")
                with open(os.path.join(keep, f"{os.path.splitext(script)[0]}.{os.getpid()}.{i}.log"), "w") as f:
                    f.write(out or "")
        scratch.cleanup()
        shm_regions.remove_of(p.pid for p in procs)  # a killed worker's shm endpoints (it could not close them)
    return outputs
