"""Backend "cuda" across nodes: ranks of other nodes reached through the host proxy and the TransferEngine (tcp, shm)
instead of NVLink, alone or mixed with NVLink peers in one group. "Nodes" are forced with ranks_per_node on one
host; several processes may share one GPU, so every case below also runs on a single-GPU machine. Each multi-process
case runs the shared worker's checks against the NumPy oracle (bf16 and fp8 round trips, several rounds in one
program forward and backward, gradients)."""
from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_moe
from jax_moe.backends.cuda import CudaBackend

_why = CudaBackend.unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_why is not None, reason=f"backend 'cuda': {_why}")]

if _why is None:
    from support.helpers import check_roundtrip, mesh_of, random_routing, random_tokens, roundtrip
    from support.multiprocess import free_port, launch

# Processes sharing a GPU must not each take most of its memory.
_SHARED = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
           "JAX_MOE_TIMEOUT_S": os.environ.get("JAX_MOE_TEST_TIMEOUT_S", "30")}  # shorter where a hang is expected


def _gpus() -> int:
    return len(jax.devices("gpu"))


def _run_workers(nproc: int, ranks_per_node: int, provider: str, rng, **extra_env: str) -> None:
    gpus = min(_gpus(), 2)
    port, seed = free_port(), int(rng.integers(1 << 30))
    env = dict(_SHARED, MP_WORKER_GPUS=str(gpus), JAX_MOE_RANKS_PER_NODE=str(ranks_per_node),
               JAX_MOE_FABRIC_PROVIDER=provider, **extra_env)
    outs = launch("mp_worker.py", [(i, nproc, port, 1, "cuda", seed) for i in range(nproc)], timeout_s=400, env=env)
    for i, out in enumerate(outs):
        assert f"OK process {i}/{nproc} devices={nproc} backend=cuda" in out, out[-3000:]


@functools.lru_cache(maxsize=None)
def _carries_gpu_memory(provider: str) -> bool:
    """Whether this libfabric's `provider` registers CUDA memory (FI_HMEM granted, built with CUDA): libfabric 2.x
    built with CUDA on shm; Ubuntu's 1.17 nowhere."""
    from jax_moe import _core
    from jax_moe.fabric import TransferEngine
    try:
        eng = TransferEngine(provider)
    except Exception:  # noqa: BLE001 - provider not built in
        return False
    mem = region = None
    try:
        if not eng.supports_device_memory:
            return False
        mem = _core.cuda.DeviceMemory(1 << 16, 0)  # its own errors (out of memory) are not an answer: they propagate
        try:
            region = eng.register_ptr(mem.ptr, mem.nbytes, device=0, dmabuf_fd=mem.dmabuf_fd)
        except RuntimeError as err:  # FI_HMEM for host memory only: a libfabric built without CUDA
            if "configure --with-cuda" not in str(err):
                raise
            return False
        return True
    finally:
        del region  # the registration, then the engine, then the memory
        eng.close()
        del mem


def _expect_on_gpu(memory: str, provider: str) -> dict[str, str]:
    """What the workers must find: "host", "staged" and "auto" host memory on the wire; "device" GPU memory where the
    provider registers CUDA memory (shm with a libfabric built with CUDA, which the workers run under eager loading),
    else a refusal that says why."""
    if memory != "device":
        return {"MP_EXPECT_FABRIC_ON_GPU": "0"}
    if _carries_gpu_memory(provider):
        return {"MP_EXPECT_FABRIC_ON_GPU": "1"}
    return {"MP_EXPECT_REFUSAL": r'fabric_memory="device"( is not possible here: provider \w+ did not grant FI_HMEM'
                                 r"|: provider \w+ cannot register CUDA memory .*configure --with-cuda)"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("memory", ["auto", "host", "staged", "device"])
@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_two_processes_as_two_nodes(provider, memory, rng):
    """2 processes x 1 GPU, ranks_per_node=1: every byte between the ranks goes through the proxies, with the areas in
    pinned host memory ("host", "auto"), or there on the wire and in HBM for the kernels with a copy engine between
    ("staged"), or ("device") in GPU memory on both sides where the provider registers it (shm with a libfabric built
    with CUDA), else refused, naming why."""
    _run_workers(2, 1, provider, rng, JAX_MOE_FABRIC_MEMORY=memory, **_expect_on_gpu(memory, provider),
                 **_loading_env(memory))


@pytest.mark.multiprocess
@pytest.mark.parametrize("memory", ["host", "staged", "device"])
def test_programs_enqueued_far_ahead_across_nodes(memory, rng):
    """Eight programs of 25 round trips each, enqueued without waiting (a training loop's shape): the host runs far
    ahead of the GPU. With "staged" the proxy's copies then waited for room in the launch queue, behind the receive
    kernel that waited for them, until the plain handlers held the host a few rounds ahead (cuda/run_ahead.h). "device"
    on shm (where this libfabric registers CUDA memory) needs the same hold: shm's copies are CUDA calls on the proxy
    thread too."""
    _run_workers(2, 1, "shm", rng, JAX_MOE_FABRIC_MEMORY=memory, MP_QUEUE_AHEAD="8,25",
                 **_expect_on_gpu(memory, "shm"), **_loading_env(memory))


@pytest.mark.multiprocess
def test_rows_per_entry_on_the_gradient_channel_are_refused_across_nodes(rng):
    """Combine channel 1's regions hold one row per token (dispatch's transpose is always summed): the handler refuses
    rows per (t, k) there when ranks are on other nodes, on every rank alike."""
    _run_workers(2, 1, "shm", rng, MP_CHANNEL1_REFUSAL="1")


def _loading_env(memory: str) -> dict[str, str]:
    """The CUDA_MODULE_LOADING a memory's workers need: "staged", and "device" on shm and tcp, run only with CUDA's
    eager module loading (src/cuda/stage_copies.h, src/cuda/device_fabric.cc say why); the others keep the default."""
    return {"CUDA_MODULE_LOADING": "EAGER"} if memory in ("staged", "device") else {}


@pytest.mark.multiprocess
def test_auto_stages_under_eager_loading(rng):
    """"auto" under CUDA_MODULE_LOADING=EAGER stages through HBM with the plain handlers (which hold the host back;
    with the command-buffer ones, which do not, the backend asks for no staging: test_cuda_offline); the worker checks
    which memory it got and that fabric_info()["fallback"] says why, and the oracle the round trips."""
    _run_workers(2, 1, "shm", rng, JAX_MOE_FABRIC_MEMORY="auto", CUDA_MODULE_LOADING="EAGER",
                 MP_EXPECT_FABRIC_ON_GPU="0")


@pytest.mark.multiprocess
def test_staged_is_refused_under_lazy_loading(rng):
    """Without CUDA_MODULE_LOADING=EAGER, "staged" is refused when the Communicator is made, saying what to set."""
    _run_workers(2, 1, "shm", rng, JAX_MOE_FABRIC_MEMORY="staged", CUDA_MODULE_LOADING="LAZY",
                 MP_EXPECT_REFUSAL=r'fabric_memory="staged" needs CUDA.s eager module loading: set '
                                   r"CUDA_MODULE_LOADING=EAGER")


@pytest.mark.multiprocess
def test_device_memory_on_a_copying_provider_is_refused_under_lazy_loading(rng):
    """shm copies GPU memory with cudaMemcpy on the proxy thread, which under lazy loading waits for the receive kernel
    that waits for it: "device" there is refused when the Communicator is made, saying what to set."""
    if not _carries_gpu_memory("shm"):
        pytest.skip("this libfabric's shm does not register CUDA memory (build libfabric with CUDA: "
                    "tests/gpu/device_run.sh hmem)")
    _run_workers(2, 1, "shm", rng, JAX_MOE_FABRIC_MEMORY="device", CUDA_MODULE_LOADING="LAZY",
                 MP_EXPECT_REFUSAL=r"provider shm copies GPU memory with CUDA calls on the proxy thread, which do not "
                                   r"complete .*set CUDA_MODULE_LOADING=EAGER")


@pytest.mark.multiprocess
@pytest.mark.parametrize("one_kernel", ["1", "0"])
def test_two_processes_in_one_node(one_kernel, rng):
    """2 processes, one node: the NVLink kernels between processes (CUDA IPC), on one GPU both ranks in its memory.
    The worker's round trips take the weights at combine (rows per (t, k)) and at dispatch (summed per token and
    rank at the expert rank), and dispatch's transpose sums with unit weights. The one-shot calls run as one kernel
    ("1", the default) and as two ("0"). On one GPU without MPS the two processes are time-sliced, so each one
    kernel waits for a peer that is not running: the queue (kernels/queue.cuh) must not need its blocks resident."""
    _run_workers(2, 2, "shm", rng, JAX_MOE_CUDA_ONE_KERNEL=one_kernel)


@pytest.mark.multiprocess
@pytest.mark.parametrize("memory", ["auto", "host", "staged", "device"])
def test_four_processes_as_two_nodes_of_two_hybrid(memory, rng):
    """4 processes as 2 nodes x 2 ranks: NVLink (CUDA IPC) inside a node, the proxy between nodes, in one group."""
    _run_workers(4, 2, "shm", rng, JAX_MOE_FABRIC_MEMORY=memory, **_expect_on_gpu(memory, "shm"), **_loading_env(memory))


def test_one_process_driving_two_gpus_as_two_nodes(rng):
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    n, e, r, hidden, t = 2, 8, 3, 256, 7
    for fp8 in (False, True):
        cfg = jax_moe.MoEConfig(e, r, hidden, t, dispatch_dtype=jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
        comm = jax_moe.Communicator(cfg, mesh_of(n, platform="gpu"), "ep", backend="cuda", ranks_per_node=1,
                                    fabric_provider="tcp")
        info = comm.backend.fabric_info()
        assert sorted(info) == [0, 1] and all(i["provider"] == "tcp" for i in info.values()), info
        for _ in range(3):
            x, scale = random_tokens(rng, n * t, hidden, fp8)
            idx = random_routing(rng, n, t, r, e, mask=0.2)
            w = rng.random((n * t, r)).astype(np.float32)
            check_roundtrip(comm, n, x, idx, w, scale, roundtrip(comm, x, idx, w, scale))


@pytest.mark.multiprocess
@pytest.mark.parametrize("memory", ["host", "staged", "device"])
def test_a_killed_process_is_named_by_the_other_within_the_timeout(memory):
    provider = "shm" if memory == "device" else "tcp"  # GPU memory only where a provider registers it
    if memory == "device" and not _carries_gpu_memory(provider):
        pytest.skip("this libfabric's shm does not register CUDA memory (tests/gpu/device_run.sh hmem)")
    timeout_s = 4.0
    port = free_port()
    env = dict(_SHARED, MP_FAILURE_BACKEND="cuda", MP_WORKER_GPUS=str(min(_gpus(), 2)), JAX_MOE_RANKS_PER_NODE="1",
               JAX_MOE_FABRIC_PROVIDER=provider, JAX_MOE_FABRIC_MEMORY=memory, **_loading_env(memory))
    outs = launch("mp_failure_worker.py", [("kill", i, 2, port, timeout_s) for i in range(2)], timeout_s=200,
                  env=env, may_fail=(1,))
    m = re.search(r"ERROR after ([0-9.]+) s: (.*)", outs[0])
    assert m, outs[0][-3000:]
    assert float(m.group(1)) <= 2 * timeout_s + 2, outs[0][-2000:]
    assert re.search(r"rank 1 \(process 1|ranks \[1\]", outs[0]), outs[0][-2000:]
