"""The flat path's gradients: each bucket reduced by its hook as soon as its grads are complete.

Where the stage reduces per unit (`Stage.per_unit`: `zero.overlap_grad_reduce`, and always under
ZeRO-3) the flat buffers are laid out per FSDP unit (`plan.py`) and every bucket's grads are reduced
by its hook the moment its unit's backward is done (`hooks.py`): a scanned stack's buckets inside the
layer loop, one layer's slice at a time; the rest group's (embeddings, final norm, head) when the
loss's backward completes them. Otherwise one layout covers the whole model (the rest group), reduced
after the backward, as Megatron's buckets without overlap. The
micro-batches follow Megatron, as on the spec path (`common/schedule.py`):

  ZeRO-2/3: every micro-batch reduce-scatters each bucket into the owned shard's accumulator.
  DDP, ZeRO-1: the first M-1 micro-batches accumulate this rank's own buckets ([S_b], Megatron's
    grad buffer); the last adds them before its per-unit psum (DDP) or psum_scatter (ZeRO-1).
  Params resting as bucket shards (ZeRO-3; ZeRO-1/2 with `overlap_param_gather`): each unit's buckets
    are all-gathered just before it runs; ZeRO-3 again for its backward (`reshard_after_forward`)
    and in every micro-batch; ZeRO-1/2 in the first micro-batch only, which hands the whole buckets
    it gathered to the later ones.

Everything here runs per device, inside the step's shard_map over the whole mesh: a bucket is
[S_b] ([L, S_b] stacked), its owned shard [S_b/d] (`local.py`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jzero.mesh import AXES, BATCH_AXES
from jzero.zero.common.batch import grad_scale
from jzero.zero.common.loss_scale import scaled_loss
from jzero.zero.common.schedule import Phase, backward, run_schedule
from jzero.zero.common.units import UnitParam, scale_grad
from jzero.zero.config import Stage
from jzero.zero.flat.hooks import Mode, bucket_hooks, bucket_values, flat_view, sink_axes
from jzero.zero.flat.local import from_local

PyTree = Any


def _zeros(shape, dtype, axes) -> jax.Array:
    """Zeros varying over `axes` (a sink's type: `hooks.sink_axes`)."""
    return jax.lax.pcast(jnp.zeros(shape, dtype), axes, to="varying") if axes else jnp.zeros(shape, dtype)


def _mode(stage: Stage, phase: Phase) -> Mode:
    if phase.stacked(stage):
        return Mode.BUCKET
    return Mode.SHARD if phase.gathers(stage) else Mode.PARAMS


def phase_hooks(prog, phase: Phase) -> list:
    """Per plan bucket, the `hooks.BucketHook` of `phase`."""
    fp, o = prog.fp, prog.options
    stage = fp.plan.stage
    mode = _mode(stage, phase)
    return bucket_hooks(
        fp, mode, grad_scale(fp.plan.mesh, o.microbatches), o.grad_reduce_dtype, reduce=phase.reduces(stage),
        extract=phase.extracts(stage), keep=mode == Mode.SHARD and not stage.shards_params,
        reshard=mode == Mode.SHARD and prog.reshard_after_forward and stage.shards_params,
    )  # fmt: skip


def sinks(prog, reduce: bool) -> list[jax.Array]:
    """Per plan bucket, zeros shaped like what its grads become: the owned shard of the reduced bucket
    (all of it under DDP), or this rank's own bucket in the param dtype when the phase only accumulates
    (`hooks.BucketHook.reduce_grads`)."""
    fp, dtype = prog.fp, prog.options.grad_reduce_dtype if reduce else prog.param_dtype
    shapes = [fp.shard_shape(k) if reduce else (*buf.lead, buf.numel(b)) for k, (buf, b) in enumerate(fp.buckets)]
    return [_zeros(s, dtype, sink_axes(buf, reduce)) for s, (buf, _) in zip(shapes, fp.buckets)]


def run_phase(prog, phase: Phase, params, mb, acc=None, loss_scale=None, model_state=None):
    """One micro-batch `mb` on this device as `phase` says: (loss, (metrics, stats), per plan bucket its grads,
    the gathered buckets when extracting else None). `params`: as the state holds them (model-shaped
    tp-local, or the resting bucket shards), or the buckets an extracting phase gave (`phase.stacked`)."""
    fp, stage = prog.fp, prog.fp.plan.stage
    reduces = phase.reduces(stage)
    hooks = phase_hooks(prog, phase)
    values = bucket_values(fp, _mode(stage, phase), params)
    gsinks = None
    if phase.extracts(stage):
        dtype = prog.param_dtype
        gsinks = [_zeros((*buf.lead, buf.numel(b)), dtype, AXES) for buf, b in fp.buckets]
    accs = acc if phase.adds_carry else [None] * fp.n_buckets
    treedef = jax.tree.structure(fp.plan.tensors)

    def view(sinks, gsinks):
        extra = [None] * fp.n_buckets if gsinks is None else gsinks
        return flat_view(fp, treedef, [UnitParam(*args) for args in zip(values, sinks, hooks, accs, extra)])

    def loss_at(view):
        return scaled_loss(prog.loss_fn, loss_scale)(view, mb, model_state, **prog.axis_kwargs)

    (loss, metrics, stats), (g, full) = backward(loss_at, view, sinks(prog, reduces), gsinks)
    if not reduces:  # this rank's own buckets, unscaled: scaled as they enter the accumulator
        g = [scale_grad(x, grad_scale(fp.plan.mesh, prog.options.microbatches), prog.options.grad_reduce_dtype)
             for x in g]  # fmt: skip
    return loss, (metrics, stats), g, full


def scheduled_grads(prog, params, batch, loss_scale=None, model_state=None):
    """((loss, metrics) averaged over DP and micro-batches and the model's stats summed over them, the
    reduced grad buckets as shard_map returns them: [1, S_b/d] ([L, 1, S_b/d] stacked; [S_b] under DDP)),
    of the loss times `loss_scale` if given; `prog.loss_fn` in `state.loss_parts`'s form, called with
    `model_state`."""
    fp = prog.fp
    run = functools.partial(run_phase, prog, loss_scale=loss_scale, model_state=model_state)
    mbs = prog.rank_microbatches(batch)
    losses, (metrics, stats), g = run_schedule(run, params, mbs, fp.plan.stage, lambda: sinks(prog, True))
    loss, metrics = jax.lax.pmean((jnp.mean(losses), jax.tree.map(jnp.mean, metrics)), BATCH_AXES)
    stats = jax.lax.psum(jax.tree.map(lambda x: jnp.sum(x, axis=0), stats), BATCH_AXES)  # [M, ...] per device
    return (loss, metrics, stats), [from_local(buf, x) for (buf, _), x in zip(fp.buckets, g)]


def evaluate_view(prog, params) -> PyTree:
    """The params as the step's forward sees them, for the loss without grads: the resting bucket shards
    gathered per unit (the sinks, never differentiated, only need the layer dims a scan slices)."""
    fp = prog.fp
    hooks = phase_hooks(prog, Phase.ALIKE)
    values = bucket_values(fp, Mode.SHARD, params)
    buckets = [UnitParam(v, jnp.zeros(buf.lead), h) for v, h, (buf, _) in zip(values, hooks, fp.buckets)]
    return flat_view(fp, jax.tree.structure(fp.plan.tensors), buckets)
