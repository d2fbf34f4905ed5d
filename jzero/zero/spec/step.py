"""The spec path's step: the reduced grads (`grads.py`), the distributed optimizer (`optimizer.py`), jitted
with pinned shardings; and `evaluate`, the step's forward without grads.

The optimizer reads the grads in `plan.grad_shardings()` and leaves the params in
`plan.param_shardings()`; XLA emits every collective the specs imply (the param all-gather after the
update, unless the params rest sharded and the next forward gathers them: `grads.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.mesh import BATCH_AXES, axes_size
from jzero.zero.common.batch import batch_sharding, split_batch
from jzero.zero.common.compiler import step_compiler_options
from jzero.zero.common.offload import Offload
from jzero.zero.common.schedule import Phase
from jzero.zero.common.state import LossFn, Programs, TrainState, ZeroState, with_metrics
from jzero.zero.common.strategies import ShardingPlan, restrict
from jzero.zero.config import StepOptions, ZeroConfig
from jzero.zero.spec.grads import ep_kwargs, reduced_grads, unit_hooks, unit_view
from jzero.zero.spec.optimizer import zero_optimizer

PyTree = Any


def build_spec_step(
    loss_fn: LossFn,
    inner: optax.GradientTransformation,
    plan: ShardingPlan,
    config: ZeroConfig,
    options: StepOptions,
    *,
    groups: PyTree | None,
    offload: Offload,
    opt_shardings: ZeroState,
) -> Programs:
    """The spec path's shardings, optimizer init, jitted step, grads and evaluate (`state.Programs`).

    Args:
      loss_fn: (params, batch) -> scalar mean loss over the batch (with `options.has_aux`: (loss,
        metrics)); on global, tp-split params under jit.
      inner: any optax transformation, wrapped by `optimizer.zero_optimizer`.
      config: the ZeRO config (`reshard_after_forward` is read here).
      groups: per param a `groups.ParamGroup`, or None.
      offload: the params whose state lives in host memory between steps (`common/offload.py`).
      opt_shardings: the ZeroState's shardings without offload (`optimizer.opt_state_shardings`).
    """
    optimizer = zero_optimizer(
        inner, plan, options.clip_grad, groups, options.loss_scale, offload if offload.active else None
    )
    shardings = TrainState(plan.param_shardings(), offload.shardings(opt_shardings), NamedSharding(plan.mesh, P()))

    def step(state: TrainState, batch: PyTree):
        scaler = state.opt_state.grad_scaler
        loss_scale = None if scaler is None else scaler.loss_scale
        loss, metrics, grads = reduced_grads(loss_fn, state.params, batch, plan, options, config, loss_scale)
        params, opt_state, opt_metrics = optimizer.step(grads, state.opt_state, state.params)
        return TrainState(params, opt_state, state.step + 1), {"loss": loss, **opt_metrics, **metrics}

    replicated, batch_sh = NamedSharding(plan.mesh, P()), batch_sharding(plan.mesh)
    step_jit = jax.jit(
        step, in_shardings=(shardings, batch_sh), out_shardings=(shardings, replicated), donate_argnums=0,
        compiler_options=step_compiler_options(plan.mesh, config) or None,
    )  # fmt: skip
    grads_jit = jax.jit(
        lambda params, batch: reduced_grads(loss_fn, params, batch, plan, options, config)[2],
        in_shardings=(plan.param_shardings(), batch_sh),
        out_shardings=plan.grad_shardings(),
    )
    evaluate = build_evaluate(loss_fn, plan, options, config.reshard_after_forward)
    return Programs(shardings, optimizer.init, step_jit, grads_jit, evaluate)


def build_evaluate(
    loss_fn: LossFn, plan: ShardingPlan, options: StepOptions, reshard_after_forward: bool = True
) -> Callable[[PyTree, PyTree], dict]:
    """A jitted `evaluate(params, batch) -> {"loss", **metrics}`: the step's forward, without grads.

    The loss runs as in the step: per DP rank in a shard_map manual over the DP axes, on each
    microbatch of the rank's rows, params in `plan.param_shardings()`; under ZeRO-2/3 a unit's params
    enter as `UnitParam`s (`unit_view`), so ZeRO-3 gathers each unit's shards just before it runs.
    The result is the mean over ranks and microbatches, the step's "loss" for the same params and
    batch; replicated.
    """
    mesh, reduce_dtype = plan.mesh, options.grad_reduce_dtype
    loss_metrics = with_metrics(loss_fn, options.has_aux)
    hooks = None
    if plan.shards_grads or plan.params_rest_sharded:  # run the units as the step does (no grads: no reduction)
        hooks = unit_hooks(plan, options, reshard_after_forward, Phase(gather=True, reduce=True))

    def rank_loss(params, mb):  # one rank's [1, b, ...] rows -> its [1] loss and metrics
        if hooks is not None:  # no grads: a sink only needs the stacked dims a scan over the layers slices
            sinks = jax.tree.map(lambda t: jnp.zeros(t.shape[: t.unit_dims or 0], reduce_dtype), plan.tensors)
            params = unit_view(params, sinks, hooks, plan)
        loss, metrics = loss_metrics(params, jax.tree.map(lambda x: x[0], mb), **ep_kwargs(plan))
        return loss[None], jax.tree.map(lambda m: m[None], metrics)

    stacked = P(BATCH_AXES)
    param_specs = jax.tree.map(lambda t: restrict(plan.param_spec(t), BATCH_AXES), plan.tensors)
    losses_fn = jax.shard_map(
        rank_loss, mesh=mesh, in_specs=(param_specs, stacked), out_specs=(stacked, stacked), axis_names=set(BATCH_AXES)
    )

    def evaluate(params, batch):
        mbs = split_batch(batch, axes_size(mesh, BATCH_AXES), options.microbatches)  # [M, n_dp, b, ...]
        mbs = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, BATCH_AXES))), mbs)
        losses, metrics = jax.lax.map(lambda mb: losses_fn(params, mb), mbs)  # [M, n_dp]
        return {"loss": jnp.mean(losses), **jax.tree.map(jnp.mean, metrics)}

    return jax.jit(
        evaluate,
        in_shardings=(plan.param_shardings(), batch_sharding(mesh)),
        out_shardings=NamedSharding(mesh, P()),
    )
