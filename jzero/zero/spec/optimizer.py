"""The spec path's distributed optimizer: an optax-shaped wrapper around any optax transformation.

Like Megatron's `DistributedOptimizer`, it keeps fp32 main params (when the model
params are not fp32) and the inner optimizer's state sharded over each param's
data-parallel domain, steps the inner transformation on those shards, and
gathers the updated params back into the model's layout. The inner
transformation never knows it is sharded: XLA partitions its math, per-tensor
(trust ratios, factored moments, masks) and global (norms) computations included.

Shardings (see `common/strategies.py` for the notation), with `W[D, F_tp]` a model param:
  params in/out:       W[D, F_tp]      (replicated over DP)
  grads in:            W[D_dp, F_tp]   (W[D, F_tp] under no_shard)
  main params, state:  W[D_dp, F_tp]   (W[D, F_tp] under no_shard)
Inner-state leaves that are not shaped like their param (adafactor's factored moments,
counts, injected hyperparameters) get a sharding of their own: `inner_state_shardings`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.mesh import axes_size
from jzero.zero.common import groups as groups_lib
from jzero.zero.common import loss_scale as scaler
from jzero.zero.common import spike
from jzero.zero.common.state import ZeroState, keeps_main_params
from jzero.zero.common.strategies import ShardingPlan, TensorPlan, choose_shard_dim
from jzero.zero.common.update import finish, kept_main, model_copy, optimizer_step
from jzero.zero.config import DynamicLossScale, SpikeGuard

PyTree = Any


class ZeroOptimizer(NamedTuple):
    """A pair of pure functions, like `optax.GradientTransformation`.

    init(params) -> ZeroState
    step(grads, state, params) -> (new_params, new_state, metrics): metrics {"grad_norm"} (the norm
      before clipping), and with loss scaling {"loss_scale" (the scale the grads carried),
      "skipped" (1.0 if an inf/nan skipped the step, else 0.0)}

    `step` returns new params rather than optax's additive updates: with fp32 main
    params the model copy is a cast of the main copy (Megatron's
    `_copy_main_params_to_model_params`), which `params + updates` would not reproduce
    in bf16.
    """

    init: Callable[[PyTree], ZeroState]
    step: Callable[[PyTree, ZeroState, PyTree], tuple[PyTree, ZeroState, dict]]


def _abstract_main(plan: ShardingPlan) -> PyTree:
    return jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, jnp.float32), plan.tensors)


def inner_state_shardings(inner: optax.GradientTransformation, plan: ShardingPlan) -> PyTree:
    """A NamedSharding for every leaf of `inner`'s state, whatever the transformation.

    A leaf whose key path ends in a param's path and whose shape is the param's (Adam's
    mu and nu, MultiSteps' accumulated grads, ...) follows `plan.state_shardings()`. Any
    other leaf gets a spec of its own: replicated if it is a scalar or the strategy keeps
    the state replicated, else a dim divisible by the DP size (`choose_shard_dim`) split over the axes
    the state of the param it belongs to (if any; else a dense param's) is split over, else
    replicated.
    """
    replicated = NamedSharding(plan.mesh, P())

    def sharding(path, leaf):
        owner = plan.param_of(tuple(path))
        tensor = None if owner is None else plan.tensor(owner)
        if tensor is not None and tuple(leaf.shape) == tensor.shape:
            return NamedSharding(plan.mesh, plan.state_spec(tensor))
        if not leaf.shape or not plan.stage.shards_state:
            return replicated
        axes = plan.dense_shard_axes() if tensor is None else tensor.shard_axes
        dim = choose_shard_dim(tuple(leaf.shape), P(), axes_size(plan.mesh, axes), plan.mesh)
        if dim is None:
            return replicated
        return NamedSharding(plan.mesh, P(*[axes if i == dim else None for i in range(len(leaf.shape))]))

    abstract = jax.eval_shape(inner.init, _abstract_main(plan))
    return jax.tree_util.tree_map_with_path(sharding, abstract)


def opt_state_shardings(
    inner: optax.GradientTransformation,
    plan: ShardingPlan,
    loss_scale: DynamicLossScale | None = None,
    quantized_gather: bool = False,
    spike_guard: SpikeGuard | None = None,
) -> ZeroState:
    """The NamedShardings of the spec path's `ZeroState` (also the model-space layout of checkpoints,
    where a flat path's `quantized_gather` keeps main params: `state.keeps_main_params`)."""
    keep_main = keeps_main_params(jax.tree.leaves(plan.tensors), quantized_gather)
    return ZeroState(
        plan.state_shardings() if keep_main else None,
        inner_state_shardings(inner, plan),
        None if loss_scale is None else scaler.shardings(plan.mesh),
        None if spike_guard is None else spike.shardings(plan.mesh),
    )


def _constrain(tree: PyTree, shardings: PyTree) -> PyTree:
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def _gather(main: jax.Array, param: jax.Array, t: TensorPlan, plan: ShardingPlan) -> jax.Array:
    """The model copy of `main` in `param`'s dtype and sharding (Megatron's `_copy_main_params_to_model_params`,
    an all-gather where the state is sharded and the param is not). Under ZeRO-2/3 a stacked unit
    param [L, ...] is gathered one layer at a time, so the gather needs one layer's buffer, not a
    second whole stack (LLaMA-2-7B ZeRO-2 on 8 x H100: peak 35.2 -> 30.9 GiB). Under ZeRO-1, whose
    peak is the full local grad buffer in backward, XLA lays the stacked grads out worse with it
    (45.2 -> 55.0 GiB), so it gathers whole params there."""
    sharding = NamedSharding(plan.mesh, plan.param_spec(t))
    if not (t.unit_dims and plan.stage.shards_grads) or main.shape[0] == 1 or plan.param_spec(t) == plan.state_spec(t):
        return jax.lax.with_sharding_constraint(model_copy(main, param.dtype), sharding)
    layer = NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
    per_layer = jax.lax.map(lambda m: jax.lax.with_sharding_constraint(model_copy(m, param.dtype), layer), main)
    return jax.lax.with_sharding_constraint(per_layer, sharding)


def zero_optimizer(
    inner: optax.GradientTransformation,
    plan: ShardingPlan,
    clip_grad: float | None = None,
    groups: PyTree | None = None,
    loss_scale: DynamicLossScale | None = None,
    skip_nonfinite: bool = False,
    spike_guard: SpikeGuard | None = None,
) -> ZeroOptimizer:
    """Wraps `inner` as a distributed optimizer with the layout of `plan`.

    Args:
      inner: any optax transformation (its updates are added to the fp32 main params).
      plan: the run's shardings.
      clip_grad: global-norm clipping threshold applied across shards, None = off.
      groups: per param a `groups.ParamGroup` (see `groups.param_groups`), or None.
      loss_scale: fp16's dynamic loss scaling (`common/loss_scale.py`): the grads arrive multiplied by
        the state's scale; they are unscaled in fp32, and an inf/nan in any of them skips the step.
      skip_nonfinite: an inf or nan grad norm keeps the old params and state (`update.kept_main`, `finish`).
      spike_guard: so does a grad norm above its recent mean (`common/spike.py`), None = off.
    """
    shardings = opt_state_shardings(inner, plan, loss_scale, spike_guard=spike_guard)
    state_sh, inner_sh = plan.state_shardings(), shardings.inner_state
    keep_main = shardings.main_params is not None
    values = None if groups is None else groups_lib.per_param_values(groups)

    def init(params):
        main = _constrain(jax.tree.map(lambda p: p.astype(jnp.float32), params), state_sh)
        inner_state = _constrain(inner.init(main), inner_sh)
        grad_scaler = None if loss_scale is None else scaler.init(loss_scale)
        history = None if spike_guard is None else spike.init(spike_guard)
        return ZeroState(main if keep_main else None, inner_state, grad_scaler, history)

    def step(grads, state, params):
        grads = _constrain(jax.tree.map(lambda g: g.astype(jnp.float32), grads), state_sh)  # each rank's shard
        main = state.main_params if keep_main else _constrain(params, state_sh)
        update = optimizer_step(
            inner, grads, main, state, global_norm=optax.tree.norm, nonfinite=scaler.found_inf,
            clip_grad=clip_grad, loss_scale=loss_scale, groups=values,
        )  # fmt: skip
        if keep_main:  # (fp32 params: `finish` selects the params themselves)
            main = kept_main(loss_scale, update, state, main, skip_nonfinite, spike_guard)
        else:
            main = update.main
        main = _constrain(main, state_sh)
        # All-gather: each rank's updated shard goes back into the replicated model copy.
        new_params = jax.tree.map(lambda m, p, t: _gather(m, p, t, plan), main, params, plan.tensors)
        new_state = ZeroState(main if keep_main else None, _constrain(update.inner_state, inner_sh))
        new_params, new_state, metrics = finish(
            loss_scale, update, params, state, new_params, new_state, skip_nonfinite, spike_guard
        )
        return new_params, new_state, metrics

    return ZeroOptimizer(init, step)
