"""Training-stack programs (issue 26): the MoE layer under jax.checkpoint with the usual policies, and scanned over
stacked layers with and without remat, on every backend. Gradients equal "xla"'s and the dense reference's, and a
checkpointed layer sends no round again in the backward pass (the native calls are counted in the lowered
program). With save_only_these_names(DISPATCH_NAME, COMBINE_NAME) the layer's communicated results are the saved
residuals, by name."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe
from support.helpers import backend_mesh
from support.grads import check_against, moe_layer
from support.remat import (POLICIES, dense_grads, native_calls, remat_grad_fn, remat_problem,
                           scanned_sharded_grad_fn)

NATIVE = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
E, R, HIDDEN, T = 8, 3, 64, 6


def _ranks(backend: str) -> int:
    """2 ranks; "cuda" on as many GPUs as there are, up to 2 (one GPU: EP1, the same program)."""
    if backend != "cuda":
        return 2
    try:
        return max(1, min(2, len(jax.devices("gpu"))))
    except RuntimeError:
        return 2  # no GPU: backend_mesh skips


def _setup(backend: str, n: int, rng, layers: int):
    comm = jax_moe.Communicator(jax_moe.MoEConfig(E, R, HIDDEN, T), backend_mesh(backend, n), "ep", backend=backend)
    problem = remat_problem(rng, n, T, R, E, HIDDEN, layers)
    mesh = comm.mesh
    specs = (P("ep"), P("ep"), P("ep"), P(None, "ep"), P(None, "ep"), P("ep"))
    args = [jax.device_put(v, NamedSharding(mesh, s)) for v, s in zip(problem, specs)]
    return comm, problem, args


def _xla_twin(comm, problem, args):
    """The same problem on backend "xla" (the reference): its Communicator and arguments, laid out as `args`."""
    ref = jax_moe.Communicator(comm.cfg, backend_mesh("xla", comm.mesh.size), "ep", backend="xla")
    return ref, [jax.device_put(np.asarray(v), NamedSharding(ref.mesh, a.sharding.spec)) for v, a in zip(problem, args)]


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("layers", [1, 3], ids=["one-layer", "scan-3"])
@pytest.mark.parametrize("variant", [v for v in POLICIES if v != "plain"])
def test_checkpointed_layers_match_xla_and_send_nothing_again(rng, backend, layers, variant):
    n = _ranks(backend)
    comm, problem, args = _setup(backend, n, rng, layers)
    ref, ref_args = _xla_twin(comm, problem, args)
    got = remat_grad_fn(comm, variant, layers)(*args)
    want = remat_grad_fn(ref, variant, layers)(*ref_args)
    check_against(got, want, f"{backend} {variant} vs xla", rtol=1e-2)
    check_against(got, dense_grads(problem, E), f"{backend} {variant} vs dense")
    # The same rounds as without remat: partial evaluation saves what effectful calls return and never replays them.
    plain = native_calls(remat_grad_fn(comm, "plain", layers), *args)
    assert sum(plain.values()) > 0, plain
    assert native_calls(remat_grad_fn(comm, variant, layers), *args) == plain


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("variant", ["plain", "checkpoint", "save_only_names"])
def test_scan_over_sharded_layers_matches_xla(rng, backend, variant):
    """lax.scan in the global view over shard_map'ed layers (how MaxText and nnx.scan stack blocks; tests/test_remat's
    other cases scan inside one shard_map). On jax 0.11.2 backend "cpu"'s zero-sized scale arrays, carried from
    one shard_map body to another by the backward pass, crashed XLA's partitioner (segfault while compiling)."""
    n = _ranks(backend)
    comm, problem, args = _setup(backend, n, rng, 3)
    ref, ref_args = _xla_twin(comm, problem, args)
    got = scanned_sharded_grad_fn(comm, variant)(*args)
    check_against(got, scanned_sharded_grad_fn(ref, variant)(*ref_args), f"{backend} {variant} vs xla", rtol=1e-2)
    check_against(got, dense_grads(problem, E), f"{backend} {variant} vs dense")


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("variant", ["plain", "nothing_saveable"])
def test_split_halves_under_remat(rng, backend, variant):
    """dispatch_send / dispatch_recv and combine_send / combine_recv inside one checkpointed layer."""
    comm, problem, args = _setup(backend, _ranks(backend), rng, 1)
    check_against(remat_grad_fn(comm, variant, 1, split=True)(*args), dense_grads(problem, E), f"{backend} split")


def test_dispatch_and_combine_results_carry_their_checkpoint_names(rng):
    """The results carry DISPATCH_NAME / COMBINE_NAME, so that a policy can select them. (What a policy then saves:
    the native backends save their calls' results under every policy, test_checkpointed_layers_match_xla_and_send_
    nothing_again; "xla" keeps its receive halves' results too, being inside jax.custom_vjp.)"""
    comm, problem, args = _setup("cpu", 2, rng, 1)
    layer = moe_layer(comm, split_halves=False)
    text = str(jax.make_jaxpr(jax.shard_map(lambda x, i, w, a, b: layer(x, i, w, a[0], b[0]), mesh=comm.mesh,
                                            in_specs=(P("ep"), P("ep"), P("ep"), P(None, "ep"), P(None, "ep")),
                                            out_specs=P("ep")))(*args[:5]))
    for name in (jax_moe.DISPATCH_NAME, jax_moe.COMBINE_NAME):
        assert f"name={name}" in text, text[-2000:]
