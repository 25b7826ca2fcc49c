"""jax.ffi.ffi_call for the native backends, usable inside shard_map with check_vma=True.

XLA custom calls know nothing of shard_map's varying-manual-axes (vma) types: their results come out invariant, which
breaks custom_vjp and later arithmetic with per-rank values. Results are made varying over every axis any operand
varies over (they depend on those operands per rank).
"""
from __future__ import annotations

from typing import Any

import jax


def _vma(x: Any) -> frozenset:
    """The manual axes x varies over (jax <= 0.10 keeps them in aval.mat.varying, later jax in aval.vma)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "mat", None), "varying", None)
    return frozenset(vma or ())


def varying(x: jax.Array, axes: frozenset) -> jax.Array:
    """x, made varying over `axes` where it is not yet."""
    missing = tuple(sorted(axes - _vma(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def ffi_call(target: str, results: Any, *args: jax.Array, **attrs: Any) -> Any:
    """A side-effecting ffi_call (never removed or merged by XLA) whose results vary like its operands."""
    # Gradients come from jax_moe.api's custom_vjp, never through the call itself; stop_gradient also drops the
    # (zero) tangents that integer routing arrays carry out of a custom_vjp.
    args = tuple(jax.lax.stop_gradient(a) for a in args)
    outs = jax.ffi.ffi_call(target, results, has_side_effect=True)(*args, **attrs)
    axes = frozenset().union(*(_vma(a) for a in args))
    if not axes:
        return outs
    return jax.tree.map(lambda o: varying(o, axes), outs)
