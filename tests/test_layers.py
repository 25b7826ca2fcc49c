"""The native layers' declared dependencies (CMakeLists.txt) are exactly the folders their files include, and data
flows one way: no layer includes a layer that depends on it."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
# Folders under src/ that are layers (python/ is the extension module itself, not a layer library).
ORDER = ["common", "fabric", "proxy", "cpu", "kernels", "cuda", "ffi"]


def _declared() -> dict[str, set[str]]:
    text = (ROOT / "CMakeLists.txt").read_text()
    deps: dict[str, set[str]] = {}
    for name, body in re.findall(r"jax_moe_layer\((\w+)(.*?)\)\n", text, flags=re.S):
        deps[name] = set(re.findall(r"\$\{JAX_MOE_LAYER_(\w+)\}", body.split("DEPS", 1)[1])) if "DEPS" in body else set()
    return deps


def _included(layer: str) -> set[str]:
    found: set[str] = set()
    for path in (SRC / layer).rglob("*"):
        if path.suffix not in {".h", ".cc", ".cu", ".cuh"}:
            continue
        for folder in re.findall(r'#include "(\w+)/', path.read_text()):
            if folder in ORDER and folder != layer:
                found.add(folder)
    return found


def test_every_layer_is_declared():
    assert set(_declared()) == set(ORDER), "CMakeLists.txt and the layer list disagree"


def test_declared_dependencies_equal_the_includes():
    declared = _declared()
    for layer in ORDER:
        assert declared[layer] == _included(layer), (
            f"src/{layer}: CMake declares {sorted(declared[layer])}, its files include {sorted(_included(layer))}")


def test_data_flows_one_way():
    for layer in ORDER:
        for dep in _included(layer):
            assert ORDER.index(dep) < ORDER.index(layer), f"src/{layer} includes src/{dep}, a later layer"


def test_nothing_below_the_communicator_imports_it():
    """Python imports flow one way (nn -> communicator -> api -> backends): the API layer and the backends know the
    Communicator only as backends.base.CommView, not even under TYPE_CHECKING."""
    import glob
    import os
    import re

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jax_moe")
    below = [os.path.join(root, f) for f in ("api.py", "rounds.py", "validate.py", "types.py", "contract.py")]
    below += glob.glob(os.path.join(root, "backends", "*.py"))
    offenders = []
    for path in below:
        with open(path) as f:
            if re.search(r"from jax_moe(\.communicator| import .*\bcommunicator\b)|import jax_moe\.communicator",
                         f.read()):
                offenders.append(os.path.relpath(path, root))
    assert offenders == [], offenders
