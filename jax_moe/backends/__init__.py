"""Backend registry: name -> class, and what "auto" picks on a platform."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jax_moe.backends.base import Backend

# name -> (module, class). Modules import lazily so that a missing native part only affects its own backend.
_BACKENDS = {
    "xla": ("jax_moe.backends.xla", "XlaBackend"),
    "cpu": ("jax_moe.backends.cpu", "CpuBackend"),
    "cuda": ("jax_moe.backends.cuda", "CudaBackend"),
}
# What "auto" tries, per platform, in order; the reference is always last.
_AUTO = {"cpu": ("cpu", "xla"), "gpu": ("cuda", "xla"), "cuda": ("cuda", "xla")}


class BackendUnavailable(RuntimeError):
    pass


def names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def load(name: str) -> type["Backend"]:
    """The backend class for `name`; BackendUnavailable says why it cannot run in this build."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(names())} or 'auto'")
    module_name, class_name = _BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            raise BackendUnavailable(f"backend {name!r} is not part of this version of jax_moe") from None
        raise
    cls = getattr(module, class_name)
    reason = getattr(cls, "unavailable_reason", lambda: None)()
    if reason:
        raise BackendUnavailable(f"backend {name!r} is unavailable: {reason}")
    return cls


def resolve(name: str, platform: str) -> type["Backend"]:
    if name != "auto":
        return load(name)
    for candidate in _AUTO.get(platform, ("xla",)):
        try:
            return load(candidate)
        except BackendUnavailable:
            continue
    return load("xla")
