"""Lifetime of the Flax layer's Communicators: they go with their layer (and the native buffers of backend "cpu" with
them), also when models are built in a loop, and nnx.split/merge/state/jit keep working with one Communicator per
layer and token count."""
from __future__ import annotations

import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe
from jax_moe.nn import MoE
from support.helpers import cpu_module, mesh_of

N, HIDDEN, FFN, E, R = 4, 16, 16, 8, 2


@pytest.fixture
def core():
    cpu = cpu_module()
    collect()
    return cpu


def loss(m: MoE, x: jax.Array) -> jax.Array:
    y, aux = m(x)
    return jnp.sum(y) + aux


def collect() -> None:
    """Full collections until nothing is left: a Communicator and its backend refer to each other, and jax's tracing
    caches drop what a finished jit held in a pass after the jit itself, so a layer takes two or three passes."""
    for _ in range(4):
        if gc.collect() == 0:
            return


def layer(mesh, seed: int = 0) -> MoE:
    return MoE(HIDDEN, FFN, E, R, mesh=mesh, backend="cpu", rngs=nnx.Rngs(seed))


def tokens(mesh, batch: int = 8, seq: int = 3) -> jax.Array:
    x = np.random.default_rng(0).standard_normal((batch, seq, HIDDEN)).astype(np.float32)
    return jax.device_put(x, NamedSharding(mesh, P("ep")))


def forward(m: MoE, x: jax.Array) -> jax.Array:
    return m(x)[0]


def test_layer_releases_its_communicators(core):
    mesh, base = mesh_of(N), core.live_comms()
    m = layer(mesh)
    x = tokens(mesh)
    t = x.size // (HIDDEN * N)
    y = nnx.jit(forward)(m, x)
    grads = nnx.jit(nnx.grad(loss))(m, x)
    jax.block_until_ready((y, grads))
    comm = m.comm_for(t)
    assert comm is m.comm_for(t) and comm.backend_name == "cpu"
    assert core.live_comms() == base + 1  # forward and backward, traced twice: one Communicator
    native_id = comm.backend.native_id
    assert comm.bytes_allocated > 0
    del m, comm, y, grads
    collect()
    assert core.live_comms() == base
    with pytest.raises(ValueError, match="no CpuComm"):
        core.bytes_allocated(native_id)  # its buffers are gone with it


def test_split_merge_state_keep_one_communicator_per_layer(core):
    mesh, base = mesh_of(N), core.live_comms()
    m = layer(mesh)
    x = tokens(mesh)
    t = x.size // (HIDDEN * N)
    comm = m.comm_for(t)
    assert m.comm_for(2 * t) is not comm and core.live_comms() == base + 2
    graphdef, state = nnx.split(m)
    assert {str(p[0]) for p, _ in nnx.to_flat_state(state)} == {"router", "w_in", "w_up", "w_out"}
    assert jax.tree.leaves(state) and all(isinstance(v, jax.Array) for v in jax.tree.leaves(state))
    copy = nnx.merge(graphdef, state)
    assert copy.comm_for(t) is comm
    clone = nnx.clone(m)
    assert clone.comm_for(t) is comm
    other = layer(mesh, seed=1)
    assert other.comm_for(t) is not comm  # another layer, its own Communicator

    y = nnx.jit(forward)(copy, x)
    want = nnx.jit(forward)(m, x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    assert core.live_comms() == base + 3
    del m, clone
    collect()
    assert core.live_comms() == base + 3  # the merged copy still holds the layer
    np.testing.assert_array_equal(np.asarray(nnx.jit(forward)(copy, x)), np.asarray(want))
    del copy, other, comm, y, want
    collect()
    assert core.live_comms() == base


def test_models_built_in_a_loop_do_not_accumulate_communicators(core):
    mesh, base = mesh_of(N), core.live_comms()
    step = nnx.jit(forward)  # one jitted function for every model, as in a training script
    x = tokens(mesh)
    for i in range(8):
        model = layer(mesh, seed=i)
        jax.block_until_ready(step(model, x))
        assert core.live_comms() == base + 1
        del model
        collect()
        assert core.live_comms() == base, f"model {i}: {core.live_comms() - base} Communicators left"


def test_layer_deleted_while_its_program_runs(core):
    """jax dispatches asynchronously: a layer dropped while a program of it still runs keeps its Communicator until
    the program is done. Here the program waits in a host callback until a timer fires, after the layer is gone."""
    mesh, base = mesh_of(N), core.live_comms()
    m = layer(mesh)
    x = tokens(mesh)
    go = threading.Event()

    def wait() -> np.ndarray:
        go.wait(30)
        return np.zeros((), np.float32)

    @nnx.jit
    def held(m, x):
        return m(x + jax.pure_callback(wait, jax.ShapeDtypeStruct((), jnp.float32)))[0]

    go.set()
    want = np.asarray(held(m, x))
    go.clear()
    y = held(m, x)
    threading.Timer(1.0, go.set).start()
    del m
    collect()
    assert go.is_set()  # the layer's teardown waited for the program
    np.testing.assert_array_equal(np.asarray(y), want)
    assert core.live_comms() == base
