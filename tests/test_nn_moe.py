"""jax_moe.nn: the Flax MoE layer against a dense per-token MoE (forward, aux loss, gradients) on 4 CPU devices, and
the LM's KV-cache decode against its full forward."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe
from jax_moe.nn import MoE, MoELM, MoELMConfig, lm_loss
from jax_moe.nn.moe import dense_ffn

N, HIDDEN, FFN, E, R = 4, 16, 32, 8, 2
HI = jax.lax.Precision.HIGHEST


def mesh4() -> jax.sharding.Mesh:
    return jax.make_mesh((N,), ("ep",), devices=jax.devices()[:N])


def bf16(a: jax.Array) -> jax.Array:
    return a.astype(jnp.bfloat16).astype(jnp.float32)


def params_of(m: MoE) -> dict[str, jax.Array]:
    p = {"router": m.router[...], "w_in": m.w_in[...], "w_out": m.w_out[...]}
    if m.w_up is not None:
        p["w_up"] = m.w_up[...]
    if m.shared is not None:
        for name in ("w_in", "w_up", "w_out"):
            if getattr(m.shared, name) is not None:
                p["shared_" + name] = getattr(m.shared, name)[...]
    return {k: jnp.asarray(np.asarray(v)) for k, v in p.items()}  # plain, unsharded copies


def dense_moe(p: dict[str, jax.Array], x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Every token through every expert densely, then each token's top-k outputs weighted; same bf16 wire casts."""
    x = x.reshape(-1, HIDDEN)
    logits = jnp.dot(x, p["router"], precision=HI)
    top, idx = jax.lax.top_k(logits, R)
    w = jax.nn.softmax(top, axis=-1)
    w_up = p.get("w_up")
    ys = jax.vmap(lambda wi, wo, wu: dense_ffn(bf16(x), wi, wo, wu), in_axes=(0, 0, None if w_up is None else 0)
                  )(p["w_in"], p["w_out"], w_up)                          # [E, T, H]
    picked = bf16(ys)[idx, jnp.arange(x.shape[0])[:, None]]               # [T, R, H]
    y = bf16(jnp.einsum("tr,trh->th", w, picked, precision=HI))
    if "shared_w_in" in p:
        y = y + dense_ffn(x, p["shared_w_in"], p["shared_w_out"], p.get("shared_w_up"))
    f = jnp.mean(jax.nn.one_hot(idx, E).sum(1), axis=0) / R
    probs = jnp.mean(jax.nn.softmax(logits, axis=-1), axis=0)
    return y, E * jnp.sum(f * probs)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


@pytest.mark.parametrize("activation,shared_ffn,backend,poison", [
    ("swiglu", 0, "xla", False), ("swiglu", 24, "xla", False), ("gelu", 24, "xla", False),
    ("swiglu", 24, "cpu", False), ("swiglu", 24, "xla", True), ("gelu", 0, "xla", True)])
def test_moe_matches_dense_reference(activation: str, shared_ffn: int, backend: str, poison: bool,
                                     monkeypatch) -> None:
    """poison: the padding rows of expert_x are NaN (the contract leaves them unspecified); the layer masks them through
    ragged_dot, so the forward and every gradient stay finite and equal to the dense reference."""
    if poison:
        monkeypatch.setenv("JAX_MOE_POISON_PADDING", "1")
    mesh = mesh4()
    try:
        jax_moe.backends.load(backend)
    except jax_moe.BackendUnavailable as e:
        pytest.skip(str(e))
    m = MoE(HIDDEN, FFN, E, R, mesh=mesh, backend=backend, shared_ffn=shared_ffn, activation=activation,
            rngs=nnx.Rngs(0))
    assert m.comm_for(12).backend_name == backend
    assert m.w_in[...].sharding.spec == P("ep", None, None)
    x_np = np.random.default_rng(1).standard_normal((8, 6, HIDDEN)).astype(np.float32)
    x = jax.device_put(x_np, NamedSharding(mesh, P("ep")))
    c = jnp.asarray(np.random.default_rng(2).standard_normal((8 * 6, HIDDEN)).astype(np.float32))

    y, aux = nnx.jit(lambda m, x: m(x))(m, x)
    assert y.shape == x.shape and y.dtype == jnp.float32
    p = params_of(m)
    y_ref, aux_ref = dense_moe(p, jnp.asarray(x_np))
    np.testing.assert_allclose(np.asarray(y).reshape(-1, HIDDEN), y_ref, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(float(aux), float(aux_ref), rtol=1e-4)

    def loss(m: MoE, x: jax.Array) -> jax.Array:
        y, aux = m(x)
        return jnp.sum(y.reshape(-1, HIDDEN) * c) + aux

    grads = nnx.jit(nnx.grad(loss))(m, x)
    assert grads["w_in"][...].sharding.spec == P("ep", None, None)  # expert gradients stay sharded
    g = params_of_grads(grads)
    g_ref = jax.grad(lambda p: jnp.sum(dense_moe(p, jnp.asarray(x_np))[0] * c) + dense_moe(p, jnp.asarray(x_np))[1]
                     )(p)
    assert set(g) == set(g_ref)
    for name in g_ref:
        assert rel_err(g[name], g_ref[name]) < 3e-2, (name, rel_err(g[name], g_ref[name]))


def params_of_grads(grads: nnx.State) -> dict[str, np.ndarray]:
    out = {}
    for path, var in nnx.to_flat_state(grads):
        out["_".join(str(k) for k in path)] = np.asarray(var.get_value())
    return out


def test_moe_takes_a_communicator_and_checks_it() -> None:
    mesh = mesh4()
    comm = jax_moe.Communicator(jax_moe.MoEConfig(E, R, HIDDEN, max_tokens=16), mesh, "ep", backend="xla")
    m = MoE(HIDDEN, FFN, E, R, communicator=comm, rngs=nnx.Rngs(3))
    assert m.comm_for(12) is comm
    x = jax.device_put(np.ones((8, 6, HIDDEN), np.float32), NamedSharding(mesh, P("ep")))
    y, _ = nnx.jit(lambda m, x: m(x))(m, x)
    assert np.all(np.isfinite(np.asarray(y)))
    with pytest.raises(ValueError, match="communicator"):
        MoE(HIDDEN, FFN, E, 3, communicator=comm, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="divisible"):
        MoE(HIDDEN, FFN, 6, R, mesh=mesh, rngs=nnx.Rngs(0))


def test_decode_steps_match_full_forward() -> None:
    mesh = mesh4()
    cfg = MoELMConfig(vocab_size=20, hidden=16, num_layers=2, num_heads=2, ffn=16, num_experts=E,
                      experts_per_token=R, shared_ffn=8, tie_embeddings=False)
    model = MoELM(cfg, mesh, backend="xla", rngs=nnx.Rngs(0))
    s = 6
    tokens_np = np.random.default_rng(4).integers(0, 20, (4, s)).astype(np.int32)
    sharding = NamedSharding(mesh, P("ep"))
    full, aux = nnx.jit(lambda m, t: m(t))(model, jax.device_put(tokens_np, sharding))
    assert full.shape == (4, s, 20) and np.isfinite(float(aux))

    step = nnx.jit(lambda m, t, c, pos: m.decode_step(t, c, pos))
    caches: Optional[list] = model.init_cache(4, s)
    for pos in range(s):
        logits, caches = step(model, jax.device_put(tokens_np[:, pos], sharding), caches, jnp.int32(pos))
        np.testing.assert_allclose(np.asarray(logits), np.asarray(full[:, pos]), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="multiple of the EP size"):
        model.init_cache(3, s)


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_lm_gradients_are_the_same_under_every_remat_policy_and_scan(backend: str) -> None:
    """MoELMConfig.remat (nnx.remat around each block, with the usual policies) and scan_layers (lax.scan over the
    stacked blocks, remat'ed inside): the loss and every parameter's gradient equal those of the plain loop, on the
    native backend too (its dispatch/combine carry an ordered effect)."""
    mesh = mesh4()
    tokens = jax.device_put(np.random.default_rng(7).integers(0, 20, (4, 9)).astype(np.int32),
                            NamedSharding(mesh, P("ep")))
    results = {}
    for remat, scan in [("none", False), ("full", False), ("dots", False), ("moe", False), ("none", True),
                        ("full", True), ("moe", True)]:
        cfg = MoELMConfig(vocab_size=20, hidden=16, num_layers=3, num_heads=2, ffn=16, num_experts=E,
                          experts_per_token=R, shared_ffn=8, remat=remat, scan_layers=scan)
        model = MoELM(cfg, mesh, backend=backend, rngs=nnx.Rngs(3))
        (loss, _), grads = nnx.jit(nnx.value_and_grad(lm_loss, has_aux=True))(model, tokens)
        results[remat, scan] = float(loss), jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(grads, nnx.Param)))
        graphdef, state = nnx.split(model)
        jaxpr = str(jax.make_jaxpr(jax.grad(lambda st: lm_loss(nnx.merge(graphdef, st), tokens)[0]))(state))
        assert ("checkpoint" in jaxpr or "remat" in jaxpr) == (remat != "none"), remat  # the blocks are remat'ed
        assert ("length=3" in jaxpr) == scan, scan  # a scan over the 3 blocks
    base_loss, base_grads = results["none", False]
    for what, (loss, grads) in results.items():
        assert loss == pytest.approx(base_loss, rel=1e-5), what
        for (path, g), (_, want) in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                                        jax.tree_util.tree_flatten_with_path(base_grads)[0]):
            np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-6, err_msg=f"{what} {path}")
    with pytest.raises(ValueError, match="remat must be one of"):
        MoELMConfig(vocab_size=20, remat="everything")
