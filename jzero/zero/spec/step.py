"""The spec path's step: the reduced grads (`grads.py`), the distributed optimizer (`optimizer.py`), jitted
with pinned shardings; and `evaluate`, the step's forward without grads.

The optimizer reads the grads in `plan.grad_shardings()` and leaves the params in
`plan.param_shardings()`; XLA emits every collective the specs imply (the param all-gather after the
update, unless the params rest sharded and the next forward gathers them: `grads.py`).
"""

from __future__ import annotations

import functools
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
from jzero.zero.common.state import (
    LossFn,
    ModelState,
    Programs,
    TrainState,
    ZeroState,
    loss_parts,
    model_state_shardings,
    state_optional,
)
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
    model_state: ModelState | None = None,
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
      model_state: the model's non-trainable state (`state.ModelState`), or None.
    """
    optimizer = zero_optimizer(
        inner, plan, options.clip_grad, groups, options.loss_scale, offload if offload.active else None
    )
    replicated, batch_sh = NamedSharding(plan.mesh, P()), batch_sharding(plan.mesh)
    shardings = TrainState(
        plan.param_shardings(), offload.shardings(opt_shardings), replicated,
        model_state_shardings(model_state, replicated),
    )  # fmt: skip
    grads_of = functools.partial(reduced_grads, loss_fn, plan=plan, options=options, config=config, hook=model_state)

    def step(state: TrainState, batch: PyTree):
        scaler = state.opt_state.grad_scaler
        loss_scale = None if scaler is None else scaler.loss_scale
        loss, metrics, stats, grads = grads_of(state.params, batch, loss_scale=loss_scale,
                                               model_state=state.model_state)  # fmt: skip
        new_model_state, state_metrics = state.model_state, {}
        if model_state is not None:  # after the grads' reduction, before the optimizer (Megatron's order)
            new_model_state, state_metrics = model_state.update(state.model_state, stats)
        params, opt_state, opt_metrics = optimizer.step(grads, state.opt_state, state.params)
        metrics = {"loss": loss, **opt_metrics, **metrics, **state_metrics}
        return TrainState(params, opt_state, state.step + 1, new_model_state), metrics

    step_jit = jax.jit(
        step, in_shardings=(shardings, batch_sh), out_shardings=(shardings, replicated), donate_argnums=0,
        compiler_options=step_compiler_options(plan.mesh, config, options.microbatches) or None,
    )  # fmt: skip
    grads_jit = jax.jit(
        lambda params, batch, state: grads_of(params, batch, model_state=state)[3],
        in_shardings=(plan.param_shardings(), batch_sh, shardings.model_state),
        out_shardings=plan.grad_shardings(),
    )
    grads_jit = state_optional(grads_jit, model_state, shardings.model_state)
    evaluate = build_evaluate(loss_fn, plan, options, config.reshard_after_forward, model_state)
    return Programs(shardings, optimizer.init, step_jit, grads_jit, evaluate)


def build_evaluate(
    loss_fn: LossFn,
    plan: ShardingPlan,
    options: StepOptions,
    reshard_after_forward: bool = True,
    model_state: ModelState | None = None,
) -> Callable[..., dict]:
    """A jitted `evaluate(params, batch, model_state=None) -> {"loss", **metrics}`: the step's forward,
    without grads, with `model_state` (None: the `ModelState`'s initial state, if any).

    The loss runs as in the step: per DP rank in a shard_map manual over the DP axes, on each
    microbatch of the rank's rows, params in `plan.param_shardings()`; under ZeRO-2/3 a unit's params
    enter as `UnitParam`s (`unit_view`), so ZeRO-3 gathers each unit's shards just before it runs.
    The result is the mean over ranks and microbatches, the step's "loss" for the same params and
    batch; replicated.
    """
    mesh, reduce_dtype = plan.mesh, options.grad_reduce_dtype
    loss_metrics = loss_parts(loss_fn, options.has_aux, model_state)
    hooks = None
    if plan.shards_grads or plan.params_rest_sharded:  # run the units as the step does (no grads: no reduction)
        hooks = unit_hooks(plan, options, reshard_after_forward, Phase(gather=True, reduce=True))

    def rank_loss(params, mb, state):  # one rank's [1, b, ...] rows -> its [1] loss and metrics
        if hooks is not None:  # no grads: a sink only needs the stacked dims a scan over the layers slices
            sinks = jax.tree.map(lambda t: jnp.zeros(t.shape[: t.unit_dims or 0], reduce_dtype), plan.tensors)
            params = unit_view(params, sinks, hooks, plan)
        loss, metrics, _ = loss_metrics(params, jax.tree.map(lambda x: x[0], mb), state, **ep_kwargs(plan))
        return loss[None], jax.tree.map(lambda m: m[None], metrics)

    stacked = P(BATCH_AXES)
    param_specs = jax.tree.map(lambda t: restrict(plan.param_spec(t), BATCH_AXES), plan.tensors)
    losses_fn = jax.shard_map(
        rank_loss, mesh=mesh, in_specs=(param_specs, stacked, P()), out_specs=(stacked, stacked),
        axis_names=set(BATCH_AXES),
    )  # fmt: skip

    def evaluate(params, batch, state):
        mbs = split_batch(batch, axes_size(mesh, BATCH_AXES), options.microbatches)  # [M, n_dp, b, ...]
        mbs = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, BATCH_AXES))), mbs)
        losses, metrics = jax.lax.map(lambda mb: losses_fn(params, mb, state), mbs)  # [M, n_dp]
        return {"loss": jnp.mean(losses), **jax.tree.map(jnp.mean, metrics)}

    replicated = NamedSharding(mesh, P())
    state_sh = model_state_shardings(model_state, replicated)
    program = jax.jit(
        evaluate, in_shardings=(plan.param_shardings(), batch_sharding(mesh), state_sh), out_shardings=replicated
    )
    return state_optional(program, model_state, state_sh)
