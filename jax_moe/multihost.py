"""Arrays across the processes of jax.distributed without device collectives: inputs placed shard by shard, values
gathered through jax.distributed's key-value store. For benchmarks and tests whose processes may share a GPU (NCCL
refuses that, and `jax.device_put` of a host array compares it across processes with a collective)."""
from __future__ import annotations

import itertools
import pickle
from typing import Any

import jax
import numpy as np

_exchanges = itertools.count()


def place(a: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """`a` (the same host value in every process) with `sharding`, each process taking its own shards."""
    if jax.process_count() == 1:
        return jax.device_put(a, sharding)
    a = np.asarray(a)
    return jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])


def share(value: Any, timeout_s: float = 600.0) -> list[Any]:
    """Every process's `value` (picklable), in process order. Every process must call it, in the same order."""
    if jax.process_count() == 1:
        return [value]
    from jax._src import distributed  # private: the only handle on the key-value store

    client = distributed.global_state.client
    key = f"jax_moe/multihost/{next(_exchanges)}"
    client.key_value_set_bytes(f"{key}/{jax.process_index()}", pickle.dumps(value))
    return [pickle.loads(client.blocking_key_value_get_bytes(f"{key}/{p}", int(timeout_s * 1000)))
            for p in range(jax.process_count())]


def gather(a: jax.Array, timeout_s: float = 600.0) -> np.ndarray:
    """The global value of `a` in every process (a collective call, like `share`)."""
    if a.is_fully_addressable:
        return np.asarray(a)
    out = np.zeros(a.shape, a.dtype)
    for parts in share([(s.index, np.asarray(s.data)) for s in a.addressable_shards], timeout_s):
        for index, part in parts:
            out[index] = part
    return out
