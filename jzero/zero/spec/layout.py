"""The spec layout (`zero.path: spec`): per-param sharding specs under GSPMD, for any optax transformation.

Each param's model copy, reduced grad, fp32 main copy and optimizer state are laid over its DP domain by
the `ShardingPlan`'s specs: the grads (`grads.py`) reduced per unit by the hooks' explicit collectives
inside a shard_map manual over the DP axes; the optimizer (`optimizer.py`) stepped on the sharded main
params under jit, where XLA partitions any transformation's math and emits the param all-gather after
the update (unless the params rest sharded and the next forward gathers them); `evaluate`, the step's
forward without grads. The engine (`engine.py`) builds the step from them.

The optimizer reads the grads in `plan.state_shardings()` and leaves the params in `plan.param_shardings()`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.mesh import BATCH_AXES, axes_size
from jzero.zero.common.batch import split_batch
from jzero.zero.common.offload import spec_offload
from jzero.zero.common.schedule import Phase
from jzero.zero.common.state import LossFn, ModelState, TrainState, loss_parts, model_state_shardings
from jzero.zero.common.strategies import ShardingPlan, restrict
from jzero.zero.config import StepOptions
from jzero.zero.engine import Layout, LayoutInputs
from jzero.zero.spec.grads import ep_kwargs, reduced_grads, unit_hooks, unit_view
from jzero.zero.spec.optimizer import opt_state_shardings, zero_optimizer

PyTree = Any


def spec_layout(inputs: LayoutInputs) -> Layout:
    """The spec layout of a run (module docstring): its shardings and traceable programs."""
    plan, options, config, model_state = inputs.plan, inputs.options, inputs.config, inputs.model_state
    opt_shardings = opt_state_shardings(inputs.inner, plan, options.loss_scale, spike_guard=options.spike_guard)
    offload = spec_offload(plan, inputs.inner, opt_shardings, config.offload_fraction)
    optimizer = zero_optimizer(
        inputs.inner, plan, options.clip_grad, inputs.groups, options.loss_scale, options.skip_nonfinite,
        options.spike_guard,
    )
    replicated = NamedSharding(plan.mesh, P())
    shardings = TrainState(
        plan.param_shardings(), offload.shardings(opt_shardings), replicated,
        model_state_shardings(model_state, replicated),
    )  # fmt: skip
    grads_of = functools.partial(
        reduced_grads, inputs.loss_fn, plan=plan, options=options, config=config, hook=model_state
    )

    def grads(params, batch, loss_scale, state):
        loss, metrics, stats, g = grads_of(params, batch, loss_scale=loss_scale, model_state=state)
        return (loss, metrics, stats), g

    def grad_buffer(dtype) -> PyTree:
        return jax.tree.map(
            lambda t, s: jax.ShapeDtypeStruct(t.shape, dtype, sharding=s), plan.tensors, plan.grad_buffer_shardings()
        )

    return Layout(
        shardings=shardings,
        grad_shardings=plan.state_shardings(),
        init_opt=optimizer.init,
        grads=grads,
        update=lambda params, opt_state, g: optimizer.step(g, opt_state, params),
        evaluate=evaluate_fn(inputs.loss_fn, plan, options, config.reshard_after_forward, model_state),
        offload=offload,
        grad_buffer=grad_buffer,
    )


def evaluate_fn(
    loss_fn: LossFn,
    plan: ShardingPlan,
    options: StepOptions,
    reshard_after_forward: bool = True,
    model_state: ModelState | None = None,
) -> Callable[..., dict]:
    """`evaluate(params, batch, model_state) -> {"loss", **metrics}`, traceable: the step's forward,
    without grads, with `model_state` (None for a model without one).

    The loss runs as in the step: per DP rank in a shard_map manual over the DP axes, on each
    microbatch of the rank's rows, params in `plan.param_shardings()`; where they rest sharded a unit's
    params enter as `UnitParam`s (`unit_view`), so each unit's shards are gathered just before it runs.
    The result is the mean over ranks and microbatches, the step's "loss" for the same params and
    batch; replicated.
    """
    mesh, reduce_dtype = plan.mesh, options.grad_reduce_dtype
    loss_metrics = loss_parts(loss_fn, options.has_aux, model_state)
    hooks = None
    if plan.stage.params_rest_sharded:  # gather each unit's params as the step does (no grads: no reduction)
        hooks = unit_hooks(plan, options, reshard_after_forward, Phase.ALIKE)

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

    return evaluate
