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

With `zero.overlap_grad_reduce: false` DDP and ZeRO-1 put no param in a unit (`Stage.per_unit`): every
micro-batch only accumulates this rank's local grads, stacked `[n_dp, *shape]`, and after the last
an explicit sum over the ranks, in the strategy's grad sharding, reduces them (`_reduce_local`: XLA
emits the collective). ZeRO-2 and ZeRO-3 reduce per unit whatever the setting.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.mesh import BATCH_AXES, EP_AXIS, OUTER_AXIS, axes_size
from jzero.zero.common.batch import grad_scale, split_batch
from jzero.zero.common.loss_scale import scaled_loss
from jzero.zero.common.schedule import Phase, backward, run_schedule
from jzero.zero.common.state import LossFn, ModelState, loss_parts
from jzero.zero.common.strategies import ShardingPlan, TensorPlan, restrict, spec_axes
from jzero.zero.common.units import Hook, UnitParam, materialize, scale_grad
from jzero.zero.config import StepOptions, ZeroConfig

PyTree = Any


def unit_hooks(plan: ShardingPlan, options: StepOptions, reshard_after_forward: bool, phase: Phase) -> PyTree:
    """Per param, the `units.Hook` that materializes it and reduces its grad in `phase`."""
    scale, stage = grad_scale(plan.mesh, options.microbatches), plan.stage

    def hook(t: TensorPlan) -> Hook:
        gather = phase.gathers(stage) and t.shard_dim is not None
        value_spec = t.local_grad_spec if phase.stacked(stage) else plan.param_spec(t) if gather else t.tp_spec
        varying = set(spec_axes(restrict(value_spec, BATCH_AXES))) | (set(t.inner_axes) if gather else set())
        outer = tuple(a for a in t.dp_axes if a not in t.inner_axes)
        regather = not plan.stage.shards_state and bool(outer)  # DDP under HSDP: a hierarchical all-reduce
        split = t.shard_dim is not None and (plan.stage.shards_state or regather)  # the grad is split on its shard dim
        return Hook(
            dim=t.shard_dim - len(t.shape) if split else None,
            inner=t.inner_axes,
            outer=outer,
            outer_scatter=OUTER_AXIS in t.shard_axes,
            gathers=gather,
            to_varying=tuple(a for a in BATCH_AXES if a not in varying),
            scale=scale,
            reduce_dtype=jnp.dtype(options.grad_reduce_dtype).name,
            reshard=gather and reshard_after_forward and stage.shards_params,
            regather=regather and split,
            tp_spec=_tp_only(plan, t),
            reduce=phase.reduces(stage),
            extract=phase.extracts(stage),
            keep=gather and not stage.shards_params,
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
        return x if t.unit_dims is not None and plan.stage.per_unit else materialize(x)

    leaves, treedef = jax.tree.flatten(plan.tensors)
    rest = [treedef.flatten_up_to(tree) for tree in (params, sinks, hooks, accs, gsinks)]
    return treedef.unflatten([wrap(*args) for args in zip(leaves, *rest)])


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

    stage, local = plan.stage, of(lambda t: t.local_grad_spec)
    params = local if phase.stacked(stage) else of(plan.param_spec) if phase.gathers(stage) else of(lambda t: t.tp_spec)
    return _Specs(params, of(plan.state_spec) if phase.reduces(stage) else local, local)


def run_phase(loss_metrics, plan, options, config, phase, params, mb, acc=None, loss_scale=None, model_state=None):
    """One micro-batch `mb` ([n_dp, b, ...]) on every rank as `phase` says: (losses [n_dp], (metrics,
    stats) [n_dp], grads, extracted params or None), `loss_metrics` in `state.loss_parts`'s form and
    called with `model_state`. grads are reduced in `plan.state_shardings()`, or, for a
    phase that does not reduce, this rank's own stacked `[n_dp, *shape]` in `plan.local_grad_shardings()`;
    extracted params are each rank's gathered copy, stacked alike (a later phase's `stacked` params)."""
    mesh, reduce_dtype, stage = plan.mesh, options.grad_reduce_dtype, plan.stage
    scale, reduces = grad_scale(mesh, options.microbatches), phase.reduces(stage)
    hooks = unit_hooks(plan, options, config.reshard_after_forward, phase)
    specs, stacked = _specs(plan, phase), P(BATCH_AXES)

    def rank(params, sinks, accs, gsinks, mb, loss_scale, model_state):  # one rank's [1, b, ...] rows
        local = not reduces
        sinks = _squeeze(sinks) if local else sinks
        params = _squeeze(params) if phase.stacked(stage) else params
        gsinks = None if gsinks is None else _squeeze(gsinks)

        def view(sinks, gsinks):
            return unit_view(params, sinks, hooks, plan, None if accs is None else _squeeze(accs), gsinks)

        def loss_at(view):
            return scaled_loss(loss_metrics, loss_scale)(view, _squeeze(mb), model_state, **ep_kwargs(plan))

        (loss, *aux), (g, full) = backward(loss_at, view, sinks, gsinks)
        g = jax.tree.map(lambda x: scale_grad(x, scale, reduce_dtype)[None], g) if local else g
        full = None if full is None else jax.tree.map(lambda x: x[None], full)
        return loss[None], jax.tree.map(lambda m: m[None], tuple(aux)), g, full

    grad_sh = plan.state_shardings() if reduces else plan.local_grad_shardings()

    def sink(t, s):  # a phase that only accumulates gets its grads unscaled in the param dtype (`units.UnitParam`)
        if reduces:
            return _zeros(t.shape, reduce_dtype, s)
        return _zeros((axes_size(mesh, t.dp_axes), *t.shape), t.dtype, s)

    sinks = jax.tree.map(sink, plan.tensors, grad_sh)
    gsinks = None
    if phase.extracts(stage):
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
    data-parallel mean of the gradients, in `plan.state_shardings()`.

    Expert params (split over ep) enter each rank as its local experts and their grads
    leave stacked over the expert-DP domain only: `loss_fn` gets `ep_axis=` and moves tokens
    to the experts' ranks itself, so a rank's expert grads already hold every ep rank's tokens.

    Args:
      params: in `plan.param_shardings()` (sharded where they rest sharded).
      batch: leaves `[B, ...]`, B split over the dense DP domain.
      options: microbatches, the grad reduce dtype, has_aux.
      config: `reshard_after_forward` is read here.
      loss_scale: fp16's loss scale (a scalar): the grads are those of loss x loss_scale
        (`common/loss_scale.py`); the loss and metrics returned are not scaled. None: no scaling.
      hook, model_state: the model's `ModelState` and its current value (replicated): the loss is
        then called with `model_state=` and returns (loss, metrics, stats). None: a stateless loss.
    Returns:
      (loss, metrics, stats, grads): stats replicated ({} without a hook), grads in the grad reduce
      dtype, sharded like `plan.state_shardings()`.
    """
    mesh = plan.mesh
    mbs = split_batch(batch, axes_size(mesh, BATCH_AXES), options.microbatches)
    mbs = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, BATCH_AXES))), mbs)
    loss_metrics = loss_parts(loss_fn, options.has_aux, hook)
    run = functools.partial(run_phase, loss_metrics, plan, options, config, loss_scale=loss_scale,
                            model_state=model_state)  # fmt: skip
    zeros = lambda: jax.tree.map(  # noqa: E731
        lambda t, s: _zeros(t.shape, options.grad_reduce_dtype, s), plan.tensors, plan.state_shardings()
    )
    reduce_after = None if plan.stage.per_unit else functools.partial(_reduce_local, plan, options)
    losses, (metrics, stats), g = run_schedule(run, params, mbs, plan.stage, zeros, reduce_after)
    stats = jax.tree.map(lambda x: jnp.sum(x.reshape(-1, *x.shape[2:]), axis=0), stats)  # [M, n_dp, ...] summed
    return jnp.mean(losses), jax.tree.map(jnp.mean, metrics), stats, g


def _reduce_local(plan: ShardingPlan, options: StepOptions, g: PyTree) -> PyTree:
    """DDP's and ZeRO-1's accumulated local grads, stacked `[n_dp, *shape]`, summed over the ranks into the
    strategy's grad sharding: XLA emits the all-reduce (or, on GPU, ZeRO-1's reduce-scatter; on CPU
    all-reduce + dynamic-slice: docs/xla.md, "Reduce-scatter: XLA:CPU vs XLA:GPU")."""
    summed = jax.tree.map(lambda x: jnp.sum(x, axis=0, dtype=options.grad_reduce_dtype), g)
    return jax.tree.map(jax.lax.with_sharding_constraint, summed, plan.state_shardings())
