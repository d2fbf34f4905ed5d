"""The flat layout (`zero.path: flat`): Megatron's flat buffers, bucketed psum_scatter / all_gather in shard_map.

Per bucket of the flat buffers (`plan.py`), over that bucket's DP domain (dp_outer x dp x ep
for a dense bucket, dp_outer x dp for an expert bucket; the collectives are `collectives.py`'s):

  ZeRO-2 (optim_grads): psum_scatter every microbatch; rank r of the domain keeps its
      shard `[r*S/d, (r+1)*S/d)`, so only the shard is ever accumulated.
  HSDP (dp_outer > 1): the psum_scatter runs over the inner DP axes, then a psum across
      dp_outer (outer_strategy no_shard: d = the inner size) or a second psum_scatter there
      (optim: rank r = inner rank x dp_outer + outer rank); the updated shards are
      all-gathered back in the reverse order.
  ZeRO-1 (optim): the full local bucket accumulates over microbatches (Megatron's
      grad buffer), then one psum_scatter after the last: DDP's wire bytes.
  DDP (no_shard): the full local bucket accumulates, then one psum.
  ZeRO-3 (optim_grads_params): as ZeRO-2, and the params rest as bucket shards, gathered per unit.

Where the stage reduces per unit (`Stage.per_unit`) the buffers are per FSDP unit and each bucket is
reduced inside the backward; otherwise one layout covers the whole model and every bucket is reduced
after the backward (`grads.py`).

Expert grads need no reduction over ep: the loss moves tokens to the experts' ranks and
back (all_to_all over ep), so a rank's expert grads already hold every ep rank's tokens.
Every grad, dense and expert, is scaled by 1 / (dense DP size x microbatches), as Megatron does.

The inner optax transformation steps on the owned fp32 shards, with the param groups'
multipliers laid out like them (`local.values_on_shard`), by the update both paths share
(`common/update.py`); the updated shards are cast to the param dtype and all_gathered per bucket
back into the params (with `param_gather_dtype`: quantized blockwise to one byte and gathered with
their scales, `quantize.py`), or, where the params rest sharded, kept as the param dtype's shards
(across dp_outer gathered first under HSDP `optim`). Only element-wise transformations mean the
same on a shard as on the params: `common/probe.check_elementwise` refuses the others when
`build.build_zero` builds the step.

`FlatProgram` holds the per-device programs (each runs inside a shard_map over the whole mesh);
`flat_layout` wraps them in shard_map for the engine (`engine.py`). Shardings: `state.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.mesh import BATCH_AXES, EP_AXIS, TP_AXIS, spec_axes
from jzero.zero.common import loss_scale as scaler
from jzero.zero.common import spike
from jzero.zero.common.batch import split_batch
from jzero.zero.common.groups import GroupValues, group_leaves
from jzero.zero.common.probe import check_elementwise
from jzero.zero.common.state import TrainState, ZeroState, loss_parts, model_state_shardings
from jzero.zero.common.update import finish, kept_main, model_copy, optimizer_step
from jzero.zero.config import ParamGatherDType, StepOptions
from jzero.zero.engine import Layout, LayoutInputs
from jzero.zero.flat import collectives, grads, state
from jzero.zero.flat.convert import flat_to_model_space, model_space_to_flat
from jzero.zero.flat.local import flatten, from_local, owned, to_local, unflatten
from jzero.zero.flat.offload import flat_offload
from jzero.zero.flat.plan import FlatPlan, make_flat_plan
from jzero.zero.flat.quantize import gather_quantized

PyTree = Any


def _specs(shardings: PyTree) -> PyTree:
    return jax.tree.map(lambda s: s.spec, shardings)


def _squeeze(fp: FlatPlan, tree: PyTree) -> PyTree:
    """A per-bucket state tree as shard_map hands it to one device, [1, S] ([L, 1, S]) per bucket -> [S]
    ([L, S]); scalars as they are. A leaf's bucket is its index in its list."""
    return jax.tree_util.tree_map_with_path(lambda path, x: to_local(fp.buckets[path[-1].idx][0], x) if x.ndim else x,
                                            tree)  # fmt: skip


def _unsqueeze(fp: FlatPlan, tree: PyTree) -> PyTree:
    return jax.tree_util.tree_map_with_path(lambda path, x: from_local(fp.buckets[path[-1].idx][0], x) if x.ndim else x,
                                            tree)  # fmt: skip


def _outer_part(buf, x: jax.Array) -> jax.Array:
    """This rank's owned [S_b/d] of its [S_b/d_inner] part of a bucket (its dp_outer rank's slice under
    HSDP `optim`; all of it otherwise)."""
    if buf.d == buf.d_inner or not buf.sharded:
        return x
    size = x.shape[-1] // (buf.d // buf.d_inner)
    rank = jax.lax.axis_index(tuple(a for a in buf.shard_axes if a not in buf.inner_axes))
    return jax.lax.dynamic_slice_in_dim(x, rank * size, size, axis=x.ndim - 1)


@dataclasses.dataclass(frozen=True)
class FlatProgram:
    """The flat path's per-device programs; each runs inside a shard_map over the whole mesh.

    Attributes:
      loss_fn: the user's loss, as (params, batch, model_state, **axes) -> (loss, metrics, stats)
        (`state.loss_parts`).
      inner: the element-wise optax transformation stepped on the owned shards.
      fp: the flat buffers.
      options: microbatches, grad reduce dtype, clipping, loss scaling.
      groups: per param its `ParamGroup` (leaves order), or None.
      gather_dtype: the quantized param all-gather's dtype, or None.
      keep_main: whether the state holds fp32 main params (`state.keeps_main_params`).
      axis_kwargs: the mesh axes the loss is told of: `tp_axis` if tp splits a param, `ep_axis`
        if ep does.
      reshard_after_forward: ZeRO-3 gathers a unit's buckets again for its backward.
    """

    loss_fn: Callable
    inner: optax.GradientTransformation
    fp: FlatPlan
    options: StepOptions
    groups: tuple | None
    gather_dtype: ParamGatherDType | None
    keep_main: bool
    axis_kwargs: dict
    reshard_after_forward: bool = True

    @property
    def tensors(self) -> list:
        return jax.tree.leaves(self.fp.plan.tensors)

    @property
    def param_dtype(self):
        return self.tensors[0].dtype  # the flat path holds one param dtype (`plan.make_flat_plan`)

    def local_params(self, params: PyTree) -> PyTree:
        """The state's params as one device uses them: the params tree, or the resting bucket shards [S_b/d_inner]."""
        if not self.fp.plan.stage.params_rest_sharded:
            return params
        return [to_local(buf, x) for (buf, _), x in zip(self.fp.buckets, params)]

    def rank_microbatches(self, batch: PyTree) -> PyTree:
        """This rank's rows -> its microbatches [M, b, ...]."""
        return jax.tree.map(lambda x: x[:, 0], split_batch(batch, 1, self.options.microbatches))

    def grads(self, params: PyTree, batch: PyTree, loss_scale: jax.Array | None = None, model_state: PyTree = None):
        """((loss, metrics) averaged over DP and microbatches, the stats summed over them, the reduced
        grad buckets): the owned shards [1, S_b/d], full [1, S_b] under DDP (of the loss times
        `loss_scale`, if given).

        Each bucket is reduced by its hook as soon as its grads are complete (`grads.scheduled_grads`).
        """
        return grads.scheduled_grads(self, self.local_params(params), batch, loss_scale, model_state)

    def main_shards(self, params: PyTree, opt_state: ZeroState, ranks) -> list[jax.Array]:
        """The fp32 main params this rank steps: the kept ones, or its shards of the fp32 params."""
        if self.keep_main:
            return [to_local(buf, m) for (buf, _), m in zip(self.fp.buckets, opt_state.main_params)]
        if self.fp.plan.stage.params_rest_sharded:
            return self.resting_main(params)
        full = flatten(self.fp, jax.tree.leaves(params), jnp.float32)
        return [owned(buf, x, r) for (buf, _), x, r in zip(self.fp.buckets, full, ranks)]

    def resting_main(self, params: PyTree) -> list[jax.Array]:
        """This rank's owned fp32 shards of params resting as bucket shards (`Stage.params_rest_sharded`)."""
        local = self.local_params(params)
        return [_outer_part(buf, x.astype(jnp.float32)) for (buf, _), x in zip(self.fp.buckets, local)]

    def group_values(self, ranks) -> GroupValues | None:
        if self.groups is None:
            return None
        return GroupValues(
            collectives.on_shards(self.fp, [g.lr_mult for g in self.groups], ranks),
            collectives.on_shards(self.fp, [g.wd_mult for g in self.groups], ranks),
        )

    def new_params(self, params: PyTree, main: list[jax.Array]) -> PyTree:
        """The model params from the updated main shards: where they rest sharded, each bucket's shard in the
        param dtype (gathered across dp_outer under HSDP `optim`); else all-gathered whole (`gather_params`)."""
        fp, dtype = self.fp, self.param_dtype
        if not fp.plan.stage.params_rest_sharded:
            return jax.tree.unflatten(jax.tree.structure(params), self.gather_params(main))
        gather = collectives.gather_outer
        return [from_local(buf, gather(buf, m.astype(dtype))) for (buf, _), m in zip(fp.buckets, main)]

    def gather_params(self, main: list[jax.Array]) -> list[jax.Array]:
        """All-gather each updated bucket shard over its DP domain in the param dtype (or quantized,
        `quantize.gather_quantized`) into the local params (leaves order)."""
        fp, dtype = self.fp, self.param_dtype
        if self.gather_dtype is None:
            local = model_copy(main, [dtype] * fp.n_buckets)
            gathered = [collectives.gather_bucket(buf, m) for (buf, _), m in zip(fp.buckets, local)]
        else:
            gathered = [
                gather_quantized(m, functools.partial(collectives.gather_bucket, buf), self.gather_dtype, dtype)
                for (buf, _), m in zip(fp.buckets, main)
            ]
        return unflatten(fp, gathered, [t.dtype for t in self.tensors])

    def update(self, params: PyTree, opt_state: ZeroState, grads: list[jax.Array]):
        """The optimizer step on this rank's shards (`update.optimizer_step`), then the new params
        (`new_params`): (new params, new ZeroState, metrics)."""
        fp, o = self.fp, self.options
        ranks = collectives.bucket_ranks(fp)
        mesh_axes = tuple(fp.plan.mesh.axis_names)
        state_ = opt_state._replace(inner_state=_squeeze(fp, opt_state.inner_state))
        g32 = [to_local(buf, g).astype(jnp.float32) for (buf, _), g in zip(fp.buckets, grads)]
        main = self.main_shards(params, opt_state, ranks)
        step = optimizer_step(
            self.inner, g32, main, state_,
            global_norm=lambda g: collectives.global_norm(fp, g, ranks),
            nonfinite=lambda g: collectives.any_nonfinite(g, mesh_axes),
            clip_grad=o.clip_grad, loss_scale=o.loss_scale, groups=self.group_values(ranks),
        )  # fmt: skip
        if self.keep_main:  # (fp32 params: `finish` selects the params themselves)
            main = kept_main(o.loss_scale, step, opt_state, main, o.skip_nonfinite, o.spike_guard)
        else:
            main = step.main
        new_main = [from_local(buf, m) for (buf, _), m in zip(fp.buckets, main)] if self.keep_main else None
        new_state = ZeroState(new_main, _unsqueeze(fp, step.inner_state))
        new_params = self.new_params(params, main)
        return finish(o.loss_scale, step, params, opt_state, new_params, new_state, o.skip_nonfinite, o.spike_guard)

    def init(self, params: PyTree) -> ZeroState:
        """The optimizer state from the state's params: this rank's fp32 shards and the inner state on them."""
        fp = self.fp
        if fp.plan.stage.params_rest_sharded:
            main = self.resting_main(params)
        else:
            full = flatten(fp, jax.tree.leaves(params), jnp.float32)
            main = [owned(buf, x, r) for (buf, _), x, r in zip(fp.buckets, full, collectives.bucket_ranks(fp))]
        loss_scale, spike_guard = self.options.loss_scale, self.options.spike_guard
        grad_scaler = None if loss_scale is None else scaler.init(loss_scale)
        history = None if spike_guard is None else spike.init(spike_guard)
        kept = [from_local(buf, m) for (buf, _), m in zip(fp.buckets, main)] if self.keep_main else None
        return ZeroState(kept, _unsqueeze(fp, self.inner.init(main)), grad_scaler, history)

    def evaluate(self, params: PyTree, batch: PyTree, model_state: PyTree = None) -> dict:
        """The step's loss and metrics without grads: each microbatch's on this rank, averaged over DP
        (where the params rest sharded, each unit's gathered as the step's forward does)."""
        if self.fp.plan.stage.params_rest_sharded:
            view = grads.evaluate_view(self, self.local_params(params))
        else:
            view = params
        run = lambda mb: self.loss_fn(view, mb, model_state, **self.axis_kwargs)[:2]  # noqa: E731
        loss, metrics = jax.lax.map(run, self.rank_microbatches(batch))
        return jax.lax.pmean({"loss": jnp.mean(loss), **jax.tree.map(jnp.mean, metrics)}, BATCH_AXES)


def _program(inputs: LayoutInputs, fp: FlatPlan, keep_main: bool) -> FlatProgram:
    options, zero, groups = inputs.options, inputs.config, inputs.groups
    tensors = jax.tree.leaves(fp.plan.tensors)
    axis_kwargs = {"tp_axis": TP_AXIS} if any(TP_AXIS in spec_axes(t.tp_spec) for t in tensors) else {}
    if fp.plan.splits_ep:
        axis_kwargs["ep_axis"] = EP_AXIS
    return FlatProgram(
        loss_parts(inputs.loss_fn, options.has_aux, inputs.model_state), inputs.inner, fp, options,
        None if groups is None else tuple(group_leaves(groups)), zero.param_gather_dtype, keep_main, axis_kwargs,
        reshard_after_forward=zero.reshard_after_forward,
    )  # fmt: skip


def flat_layout(inputs: LayoutInputs) -> Layout:
    """The flat layout of a run (module docstring): Megatron's buffers of `inputs.plan`, its shardings, and
    `FlatProgram`'s per-device programs in shard_map over the whole mesh.

    The loss (`LayoutInputs.loss_fn`) runs on tp- and ep-local params: if a tp spec splits any param it
    is called with `tp_axis=` the mesh's tp axis and must sum its row-parallel outputs over it
    (Megatron's `g` operator); if some param is split over ep (expert weights) also with `ep_axis=` the
    mesh's ep axis, over which it sends tokens to their experts' ranks and back. The inner transformation
    must be element-wise (`probe.check_elementwise` refuses the others, naming them). The model state's
    stats are summed over the ranks (psum) and micro-batches.
    """
    plan, inner, options, zero = inputs.plan, inputs.inner, inputs.options, inputs.config
    fp = make_flat_plan(plan, zero.bucket_size, zero.pad_for_high_nccl_busbw, inputs.unit_key)
    check_elementwise(inner, plan, inputs.groups)  # before any layout of its state: the error names it
    mesh = plan.mesh
    opt_sh = state.opt_state_shardings(
        inner, fp, options.loss_scale, quantized=zero.param_gather_dtype is not None, spike_guard=options.spike_guard
    )
    offload = flat_offload(fp, inner, opt_sh, zero.offload_fraction)
    replicated = NamedSharding(mesh, P())
    shardings = TrainState(
        state.param_shardings(fp), offload.shardings(opt_sh), replicated,
        model_state_shardings(inputs.model_state, replicated),
    )  # fmt: skip
    program = _program(inputs, fp, opt_sh.main_params is not None)
    param_specs, opt_specs, reduce_specs = _specs(shardings.params), _specs(opt_sh), fp.bucket_specs()
    grads_fn = jax.shard_map(
        program.grads, mesh=mesh, in_specs=(param_specs, P(BATCH_AXES), P(), P()),
        out_specs=((P(), P(), P()), reduce_specs),
    )  # fmt: skip
    # check_vma=False: the output params of tp-replicated tensors are identical on every tp
    # rank by construction (their grads were summed over tp above), which vma typing
    # cannot see through the concatenated buffer. Gradients are taken in grads_fn,
    # which keeps check_vma on (docs/xla.md, "shard_map and check_vma").
    update_fn = jax.shard_map(
        program.update, mesh=mesh, in_specs=(param_specs, opt_specs, reduce_specs),
        out_specs=(param_specs, opt_specs, P()), check_vma=False,
    )  # fmt: skip
    init_opt = jax.shard_map(program.init, mesh=mesh, in_specs=(param_specs,), out_specs=opt_specs, check_vma=False)
    eval_fn = jax.shard_map(
        program.evaluate, mesh=mesh, in_specs=(param_specs, P(BATCH_AXES), P()), out_specs=P()
    )

    def grad_buffer(dtype) -> list:
        specs = fp.bucket_specs(sharded=plan.stage.shards_grads)
        return [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
                for shape, spec in zip(fp.bucket_shapes(), specs)]  # fmt: skip

    rest_sharded = plan.stage.params_rest_sharded
    return Layout(
        shardings=shardings,
        grad_shardings=[NamedSharding(mesh, spec) for spec in reduce_specs],
        init_opt=init_opt,
        grads=grads_fn,
        update=update_fn,
        evaluate=eval_fn,
        offload=offload,
        grad_buffer=grad_buffer,
        to_state=functools.partial(state.from_model_params, fp) if rest_sharded else None,
        to_model=functools.partial(state.to_model_params, fp) if rest_sharded else None,
        to_model_space=functools.partial(flat_to_model_space, fp, inner),
        from_model_space=functools.partial(model_space_to_flat, fp, inner),
        flat=fp,
    )
