"""Bad input raises a Python error at trace time that names the problem."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe
from support.helpers import mesh_of, run

N, E, R, H, T = 2, 8, 2, 128, 4


@pytest.fixture
def comm():
    return jax_moe.Communicator(jax_moe.MoEConfig(E, R, H, T), mesh_of(N), "ep", backend="xla")


@pytest.fixture
def comm8():
    cfg = jax_moe.MoEConfig(E, R, H, T, dispatch_dtype=jnp.float8_e4m3fn)
    return jax_moe.Communicator(cfg, mesh_of(N), "ep", backend="xla")


def x_of(t=T, h=H, dtype=jnp.bfloat16):
    return np.zeros((N * t, h), dtype)


def idx_of(t=T, r=R, dtype=np.int32):
    return np.zeros((N * t, r), dtype)


def dispatch_with(comm, *args):
    def body(*a):
        return comm.dispatch(*a).expert_x

    return run(comm, body, *args)


@pytest.mark.parametrize("cfg_kwargs, match", [
    (dict(num_experts=0), "num_experts must be a positive int"),
    (dict(hidden=-1), "hidden must be a positive int"),
    (dict(max_tokens=2.5), "max_tokens must be a positive int"),
    (dict(experts_per_token=9), "experts_per_token \\(9\\) exceeds num_experts \\(8\\)"),
    (dict(dispatch_dtype=jnp.float32), "dispatch_dtype must be bfloat16 or float8_e4m3fn"),
    (dict(combine_dtype=jnp.float16), "combine_dtype must be bfloat16"),
    (dict(hidden=100, dispatch_dtype=jnp.float8_e4m3fn), "hidden \\(100\\) must be divisible by scale_block"),
    (dict(dispatch_dtype="notadtype"), "MoEConfig.dispatch_dtype must be a dtype"),
])
def test_bad_config(cfg_kwargs, match):
    kw = dict(num_experts=E, experts_per_token=R, hidden=H, max_tokens=T) | cfg_kwargs
    with pytest.raises((ValueError, TypeError), match=match):
        jax_moe.MoEConfig(**kw)


def test_bad_communicator():
    cfg = jax_moe.MoEConfig(6, 2, H, T)
    with pytest.raises(ValueError, match="num_experts \\(6\\) is not divisible by the 4 ranks"):
        jax_moe.Communicator(cfg, mesh_of(4), "ep")
    with pytest.raises(ValueError, match="axis 'tp' is not in the mesh"):
        jax_moe.Communicator(cfg, mesh_of(2), "tp")
    with pytest.raises(ValueError, match="unknown backend 'nccl'"):
        jax_moe.Communicator(cfg, mesh_of(2), "ep", backend="nccl")
    with pytest.raises(TypeError, match="cfg must be a jax_moe.MoEConfig"):
        jax_moe.Communicator({"num_experts": 8}, mesh_of(2), "ep")
    for axis in (0, None):
        with pytest.raises(TypeError, match="axis_name must be a mesh axis name"):
            jax_moe.Communicator(cfg, mesh_of(2), axis)
    for t in ("abc", 0, -1.0, True):
        with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
            jax_moe.Communicator(cfg, mesh_of(2), "ep", backend="xla", timeout_s=t)
    with pytest.raises(ValueError, match="fabric_provider must be one of"):
        jax_moe.Communicator(cfg, mesh_of(2), "ep", backend="xla", fabric_provider="bogus")


def test_environment_defaults_are_checked(monkeypatch):
    """The environment's defaults are checked like the options, and the error names the variable."""
    cfg = jax_moe.MoEConfig(4, 2, H, T)
    for raw in ("abc", "0", "-3", "inf"):
        monkeypatch.setenv("JAX_MOE_TIMEOUT_S", raw)
        with pytest.raises(ValueError, match=f"JAX_MOE_TIMEOUT_S='{raw}': must be a positive number of seconds"):
            jax_moe.Communicator(cfg, mesh_of(2), "ep", backend="cpu")
    monkeypatch.setenv("JAX_MOE_TIMEOUT_S", "7.5")
    monkeypatch.setenv("JAX_MOE_FABRIC_PROVIDER", "bogus")
    with pytest.raises(ValueError, match="JAX_MOE_FABRIC_PROVIDER='bogus': must be one of"):
        jax_moe.Communicator(cfg, mesh_of(2), "ep", backend="cpu")
    monkeypatch.delenv("JAX_MOE_FABRIC_PROVIDER")
    assert jax_moe.Communicator(cfg, mesh_of(2), "ep", backend="cpu").timeout_s == 7.5
    assert jax_moe.Communicator(cfg, mesh_of(2), "ep", backend="cpu", timeout_s=3).timeout_s == 3.0


def test_outside_shard_map(comm):
    with pytest.raises(RuntimeError, match="inside jax.shard_map over axis 'ep'"):
        comm.dispatch(jnp.zeros((T, H), jnp.bfloat16), jnp.zeros((T, R), jnp.int32))
    with pytest.raises(RuntimeError, match="inside jax.shard_map over axis 'ep'"):
        jax.jit(lambda x, i: jax_moe.dispatch(comm, x, i).expert_x)(
            jnp.zeros((T, H), jnp.bfloat16), jnp.zeros((T, R), jnp.int32))


def test_vmap_axis_is_not_shard_map(comm):
    """jax.vmap(axis_name="ep") binds the name, but runs one program for all ranks: refused at trace time."""
    with pytest.raises(RuntimeError, match="not a shard_map \\(manual\\) axis"):
        jax.vmap(lambda x, i: comm.dispatch(x, i).expert_x, axis_name="ep")(
            jnp.zeros((N, T, H), jnp.bfloat16), jnp.zeros((N, T, R), jnp.int32))


def test_wrong_axis_size(comm):
    other = jax_moe.Communicator(comm.cfg, mesh_of(4), "ep", backend="xla")
    with pytest.raises(ValueError, match="has size 4 here, but the Communicator was built for 2 ranks"):
        run(other, lambda x, i: comm.dispatch(x, i).expert_x, np.zeros((4 * T, H), jnp.bfloat16),
            np.zeros((4 * T, R), np.int32))


@pytest.mark.parametrize("x, idx, match, err", [
    (np.zeros((N * T,), jnp.bfloat16), idx_of(), "x has shape \\[4\\], expected \\[\\?, 128\\]", ValueError),
    (x_of(h=64), idx_of(), "x has shape \\[4, 64\\], expected \\[\\?, 128\\]", ValueError),
    (x_of(t=T + 1), idx_of(t=T + 1), "x has 5 tokens on this rank, more than max_tokens=4", ValueError),
    (x_of(t=0), idx_of(t=0), "x has 0 tokens on this rank; pass at least one", ValueError),
    (x_of(dtype=np.float32), idx_of(), "x has dtype float32, expected dispatch_dtype bfloat16", TypeError),
    (x_of(), idx_of(r=3), "topk_idx has shape \\[4, 3\\], expected \\[4, 2\\]", ValueError),
    (x_of(), idx_of(dtype=np.float32), "topk_idx has dtype float32, expected int32", TypeError),
])
def test_bad_dispatch_input(comm, x, idx, match, err):
    with pytest.raises(err, match="jax_moe.dispatch: " + match):  # the call the user made, not its send half
        dispatch_with(comm, x, idx)


def test_bad_scales(comm, comm8):
    x8 = x_of(dtype=jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8 dispatch needs x_scale \\[4, 1\\] float32"):
        dispatch_with(comm8, x8, idx_of())
    with pytest.raises(ValueError, match="x_scale has shape \\[4, 2\\], expected \\[4, 1\\]"):
        dispatch_with(comm8, x8, idx_of(), np.zeros((N * T, 2), np.float32))
    with pytest.raises(TypeError, match="x_scale has dtype bfloat16, expected float32"):
        dispatch_with(comm8, x8, idx_of(), np.zeros((N * T, 1), jnp.bfloat16))
    with pytest.raises(ValueError, match="x_scale is only for float8_e4m3fn dispatch"):
        dispatch_with(comm, x_of(), idx_of(), np.zeros((N * T, 1), np.float32))
    with pytest.raises(TypeError, match="use jax_moe.quantize_fp8"):
        dispatch_with(comm8, x_of(), idx_of(), np.zeros((N * T, 1), np.float32))


def test_bad_combine_input(comm):
    m = comm.max_recv_rows

    def combine_with(y_rows, y_dtype, w_shape, w_dtype):
        def body(x, idx):
            d = comm.dispatch(x, idx)
            y = jnp.zeros((y_rows, H), y_dtype)
            return comm.combine(y, jnp.zeros(w_shape, w_dtype), d)

        return run(comm, body, x_of(), idx_of())

    with pytest.raises(ValueError, match=f"expert_y has shape \\[{m - 1}, 128\\], expected \\[{m}, 128\\]"):
        combine_with(m - 1, jnp.bfloat16, (T, R), jnp.float32)
    with pytest.raises(TypeError, match="expert_y has dtype float32, expected bfloat16"):
        combine_with(m, jnp.float32, (T, R), jnp.float32)
    with pytest.raises(ValueError, match="topk_weights has shape \\[4, 3\\], expected \\[4, 2\\]"):
        combine_with(m, jnp.bfloat16, (T, 3), jnp.float32)
    with pytest.raises(TypeError, match="topk_weights has dtype int32, expected a floating dtype"):
        combine_with(m, jnp.bfloat16, (T, R), jnp.int32)


def w_of(t=T, r=R, dtype=np.float32):
    return np.ones((N * t, r), dtype)


@pytest.mark.parametrize("w, match, err", [
    (w_of(r=3), "jax_moe.dispatch: topk_weights has shape \\[4, 3\\], expected \\[4, 2\\]", ValueError),
    (w_of(t=T - 1), "jax_moe.dispatch: topk_weights has shape \\[3, 2\\], expected \\[4, 2\\]", ValueError),
    (np.ones((N * T,), np.float32), "jax_moe.dispatch: topk_weights has shape \\[4\\], expected \\[4, 2\\]", ValueError),
    (w_of(dtype=np.int32), "jax_moe.dispatch: topk_weights has dtype int32, expected a floating dtype", TypeError),
])
def test_bad_dispatch_weights(comm, w, match, err):
    """Weights given to dispatch are checked like combine's."""
    with pytest.raises(err, match=match):
        run(comm, lambda x, idx, w: comm.dispatch(x, idx, topk_weights=w).expert_x, x_of(), idx_of(), w)


def test_recv_weights_must_match_dispatch(comm):
    """After a combine_send of a dispatch with weights, combine_recv takes no other weights; without weights at
    dispatch it needs them."""
    m = comm.max_recv_rows

    def other_at_recv(x, idx, w):
        d = comm.dispatch(x, idx, topk_weights=w)
        return comm.combine_recv(comm.combine_send(jnp.zeros((m, H), jnp.bfloat16), d), w * 2)

    with pytest.raises(ValueError, match="combine_recv: this round's rows were summed at the experts with the weights "
                                         "given to dispatch_send.*pass topk_weights=None.*or dispatch without"):
        run(comm, other_at_recv, x_of(), idx_of(), w_of())

    def none_at_recv(x, idx, w):
        d = comm.dispatch(x, idx)
        return comm.combine_recv(comm.combine_send(jnp.zeros((m, H), jnp.bfloat16), d))

    def none_at_combine(x, idx, w):
        return comm.combine(jnp.zeros((m, H), jnp.bfloat16), None, comm.dispatch(x, idx))

    for body in (none_at_recv, none_at_combine):
        with pytest.raises(TypeError, match="topk_weights is needed, since dispatch was given none"):
            run(comm, body, x_of(), idx_of(), w_of())

    with pytest.raises(TypeError, match="combine: d \\(the Dispatched returned by dispatch\\) is required"):
        run(comm, lambda x, idx, w: comm.combine(jnp.zeros((m, H), jnp.bfloat16), w), x_of(), idx_of(), w_of())


def test_handles_are_checked(comm):
    other = jax_moe.Communicator(comm.cfg, comm.mesh, "ep", backend="xla")

    def recv_other(x, idx):
        return other.dispatch_recv(comm.dispatch_send(x, idx)).expert_x

    with pytest.raises(ValueError, match="this handle was made by another Communicator"):
        run(comm, recv_other, x_of(), idx_of())

    def combine_not_dispatched(x, idx):
        return comm.combine(jnp.zeros((comm.max_recv_rows, H), jnp.bfloat16), jnp.zeros((T, R)), x)

    with pytest.raises(TypeError, match="expected the Dispatched returned by dispatch"):
        run(comm, combine_not_dispatched, x_of(), idx_of())

    def recv_wrong_handle(x, idx):
        return comm.combine_recv(comm.dispatch_send(x, idx), jnp.zeros((T, R)))

    with pytest.raises(TypeError, match="expected the handle from combine_send, got DispatchHandle"):
        run(comm, recv_wrong_handle, x_of(), idx_of())

    def combine_hand_built(x, idx):
        d = jax_moe.Dispatched(jnp.zeros((comm.max_recv_rows, H), jnp.bfloat16), None, jnp.zeros((E // N,), jnp.int32),
                               idx, None, comm.id)
        return comm.combine(d.expert_x, jnp.zeros((T, R)), d)

    with pytest.raises(ValueError, match="this Dispatched was not made by dispatch"):
        run(comm, combine_hand_built, x_of(), idx_of())


def test_vmap_over_a_native_backend_says_what_to_do():
    """jax.vmap of dispatch on a native backend is refused at trace time with the way out (fold the batch into the
    tokens), not JAX's bare "Batching rule ... not implemented"."""
    mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices("cpu")[:2])
    comm = jax_moe.Communicator(jax_moe.MoEConfig(E, R, H, T), mesh, "ep", backend="cpu")
    sh = NamedSharding(mesh, P(None, "ep"))
    body = jax.shard_map(lambda x, idx: jax.vmap(lambda a, b: comm.dispatch(a, b).expert_x)(x, idx), mesh=mesh,
                         in_specs=(P(None, "ep"), P(None, "ep")), out_specs=P(None, "ep"))
    x = jax.device_put(jnp.zeros((3, 2 * T, H), jnp.bfloat16), sh)
    idx = jax.device_put(jnp.zeros((3, 2 * T, R), jnp.int32), sh)
    with pytest.raises(NotImplementedError, match="jax.vmap over dispatch/combine .* Fold the batch axis into the tokens"):
        jax.jit(body).lower(x, idx)
