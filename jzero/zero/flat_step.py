"""The explicit path (`zero.path: flat`): Megatron's bucketed psum_scatter / all_gather in shard_map.

Per bucket of the flat buffers (`flat_plan.py`), over that bucket's DP domain (dp_outer x dp x ep
for a dense bucket, dp_outer x dp for an expert bucket):

  ZeRO-2 (optim_grads): psum_scatter every microbatch; rank r of the domain keeps its
      shard `[r*S/d, (r+1)*S/d)`, so only the shard is ever accumulated.
  HSDP (dp_outer > 1): the psum_scatter runs over the inner DP axes, then a psum across
      dp_outer (outer_strategy no_shard: d = the inner size) or a second psum_scatter there
      (optim: rank r = inner rank x dp_outer + outer rank); the updated shards are
      all-gathered back in the reverse order.
  ZeRO-1 (optim): the full local bucket accumulates over microbatches (Megatron's
      grad buffer), then one psum_scatter after the last: DDP's wire bytes.
  DDP (no_shard): the full local bucket accumulates, then one psum.

Expert grads need no reduction over ep: the loss moves tokens to the experts' ranks and
back (all_to_all over ep), so a rank's expert grads already hold every ep rank's tokens.
Every grad, dense and expert, is scaled by 1 / (dense DP size x microbatches), as Megatron does.

The inner optax transformation steps on the owned fp32 shards, with the param groups'
multipliers laid out like them (`flat_plan.values_on_shard`); the updated shards are cast
to the param dtype and all_gathered per bucket back into the params (with
`param_gather_dtype`: quantized blockwise to one byte and gathered with their scales,
`quantize.py`). Only element-wise transformations mean the same on a shard as on the params:
`probe.check_elementwise` refuses the others when `build.build_zero` builds the step.

Shardings: params as the spec path (tp- and ep-sharded, replicated over their DP domain);
main params and every non-scalar optimizer-state leaf one array per bucket, [tp, S_b] dense or
[ep * tp, S_b] expert, in `FlatPlan.bucket_specs()`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.config import ConfigError, ParamGatherDType
from jzero.mesh import BATCH_AXES, EP_AXIS, TP_AXIS
from jzero.zero import loss_scale as scaler
from jzero.zero.batch import batch_sharding, split_batch
from jzero.zero.flat_plan import FlatPlan, flatten, owned, unflatten, values_on_shard
from jzero.zero.groups import GroupValues, group_leaves
from jzero.zero.loss_scale import DynamicLossScale, scaled_loss
from jzero.zero.offload import Offload
from jzero.zero.quantize import gather_quantized
from jzero.zero.state import LossFn, TrainState, ZeroState, keeps_main_params, with_metrics
from jzero.zero.strategies import spec_axes
from jzero.zero.update import clip_coefficient, inner_update, model_copy

PyTree = Any


class FlatStep(NamedTuple):
    """shardings: the TrainState's NamedShardings; init_opt(params) -> ZeroState (call under jit);
    step(state, batch) -> (state, metrics); grads(params, batch) -> reduced grad buckets;
    evaluate(params, batch) -> {"loss", **metrics}, the step's forward without grads."""

    shardings: TrainState
    init_opt: Callable
    step: Callable
    grads: Callable
    evaluate: Callable


def opt_state_shardings(
    inner: optax.GradientTransformation,
    fp: FlatPlan,
    loss_scale: DynamicLossScale | None = None,
    quantized: bool = False,
) -> ZeroState:
    """Main params and state leaves shaped like a bucket shard: bucket b's array in `fp.bucket_specs()[b]`;
    scalars (and the loss scaler's) replicated. Main params are kept for non-fp32 params, and for any
    when the gather is `quantized` (the model copy is then not the main params)."""
    mesh = fp.plan.mesh
    bucket_sh = [NamedSharding(mesh, spec) for spec in fp.bucket_specs()]
    shards = [jax.ShapeDtypeStruct((fp.shard_size(b),), jnp.float32) for b in range(fp.n_buckets)]

    def sharding(path, leaf):
        if not leaf.shape:
            return NamedSharding(mesh, P())
        b = getattr(path[-1], "idx", None) if path else None  # the state of bucket b sits at [..., b]
        if len(leaf.shape) == 1 and b is not None and b < fp.n_buckets and leaf.shape[0] == fp.shard_size(b):
            return bucket_sh[b]
        raise ConfigError(
            f"zero.path=flat: optimizer state leaf {jax.tree_util.keystr(path)} of shape {leaf.shape} is neither a "
            "scalar nor shaped like a buffer shard; use zero.path=spec"
        )

    inner_sh = jax.tree_util.tree_map_with_path(sharding, jax.eval_shape(inner.init, shards))
    keep_main = quantized or keeps_main_params(jax.tree.leaves(fp.plan.tensors))
    return ZeroState(
        bucket_sh if keep_main else None, inner_sh, None if loss_scale is None else scaler.shardings(mesh)
    )


def _specs(shardings: PyTree) -> PyTree:
    return jax.tree.map(lambda s: s.spec, shardings)


def build_flat_step(
    loss_fn: LossFn,
    inner: optax.GradientTransformation,
    fp: FlatPlan,
    *,
    clip_grad: float | None = None,
    groups: PyTree | None = None,
    microbatches: int = 1,
    grad_reduce_dtype=jnp.float32,
    has_aux: bool = False,
    loss_scale: DynamicLossScale | None = None,
    param_gather_dtype: ParamGatherDType | None = None,
    offload: Offload | None = None,
) -> FlatStep:
    """The flat path's shardings, optimizer init, jitted step and grads.

    Args:
      loss_fn: (params, local batch) -> mean loss, on tp- and ep-local params; if a tp spec
        splits any param it is called with `tp_axis=` the mesh's tp axis and must sum its
        row-parallel outputs over it (Megatron's `g` operator); if some param is split over
        ep (expert weights) also with `ep_axis=` the mesh's ep axis, over which it sends
        tokens to their experts' ranks and back.
      inner: an element-wise optax transformation (`build.build_zero` checks it with `probe.check_elementwise`).
      groups: per param a `groups.ParamGroup`, or None.
      loss_scale: fp16's dynamic loss scaling (`loss_scale.py`; `build.build_zero`).
      param_gather_dtype: all-gather the updated shards blockwise-quantized to this dtype
        (`quantize.gather_quantized`) instead of in the param dtype; None: the param dtype.
      offload: the buckets whose state lives in host memory between steps (`offload.flat_offload`),
        or None; the step copies them to device memory around the update.
    """
    mesh, plan = fp.plan.mesh, fp.plan
    tensors = jax.tree.leaves(plan.tensors)
    treedef = jax.tree.structure(plan.tensors)
    dtypes = [t.dtype for t in tensors]
    param_specs = _specs(plan.param_shardings())
    opt_sh = opt_state_shardings(inner, fp, loss_scale, quantized=param_gather_dtype is not None)
    host_opt_sh = opt_sh if offload is None else offload.shardings(opt_sh)
    shardings = TrainState(plan.param_shardings(), host_opt_sh, NamedSharding(mesh, P()))
    opt_specs = _specs(opt_sh)
    reduce_specs = fp.bucket_specs()  # the reduced grads: sharded unless no_shard
    scale = 1.0 / (fp.d * microbatches)  # the dense DP size, for expert grads too (Megatron's)
    keep_main = opt_sh.main_params is not None
    axis_kwargs = {"tp_axis": TP_AXIS} if any(TP_AXIS in spec_axes(t.tp_spec) for t in tensors) else {}
    if plan.splits_ep:
        axis_kwargs["ep_axis"] = EP_AXIS
    group_list = None if groups is None else group_leaves(groups)
    loss_metrics = with_metrics(loss_fn, has_aux)

    def reduce_one(buf, g):
        """A bucket's DP reduction: psum_scatter over the inner DP axes, then (HSDP) across dp_outer a
        psum_scatter if the state is split there too, else a psum; a psum over all of DP under DDP."""
        if not buf.sharded:
            return jax.lax.psum(g, buf.dp_axes)
        g = jax.lax.psum_scatter(g, buf.inner_axes, scatter_dimension=0, tiled=True)
        if not buf.outer_axes:
            return g
        if set(buf.outer_axes) <= set(buf.shard_axes):
            return jax.lax.psum_scatter(g, buf.outer_axes, scatter_dimension=0, tiled=True)
        return jax.lax.psum(g, buf.outer_axes)

    def reduce(buckets):
        return [reduce_one(buf, g) for (buf, _), g in zip(fp.buckets, buckets)]

    def gather(buf, m):
        """Inverse of the sharded reduction's layout: across dp_outer (if split there), then inner."""
        if not buf.sharded:
            return m
        if set(buf.outer_axes) & set(buf.shard_axes):
            m = jax.lax.all_gather(m, buf.outer_axes, tiled=True)
        return jax.lax.all_gather(m, buf.inner_axes, tiled=True)

    def local_grad_buckets(params, mb, loss_scale):
        # Params are invariant over their DP domain; differentiating them directly would make AD
        # insert the DP all-reduce itself (the transpose of the implicit cast to varying). Casting
        # them to DP-varying first gives this rank's local grads, which the buckets then reduce.
        # (An expert param already varies over ep, its only batch axis outside its DP domain.)
        leaves = [jax.lax.pcast(p, t.dp_axes, to="varying") for p, t in zip(jax.tree.leaves(params), tensors)]
        params = jax.tree.unflatten(treedef, leaves)
        (_, (loss, metrics)), g = jax.value_and_grad(scaled_loss(loss_metrics, loss_scale), has_aux=True)(
            params, mb, **axis_kwargs
        )
        g = [(x.astype(jnp.float32) * scale).astype(grad_reduce_dtype) for x in jax.tree.leaves(g)]
        return (loss, metrics), flatten(fp, g, grad_reduce_dtype)

    def rank_microbatches(batch):  # this rank's rows -> its microbatches [M, b, ...]
        return jax.tree.map(lambda x: x[:, 0], split_batch(batch, 1, microbatches))

    def grads_body(params, batch, loss_scale=None):
        """Reduced grad buckets: the owned shards [1, S_b/d], full [1, S_b] under DDP (of the loss
        times `loss_scale`, if given)."""
        mbs = rank_microbatches(batch)
        # The first microbatch seeds the accumulator (so it has the carry's sharding type).
        first, rest = jax.tree.map(lambda x: x[0], mbs), jax.tree.map(lambda x: x[1:], mbs)
        means, acc = local_grad_buckets(params, first, loss_scale)
        if plan.shards_grads:  # reduce-scatter every microbatch: only the owned shard accumulates
            acc = reduce(acc)

        def body(acc, mb):
            means, g = local_grad_buckets(params, mb, loss_scale)
            return [a + x for a, x in zip(acc, reduce(g) if plan.shards_grads else g)], means

        if microbatches > 1:
            acc, rest_means = jax.lax.scan(body, acc, rest)
            means = jax.tree.map(lambda m, r: (m + r.sum()) / microbatches, means, rest_means)
        red = acc if plan.shards_grads else reduce(acc)  # DDP / ZeRO-1: reduce once, after the last
        return jax.lax.pmean(means, BATCH_AXES), [r[None] for r in red]

    grads_fn = jax.shard_map(
        grads_body,
        mesh=mesh,
        in_specs=(param_specs, P(BATCH_AXES), P()),
        out_specs=((P(), P()), reduce_specs),
    )

    def bucket_ranks():
        """Per plan bucket, this device's rank in that bucket's DP domain."""
        ranks = {buf.kind: jax.lax.axis_index(buf.shard_axes) for buf in fp.buffers}
        return [ranks[buf.kind] for buf, _ in fp.buckets]

    def on_shards(per_param, ranks):
        return [values_on_shard(buf, b, per_param, r) for (buf, b), r in zip(fp.buckets, ranks)]

    def global_norm(grads, ranks):
        """Every element once across dp, ep and tp: each bucket's sums of squares (its tp-split and
        its tp-replicated elements apart) summed over the axes its elements are distinct on."""
        squares: dict[tuple[str, ...], jax.Array] = {}
        for (buf, _), g, split in zip(fp.buckets, grads, on_shards(fp.tp_sharded, ranks)):
            for weight, axes in ((split, buf.norm_axes(tp_split=True)), (1 - split, buf.norm_axes(tp_split=False))):
                squares[axes] = squares.get(axes, 0.0) + jnp.sum(g * g * weight)
        return jnp.sqrt(sum(jax.lax.psum(sq, axes) if axes else sq for axes, sq in squares.items()))

    def update_body(params, opt_state, grads):
        ranks = bucket_ranks()
        grads = [g[0].astype(jnp.float32) for g in grads]
        if loss_scale is not None:
            grads = scaler.unscale(grads, opt_state.grad_scaler.loss_scale)
            # One flag for the whole step: any inf/nan on any rank (pmax over every mesh axis).
            local = scaler.found_inf(grads).astype(jnp.int32)
            skip = jax.lax.pmax(local, tuple(mesh.axis_names)) > 0
        norm = global_norm(grads, ranks)
        if clip_grad is not None:
            coeff = clip_coefficient(norm, clip_grad)
            grads = [g * coeff for g in grads]
        if keep_main:
            main = [m[0] for m in opt_state.main_params]
        else:
            full = flatten(fp, jax.tree.leaves(params), jnp.float32)
            main = [owned(buf, x, r) for (buf, _), x, r in zip(fp.buckets, full, ranks)]
        values = None
        if group_list is not None:
            values = GroupValues(
                on_shards([g.lr_mult for g in group_list], ranks), on_shards([g.wd_mult for g in group_list], ranks)
            )
        inner_state = jax.tree.map(lambda x: x[0] if x.ndim else x, opt_state.inner_state)
        updates, inner_state = inner_update(inner, grads, inner_state, main, values)
        main = optax.apply_updates(main, updates)
        # All-gather each updated bucket in the param dtype (or quantized) over its DP domain, back into the params.
        if param_gather_dtype is None:
            local = model_copy(main, [dtypes[0]] * fp.n_buckets)
            gathered = [gather(buf, m) for (buf, _), m in zip(fp.buckets, local)]
        else:
            gathered = [
                gather_quantized(m, functools.partial(gather, buf), param_gather_dtype, dtypes[0])
                for (buf, _), m in zip(fp.buckets, main)
            ]
        new_params = jax.tree.unflatten(treedef, unflatten(fp, gathered, dtypes))
        inner_state = jax.tree.map(lambda x: x[None] if x.ndim else x, inner_state)
        new_main = [m[None] for m in main] if keep_main else None
        new_state = ZeroState(new_main, inner_state)
        if loss_scale is None:
            return new_params, new_state, {"grad_norm": norm}
        return scaler.guard_step(loss_scale, skip, norm, params, opt_state, new_params, new_state)

    # check_vma=False: the output params of tp-replicated tensors are identical on every tp
    # rank by construction (their grads were summed over tp above), which vma typing
    # cannot see through the concatenated buffer. Gradients are taken in grads_fn,
    # which keeps check_vma on (docs/xla.md, "shard_map and check_vma").
    update_fn = jax.shard_map(
        update_body,
        mesh=mesh,
        in_specs=(param_specs, opt_specs, reduce_specs),
        out_specs=(param_specs, opt_specs, P()),
        check_vma=False,
    )

    def init_body(params):
        full = flatten(fp, jax.tree.leaves(params), jnp.float32)
        main = [owned(buf, x, r) for (buf, _), x, r in zip(fp.buckets, full, bucket_ranks())]
        inner_state = jax.tree.map(lambda x: x[None] if x.ndim else x, inner.init(main))
        grad_scaler = None if loss_scale is None else scaler.init(loss_scale)
        return ZeroState([m[None] for m in main] if keep_main else None, inner_state, grad_scaler)

    init_opt = jax.shard_map(init_body, mesh=mesh, in_specs=(param_specs,), out_specs=opt_specs, check_vma=False)

    def step(state: TrainState, batch):
        grad_scaler = state.opt_state.grad_scaler
        (loss, metrics), grads = grads_fn(state.params, batch, None if grad_scaler is None else grad_scaler.loss_scale)
        opt_state = state.opt_state
        if offload is not None:
            opt_state, grads = offload.to_device(opt_state, after=grads)
        params, opt_state, opt_metrics = update_fn(state.params, opt_state, grads)
        opt_state = opt_state if offload is None else offload.to_host(opt_state)
        return TrainState(params, opt_state, state.step + 1), {"loss": loss, **opt_metrics, **metrics}

    replicated = NamedSharding(mesh, P())
    step_jit = jax.jit(
        step,
        in_shardings=(shardings, batch_sharding(mesh)),
        out_shardings=(shardings, replicated),
        donate_argnums=0,
    )
    grads_jit = jax.jit(
        lambda params, batch: grads_fn(params, batch, None),
        in_shardings=(shardings.params, batch_sharding(mesh)),
        out_shardings=((replicated, replicated), [NamedSharding(mesh, spec) for spec in reduce_specs]),
    )

    def eval_body(params, batch):
        """The step's loss and metrics without grads: each microbatch's on this rank, averaged over DP."""
        loss, metrics = jax.lax.map(lambda mb: loss_metrics(params, mb, **axis_kwargs), rank_microbatches(batch))
        return jax.lax.pmean({"loss": jnp.mean(loss), **jax.tree.map(jnp.mean, metrics)}, BATCH_AXES)

    eval_fn = jax.shard_map(eval_body, mesh=mesh, in_specs=(param_specs, P(BATCH_AXES)), out_specs=P())
    eval_jit = jax.jit(eval_fn, in_shardings=(shardings.params, batch_sharding(mesh)), out_shardings=replicated)
    return FlatStep(shardings, init_opt, step_jit, lambda params, batch: grads_jit(params, batch)[1], eval_jit)
