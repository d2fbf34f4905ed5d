"""The distributed optimizer: an optax-shaped wrapper around any inner optax transformation.

Like Megatron's `DistributedOptimizer`, it keeps fp32 main params (when the model
params are not fp32) and the inner optimizer's state sharded over each param's
data-parallel domain, steps the inner transformation on those shards, and
gathers the updated params back into the model's layout. The inner
transformation never knows it is sharded: XLA partitions its element-wise math.

Shardings (see `strategies.py` for the notation), with `W[D, F_tp]` a model param:
  params in/out:       W[D, F_tp]      (replicated over DP)
  grads in:            W[D, F_tp] or W[D_dp, F_tp] (optim_grads)
  main params, state:  W[D_dp, F_tp]   (W[D, F_tp] under no_shard)
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jzero.zero.strategies import ShardingPlan

PyTree = Any


class ZeroState(NamedTuple):
    """Optimizer state, every per-param array sharded like `plan.state_shardings()`.

    main_params: fp32 master copy, or None when the model params are fp32 (then, as in
      Megatron, the model params are the main params and no second copy is kept).
    inner_state: the wrapped optax transformation's state.
    """

    main_params: PyTree | None
    inner_state: optax.OptState


class ZeroOptimizer(NamedTuple):
    """A pair of pure functions, like `optax.GradientTransformation`.

    init(params) -> ZeroState
    step(grads, state, params) -> (new_params, new_state, grad_norm)

    `step` returns new params rather than optax's additive updates: with fp32 main
    params the model copy is a cast of the main copy (Megatron's
    `_copy_main_params_to_model_params`), which `params + updates` would not reproduce
    in bf16.
    """

    init: Callable[[PyTree], ZeroState]
    step: Callable[[PyTree, ZeroState, PyTree], tuple[PyTree, ZeroState, jax.Array]]


def clip_by_global_norm(grads: PyTree, max_norm: float | None) -> tuple[PyTree, jax.Array]:
    """Megatron's clipping: g *= min(1, max_norm / (norm + 1e-6)); returns (grads, norm).

    On sharded grads XLA sums the squares of each shard and all-reduces them, so the
    norm equals the unsharded one.
    """
    norm = optax.tree.norm(grads)
    if max_norm is None:
        return grads, norm
    coeff = jnp.minimum(1.0, max_norm / (norm + 1e-6))
    return jax.tree.map(lambda g: g * coeff.astype(g.dtype), grads), norm


def _constrain(tree: PyTree, shardings: PyTree) -> PyTree:
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def _map_state(inner: optax.GradientTransformation, fn, state, per_param: PyTree, other):
    """Applies fn(leaf, per_param_leaf) to param-shaped state leaves, `other` to the rest."""
    return optax.tree_map_params(inner, fn, state, per_param, transform_non_params=other)


def zero_optimizer(
    inner: optax.GradientTransformation, plan: ShardingPlan, clip_grad: float | None = None
) -> ZeroOptimizer:
    """Wraps `inner` as a distributed optimizer with the layout of `plan`.

    Args:
      inner: any element-wise optax transformation (its updates are added to the
        fp32 main params).
      plan: the run's shardings.
      clip_grad: global-norm clipping threshold applied across shards, None = off.
    """
    state_sh = plan.state_shardings()
    param_sh = plan.param_shardings()

    def init(params):
        main = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        main = _constrain(main, state_sh)
        keep_main = any(p.dtype != jnp.float32 for p in jax.tree.leaves(params))
        inner_state = inner.init(main)
        inner_state = _map_state(inner, jax.lax.with_sharding_constraint, inner_state, state_sh, None)
        return ZeroState(main if keep_main else None, inner_state)

    def step(grads, state, params):
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        grads = _constrain(grads, state_sh)  # optim: each rank keeps its shard of the full grad
        grads, norm = clip_by_global_norm(grads, clip_grad)
        if state.main_params is None:
            main = _constrain(params, state_sh)
        else:
            main = state.main_params
        updates, inner_state = inner.update(grads, state.inner_state, main)
        main = _constrain(optax.apply_updates(main, updates), state_sh)
        inner_state = _map_state(inner, jax.lax.with_sharding_constraint, inner_state, state_sh, None)
        # All-gather: each rank's updated shard goes back into the replicated model copy.
        new_params = jax.tree.map(lambda m, p: m.astype(p.dtype), main, params)
        new_params = _constrain(new_params, param_sh)
        keep = state.main_params is not None
        return new_params, ZeroState(main if keep else None, inner_state), norm

    return ZeroOptimizer(init, step)


def state_shardings(inner: optax.GradientTransformation, plan: ShardingPlan, abstract_params: PyTree) -> ZeroState:
    """The NamedShardings of the `ZeroState` for params shaped like `abstract_params`.

    Per-param state leaves follow `plan.state_shardings()`; scalars (step counts)
    are replicated.
    """
    replicated = NamedSharding(plan.mesh, P())
    keep_main = any(p.dtype != jnp.float32 for p in jax.tree.leaves(abstract_params))
    main = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), abstract_params)
    abstract_inner = jax.eval_shape(inner.init, main)
    inner_sh = _map_state(inner, lambda _, s: s, abstract_inner, plan.state_shardings(), lambda _: replicated)
    return ZeroState(plan.state_shardings() if keep_main else None, inner_sh)
