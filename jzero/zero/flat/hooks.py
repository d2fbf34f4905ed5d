"""The flat path's FSDP units: each bucket of a unit materialized, and its grads reduced, inside the step.

Inside the flat step's shard_map the loss gets each unit's params as one `units.GroupParam` (the
unit's buckets) at its first param and `units.GroupRef`s at the others; `units.unit` materializes
the unit's buckets when it runs, each through a `units.UnitParam` whose `BucketHook` is the
bucket's Megatron layout (`plan.FlatBuffer`). The params in no unit (the rest group) are
materialized before the loss runs. Per bucket b (one layer's, for a scanned stack: the layer loop
slices the [L, ...] arrays):

  forward:  PARAMS: the bucket's params as they rest whole (tp-local), cast to DP-varying;
            SHARD: this rank's [S_b/d_inner] part, all-gathered over the inner DP axes into the
            bucket [S_b] (param dtype), cut into its params;
            BUCKET: the whole bucket an earlier micro-batch gathered, cut into its params.
  backward: the params' grads, scaled by 1 / (d x M) in fp32 and cast to the grad reduce dtype,
            laid into the bucket (zero in the gaps), the carry added (DDP/ZeRO-1's last micro-batch),
            then `collectives.reduce_bucket` (psum_scatter over the inner axes, then across dp_outer,
            or DDP's psum) into the sink: the owned [S_b/d] shard ([S_b] under DDP). A phase that
            only accumulates gives the sink this rank's own [S_b], unscaled in the param dtype (the
            step scales it into the accumulator: `units.scale_grad`).

Types (shard_map's varying-manual-axes check, which the loss's tp collectives need): the
materialized params vary over every DP axis and over tp exactly when their tp spec names it, as the
loss gets them without units. A param tp does not split comes out of a gathered bucket varying over
tp (the bucket's rows are per tp rank), so it is made tp-invariant by a psum over tp of tp rank 0's
copy (identical on every tp rank; norm scales and biases: a few KiB). Grads are cast to vary over
every mesh axis before their reduction, so a sink varies over every axis but those its reduction
sums over (`sink_axes`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jzero.mesh import AXES, TP_AXIS, spec_axes
from jzero.zero.common.units import GroupParam, GroupRef, UnitHook, UnitParam, materialize_all, scale_grad
from jzero.zero.flat import collectives
from jzero.zero.flat.local import bucket_of
from jzero.zero.flat.plan import REST, FlatBuffer, FlatPlan

PyTree = Any


class Mode(enum.Enum):
    """What a bucket's value is, as its hook gathers it (module docstring)."""

    PARAMS = "params"  # the bucket's params as they rest whole
    SHARD = "shard"  # this rank's part of the bucket, gathered over the inner DP axes
    BUCKET = "bucket"  # the whole bucket, which an earlier micro-batch gathered


def _varying(x: jax.Array, axes) -> jax.Array:
    """`x` cast to vary over `axes` too (it must vary over none of them: a wrong assumption about its type
    fails here, at trace time)."""
    return jax.lax.pcast(x, tuple(axes), to="varying") if axes else x


def sink_axes(buf: FlatBuffer, reduce: bool) -> tuple[str, ...]:
    """The axes a sink of `buf` varies over: every axis but those its reduction sums over."""
    summed = collectives.summed_axes(buf) if reduce else ()
    return tuple(a for a in AXES if a not in summed)


def _tp_invariant(x: jax.Array) -> jax.Array:
    """A value identical on every tp rank but typed tp-varying -> the same value, tp-invariant."""
    mine = jnp.where(jax.lax.axis_index(TP_AXIS) == 0, x, jnp.zeros_like(x))
    return jax.lax.psum(mine, TP_AXIS)


@dataclasses.dataclass(frozen=True)
class BucketHook(UnitHook):
    """What one bucket of a unit does in the step (module docstring); static and hashable.

    buf, b: the buffer and its bucket. mode: its `Mode`. shapes, dtypes: its params'
    one-layer local shapes and dtypes, in the bucket's order. tp_named: per param, whether its tp
    spec names tp (it stays tp-varying). dp_axes: per param, its DP domain (a PARAMS value enters
    invariant over it). scale: 1 / (dense DP size x micro-batches). reduce: reduce over DP; False: the
    sink gets this rank's own grads. extract, keep, reshard, probe: `units.Hook`'s.
    """

    buf: FlatBuffer
    b: int
    mode: Mode
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    tp_named: tuple[bool, ...]
    dp_axes: tuple[tuple[str, ...], ...]
    scale: float
    reduce_dtype: str
    reduce: bool = True
    extract: bool = False
    keep: bool = False
    reshard: bool = False
    probe: bool = False

    def gather(self, value):
        if self.mode == Mode.PARAMS:
            return tuple(value)
        if self.mode == Mode.BUCKET:  # a gsink's cotangent: varies over every axis already
            return value
        # The resting shard enters varying over its spec's axes (rows: model axes; columns: inner DP), and
        # all_gather keeps that: the whole bucket, identical over the inner axes, is typed as varying there.
        full = collectives.gather_inner(self.buf, value)
        return _varying(full, [a for a in AXES if a not in self.buf.model_axes + self.buf.inner_axes])

    def split(self, full) -> tuple:
        if self.mode == Mode.PARAMS:  # as the loss gets them without units: DP-varying (this rank's grads)
            return tuple(_varying(x.astype(d), dp) for x, d, dp in zip(full, self.dtypes, self.dp_axes))
        start = self.buf.layout.bucket_indices[self.b][0]
        spans = [self.buf.layout.param_index_map[j][:2] for j in self.buf.layout.bucket_params[self.b]]
        xs = [full[ps - start : pe - start].reshape(s).astype(d) for (ps, pe), s, d in zip(spans, self.shapes,
                                                                                            self.dtypes)]  # fmt: skip
        return tuple(x if named else _tp_invariant(x) for x, named in zip(xs, self.tp_named))

    def join(self, params: tuple):
        """`split`'s inverse for a gathered bucket (SHARD): its params laid back in, zero in the gaps, typed
        as `gather` types the bucket (varying over every axis)."""
        tp = [() if named else (TP_AXIS,) for named in self.tp_named]
        return bucket_of(self.buf, self.b, [_varying(x, axes) for x, axes in zip(params, tp)], params[0].dtype)

    def reduce_grads(self, grads: tuple, acc):
        # A grad varies as its param: over DP, and over tp where tp splits it; laid into the bucket
        # (whose rows are per tp rank) every one varies over tp.
        tp = [() if named else (TP_AXIS,) for named in self.tp_named]
        if not self.reduce:  # only accumulates: unscaled, in the param dtype (`units.UnitParam`'s sink)
            return bucket_of(self.buf, self.b, [_varying(g, axes) for g, axes in zip(grads, tp)], grads[0].dtype)
        scaled = [_varying(scale_grad(g, self.scale, self.reduce_dtype), axes) for g, axes in zip(grads, tp)]
        g = bucket_of(self.buf, self.b, scaled, self.reduce_dtype)
        if acc is not None:
            g = acc + g
        return collectives.reduce_bucket(self.buf, g)

    def reduce_acc(self, acc):
        """The carry alone, reduced as `reduce_grads` reduces it with the grads (`units.micro_batch_loss`)."""
        return collectives.reduce_bucket(self.buf, acc)


def bucket_hooks(fp: FlatPlan, mode: str, scale: float, reduce_dtype, **flags) -> list[BucketHook]:
    """Per plan bucket its `BucketHook` (`flags`: reduce, extract, keep, reshard)."""
    tensors = jax.tree.leaves(fp.plan.tensors)
    hooks = []
    for buf, b in fp.buckets:
        idx = [buf.params[j] for j in buf.layout.bucket_params[b]]
        hooks.append(BucketHook(
            buf, b, mode, tuple(fp.layer_shape(i) for i in idx), tuple(tensors[i].dtype.name for i in idx),
            tuple(TP_AXIS in _named(tensors[i].tp_spec) for i in idx), tuple(tensors[i].dp_axes for i in idx),
            scale, jnp.dtype(reduce_dtype).name, **flags,
        ))  # fmt: skip
    return hooks


def _named(spec) -> set[str]:
    return set(spec_axes(spec))


def bucket_values(fp: FlatPlan, mode: str, params: PyTree) -> list:
    """Per plan bucket, what its hook gathers in `mode`: PARAMS: its params (from the model-shaped local
    `params`); SHARD, BUCKET: `params` is already the per-bucket list (resting shards, or gathered buckets)."""
    if mode != Mode.PARAMS:
        return list(params)
    leaves = jax.tree.leaves(params)
    return [tuple(leaves[buf.params[j]] for j in buf.layout.bucket_params[b]) for buf, b in fp.buckets]


def flat_view(fp: FlatPlan, treedef, buckets: Sequence[UnitParam]) -> PyTree:
    """The params as the loss takes them (module docstring), from one `UnitParam` per plan bucket:
    each unit's a `GroupParam` at its first param and `GroupRef`s at the others; the rest group's
    materialized now. `treedef`: the params' structure."""
    leaves: list = [None] * len(fp.local_shapes)
    start = 0
    for group in fp.groups:
        n = sum(buf.n_buckets for buf in group.buffers)
        mine, start = tuple(buckets[start : start + n]), start + n
        place, first = {}, 0
        for buf in group.buffers:
            for b in range(buf.n_buckets):
                for pos, j in enumerate(buf.layout.bucket_params[b]):
                    place[buf.params[j]] = (first + b, pos)
            first += buf.n_buckets
        members = tuple(place[i] for i in group.params)
        leaves[group.params[0]] = GroupParam(mine, group.key or "<rest>", members)
        for m, i in enumerate(group.params[1:], start=1):
            leaves[i] = GroupRef(group.key or "<rest>", m)
        if group.key == REST:
            rest = materialize_all([leaves[i] for i in group.params])
            for i, x in zip(group.params, rest):
                leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)
