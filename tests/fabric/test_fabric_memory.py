"""What memory the TransferEngine registers, and how it refuses what it cannot: device memory is offered by every
provider that grants FI_HMEM (shm and tcp where libfabric has CUDA, efa); a libfabric without CUDA refuses it with an
error that says so, which is what makes the "cuda" backend fall back to pinned host memory. Without a GPU, an engine
that fakes device memory carries host buffers as device regions, so the path of device regions runs here too."""
import os
import subprocess
import sys

import numpy as np
import pytest

from support.fabric_mp import AVAILABLE

fabric = pytest.importorskip("jax_moe.fabric")
from jax_moe import _core  # noqa: E402

T = _core.fabric._testing
needs_tcp = pytest.mark.skipif("tcp" not in AVAILABLE, reason="libfabric tcp provider not available")
FLAG_DEVICE = 1  # RegionDescriptor::kFlagDevice


@needs_tcp
def test_host_memory_is_registered_as_host():
    e = fabric.TransferEngine("tcp")
    try:
        buf = np.zeros(4096, np.uint8)
        mr = e.register(buf)
        assert mr.registration == "host" and mr.device == -1
        assert T.descriptor_parse(mr.descriptor())["flags"] & FLAG_DEVICE == 0
    finally:
        e.close()


@needs_tcp
def test_device_memory_without_cuda_is_refused_with_the_reason():
    """Here libfabric has no CUDA (or the buffer is no CUDA memory at all): the registration must fail, naming the
    provider and what is missing, never register host memory as if it were the GPU's."""
    e = fabric.TransferEngine("tcp")
    try:
        buf = np.zeros(1 << 16, np.uint8)
        with pytest.raises(RuntimeError, match=r"provider tcp .*(FI_HMEM|CUDA)"):
            e.register_ptr(buf.ctypes.data, buf.nbytes, device=0)
    finally:
        e.close()


@needs_tcp
def test_hmem_can_be_turned_off():
    """JAX_MOE_FABRIC_HMEM=0: the engine does not ask for FI_HMEM, says so, and refuses device memory."""
    code = ("import numpy as np, jax_moe.fabric as f\n"
            "e = f.TransferEngine('tcp')\n"
            "print('HMEM', e.supports_device_memory)\n"
            "b = np.zeros(4096, np.uint8)\n"
            "try:\n"
            "    e.register_ptr(b.ctypes.data, b.nbytes, device=0)\n"
            "except RuntimeError as err:\n"
            "    print('REFUSED', err)\n"
            "e.close()\n")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, JAX_MOE_FABRIC_HMEM="0"),
                         capture_output=True, text=True, timeout=60)
    assert "HMEM False" in out.stdout, out.stdout + out.stderr
    assert "REFUSED" in out.stdout and "did not grant FI_HMEM" in out.stdout, out.stdout + out.stderr


@pytest.mark.skipif("shm" not in AVAILABLE, reason="libfabric shm provider not available")
def test_host_memory_only_engines_do_not_ask_for_gpu_memory():
    """host_memory_only (the "cpu" backend's engines, and the cuda backend's on shm and tcp): FI_HMEM is not asked
    for, so shm keeps its single-copy path; device memory is then refused, naming why. Here shm grants FI_HMEM when
    asked, so the option is what turns it off."""
    asked = fabric.TransferEngine("shm")
    try:
        granted = asked.supports_device_memory
    finally:
        asked.close()
    e = fabric.TransferEngine("shm", host_memory_only=True)
    try:
        assert not e.supports_device_memory
        buf = np.zeros(4096, np.uint8)
        assert e.register(buf).registration == "host"
        with pytest.raises(RuntimeError, match=r"provider shm did not grant FI_HMEM"):
            e.register_ptr(buf.ctypes.data, buf.nbytes, device=0)
    finally:
        e.close()
    with pytest.raises(ValueError, match="contradict"):
        fabric.TransferEngine("shm", host_memory_only=True, fake_device_memory=True)
    if not granted:
        pytest.skip("this libfabric's shm does not grant FI_HMEM even when asked: nothing was turned off")


@needs_tcp
def test_fake_device_regions_carry_data_and_their_flag():
    """Two engines that fake device memory: the regions are registered as host memory but described as device
    regions, and writes between them deliver every byte and the immediate."""
    a, b = fabric.TransferEngine("tcp", fake_device_memory=True), fabric.TransferEngine("tcp", fake_device_memory=True)
    try:
        assert a.supports_device_memory and b.supports_device_memory
        rng = np.random.default_rng()
        src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
        dst = np.zeros(1 << 17, np.uint8)
        ma = a.register_ptr(src.ctypes.data, src.nbytes, device=0)
        mb = b.register_ptr(dst.ctypes.data, dst.nbytes, device=0)
        assert ma.registration.startswith("fake device") and mb.device == 0
        assert T.descriptor_parse(mb.descriptor())["flags"] & FLAG_DEVICE
        host = b.register(np.zeros(64, np.uint8))
        assert host.registration == "host"  # host registrations of such an engine stay host
        p = a.connect(b.address(), 10)
        at = int(rng.integers(0, 1 << 16))
        a.write(p, ma, 0, src.nbytes, mb.descriptor(), at, imm=9)
        b.wait_imm(9, 1, 10)
        a.wait_sends(10)
        assert np.array_equal(dst[at:at + src.nbytes], src)
        assert not dst[:at].any() and not dst[at + src.nbytes:].any()  # nothing outside the write
    finally:
        a.close()
        b.close()
