"""The train-step builder for the spec path: gradients, their reduction, the optimizer step.

Each data-parallel rank computes the gradient of its own microbatch in a `shard_map`
that is manual over the DP axes only (tp stays with XLA, so the loss still sees global
tp-split params): the params are cast to DP-varying first (`jax.lax.pcast`, docs/xla.md,
"shard_map and check_vma"), so autodiff gives each rank its local grads and communicates
nothing, a param used twice (tied embeddings) summed locally. They leave as stacked local
grads `[n_dp, *shape]`, one slice per rank, in the layout backprop made them (a `vmap`
formulation made XLA relayout every grad: experiments/bench). The reduction is then
an explicit sum over that axis in `precision.grad_reduce_dtype`, whose output
sharding is the strategy's grad sharding: XLA emits an all-reduce where grads are
replicated and a reduce-scatter where they are sharded (on GPU; on CPU it emits
all-reduce + dynamic-slice: docs/xla.md, "Reduce-scatter: XLA:CPU vs XLA:GPU").

Accumulation over microbatches follows Megatron: DDP and ZeRO-1 accumulate the
local grads and reduce once; ZeRO-2 reduces every microbatch into a sharded
accumulator, so no rank ever holds a full reduced gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.mesh import BATCH_AXES, EP_AXIS, axes_size
from jzero.zero.batch import batch_sharding, split_batch
from jzero.zero.optimizer import ZeroOptimizer
from jzero.zero.state import LossFn, TrainState, with_metrics
from jzero.zero.strategies import ShardingPlan, restrict, spec_axes

PyTree = Any


def reduced_grads(
    loss_fn: LossFn,
    params: PyTree,
    batch: PyTree,
    plan: ShardingPlan,
    microbatches: int,
    reduce_dtype: jnp.dtype,
    has_aux: bool = False,
) -> tuple[jax.Array, dict, PyTree]:
    """Mean loss, mean metrics and the data-parallel mean of the gradients, in `plan.grad_shardings()`.

    Expert params (split over ep) enter each rank as its local experts and their grads
    leave stacked over the expert-DP domain only: `loss_fn` gets `ep_axis=` and moves tokens
    to the experts' ranks itself, so a rank's expert grads already hold every ep rank's tokens.

    Args:
      batch: leaves `[B, ...]`, B split over the dense DP domain.
    Returns:
      (loss, metrics, grads): grads in `reduce_dtype`, sharded like `plan.grad_shardings()`.
    """
    mesh = plan.mesh
    n_dp = axes_size(mesh, BATCH_AXES)
    scale = 1.0 / (n_dp * microbatches)  # Megatron's gradient_scaling_factor, dense and expert alike
    local_sh = plan.local_grad_shardings()
    grad_sh = plan.grad_shardings()
    loss_metrics = with_metrics(loss_fn, has_aux)
    ep_kwargs = {"ep_axis": EP_AXIS} if plan.splits_ep else {}
    mbs = split_batch(batch, n_dp, microbatches)
    mbs = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, BATCH_AXES))), mbs)

    def rank_grads(params, mb):  # one rank's [1, b, ...] rows -> its [1] loss and metrics, [1, *shape] grads
        # DP-varying, so autodiff gives local grads (an expert param already varies over ep).
        params = jax.tree.map(lambda p, axes: jax.lax.pcast(p, axes, to="varying") if axes else p, params, invariant)
        (loss, metrics), g = jax.value_and_grad(loss_metrics, has_aux=True)(
            params, jax.tree.map(lambda x: x[0], mb), **ep_kwargs
        )
        g = jax.tree.map(lambda x: (x.astype(jnp.float32) * scale).astype(reduce_dtype)[None], g)
        return loss[None], jax.tree.map(lambda m: m[None], metrics), g

    param_specs = jax.tree.map(lambda t: restrict(t.tp_spec, BATCH_AXES), plan.tensors)
    # Per param, the DP axes it enters replicated over (all of them but ep for an expert weight).
    invariant = jax.tree.map(
        lambda s: tuple(a for a in BATCH_AXES if a not in spec_axes(s)), param_specs, is_leaf=_is_spec
    )
    stacked = P(BATCH_AXES)
    local_grads_fn = jax.shard_map(
        rank_grads,
        mesh=mesh,
        in_specs=(param_specs, stacked),
        out_specs=(stacked, stacked, jax.tree.map(lambda t: restrict(t.local_grad_spec, BATCH_AXES), plan.tensors)),
        axis_names=set(BATCH_AXES),
    )

    def local_grads(mb):
        """[n_dp, ...] per-rank losses, metrics and grads of one microbatch, one slice per rank."""
        loss, metrics, g = local_grads_fn(params, mb)
        return loss, metrics, jax.tree.map(jax.lax.with_sharding_constraint, g, local_sh)

    def reduce(g):  # the DP collective: sum over ranks into the strategy's grad sharding
        summed = jax.tree.map(lambda x: jnp.sum(x, axis=0, dtype=reduce_dtype), g)
        return jax.tree.map(jax.lax.with_sharding_constraint, summed, grad_sh)

    def means(loss, metrics):
        return jnp.mean(loss), jax.tree.map(jnp.mean, metrics)

    if microbatches == 1:
        loss, metrics, g = local_grads(jax.tree.map(lambda x: x[0], mbs))
        return *means(loss, metrics), reduce(g)

    if plan.shards_grads:
        # ZeRO-2: reduce-scatter each microbatch into the sharded accumulator.
        def body(acc, mb):
            loss, metrics, g = local_grads(mb)
            return jax.tree.map(jnp.add, acc, reduce(g)), means(loss, metrics)

        acc0 = jax.tree.map(lambda t, s: _zeros(t.shape, reduce_dtype, s), plan.tensors, grad_sh)
        acc, (losses, metrics) = jax.lax.scan(body, acc0, mbs)
        return *means(losses, metrics), acc

    # DDP / ZeRO-1: accumulate local grads, reduce once.
    def body(acc, mb):
        loss, metrics, g = local_grads(mb)
        return jax.tree.map(jnp.add, acc, g), means(loss, metrics)

    acc0 = jax.tree.map(
        lambda t, s: _zeros((axes_size(mesh, t.dp_axes), *t.shape), reduce_dtype, s), plan.tensors, local_sh
    )
    acc, (losses, metrics) = jax.lax.scan(body, acc0, mbs)
    return *means(losses, metrics), reduce(acc)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _zeros(shape, dtype, sharding):
    return jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), sharding)


def build_train_step(
    loss_fn: LossFn,
    optimizer: ZeroOptimizer,
    plan: ShardingPlan,
    state_shardings: TrainState,
    *,
    microbatches: int = 1,
    grad_reduce_dtype: jnp.dtype = jnp.float32,
    has_aux: bool = False,
) -> Callable[[TrainState, PyTree], tuple[TrainState, dict]]:
    """A jitted `step(state, batch) -> (state, metrics)` with pinned in/out shardings.

    Args:
      loss_fn: (params, batch) -> scalar mean loss over the batch; pure, model-agnostic.
      optimizer: from `zero_optimizer`.
      plan: the run's shardings.
      state_shardings: a TrainState of NamedShardings.
      microbatches: gradient accumulation steps.
      grad_reduce_dtype: dtype of the grad buffer and its DP reduction.
      has_aux: `loss_fn` returns (loss, metrics dict), as in `jax.value_and_grad`.
    Returns:
      step; `batch` leaves are `[B, ...]` split over the dense DP domain; the state is
      donated. metrics: {"loss", "grad_norm"} (the norm before clipping) and the loss's own.
    """

    def step(state: TrainState, batch: PyTree):
        loss, metrics, grads = reduced_grads(
            loss_fn, state.params, batch, plan, microbatches, grad_reduce_dtype, has_aux
        )
        params, opt_state, norm = optimizer.step(grads, state.opt_state, state.params)
        return TrainState(params, opt_state, state.step + 1), {"loss": loss, "grad_norm": norm, **metrics}

    replicated = NamedSharding(plan.mesh, P())
    return jax.jit(
        step,
        in_shardings=(state_shardings, batch_sharding(plan.mesh)),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )


def build_grads(
    loss_fn: LossFn,
    plan: ShardingPlan,
    *,
    microbatches: int = 1,
    grad_reduce_dtype: jnp.dtype = jnp.float32,
    has_aux: bool = False,
) -> Callable[[PyTree, PyTree], PyTree]:
    """A jitted `grads(params, batch)`: the reduced grads alone, in `plan.grad_shardings()`.

    The step never keeps grads past the optimizer; this exposes them (same code as
    the step) so their per-device size and sharding can be measured.
    """

    def grads(params, batch):
        return reduced_grads(loss_fn, params, batch, plan, microbatches, grad_reduce_dtype, has_aux)[2]

    return jax.jit(
        grads,
        in_shardings=(plan.param_shardings(), batch_sharding(plan.mesh)),
        out_shardings=plan.grad_shardings(),
    )
