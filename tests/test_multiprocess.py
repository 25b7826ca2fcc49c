"""Several processes through jax.distributed on localhost, each with its own CPU devices."""
from __future__ import annotations

import pytest

from support.helpers import CPU_BACKENDS
from support.multiprocess import free_port, launch


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("nproc, per_proc", [(2, 2)])
def test_processes_agree_with_oracle(rng, backend, nproc, per_proc):
    port, seed = free_port(), int(rng.integers(1 << 30))
    outs = launch("mp_worker.py", [(i, nproc, port, per_proc, backend, seed) for i in range(nproc)])
    for i, out in enumerate(outs):
        assert f"OK process {i}/{nproc} devices={nproc * per_proc}" in out, out[-3000:]
