"""The flat-buffer view of a ShardingPlan, and the per-device buffer operations the flat path uses.

Each device (inside `jax.shard_map`) sees its tp-local params. They are laid into one flat
buffer with Megatron's layout (`buffers.build_layout` over the tp-local element counts,
params in `jax.tree.leaves` order; docs/megatron.md, "The flat buffer"), cut into buckets.
Rank r of the DP domain owns the shard `[r*S_b/d, (r+1)*S_b/d)` of bucket b.

Global arrays (d = DP-domain size, S_b = padded size of bucket b):
  a bucket of every tp rank:  [tp, S_b], sharded P("tp", dp_axes) (P("tp", None) unsharded)
  inside shard_map:           [S_b] whole, or [S_b/d] the owned shard
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jzero.config import ConfigError
from jzero.mesh import BATCH_AXES, TP_AXIS, axes_size
from jzero.zero.buffers import Layout, build_layout
from jzero.zero.strategies import ShardingPlan

PyTree = Any
MAX_BUCKET = 2**31 - 1  # positions inside a bucket are int32 (JAX's default integer)


@dataclasses.dataclass(frozen=True)
class FlatPlan:
    """The flat-buffer view of a ShardingPlan.

    Attributes:
      plan: the per-tensor plan (tp specs, DP domain).
      layout: Megatron's layout over the tp-local element counts, params in leaves order.
      local_shapes: tp-local shape of each param (leaves order).
      tp_sharded: per param, whether tp splits it (its grad counts on every tp rank
        in the norm; a tp-replicated param counts once, Megatron's
        `param_is_not_tensor_parallel_duplicate`).
    """

    plan: ShardingPlan
    layout: Layout
    local_shapes: tuple[tuple[int, ...], ...]
    tp_sharded: tuple[bool, ...]

    @property
    def dp_axes(self) -> tuple[str, ...]:
        return BATCH_AXES

    @property
    def d(self) -> int:
        return axes_size(self.plan.mesh, self.dp_axes)

    @property
    def sharded(self) -> bool:
        """Whether the optimizer state is sharded (every strategy but no_shard)."""
        return self.plan.shards_state

    @property
    def n_buckets(self) -> int:
        return self.layout.num_buckets

    def bucket_spec(self, sharded: bool | None = None) -> P:
        """Spec of a [tp, S_b] bucket array: split over DP if `sharded` (default: the state's)."""
        sharded = self.sharded if sharded is None else sharded
        return P(TP_AXIS, self.dp_axes if sharded else None)

    def bucket_shapes(self) -> list[tuple[int, int]]:
        """Global [tp, S_b] shape of every bucket."""
        n_tp = self.plan.mesh.shape[TP_AXIS]
        return [(n_tp, end - start) for start, end in self.layout.bucket_indices]

    def shard_size(self, b: int) -> int:
        """Elements of bucket b one rank steps: its owned shard, or all of it under no_shard."""
        start, end = self.layout.bucket_indices[b]
        return (end - start) // self.d if self.sharded else end - start


def make_flat_plan(plan: ShardingPlan, bucket_size: int | None, pad_for_high_nccl_busbw: bool) -> FlatPlan:
    """Megatron's layout for the tp-local params of `plan` (one dense buffer).

    Raises ConfigError for what the flat path does not support: more than one param dtype,
    expert params, or a bucket too large for int32 positions.
    """
    tensors = jax.tree.leaves(plan.tensors)
    if len({t.dtype for t in tensors}) != 1:
        raise ConfigError("zero.path=flat needs one param dtype (one buffer); got " + str({t.dtype for t in tensors}))
    if any(t.dp_axes != BATCH_AXES for t in tensors):
        raise ConfigError("zero.path=flat does not support expert params yet")
    mesh = plan.mesh
    local_shapes = []
    for t in tensors:
        shape = list(t.shape)
        for dim, entry in enumerate(t.tp_spec):
            if entry is not None:
                shape[dim] //= axes_size(mesh, (entry,) if isinstance(entry, str) else tuple(entry))
        local_shapes.append(tuple(shape))
    layout = build_layout(
        numels=[int(np.prod(s, dtype=np.int64)) for s in local_shapes],
        dp_size=axes_size(mesh, BATCH_AXES) if plan.shards_state else 1,
        bucket_size=bucket_size,
        pad_for_high_nccl_busbw=pad_for_high_nccl_busbw,
    )
    largest = max(end - start for start, end in layout.bucket_indices)
    if largest > MAX_BUCKET:
        raise ConfigError(
            f"zero.bucket_size: a flat bucket of {largest} elements exceeds {MAX_BUCKET}; set zero.bucket_size "
            "(Megatron's default with overlap is max(40_000_000, 1_000_000 * dp))"
        )
    tp_sharded = tuple(any(e is not None for e in t.tp_spec) and mesh.shape[TP_AXIS] > 1 for t in tensors)
    return FlatPlan(plan, layout, tuple(local_shapes), tp_sharded)


# ---------------------------------------------------------------- per-device buffer ops


def assemble(layout: Layout, b: int, rows: Sequence[jax.Array], zeros: Callable[[int], jax.Array]) -> jax.Array:
    """Bucket b from per-param rows (leaves order, flattened on the last axis), with
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
    """tp-local param-shaped leaves -> one [S_b] array per bucket, zero in alignment/padding gaps."""
    rows = [x.reshape(-1).astype(dtype) for x in leaves]
    return [assemble(fp.layout, b, rows, lambda n: jnp.zeros(n, dtype)) for b in range(fp.n_buckets)]


def unflatten(fp: FlatPlan, buckets: Sequence[jax.Array], dtypes: Sequence) -> list[jax.Array]:
    """Inverse of `flatten`: full [S_b] buckets -> tp-local params (leaves order)."""
    leaves = [None] * len(fp.local_shapes)
    for b, (start, _) in enumerate(fp.layout.bucket_indices):
        for i in fp.layout.bucket_params[b]:
            ps, pe, _ = fp.layout.param_index_map[i]
            leaves[i] = buckets[b][ps - start : pe - start].reshape(fp.local_shapes[i]).astype(dtypes[i])
    return leaves


def owned(fp: FlatPlan, bucket: jax.Array, rank: jax.Array | int) -> jax.Array:
    """Rank `rank`'s shard of a full [S_b] bucket: [r*S_b/d, (r+1)*S_b/d) (all of it under no_shard)."""
    if not fp.sharded:
        return bucket
    size = bucket.shape[0] // fp.d
    return jax.lax.dynamic_slice_in_dim(bucket, rank * size, size)


def values_on_shard(fp: FlatPlan, b: int, per_param: Sequence[float], rank: jax.Array | int) -> jax.Array:
    """Per element of rank `rank`'s shard of bucket b, the value of the param it belongs to.

    Per-param constants laid out like the buffer (param-group multipliers, norm weights),
    built in the step from a few comparisons instead of stored: the values are constant
    over runs of consecutive params, and a gap or padding element takes its neighbour's
    value (its grad and param are zero, so no update reads it). Returns f32 [shard_size(b)].
    """
    start, _ = fp.layout.bucket_indices[b]
    runs: list[tuple[int, float]] = []  # (first position in the bucket, value), in buffer order
    for i in fp.layout.bucket_params[b]:
        value = float(per_param[i])
        if not runs or runs[-1][1] != value:
            runs.append((fp.layout.param_index_map[i][0] - start, value))
    size = fp.shard_size(b)
    if len(runs) == 1:
        return jnp.full((size,), runs[0][1], jnp.float32)
    first = (rank * size) if fp.sharded else 0
    position = first + jnp.arange(size, dtype=jnp.int32)
    out = jnp.full((size,), runs[0][1], jnp.float32)
    for run_start, value in runs[1:]:
        out = jnp.where(position >= run_start, jnp.float32(value), out)
    return out
