"""The optimizer step both paths share, once the reduced grads are in hand.

Megatron's `DistributedOptimizer.step` in order: clip by the global norm, step the inner
optimizer on the fp32 main params (or on the fp32 params themselves), cast the result
back to the model's dtype. The paths differ only in how they compute the norm (XLA over
sharded arrays, or explicit psums over buffer shards) and in how the new params travel
back (a sharding constraint, or an all_gather per bucket).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jzero.zero.groups import EXTRA_ARG, GroupValues

PyTree = Any


def clip_coefficient(norm: jax.Array, max_norm: float) -> jax.Array:
    """Megatron's clipping factor `min(1, max_norm / (norm + 1e-6))` (docs/megatron.md)."""
    return jnp.minimum(1.0, max_norm / (norm + 1e-6))


def clip_by_global_norm(grads: PyTree, max_norm: float | None) -> tuple[PyTree, jax.Array]:
    """(grads scaled by `clip_coefficient`, the norm before clipping); max_norm None: no clipping.

    On sharded grads XLA sums the squares of each shard and all-reduces them, so the norm
    equals the unsharded one.
    """
    norm = optax.tree.norm(grads)
    if max_norm is None:
        return grads, norm
    coeff = clip_coefficient(norm, max_norm)
    return jax.tree.map(lambda g: g * coeff.astype(g.dtype), grads), norm


def inner_update(
    inner: optax.GradientTransformation,
    grads: PyTree,
    inner_state: optax.OptState,
    main: PyTree,
    groups: GroupValues | None,
) -> tuple[PyTree, optax.OptState]:
    """The inner transformation's (updates, new state) for the fp32 main params; the caller adds
    the updates to the main params (`optax.apply_updates`).

    `groups` (laid out like `grads`) reaches the inner transformation as the extra argument
    `param_groups`; transformations that do not take extra arguments never see it.
    """
    extra = {} if groups is None else {EXTRA_ARG: groups}
    return optax.with_extra_args_support(inner).update(grads, inner_state, main, **extra)


def model_copy(main: PyTree, dtypes: PyTree) -> PyTree:
    """Megatron's `_copy_main_params_to_model_params`: the main params cast to each param's dtype."""
    return jax.tree.map(lambda m, d: m.astype(d), main, dtypes)
