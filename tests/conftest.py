"""Test session set-up: 8 simulated CPU devices (meshes of 1, 2, 4 and 8 ranks are cut from them)."""
from __future__ import annotations

import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the `support` package (tests/support/)

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=os.environ.get("JAX_MOE_SLOW") == "1",
                     help="also run the tests marked slow (or JAX_MOE_SLOW=1)")


def pytest_collection_modifyitems(config, items):
    """Tests marked slow (minutes on a 2-core CI machine) run with --runslow only."""
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow or JAX_MOE_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A fresh seed every run (printed on failure), so the suite keeps exploring new routings."""
    seed = int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    import numpy as np

    return np.random.default_rng(seed)


def pytest_sessionfinish(session, exitstatus):
    """Worker processes that end without closing their engines (SIGKILLed victims, os._exit) leave 16 MB shm regions
    in /dev/shm; remove those of our engines whose process is gone, so repeated runs do not fill the tmpfs."""
    from jax_moe.shm_regions import remove_stale

    remove_stale()
