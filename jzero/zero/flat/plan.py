"""The flat-buffer view of a ShardingPlan, and the per-device buffer operations the flat path uses.

As in Megatron, which keys its buffers by (param dtype, grad dtype, is_expert), the params
are laid into up to two flat buffers (docs/megatron.md, "The flat buffer"):

  dense:   the dense params, tp-local, over the dense DP domain (dp_outer x dp x ep);
  expert:  the expert params, ep- and tp-local (`[E/ep, D, F/tp]`), over the expert DP
           domain (dp_outer x dp). A model without expert params has no expert buffer.

Each buffer is Megatron's layout (`buffers.build_layout`) over its params' local element
counts (params in `jax.tree.leaves` order), padded to `lcm(d, 128)` with d its own DP size
and cut into buckets. Rank r of a buffer's DP domain owns `[r*S_b/d, (r+1)*S_b/d)` of each
of its buckets b. The plan numbers the buckets of all buffers in one sequence, dense first.

Global arrays (S_b = padded size of bucket b):
  dense bucket:     [tp, S_b]       P("tp", DENSE_DP_AXES)          (P("tp", None) unsharded)
                    (under HSDP the columns are split over the buffer's `shard_axes`)
  expert bucket:    [ep * tp, S_b]  P(("ep", "tp"), EXPERT_DP_AXES)  (P(("ep", "tp"), None));
                    row ep_rank * tp + tp_rank
  inside shard_map: [1, S_b/d] the owned shard, or [1, S_b] whole (the step drops the 1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jzero.errors import ConfigError
from jzero.mesh import AXES, DENSE_DP_AXES, EP_AXIS, EXPERT_DP_AXES, TP_AXIS, axes_size
from jzero.zero.common.strategies import ShardingPlan, spec_axes
from jzero.zero.flat.buffers import Layout, build_layout

PyTree = Any
MAX_BUCKET = 2**31 - 1  # positions inside a bucket are int32 (JAX's default integer)
DENSE, EXPERT = "dense", "expert"


@dataclasses.dataclass(frozen=True)
class FlatBuffer:
    """One flat buffer (one Megatron buffer key) and the mesh axes its buckets live on.

    Attributes:
      kind: "dense" or "expert".
      dp_axes: its DP domain: buckets are reduced over these axes.
      inner_axes: the DP axes a bucket is reduce-scattered over first: `dp_axes`, or under HSDP
        those less dp_outer (`strategies.TensorPlan.inner_axes`).
      shard_axes: the axes its buckets' state is split over, in layout order: `inner_axes`, then
        dp_outer under HSDP `outer_strategy: optim` (`strategies.TensorPlan.shard_axes`).
      model_axes: the mesh axes its params are split over, ("tp",) or ("ep", "tp"); a bucket
        array has one row per rank of them.
      layout: Megatron's layout over its params' local element counts (`layout.dp_size` is
        `d`, or 1 under no_shard: no padding); its param j is leaf `params[j]`.
      params: leaves-order indices of its params.
      d: size of `shard_axes`: each rank owns 1/d of every bucket.
      sharded: whether its optimizer state is sharded over `shard_axes` (not under no_shard).
    """

    kind: str
    dp_axes: tuple[str, ...]
    inner_axes: tuple[str, ...]
    shard_axes: tuple[str, ...]
    model_axes: tuple[str, ...]
    layout: Layout
    params: tuple[int, ...]
    d: int
    sharded: bool

    @property
    def n_buckets(self) -> int:
        return self.layout.num_buckets

    def bucket_spec(self, sharded: bool | None = None) -> P:
        """Spec of its bucket arrays: rows over `model_axes`, columns split over DP if `sharded`."""
        sharded = self.sharded if sharded is None else sharded
        rows = self.model_axes[0] if len(self.model_axes) == 1 else self.model_axes
        return P(rows, self.shard_axes if sharded else None)

    def shard_size(self, b: int) -> int:
        """Elements of its bucket b one rank steps: its owned shard, or all of it under no_shard."""
        start, end = self.layout.bucket_indices[b]
        return (end - start) // self.d if self.sharded else end - start

    @property
    def outer_axes(self) -> tuple[str, ...]:
        """The DP axes reduced after the inner ones: dp_outer under HSDP, else none."""
        return tuple(a for a in self.dp_axes if a not in self.inner_axes)

    def norm_axes(self, tp_split: bool) -> tuple[str, ...]:
        """The axes over which one device's elements of this buffer are distinct (the psum of the
        squares in the global norm): its DP domain when sharded (else every rank holds the same),
        ep for experts, tp for tp-split params. A tp-replicated element is identical on every tp
        rank, so not summing over tp counts it once (Megatron's tp-duplicate rule)."""
        axes = set(self.shard_axes if self.sharded else ()) | {a for a in self.model_axes if a != TP_AXIS}
        return tuple(a for a in AXES if a in axes or (tp_split and a == TP_AXIS))


@dataclasses.dataclass(frozen=True)
class FlatPlan:
    """The flat-buffer view of a ShardingPlan.

    Attributes:
      plan: the per-tensor plan (tp specs, DP domains).
      buffers: the dense buffer (if any dense param), then the expert buffer (if any expert param).
      local_shapes: tp- and ep-local shape of each param (leaves order).
      tp_sharded: per param (leaves order), whether tp splits it (its grad counts on every tp
        rank in the norm; a tp-replicated param counts once, Megatron's
        `param_is_not_tensor_parallel_duplicate`).
    """

    plan: ShardingPlan
    buffers: tuple[FlatBuffer, ...]
    local_shapes: tuple[tuple[int, ...], ...]
    tp_sharded: tuple[bool, ...]

    def buffer(self, kind: str) -> FlatBuffer | None:
        return next((buf for buf in self.buffers if buf.kind == kind), None)

    @property
    def layout(self) -> Layout:
        """The first buffer's layout: the dense buffer's (the only one for a dense model)."""
        return self.buffers[0].layout

    @property
    def dp_axes(self) -> tuple[str, ...]:
        """The dense DP domain (the batch's); `d` is its size, which scales every grad."""
        return DENSE_DP_AXES

    @property
    def d(self) -> int:
        return axes_size(self.plan.mesh, self.dp_axes)

    @property
    def sharded(self) -> bool:
        """Whether the optimizer state is sharded (every strategy but no_shard)."""
        return self.plan.shards_state

    @property
    def buckets(self) -> tuple[tuple[FlatBuffer, int], ...]:
        """Per plan bucket, (its buffer, its index in that buffer): dense buckets first."""
        return tuple((buf, b) for buf in self.buffers for b in range(buf.n_buckets))

    @property
    def n_buckets(self) -> int:
        """Buckets over all buffers."""
        return sum(buf.n_buckets for buf in self.buffers)

    @property
    def numel(self) -> int:
        """Elements one device holds in all its buffers, padding included."""
        return sum(buf.layout.numel for buf in self.buffers)

    def bucket_specs(self, sharded: bool | None = None) -> list[P]:
        """Spec of every bucket array (`FlatBuffer.bucket_spec`)."""
        return [buf.bucket_spec(sharded) for buf, _ in self.buckets]

    def bucket_spec(self, sharded: bool | None = None, b: int | None = None) -> P:
        """Spec of bucket b's array; b may be left out when all buckets share one (a single buffer)."""
        if b is None:
            if len(self.buffers) > 1:
                raise ValueError("dense and expert buckets have different specs: pass b, or use bucket_specs()")
            b = 0
        return self.bucket_specs(sharded)[b]

    def bucket_shapes(self) -> list[tuple[int, int]]:
        """Global shape of every bucket array: [tp, S_b] dense, [ep * tp, S_b] expert."""
        mesh = self.plan.mesh
        return [
            (axes_size(mesh, buf.model_axes), end - start)
            for buf in self.buffers
            for start, end in buf.layout.bucket_indices
        ]

    def shard_size(self, b: int) -> int:
        """Elements of bucket b one rank steps: its owned shard, or all of it under no_shard."""
        buf, local = self.buckets[b]
        return buf.shard_size(local)


def _local_shape(shape: tuple[int, ...], spec: P, mesh) -> tuple[int, ...]:
    out = list(shape)
    for dim, entry in enumerate(spec):
        if entry is not None:
            out[dim] //= axes_size(mesh, (entry,) if isinstance(entry, str) else tuple(entry))
    return tuple(out)


def make_flat_plan(plan: ShardingPlan, bucket_size: int | None, pad_for_high_nccl_busbw: bool) -> FlatPlan:
    """Megatron's layouts for the local params of `plan`: a dense buffer and, for expert params,
    an expert buffer, each padded for its own DP size.

    Raises ConfigError for what the flat path does not support: more than one param dtype,
    a param split over mesh axes its buffer does not know (an expert param not split over ep,
    a dense one split over ep), or a bucket too large for int32 positions.
    """
    tensors = jax.tree.leaves(plan.tensors)
    if len({t.dtype for t in tensors}) != 1:
        raise ConfigError("zero.path=flat needs one param dtype (one buffer); got " + str({t.dtype for t in tensors}))
    mesh = plan.mesh
    local_shapes = tuple(_local_shape(t.shape, t.tp_spec, mesh) for t in tensors)
    buffers = []
    for kind, dp_axes, model_axes in ((DENSE, DENSE_DP_AXES, (TP_AXIS,)), (EXPERT, EXPERT_DP_AXES, (EP_AXIS, TP_AXIS))):
        members = tuple(i for i, t in enumerate(tensors) if t.dp_axes == dp_axes)
        if not members:
            continue
        for i in members:
            axes = spec_axes(tensors[i].tp_spec)
            if not set(axes) <= set(model_axes) or (kind == EXPERT and EP_AXIS not in axes):
                raise ConfigError(
                    f"zero.path=flat: {kind} param {tensors[i].name} has model-parallel spec {tensors[i].tp_spec}; "
                    f"a {kind} param may only be split over {model_axes}"
                    + (" and must be split over ep" if kind == EXPERT else "")
                )
        inner_axes, shard_axes = tensors[members[0]].inner_axes, tensors[members[0]].shard_axes
        d = axes_size(mesh, shard_axes)
        layout = build_layout(
            numels=[int(np.prod(local_shapes[i], dtype=np.int64)) for i in members],
            dp_size=d if plan.shards_state else 1,
            bucket_size=bucket_size,
            pad_for_high_nccl_busbw=pad_for_high_nccl_busbw,
        )
        buffers.append(
            FlatBuffer(kind, dp_axes, inner_axes, shard_axes, model_axes, layout, members, d, plan.shards_state)
        )
    if sum(len(buf.params) for buf in buffers) != len(tensors):
        odd = [t.name for t in tensors if t.dp_axes not in (DENSE_DP_AXES, EXPERT_DP_AXES)]
        raise ConfigError(f"zero.path=flat: params {odd} are in neither the dense nor the expert DP domain")
    largest = max(end - start for buf in buffers for start, end in buf.layout.bucket_indices)
    if largest > MAX_BUCKET:
        raise ConfigError(
            f"zero.bucket_size: a flat bucket of {largest} elements exceeds {MAX_BUCKET}; set zero.bucket_size "
            "(Megatron's default with overlap is max(40_000_000, 1_000_000 * dp))"
        )
    tp_sharded = tuple(TP_AXIS in spec_axes(t.tp_spec) and mesh.shape[TP_AXIS] > 1 for t in tensors)
    return FlatPlan(plan, tuple(buffers), local_shapes, tp_sharded)


# ---------------------------------------------------------------- per-device buffer ops


def assemble(layout: Layout, b: int, rows: Sequence[jax.Array], zeros: Callable[[int], jax.Array]) -> jax.Array:
    """Bucket b from per-param rows (the layout's param order, flattened on the last axis), with
    `zeros(n)` in the 64-element alignment gaps and the end padding."""
    start, end = layout.bucket_indices[b]
    pieces, cursor = [], start
    for i in layout.bucket_params[b]:
        ps, pe, _ = layout.param_index_map[i]
        if ps > cursor:
            pieces.append(zeros(ps - cursor))
        pieces.append(rows[i])
        cursor = pe
    if end > cursor:
        pieces.append(zeros(end - cursor))
    return jnp.concatenate(pieces, axis=-1)


def flatten(fp: FlatPlan, leaves: Sequence[jax.Array], dtype) -> list[jax.Array]:
    """Local param-shaped leaves (leaves order) -> one [S_b] array per plan bucket, zero in the gaps."""
    rows = [x.reshape(-1).astype(dtype) for x in leaves]
    zeros = lambda n: jnp.zeros(n, dtype)  # noqa: E731
    out = []
    for buf in fp.buffers:
        mine = [rows[i] for i in buf.params]
        out += [assemble(buf.layout, b, mine, zeros) for b in range(buf.n_buckets)]
    return out


def unflatten(fp: FlatPlan, buckets: Sequence[jax.Array], dtypes: Sequence) -> list[jax.Array]:
    """Inverse of `flatten`: full [S_b] buckets -> local params (leaves order)."""
    leaves = [None] * len(fp.local_shapes)
    for bucket, (buf, b) in zip(buckets, fp.buckets):
        start = buf.layout.bucket_indices[b][0]
        for j in buf.layout.bucket_params[b]:
            ps, pe, _ = buf.layout.param_index_map[j]
            i = buf.params[j]
            leaves[i] = bucket[ps - start : pe - start].reshape(fp.local_shapes[i]).astype(dtypes[i])
    return leaves


def owned(buf: FlatBuffer, bucket: jax.Array, rank: jax.Array | int) -> jax.Array:
    """Rank `rank`'s shard of a full [S_b] bucket of `buf`: [r*S_b/d, (r+1)*S_b/d) (all of it
    under no_shard); `rank` is the rank in `buf.shard_axes`."""
    if not buf.sharded:
        return bucket
    size = bucket.shape[0] // buf.d
    return jax.lax.dynamic_slice_in_dim(bucket, rank * size, size)


def values_on_shard(buf: FlatBuffer, b: int, per_param: Sequence[float], rank: jax.Array | int) -> jax.Array:
    """Per element of rank `rank`'s shard of `buf`'s bucket b, the value of the param it belongs to.

    Per-param constants (leaves order) laid out like the buffer (param-group multipliers, norm
    weights), built in the step from a few comparisons instead of stored: the values are
    constant over runs of consecutive params, and a gap or padding element takes its
    neighbour's value (its grad and param are zero, so no update reads it). `rank` is the
    rank in `buf.shard_axes`. Returns f32 [buf.shard_size(b)].
    """
    start, _ = buf.layout.bucket_indices[b]
    runs: list[tuple[int, float]] = []  # (first position in the bucket, value), in buffer order
    for j in buf.layout.bucket_params[b]:
        value = float(per_param[buf.params[j]])
        if not runs or runs[-1][1] != value:
            runs.append((buf.layout.param_index_map[j][0] - start, value))
    size = buf.shard_size(b)
    if len(runs) == 1:
        return jnp.full((size,), runs[0][1], jnp.float32)
    first = (rank * size) if buf.sharded else 0
    position = first + jnp.arange(size, dtype=jnp.int32)
    out = jnp.full((size,), runs[0][1], jnp.float32)
    for run_start, value in runs[1:]:
        out = jnp.where(position >= run_start, jnp.float32(value), out)
    return out
