"""The native backends' XLA FFI calls: in program order on every device, usable inside shard_map with check_vma=True.

**Program order.** A send half must not run before the receive half of the round that last used its buffer on the
same device (on "cuda" the round two back, on "cpu" one lane's worth back): on a GPU the send would wait (on the
stream) for a receive queued behind it, and on the CPU more rounds than receive lanes would be in flight. Data dependencies do not order independent rounds, and XLA schedules
side-effecting custom calls freely (e.g. all sends of a loop first, or a forward receive after the backward's
sends, also across shard_map bodies). So every call carries one *ordered effect*: JAX then threads a token through
all of them in program (trace) order — across shard_map bodies, loops, custom_vjp's forward and backward and
separate jitted calls — and XLA runs them on each device in that order, the same on every rank (how the token is
tied to the call differs per platform: see the two lowerings). The ordering is the only coupling: other work still
moves freely between a send and its receive. No token is kept from one program to the next (see
_keep_no_runtime_token).

**vma types.** XLA custom calls know nothing of shard_map's varying-manual-axes types: their results come out
invariant, which breaks custom_vjp and later arithmetic with per-rank values. Results are made varying over every
axis an operand varies over, plus the Communicator's axes (they are per rank; jax_moe.contract.varying).
"""
from __future__ import annotations

import atexit
import dataclasses
from typing import Any, Iterable

import jax
import numpy as np
from jax._src import core, dispatch, effects  # private: the only way to declare an ordered effect for a primitive
from jax._src import ffi as _jax_ffi
from jax._src.interpreters import batching, mlir
from jax._src.lib.mlir.dialects import hlo

from jax_moe.contract import varying, vma


@dataclasses.dataclass(frozen=True)
class RoundOrder(effects.Effect):
    """The effect of every jax_moe native call: ordered, per device (shardable), allowed in custom_vjp and loops."""

    def __str__(self) -> str:
        return "jax_moe.RoundOrder"


_ORDER = RoundOrder()
# remat_allowed_effects: jax.checkpoint / nnx.remat around a layer. Partial evaluation keeps an effectful call whose
# inputs are known in the forward pass and saves its results (it never replays one), so a checkpointed layer sends
# each round once, in program order, whatever the policy (tests/test_remat.py counts the calls). A JAX that replayed
# them would break this: a receive replayed without its send would take another round's data. Also known: under
# jax.grad, lax.scan hoists a call whose operands are all loop-invariant out of the loop (one round instead of one
# per step: the same results, on every rank alike).
for _kind in (effects.lowerable_effects, effects.ordered_effects, effects.shardable_ordered_effects,
              effects.control_flow_allowed_effects, effects.custom_derivatives_allowed_effects,
              effects.partial_eval_kept_effects, effects.remat_allowed_effects):
    _kind.add_type(RoundOrder)

_call_p = core.Primitive("jax_moe_call")
_call_p.multiple_results = True


def _abstract_eval(*avals_in, target: str, result_avals: tuple, attrs: tuple):
    # jax.ffi's own rule: vma checks of the operands, results placed on the current (abstract) mesh.
    avals, _ = _jax_ffi.ffi_call_abstract_eval(*avals_in, result_avals=result_avals, has_side_effect=True)
    return avals, {_ORDER}


def _lowering_cpu(ctx, *operands, target: str, result_avals: tuple, attrs: tuple):
    # XLA:CPU runs independent thunks concurrently, ordered by their buffers only, so the token must be a real
    # operand and result of the call: the CPU handlers take and return an ffi::Token.
    token = ctx.tokens_in.get(_ORDER)
    tok = core.abstract_token
    sub = ctx.replace(avals_in=(tok, *ctx.avals_in), avals_out=(tok, *ctx.avals_out))
    outs = jax.ffi.ffi_lowering(target, has_side_effect=True)(sub, token, *operands, **dict(attrs))
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({_ORDER: outs[0]})))
    return list(outs[1:])


def _lowering_gpu(ctx, *operands, target: str, result_avals: tuple, attrs: tuple):
    # XLA:GPU runs a device's work on its stream in schedule order, and the schedule keeps the order of optimization
    # barriers (token + operands in, token + results out). A token inside the call itself crashed XLA:GPU's fusion
    # cost analysis (jax 0.11.2), so the GPU handlers take none.
    token = ctx.tokens_in.get(_ORDER)
    before = hlo.OptimizationBarrierOp([token, *operands]).results
    outs = jax.ffi.ffi_lowering(target, has_side_effect=True)(ctx, *before[1:], **dict(attrs))
    after = hlo.OptimizationBarrierOp([before[0], *outs]).results
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({_ORDER: after[0]})))
    return list(after[1:])


def _keep_no_runtime_token() -> None:
    """JAX carries an ordered effect's token from one executed program to the next. We need no order between programs
    (each device runs its programs in order anyway), and a carried token that a failed program left in an error state
    would fail every later program that uses jax_moe, of any Communicator. So our effect's token is never kept: every
    program starts from a fresh one."""
    cls = type(dispatch.runtime_tokens)
    original = getattr(cls, "set_token_result", None)
    if original is None or getattr(original, "_jax_moe", False):
        return

    def set_token_result(self, eff, token):
        if not isinstance(eff, RoundOrder):
            original(self, eff, token)

    set_token_result._jax_moe = True  # type: ignore[attr-defined]
    cls.set_token_result = set_token_result


def wait_for_programs() -> None:
    """Waits for the programs this thread has dispatched (asynchronously) to finish: a Communicator's native state
    must outlive the programs that call into it. Errors of failed programs were reported where their results were
    awaited."""
    try:
        jax.effects_barrier()
    except Exception:  # noqa: BLE001
        pass


def _drain_runtime_tokens() -> None:
    """At exit, before jax's own hook (atexit runs hooks in reverse order): wait for every device's last program one
    by one and forget them. jax's hook stops at the first program that failed and prints its error again as an
    'Exception ignored in atexit callback' traceback; a failed jax_moe call was already reported where its result
    was awaited."""
    tokens = dispatch.runtime_tokens
    for token in list(getattr(tokens, "output_runtime_tokens", {}).values()):
        try:
            token.block_until_ready()
        except Exception:  # noqa: BLE001 - reported where the program's results were awaited
            pass
    clear = getattr(tokens, "clear", None)
    if clear is not None:
        clear()


_keep_no_runtime_token()
atexit.register(_drain_runtime_tokens)
_call_p.def_effectful_abstract_eval(_abstract_eval)


def _refuse_vmap(args, dims, *, target: str, result_avals: tuple, attrs: tuple):
    # A batch of rounds would need a buffer per batch element and every rank to agree on the batch size: refused at
    # trace time with what to do instead.
    raise NotImplementedError(
        f"jax_moe: jax.vmap over dispatch/combine is not supported by the native backends ({target}). Fold the batch "
        "axis into the tokens instead (x.reshape(-1, hidden), topk_idx.reshape(-1, R), with max_tokens covering "
        "them), or loop over the batch with lax.scan / lax.map; backend \"xla\" is pure JAX and vmaps.")


batching.primitive_batchers[_call_p] = _refuse_vmap
dispatch.simple_impl(_call_p)
mlir.register_lowering(_call_p, _lowering_cpu, platform="cpu")
mlir.register_lowering(_call_p, _lowering_gpu, platform="cuda")


def _attr(v: Any) -> Any:
    """Attributes are primitive params: hashable, and typed as the handlers decode them (int64, bool, float)."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return np.int64(v)
    return v


def ffi_call(target: str, results: Any, *args: jax.Array, axes: Iterable[str] = (), **attrs: Any) -> Any:
    """Calls FFI target `target` in program order (see the module doc). `results`: a ShapeDtypeStruct or a
    tuple/list of them; the results vary over `axes` and every axis an operand varies over."""
    # Gradients come from jax_moe.api's custom_vjp, never through the call itself; stop_gradient also drops the
    # (zero) tangents that integer routing arrays carry out of a custom_vjp.
    args = tuple(jax.lax.stop_gradient(jax.numpy.asarray(a)) for a in args)
    vary = frozenset(axes).union(*(vma(a) for a in args))
    args = tuple(varying(a, vary) for a in args)  # the vma rule wants operands that vary alike
    single = not isinstance(results, (tuple, list))
    specs = (results,) if single else tuple(results)
    result_avals = tuple(core.ShapedArray(s.shape, s.dtype) for s in specs)
    outs = _call_p.bind(*args, target=target, result_avals=result_avals,
                        attrs=tuple(sorted((k, _attr(v)) for k, v in attrs.items())))
    outs = [varying(o, vary) if vary else o for o in outs]
    return outs[0] if single else type(results)(outs)
