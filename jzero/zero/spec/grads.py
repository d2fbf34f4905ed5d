"""The spec path's gradients: each DP rank's backward, the DP reductions inside it, the micro-batch schedule.

Each data-parallel rank computes the gradient of its own microbatch in a `shard_map` that is
manual over the DP axes only (tp stays with XLA, so the loss still sees global tp-split params).
The loss gets each param as a `units.UnitParam` and the step differentiates it with respect to
zero "sinks" shaped like what each grad becomes, so every param's grad is scaled and reduced by
its `units.Hook` the moment its backward is done: a unit's inside the layer loop, the head's early
in the backward, the embedding's at its end (Megatron's `overlap_grad_reduce`). DDP all-reduces
each grad over its DP domain; ZeRO-1/2/3 reduce-scatter it (psum_scatter over the inner DP axes,
then reduced across dp_outer under HSDP), so no rank holds the whole reduced gradient. Under HSDP
DDP's all-reduce is hierarchical too: reduce-scatter over the inner axes, all-reduce across
dp_outer, all-gather over the inner axes (a param with no dim divisible by d_i: one psum).

Micro-batches follow Megatron:
  ZeRO-2/3: every micro-batch reduce-scatters into the sharded accumulator.
  DDP, ZeRO-1: the first M-1 micro-batches only accumulate this rank's own grads (the sinks get
    them unreduced: no communication); the last one adds them before its per-unit reduction, so the
    wire bytes are one reduction's (DDP's all-reduce, ZeRO-1's reduce-scatter).
Where the params rest sharded between steps (ZeRO-3; ZeRO-1/2 with `overlap_param_gather`) each
unit's are all-gathered just before it runs. ZeRO-3 gathers them again for its backward
(`reshard_after_forward`) and in every micro-batch; ZeRO-1/2 keep them for the backward, and their
first micro-batch hands what it gathered to the later ones (the `gsink`s), so they are gathered once
per step: ZeRO-2's memory and wire bytes, with the gather overlapped with the forward.

With `zero.overlap_grad_reduce: false`, DDP and ZeRO-1 run as before it existed
(`_accumulated_grads`): local grads stacked `[n_dp, *shape]`, one slice per rank, accumulated over
the micro-batches and reduced once after the last by an explicit sum whose output sharding is the
strategy's grad sharding (XLA emits the all-reduce or reduce-scatter; on CPU all-reduce +
dynamic-slice: docs/xla.md, "Reduce-scatter: XLA:CPU vs XLA:GPU").
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.mesh import BATCH_AXES, EP_AXIS, OUTER_AXIS, axes_size
from jzero.zero.common.batch import split_batch
from jzero.zero.common.loss_scale import scaled_loss
from jzero.zero.common.schedule import Phase, run_schedule
from jzero.zero.common.state import LossFn, ModelState, loss_parts
from jzero.zero.common.strategies import ShardingPlan, TensorPlan, restrict, spec_axes
from jzero.zero.common.units import Hook, UnitParam, check_loss, materialize, micro_batch_loss, scale_grad
from jzero.zero.config import StepOptions, ZeroConfig

PyTree = Any


def unit_hooks(plan: ShardingPlan, options: StepOptions, reshard_after_forward: bool, phase: Phase) -> PyTree:
    """Per param, the `units.Hook` that materializes it and reduces its grad in `phase`."""
    scale = grad_scale(plan, options)

    def hook(t: TensorPlan) -> Hook:
        gather = phase.gather and t.shard_dim is not None and plan.params_rest_sharded
        value_spec = t.local_grad_spec if phase.stacked else plan.param_spec(t) if phase.gather else t.tp_spec
        varying = set(spec_axes(restrict(value_spec, BATCH_AXES))) | (set(t.inner_axes) if gather else set())
        outer = tuple(a for a in t.dp_axes if a not in t.inner_axes)
        regather = not plan.shards_state and bool(outer)  # DDP under HSDP: a hierarchical all-reduce
        split = t.shard_dim is not None and (plan.shards_state or regather)  # the grad is split on its shard dim
        return Hook(
            dim=t.shard_dim - len(t.shape) if split else None,
            inner=t.inner_axes,
            outer=outer,
            outer_scatter=OUTER_AXIS in t.shard_axes,
            gather=gather,
            to_varying=tuple(a for a in BATCH_AXES if a not in varying),
            scale=scale,
            reduce_dtype=jnp.dtype(options.grad_reduce_dtype).name,
            reshard=gather and reshard_after_forward and plan.shards_params,
            regather=regather and split,
            tp_spec=_tp_only(plan, t),
            reduce=phase.reduce,
            extract=phase.extract,
            keep=gather and not plan.shards_params,
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


def unit_view(
    params: PyTree, sinks: PyTree, hooks: PyTree, plan: ShardingPlan, accs: PyTree = None, gsinks: PyTree = None
) -> PyTree:
    """The params as the loss takes them on one rank (inside the DP-manual shard_map): a unit's as
    `UnitParam`s, materialized (gathered where they rest sharded) when the unit runs; the others now,
    for the whole loss. `accs` and `gsinks` (param-shaped trees) are the hooks' carry and extraction."""
    none = jax.tree.map(lambda _: None, plan.tensors)
    accs, gsinks = none if accs is None else accs, none if gsinks is None else gsinks

    def wrap(t, p, sink, h, acc, gsink):
        x = UnitParam(p, sink, h, acc, gsink)
        return x if t.unit_dims is not None else materialize(x)

    leaves, treedef = jax.tree.flatten(plan.tensors)
    rest = [treedef.flatten_up_to(tree) for tree in (params, sinks, hooks, accs, gsinks)]
    return treedef.unflatten([wrap(*args) for args in zip(leaves, *rest)])


def grad_scale(plan: ShardingPlan, options: StepOptions) -> float:
    """Megatron's gradient_scaling_factor 1 / (dense DP size x microbatches), dense and expert alike."""
    return 1.0 / (axes_size(plan.mesh, BATCH_AXES) * options.microbatches)


def ep_kwargs(plan: ShardingPlan) -> dict:
    return {"ep_axis": EP_AXIS} if plan.splits_ep else {}


def _squeeze(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: x[0], tree)


def _zeros(shape, dtype, sharding):
    return jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), sharding)


class _Specs(NamedTuple):
    """The in/out specs (over the DP axes) of one phase's per-rank function."""

    params: PyTree
    sinks: PyTree
    local: PyTree  # stacked per rank [n_dp, *shape]: local sinks, the carry, extracted params


def _specs(plan: ShardingPlan, phase: Phase) -> _Specs:
    def of(spec_of):
        return jax.tree.map(lambda t: restrict(spec_of(t), BATCH_AXES), plan.tensors)

    local = of(lambda t: t.local_grad_spec)
    grads = of(lambda t: t.zero_spec if plan.shards_state else t.tp_spec)
    params = local if phase.stacked else of(plan.param_spec) if phase.gather else of(lambda t: t.tp_spec)
    return _Specs(params, grads if phase.reduce else local, local)


def run_phase(loss_metrics, plan, options, config, phase, params, mb, acc=None, loss_scale=None, model_state=None):
    """One micro-batch `mb` ([n_dp, b, ...]) on every rank as `phase` says: (losses [n_dp], (metrics,
    stats) [n_dp], grads, extracted params or None), `loss_metrics` in `state.loss_parts`'s form and
    called with `model_state`. grads are reduced in `plan.grad_shardings()`, or, for a
    phase that does not reduce, this rank's own stacked `[n_dp, *shape]` in `plan.local_grad_shardings()`;
    extracted params are each rank's gathered copy, stacked alike (a later phase's `stacked` params)."""
    mesh, reduce_dtype, scale = plan.mesh, options.grad_reduce_dtype, grad_scale(plan, options)
    hooks = unit_hooks(plan, options, config.reshard_after_forward, phase)
    specs, stacked = _specs(plan, phase), P(BATCH_AXES)

    def rank(params, sinks, accs, gsinks, mb, loss_scale, model_state):  # one rank's [1, b, ...] rows
        local = not phase.reduce
        sinks = _squeeze(sinks) if local else sinks
        params = _squeeze(params) if phase.stacked else params
        gsinks = None if gsinks is None else _squeeze(gsinks)

        def view(sinks, gsinks):
            return unit_view(params, sinks, hooks, plan, None if accs is None else _squeeze(accs), gsinks)

        def loss_at(view):
            return scaled_loss(loss_metrics, loss_scale)(view, _squeeze(mb), model_state, **ep_kwargs(plan))

        outside = check_loss(loss_at, view(sinks, gsinks))

        def loss_of(sinks, gsinks):
            return micro_batch_loss(loss_at, view(sinks, gsinks), outside)

        (_, (loss, *aux)), (g, full) = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(sinks, gsinks)
        g = jax.tree.map(lambda x: scale_grad(x, scale, reduce_dtype)[None], g) if local else g
        full = None if full is None else jax.tree.map(lambda x: x[None], full)
        return loss[None], jax.tree.map(lambda m: m[None], tuple(aux)), g, full

    grad_sh = plan.grad_shardings() if phase.reduce else plan.local_grad_shardings()

    def sink(t, s):  # a phase that only accumulates gets its grads unscaled in the param dtype (`units.UnitParam`)
        if phase.reduce:
            return _zeros(t.shape, reduce_dtype, s)
        return _zeros((axes_size(mesh, t.dp_axes), *t.shape), t.dtype, s)

    sinks = jax.tree.map(sink, plan.tensors, grad_sh)
    gsinks = None
    if phase.extract:
        local_sh = plan.local_grad_shardings()
        gsinks = jax.tree.map(lambda t, s: _zeros((axes_size(mesh, t.dp_axes), *t.shape), t.dtype, s), plan.tensors,
                              local_sh)  # fmt: skip
    fn = jax.shard_map(
        rank,
        mesh=mesh,
        in_specs=(specs.params, specs.sinks, P() if acc is None else specs.local,
                  P() if gsinks is None else specs.local, stacked, P(), P()),
        out_specs=(stacked, stacked, specs.sinks, P() if gsinks is None else specs.local),
        axis_names=set(BATCH_AXES),
    )  # fmt: skip
    loss, metrics, g, full = fn(params, sinks, acc, gsinks, mb, loss_scale, model_state)
    return loss, metrics, jax.tree.map(jax.lax.with_sharding_constraint, g, grad_sh), full


def reduced_grads(
    loss_fn: LossFn,
    params: PyTree,
    batch: PyTree,
    plan: ShardingPlan,
    options: StepOptions,
    config: ZeroConfig,
    loss_scale: jax.Array | None = None,
    hook: ModelState | None = None,
    model_state: PyTree = None,
) -> tuple[jax.Array, dict, PyTree, PyTree]:
    """Mean loss, mean metrics, the model's stats summed over ranks and micro-batches, and the
    data-parallel mean of the gradients, in `plan.grad_shardings()`.

    Expert params (split over ep) enter each rank as its local experts and their grads
    leave stacked over the expert-DP domain only: `loss_fn` gets `ep_axis=` and moves tokens
    to the experts' ranks itself, so a rank's expert grads already hold every ep rank's tokens.

    Args:
      params: in `plan.param_shardings()` (sharded where they rest sharded).
      batch: leaves `[B, ...]`, B split over the dense DP domain.
      options: microbatches, the grad reduce dtype, has_aux.
      config: `overlap_grad_reduce` and `reshard_after_forward` are read here.
      loss_scale: fp16's loss scale (a scalar): the grads are those of loss x loss_scale
        (`common/loss_scale.py`); the loss and metrics returned are not scaled. None: no scaling.
      hook, model_state: the model's `ModelState` and its current value (replicated): the loss is
        then called with `model_state=` and returns (loss, metrics, stats). None: a stateless loss.
    Returns:
      (loss, metrics, stats, grads): stats replicated ({} without a hook), grads in the grad reduce
      dtype, sharded like `plan.grad_shardings()`.
    """
    mesh = plan.mesh
    mbs = split_batch(batch, axes_size(mesh, BATCH_AXES), options.microbatches)
    mbs = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, BATCH_AXES))), mbs)
    loss_metrics = loss_parts(loss_fn, options.has_aux, hook)
    if plan.shards_grads or config.overlap_grad_reduce:
        losses, (metrics, stats), g = _scheduled_grads(
            loss_metrics, params, mbs, plan, options, config, loss_scale, model_state
        )
    else:
        losses, (metrics, stats), g = _accumulated_grads(loss_metrics, params, mbs, plan, options, loss_scale,
                                                         model_state)  # fmt: skip
    # Per rank and micro-batch [..., n_dp, *shape] (one micro-batch's sums, [M, *shape], without overlap):
    # every leading dim is summed.
    stats = jax.tree.map(lambda x, s: jnp.sum(x.reshape(-1, *s.shape), axis=0), stats, _stat_shapes(stats, losses))
    return jnp.mean(losses), jax.tree.map(jnp.mean, metrics), stats, g


def _stat_shapes(stats: PyTree, losses: jax.Array) -> PyTree:
    """Each stat's shape per rank and micro-batch: its shape past the leading dims `losses` has."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[losses.ndim :], x.dtype), stats)


def _scheduled_grads(loss_metrics, params, mbs, plan, options, config, loss_scale, model_state):
    """The micro-batches as `Phase`s (`common/schedule.py`): (losses [M, n_dp], (metrics, stats), reduced
    grads)."""
    run = functools.partial(run_phase, loss_metrics, plan, options, config, loss_scale=loss_scale,
                            model_state=model_state)  # fmt: skip
    zeros = lambda: jax.tree.map(  # noqa: E731
        lambda t, s: _zeros(t.shape, options.grad_reduce_dtype, s), plan.tensors, plan.grad_shardings()
    )
    return run_schedule(
        run, params, mbs, gather=plan.params_rest_sharded, shards_grads=plan.shards_grads,
        shards_params=plan.shards_params, zeros=zeros,
    )  # fmt: skip


def _accumulated_grads(loss_metrics, params, mbs, plan, options, loss_scale, model_state):
    """DDP and ZeRO-1 (module docstring): (losses, metrics, grads) with the local grads accumulated over
    the microbatches and reduced once, after the last."""
    mesh, reduce_dtype = plan.mesh, options.grad_reduce_dtype
    scale, ep = grad_scale(plan, options), ep_kwargs(plan)
    local_sh, grad_sh = plan.local_grad_shardings(), plan.grad_shardings()
    param_specs = jax.tree.map(lambda t: restrict(t.tp_spec, BATCH_AXES), plan.tensors)
    # Per param, the DP axes it enters replicated over (all of them but ep for an expert weight).
    invariant = jax.tree.map(
        lambda s: tuple(a for a in BATCH_AXES if a not in spec_axes(s)), param_specs, is_leaf=_is_spec
    )

    def rank_grads(params, mb, loss_scale, model_state):  # one rank's [1, b, ...] rows -> [1] loss, metrics
        # and stats, [1, *shape] grads. DP-varying, so autodiff gives local grads (an expert param already
        # varies over ep).
        params = jax.tree.map(lambda p, axes: jax.lax.pcast(p, axes, to="varying") if axes else p, params, invariant)
        (_, (loss, *aux)), g = jax.value_and_grad(scaled_loss(loss_metrics, loss_scale), has_aux=True)(
            params, jax.tree.map(lambda x: x[0], mb), model_state, **ep
        )
        g = jax.tree.map(lambda x: scale_grad(x, scale, reduce_dtype)[None], g)
        return loss[None], jax.tree.map(lambda m: m[None], tuple(aux)), g

    stacked = P(BATCH_AXES)
    local_grads_fn = jax.shard_map(
        rank_grads,
        mesh=mesh,
        in_specs=(param_specs, stacked, P(), P()),
        out_specs=(stacked, stacked, jax.tree.map(lambda t: restrict(t.local_grad_spec, BATCH_AXES), plan.tensors)),
        axis_names=set(BATCH_AXES),
    )

    def local_grads(mb):
        """[n_dp, ...] per-rank losses, metrics and grads of one microbatch, one slice per rank."""
        loss, metrics, g = local_grads_fn(params, mb, loss_scale, model_state)
        return loss, metrics, jax.tree.map(jax.lax.with_sharding_constraint, g, local_sh)

    def reduce(g):  # the DP collective: sum over ranks into the strategy's grad sharding
        summed = jax.tree.map(lambda x: jnp.sum(x, axis=0, dtype=reduce_dtype), g)
        return jax.tree.map(jax.lax.with_sharding_constraint, summed, grad_sh)

    if options.microbatches == 1:
        loss, metrics, g = local_grads(jax.tree.map(lambda x: x[0], mbs))
        return loss, metrics, reduce(g)

    def body(acc, mb):  # the per-microbatch means (the stats' sums), as the step has always averaged them
        loss, (metrics, stats), g = local_grads(mb)
        means = jax.tree.map(jnp.mean, metrics)
        return jax.tree.map(jnp.add, acc, g), (jnp.mean(loss), (means, jax.tree.map(lambda x: x.sum(0), stats)))

    acc0 = jax.tree.map(
        lambda t, s: _zeros((axes_size(mesh, t.dp_axes), *t.shape), reduce_dtype, s), plan.tensors, local_sh
    )
    acc, (losses, metrics) = jax.lax.scan(body, acc0, mbs)
    return losses, metrics, reduce(acc)


def _is_spec(x) -> bool:
    return isinstance(x, P)


