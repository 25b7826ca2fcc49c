"""The TransferEngine on GPU memory, byte for byte: where a provider registers CUDA memory (libfabric built with CUDA),
a write into it must have landed, whole, once its immediate is seen, and must touch nothing outside its range. The
bytes are read back on a non-blocking stream of their own, as a kernel on XLA's streams would read them (a read on
the legacy stream would wait for the provider's own copies and hide a write that is reported early). Sizes cross
shm's protocol bounds (inline, inject at 4 KiB, segmented beyond), sources are host and GPU memory, and the GPU
regions are registered through the CUDA pointer and through a dmabuf."""
from __future__ import annotations

import numpy as np
import pytest

fabric = pytest.importorskip("jax_moe.fabric")
from jax_moe import _core  # noqa: E402

from jax_moe.backends.cuda import CudaBackend  # noqa: E402

_why = CudaBackend.unavailable_reason()  # no GPU, or built without CUDA
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_why is not None, reason=f"no CUDA GPU here: {_why}")]

SIZES = (64, 4096, 4097, 70001, 1 << 20, (3 << 20) + 5)


def _engine_with_hmem(provider: str):
    try:
        e = fabric.TransferEngine(provider)
    except Exception as err:  # noqa: BLE001 - provider not built in
        pytest.skip(f"provider {provider}: {err}")
    if not e.supports_device_memory:
        e.close()
        pytest.skip(f"this libfabric's {provider} does not grant FI_HMEM (built without CUDA)")
    return e


@pytest.mark.parametrize("source", ["host", "cuda"])
@pytest.mark.parametrize("dmabuf", ["0", "1"])
@pytest.mark.parametrize("provider", ["shm", "tcp"])
def test_writes_into_gpu_memory_have_landed_when_their_immediate_is_seen(provider, dmabuf, source, monkeypatch):
    monkeypatch.setenv("JAX_MOE_FABRIC_DMABUF", dmabuf)
    engines = []
    try:
        a = _engine_with_hmem(provider)
        engines.append(a)
        b = _engine_with_hmem(provider)
        engines.append(b)
        cuda = _core.cuda
        rng = np.random.default_rng()
        biggest = max(SIZES)
        dst_mem = cuda.DeviceMemory(2 * biggest, 0)
        src_mem = cuda.DeviceMemory(biggest, 0) if source == "cuda" else None
        src_host = np.zeros(biggest, np.uint8)
        try:
            mb = b.register_ptr(dst_mem.ptr, dst_mem.nbytes, device=0, dmabuf_fd=dst_mem.dmabuf_fd)
        except RuntimeError as err:  # FI_HMEM granted for host memory only: a libfabric built without CUDA
            if "configure --with-cuda" not in str(err):
                raise
            pytest.skip(f"this libfabric's {provider} cannot register CUDA memory: {err}")
        if src_mem is not None:
            ma = a.register_ptr(src_mem.ptr, src_mem.nbytes, device=0, dmabuf_fd=src_mem.dmabuf_fd)
        else:
            ma = a.register(src_host)
        assert mb.device == 0 and mb.registration.startswith("cuda"), mb.registration
        if dmabuf == "1" and mb.registration != "cuda (dmabuf)":  # else this case would run the pointer path again
            pytest.skip(f"no dmabuf registration here (fd {dst_mem.dmabuf_fd}): {mb.registration}")
        p = a.connect(b.address(), 10)
        shadow = np.zeros(dst_mem.nbytes, np.uint8)  # what the destination must hold
        imm = 0
        for size in SIZES:
            for _ in range(6):
                imm += 1
                data = rng.integers(0, 256, size, dtype=np.uint8)
                if src_mem is not None:
                    src_mem.upload(0, data.tobytes())
                else:
                    src_host[:size] = data
                at = int(rng.integers(0, dst_mem.nbytes - size + 1))
                a.write(p, ma, 0, size, mb.descriptor(), at, imm=imm)
                b.wait_imm(imm, 1, 20)
                got = np.frombuffer(dst_mem.download(0, dst_mem.nbytes), np.uint8)
                shadow[at:at + size] = data
                bad = np.flatnonzero(got != shadow)
                assert bad.size == 0, (
                    f"{provider} {mb.registration}, source {source}: write {imm} of {size} B at {at}: "
                    f"{bad.size} bytes differ, first at {bad[0]} (write covers [{at}, {at + size}))")
                a.wait_sends(20)
    finally:
        for e in engines:
            e.close()
