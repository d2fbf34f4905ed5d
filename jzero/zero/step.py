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

ZeRO-2 and ZeRO-3 go further, per FSDP unit (`units.py`): the loss gets each param as a
`UnitParam` and the step differentiates it with respect to the zero "sinks" shaped like the
rank's grad shard, so each unit's grads are reduce-scattered (psum_scatter over the inner
DP axes, then reduced across dp_outer under HSDP) as soon as that unit's backward is done,
inside the layer loop; no rank holds the whole unreduced gradient. ZeRO-3's params enter
as shards and are all-gathered per unit, just before the unit runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.mesh import BATCH_AXES, EP_AXIS, OUTER_AXIS, axes_size
from jzero.zero.batch import batch_sharding, split_batch
from jzero.zero.loss_scale import scaled_loss
from jzero.zero.optimizer import ZeroOptimizer
from jzero.zero.state import LossFn, TrainState, with_metrics
from jzero.zero.strategies import ShardingPlan, TensorPlan, restrict, spec_axes
from jzero.zero.units import Hook, UnitParam, materialize

PyTree = Any


def unit_hooks(plan: ShardingPlan, scale: float, reduce_dtype, reshard_after_forward: bool) -> PyTree:
    """Per param, the `units.Hook` that materializes it and reduces its grad (ZeRO-2/3)."""

    def hook(t: TensorPlan) -> Hook:
        gather = plan.shards_params and t.shard_dim is not None
        varying = set(spec_axes(restrict(plan.param_spec(t), BATCH_AXES))) | (set(t.inner_axes) if gather else set())
        return Hook(
            dim=None if t.shard_dim is None else t.shard_dim - len(t.shape),
            inner=t.inner_axes,
            outer=tuple(a for a in t.dp_axes if a not in t.inner_axes),
            outer_scatter=OUTER_AXIS in t.shard_axes,
            gather=gather,
            to_varying=tuple(a for a in BATCH_AXES if a not in varying),
            scale=scale,
            reduce_dtype=jnp.dtype(reduce_dtype).name,
            reshard=gather and reshard_after_forward,
            tp_spec=_tp_only(plan, t),
        )

    return jax.tree.map(hook, plan.tensors)


def _tp_only(plan: ShardingPlan, t: TensorPlan) -> tuple | None:
    """`t`'s spec over the axes the grads shard_map leaves to XLA (`units.Hook.tp_spec`), one entry
    per dim; None if they split no dim, or split the shard dim (jointly with DP)."""
    spec = restrict(t.tp_spec, tuple(a for a in plan.mesh.axis_names if a not in BATCH_AXES))
    entries = tuple(spec) + (None,) * (len(t.shape) - len(spec))
    if all(e is None for e in entries) or (t.shard_dim is not None and entries[t.shard_dim] is not None):
        return None
    return entries


def unit_view(params: PyTree, sinks: PyTree, hooks: PyTree, plan: ShardingPlan) -> PyTree:
    """The params as a ZeRO-2/3 loss takes them on one rank (inside the DP-manual shard_map): a unit's
    as `UnitParam`s, materialized (ZeRO-3: gathered) when the unit runs; the others now, for the whole loss."""

    def wrap(p, sink, h, t):
        x = UnitParam(p, sink, h)
        return x if t.unit_dims is not None else materialize(x)

    return jax.tree.map(wrap, params, sinks, hooks, plan.tensors)


def _unit_grads(loss_metrics, params, mbs, plan, hooks, reduce_dtype, ep_kwargs, loss_scale):
    """ZeRO-2/3 (module docstring): (losses [M, n_dp], metrics, grads summed over the microbatches,
    each grad the rank's shard of the DP-reduced grad, in `plan.grad_shardings()`)."""
    mesh = plan.mesh
    grad_sh = plan.grad_shardings()
    sink_specs = jax.tree.map(lambda t: restrict(t.zero_spec, BATCH_AXES), plan.tensors)

    def rank_grads(params, sinks, mb, loss_scale):  # one rank: [1, b, ...] rows -> [1] loss, metrics; grad shards
        def loss_of(sinks):
            wrapped = unit_view(params, sinks, hooks, plan)
            return scaled_loss(loss_metrics, loss_scale)(wrapped, jax.tree.map(lambda x: x[0], mb), **ep_kwargs)

        (_, (loss, metrics)), g = jax.value_and_grad(loss_of, has_aux=True)(sinks)
        return loss[None], jax.tree.map(lambda m: m[None], metrics), g

    stacked = P(BATCH_AXES)
    fn = jax.shard_map(
        rank_grads,
        mesh=mesh,
        in_specs=(
            jax.tree.map(lambda t: restrict(plan.param_spec(t), BATCH_AXES), plan.tensors), sink_specs, stacked, P()
        ),
        out_specs=(stacked, stacked, sink_specs),
        axis_names=set(BATCH_AXES),
    )
    sinks = jax.tree.map(lambda t, s: _zeros(t.shape, reduce_dtype, s), plan.tensors, grad_sh)

    def body(acc, mb):
        loss, metrics, g = fn(params, sinks, mb, loss_scale)
        g = jax.tree.map(jax.lax.with_sharding_constraint, g, grad_sh)
        return (g if acc is None else jax.tree.map(jnp.add, acc, g)), (loss, metrics)

    if jax.tree.leaves(mbs)[0].shape[0] == 1:
        g, (loss, metrics) = body(None, jax.tree.map(lambda x: x[0], mbs))
        return loss[None], jax.tree.map(lambda m: m[None], metrics), g
    acc, (losses, metrics) = jax.lax.scan(body, sinks, mbs)
    return losses, metrics, acc


def reduced_grads(
    loss_fn: LossFn,
    params: PyTree,
    batch: PyTree,
    plan: ShardingPlan,
    microbatches: int,
    reduce_dtype: jnp.dtype,
    has_aux: bool = False,
    reshard_after_forward: bool = True,
    loss_scale: jax.Array | None = None,
) -> tuple[jax.Array, dict, PyTree]:
    """Mean loss, mean metrics and the data-parallel mean of the gradients, in `plan.grad_shardings()`.

    Expert params (split over ep) enter each rank as its local experts and their grads
    leave stacked over the expert-DP domain only: `loss_fn` gets `ep_axis=` and moves tokens
    to the experts' ranks itself, so a rank's expert grads already hold every ep rank's tokens.

    Args:
      batch: leaves `[B, ...]`, B split over the dense DP domain.
      loss_scale: fp16's loss scale (a scalar): the grads are those of loss x loss_scale
        (`loss_scale.py`); the loss and metrics returned are not scaled. None: no scaling.
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

    def means(loss, metrics):
        return jnp.mean(loss), jax.tree.map(jnp.mean, metrics)

    if plan.shards_grads:
        hooks = unit_hooks(plan, scale, reduce_dtype, reshard_after_forward)
        losses, metrics, g = _unit_grads(loss_metrics, params, mbs, plan, hooks, reduce_dtype, ep_kwargs, loss_scale)
        return *means(losses, metrics), g

    def rank_grads(params, mb, loss_scale):  # one rank's [1, b, ...] rows -> [1] loss and metrics, [1, *shape] grads
        # DP-varying, so autodiff gives local grads (an expert param already varies over ep).
        params = jax.tree.map(lambda p, axes: jax.lax.pcast(p, axes, to="varying") if axes else p, params, invariant)
        (_, (loss, metrics)), g = jax.value_and_grad(scaled_loss(loss_metrics, loss_scale), has_aux=True)(
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
        in_specs=(param_specs, stacked, P()),
        out_specs=(stacked, stacked, jax.tree.map(lambda t: restrict(t.local_grad_spec, BATCH_AXES), plan.tensors)),
        axis_names=set(BATCH_AXES),
    )

    def local_grads(mb):
        """[n_dp, ...] per-rank losses, metrics and grads of one microbatch, one slice per rank."""
        loss, metrics, g = local_grads_fn(params, mb, loss_scale)
        return loss, metrics, jax.tree.map(jax.lax.with_sharding_constraint, g, local_sh)

    def reduce(g):  # the DP collective: sum over ranks into the strategy's grad sharding
        summed = jax.tree.map(lambda x: jnp.sum(x, axis=0, dtype=reduce_dtype), g)
        return jax.tree.map(jax.lax.with_sharding_constraint, summed, grad_sh)

    if microbatches == 1:
        loss, metrics, g = local_grads(jax.tree.map(lambda x: x[0], mbs))
        return *means(loss, metrics), reduce(g)

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
    reshard_after_forward: bool = True,
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
      reshard_after_forward: ZeRO-3: gather each unit's params again for its backward.
    Returns:
      step; `batch` leaves are `[B, ...]` split over the dense DP domain; the state is
      donated. metrics: {"loss", "grad_norm"} (the norm before clipping), with loss scaling
      {"loss_scale", "skipped"} (`ZeroOptimizer`), and the loss's own.
    """

    def step(state: TrainState, batch: PyTree):
        scaler = state.opt_state.grad_scaler
        loss, metrics, grads = reduced_grads(
            loss_fn, state.params, batch, plan, microbatches, grad_reduce_dtype, has_aux, reshard_after_forward,
            loss_scale=None if scaler is None else scaler.loss_scale,
        )  # fmt: skip
        params, opt_state, opt_metrics = optimizer.step(grads, state.opt_state, state.params)
        return TrainState(params, opt_state, state.step + 1), {"loss": loss, **opt_metrics, **metrics}

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
    reshard_after_forward: bool = True,
) -> Callable[[PyTree, PyTree], PyTree]:
    """A jitted `grads(params, batch)`: the reduced grads alone, in `plan.grad_shardings()`.

    The step never keeps grads past the optimizer; this exposes them (same code as
    the step) so their per-device size and sharding can be measured.
    """

    def grads(params, batch):
        args = (microbatches, grad_reduce_dtype, has_aux, reshard_after_forward)
        return reduced_grads(loss_fn, params, batch, plan, *args)[2]

    return jax.jit(
        grads,
        in_shardings=(plan.param_shardings(), batch_sharding(plan.mesh)),
        out_shardings=plan.grad_shardings(),
    )


def build_evaluate(
    loss_fn: LossFn,
    plan: ShardingPlan,
    *,
    microbatches: int = 1,
    grad_reduce_dtype: jnp.dtype = jnp.float32,
    has_aux: bool = False,
    reshard_after_forward: bool = True,
) -> Callable[[PyTree, PyTree], dict]:
    """A jitted `evaluate(params, batch) -> {"loss", **metrics}`: the step's forward, without grads.

    The loss runs as in the step: per DP rank in a shard_map manual over the DP axes, on each
    microbatch of the rank's rows, params in `plan.param_shardings()`; under ZeRO-2/3 a unit's params
    enter as `UnitParam`s (`unit_view`), so ZeRO-3 gathers each unit's shards just before it runs.
    The result is the mean over ranks and microbatches, the step's "loss" for the same params and
    batch; replicated.
    """
    mesh = plan.mesh
    n_dp = axes_size(mesh, BATCH_AXES)
    loss_metrics = with_metrics(loss_fn, has_aux)
    ep_kwargs = {"ep_axis": EP_AXIS} if plan.splits_ep else {}
    hooks = unit_hooks(plan, 1.0, grad_reduce_dtype, reshard_after_forward) if plan.shards_grads else None

    def rank_loss(params, mb):  # one rank's [1, b, ...] rows -> its [1] loss and metrics
        if hooks is not None:  # no grads: a sink only needs the stacked dims a scan over the layers slices
            sinks = jax.tree.map(lambda t: jnp.zeros(t.shape[: t.unit_dims or 0], grad_reduce_dtype), plan.tensors)
            params = unit_view(params, sinks, hooks, plan)
        loss, metrics = loss_metrics(params, jax.tree.map(lambda x: x[0], mb), **ep_kwargs)
        return loss[None], jax.tree.map(lambda m: m[None], metrics)

    stacked = P(BATCH_AXES)
    param_specs = jax.tree.map(lambda t: restrict(plan.param_spec(t), BATCH_AXES), plan.tensors)
    losses_fn = jax.shard_map(
        rank_loss, mesh=mesh, in_specs=(param_specs, stacked), out_specs=(stacked, stacked), axis_names=set(BATCH_AXES)
    )

    def evaluate(params, batch):
        mbs = split_batch(batch, n_dp, microbatches)  # [M, n_dp, b, ...]
        mbs = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, BATCH_AXES))), mbs)
        losses, metrics = jax.lax.map(lambda mb: losses_fn(params, mb), mbs)  # [M, n_dp]
        return {"loss": jnp.mean(losses), **jax.tree.map(jnp.mean, metrics)}

    return jax.jit(
        evaluate,
        in_shardings=(plan.param_shardings(), batch_sharding(mesh)),
        out_shardings=NamedSharding(mesh, P()),
    )
