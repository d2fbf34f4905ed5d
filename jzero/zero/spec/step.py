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

ZeRO-2 and ZeRO-3 go further, per FSDP unit (`common/units.py`): the loss gets each param as a
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
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.mesh import BATCH_AXES, EP_AXIS, OUTER_AXIS, axes_size
from jzero.zero.common.batch import batch_sharding, split_batch
from jzero.zero.common.loss_scale import scaled_loss
from jzero.zero.common.offload import Offload
from jzero.zero.common.state import LossFn, Programs, TrainState, ZeroState, with_metrics
from jzero.zero.common.strategies import ShardingPlan, TensorPlan, restrict, spec_axes
from jzero.zero.common.units import Hook, UnitParam, materialize
from jzero.zero.config import StepOptions, ZeroConfig
from jzero.zero.spec.optimizer import zero_optimizer

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


def _unit_grads(loss_metrics, params, mbs, plan, hooks, options, loss_scale):
    """ZeRO-2/3 (module docstring): (losses [M, n_dp], metrics, grads summed over the microbatches,
    each grad the rank's shard of the DP-reduced grad, in `plan.grad_shardings()`)."""
    mesh, reduce_dtype, ep_kwargs = plan.mesh, options.grad_reduce_dtype, _ep_kwargs(plan)
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
    options: StepOptions,
    reshard_after_forward: bool = True,
    loss_scale: jax.Array | None = None,
) -> tuple[jax.Array, dict, PyTree]:
    """Mean loss, mean metrics and the data-parallel mean of the gradients, in `plan.grad_shardings()`.

    Expert params (split over ep) enter each rank as its local experts and their grads
    leave stacked over the expert-DP domain only: `loss_fn` gets `ep_axis=` and moves tokens
    to the experts' ranks itself, so a rank's expert grads already hold every ep rank's tokens.

    Args:
      batch: leaves `[B, ...]`, B split over the dense DP domain.
      options: microbatches, the grad reduce dtype, has_aux.
      loss_scale: fp16's loss scale (a scalar): the grads are those of loss x loss_scale
        (`common/loss_scale.py`); the loss and metrics returned are not scaled. None: no scaling.
    Returns:
      (loss, metrics, grads): grads in the grad reduce dtype, sharded like `plan.grad_shardings()`.
    """
    mesh = plan.mesh
    mbs = split_batch(batch, axes_size(mesh, BATCH_AXES), options.microbatches)
    mbs = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, BATCH_AXES))), mbs)
    loss_metrics = with_metrics(loss_fn, options.has_aux)
    if plan.shards_grads:
        hooks = unit_hooks(plan, _grad_scale(plan, options), options.grad_reduce_dtype, reshard_after_forward)
        losses, metrics, g = _unit_grads(loss_metrics, params, mbs, plan, hooks, options, loss_scale)
    else:
        losses, metrics, g = _accumulated_grads(loss_metrics, params, mbs, plan, options, loss_scale)
    return jnp.mean(losses), jax.tree.map(jnp.mean, metrics), g


def _grad_scale(plan: ShardingPlan, options: StepOptions) -> float:
    """Megatron's gradient_scaling_factor 1 / (dense DP size x microbatches), dense and expert alike."""
    return 1.0 / (axes_size(plan.mesh, BATCH_AXES) * options.microbatches)


def _ep_kwargs(plan: ShardingPlan) -> dict:
    return {"ep_axis": EP_AXIS} if plan.splits_ep else {}


def _accumulated_grads(loss_metrics, params, mbs, plan, options, loss_scale):
    """DDP and ZeRO-1 (module docstring): (losses, metrics, grads) with the local grads accumulated over
    the microbatches and reduced once, after the last."""
    mesh, reduce_dtype = plan.mesh, options.grad_reduce_dtype
    scale, ep_kwargs = _grad_scale(plan, options), _ep_kwargs(plan)
    local_sh, grad_sh = plan.local_grad_shardings(), plan.grad_shardings()
    param_specs = jax.tree.map(lambda t: restrict(t.tp_spec, BATCH_AXES), plan.tensors)
    # Per param, the DP axes it enters replicated over (all of them but ep for an expert weight).
    invariant = jax.tree.map(
        lambda s: tuple(a for a in BATCH_AXES if a not in spec_axes(s)), param_specs, is_leaf=_is_spec
    )

    def rank_grads(params, mb, loss_scale):  # one rank's [1, b, ...] rows -> [1] loss and metrics, [1, *shape] grads
        # DP-varying, so autodiff gives local grads (an expert param already varies over ep).
        params = jax.tree.map(lambda p, axes: jax.lax.pcast(p, axes, to="varying") if axes else p, params, invariant)
        (_, (loss, metrics)), g = jax.value_and_grad(scaled_loss(loss_metrics, loss_scale), has_aux=True)(
            params, jax.tree.map(lambda x: x[0], mb), **ep_kwargs
        )
        g = jax.tree.map(lambda x: (x.astype(jnp.float32) * scale).astype(reduce_dtype)[None], g)
        return loss[None], jax.tree.map(lambda m: m[None], metrics), g

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

    if options.microbatches == 1:
        loss, metrics, g = local_grads(jax.tree.map(lambda x: x[0], mbs))
        return loss, metrics, reduce(g)

    def body(acc, mb):  # the per-microbatch means, as the step has always averaged them
        loss, metrics, g = local_grads(mb)
        return jax.tree.map(jnp.add, acc, g), (jnp.mean(loss), jax.tree.map(jnp.mean, metrics))

    acc0 = jax.tree.map(
        lambda t, s: _zeros((axes_size(mesh, t.dp_axes), *t.shape), reduce_dtype, s), plan.tensors, local_sh
    )
    acc, (losses, metrics) = jax.lax.scan(body, acc0, mbs)
    return losses, metrics, reduce(acc)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _zeros(shape, dtype, sharding):
    return jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), sharding)


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
    reshard = config.reshard_after_forward

    def step(state: TrainState, batch: PyTree):
        scaler = state.opt_state.grad_scaler
        loss_scale = None if scaler is None else scaler.loss_scale
        loss, metrics, grads = reduced_grads(loss_fn, state.params, batch, plan, options, reshard, loss_scale)
        params, opt_state, opt_metrics = optimizer.step(grads, state.opt_state, state.params)
        return TrainState(params, opt_state, state.step + 1), {"loss": loss, **opt_metrics, **metrics}

    replicated, batch_sh = NamedSharding(plan.mesh, P()), batch_sharding(plan.mesh)
    step_jit = jax.jit(
        step, in_shardings=(shardings, batch_sh), out_shardings=(shardings, replicated), donate_argnums=0
    )
    grads_jit = jax.jit(
        lambda params, batch: reduced_grads(loss_fn, params, batch, plan, options, reshard)[2],
        in_shardings=(plan.param_shardings(), batch_sh),
        out_shardings=plan.grad_shardings(),
    )
    evaluate = build_evaluate(loss_fn, plan, options, reshard)
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
    ep_kwargs = _ep_kwargs(plan)
    hooks = unit_hooks(plan, 1.0, reduce_dtype, reshard_after_forward) if plan.shards_grads else None

    def rank_loss(params, mb):  # one rank's [1, b, ...] rows -> its [1] loss and metrics
        if hooks is not None:  # no grads: a sink only needs the stacked dims a scan over the layers slices
            sinks = jax.tree.map(lambda t: jnp.zeros(t.shape[: t.unit_dims or 0], reduce_dtype), plan.tensors)
            params = unit_view(params, sinks, hooks, plan)
        loss, metrics = loss_metrics(params, jax.tree.map(lambda x: x[0], mb), **ep_kwargs)
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
