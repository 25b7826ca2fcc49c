"""What train_moe.py and decode_moe.py share: device set-up, the mesh, the character vocabulary."""
from __future__ import annotations

import os
import sys
from typing import Optional

import jax

# Runnable from a checkout without installing: the repository root goes first on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Printable ASCII plus newline and tab: every machine's stdlib text maps onto it; anything else becomes "?".
VOCAB = "\n\t" + "".join(chr(c) for c in range(32, 127))


def init_devices(cpu_devices: int = 4) -> list:
    """Simulate cpu_devices CPU devices (only affects the CPU platform), then return the default backend's devices:
    the GPUs when there are any, else the simulated CPUs. Must run before anything else touches jax."""
    jax.config.update("jax_num_cpu_devices", cpu_devices)
    return jax.devices()


def make_mesh(devices: list, ep: Optional[int]) -> jax.sharding.Mesh:
    ep = len(devices) if ep is None else ep
    if not 1 <= ep <= len(devices):
        raise SystemExit(f"--ep {ep}: this machine has {len(devices)} {devices[0].platform} devices")
    return jax.make_mesh((ep,), ("ep",), devices=devices[:ep])


def encode(text: str, vocab: str = VOCAB) -> "list[int]":
    index = {c: i for i, c in enumerate(vocab)}
    unknown = index["?"]
    return [index.get(c, unknown) for c in text]


def decode(ids: "list[int]", vocab: str = VOCAB) -> str:
    return "".join(vocab[i] for i in ids)
