"""Test session set-up: 8 simulated CPU devices (meshes of 1, 2, 4 and 8 ranks are cut from them)."""
from __future__ import annotations

import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, os.path.dirname(__file__))  # tests/oracle.py and tests/helpers.py

import pytest  # noqa: E402


@pytest.fixture
def rng(request):
    """A fresh seed every run (printed on failure), so the suite keeps exploring new routings."""
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    import numpy as np

    return np.random.default_rng(seed)
