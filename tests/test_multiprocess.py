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


@pytest.mark.multiprocess
def test_programs_enqueued_far_ahead_across_processes(rng):
    """Programs of several round trips enqueued back to back without waiting, backend "cpu" across two processes (the
    proxy between them): every round trip of every program against the oracle (the GPU case is in tests/gpu)."""
    port, seed = free_port(), int(rng.integers(1 << 30))
    outs = launch("mp_worker.py", [(i, 2, port, 1, "cpu", seed) for i in range(2)], env={"MP_QUEUE_AHEAD": "4,5"})
    for i, out in enumerate(outs):
        assert f"QUEUE-AHEAD process {i}: 4 programs of 5 round trips" in out, out[-3000:]
        assert f"OK process {i}/2 devices=2" in out, out[-3000:]
