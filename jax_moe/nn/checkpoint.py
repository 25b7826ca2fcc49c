"""Checkpoints without extra dependencies: params.npz (the flattened nnx.Param state) + meta.json (config, extras).

Arrays are saved as float32 (NumPy has no portable bfloat16) and, on load, cast back and placed with the sharding
of a freshly built model, so a checkpoint loads on any mesh whose EP size divides num_experts.

Several processes (jax.distributed): `save` is collective (every process calls it; parameters sharded across
processes, the experts over "ep", are gathered) and only process 0 writes; `load` runs on every process, each
reading the same files and placing its own shards.
"""
from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jax_moe.nn.config import MoELMConfig
from jax_moe.nn.model import MoELM

PARAMS, META = "params.npz", "meta.json"


def _key(path: tuple[Any, ...]) -> str:
    return "/".join(str(p) for p in path)


def _to_host(value: jax.Array) -> np.ndarray:
    """The whole array: one spread over several processes is gathered (collective)."""
    if value.is_fully_addressable:
        return np.asarray(jax.device_get(value), np.float32)
    return np.asarray(multihost_utils.process_allgather(value, tiled=True), np.float32)


def save(directory: str, model: MoELM, **extra: Any) -> None:
    """Write model's parameters and {"config": ..., **extra} (JSON-serialisable) into directory.

    With several processes every one must call it (it gathers); only process 0 writes."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    arrays = {_key(path): _to_host(var.get_value()) for path, var in flat}
    if jax.process_index() != 0:
        return
    os.makedirs(directory, exist_ok=True)
    np.savez(os.path.join(directory, PARAMS), **arrays)
    meta = {"config": json.loads(model.cfg.to_json()), **extra}
    with open(os.path.join(directory, META), "w") as f:
        json.dump(meta, f, indent=2)


def load(directory: str, mesh: Any, *, axis_name: str = "ep", backend: str = "auto") -> tuple[MoELM, dict]:
    """(model on mesh with the saved parameters, the saved meta dict)."""
    with open(os.path.join(directory, META)) as f:
        meta = json.load(f)
    model = MoELM(MoELMConfig.from_dict(meta["config"]), mesh, axis_name=axis_name, backend=backend,
                  rngs=nnx.Rngs(0))
    saved = np.load(os.path.join(directory, PARAMS))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    missing = sorted({_key(p) for p, _ in flat} ^ set(saved.files))
    if missing:
        raise ValueError(f"checkpoint {directory}: parameters do not match the model: {missing[:5]}")
    updated = []
    for path, var in flat:
        current = var.get_value()
        full = saved[_key(path)].astype(current.dtype)
        # Every process places its own shards from its copy of the file (the sharding may span processes).
        value = jax.make_array_from_callback(full.shape, current.sharding, lambda index, a=full: a[index])
        updated.append((path, var.replace(value)))
    nnx.update(model, nnx.from_flat_state(updated))
    return model, meta
