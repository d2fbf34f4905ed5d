"""The flat path's per-device bucket operations (inside a shard_map): params <-> buckets, owned shards,
per-param constants laid out like a shard.

One device's bucket of a buffer (`plan.FlatBuffer`) is `[S_b]` (`[L, S_b]` for a scanned stack's
group: one row per layer, each laid out alike); its owned shard `[S_b/d]` (`[L, S_b/d]`). Every
operation works on the last axis, so a stacked bucket is handled layer by layer at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jzero.zero.flat.buffers import Layout
from jzero.zero.flat.plan import FlatBuffer, FlatPlan


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


def bucket_of(buf: FlatBuffer, b: int, arrays: Sequence[jax.Array], dtype) -> jax.Array:
    """One layer's bucket b of `buf` from its params' arrays (`buf.layout.bucket_params[b]` order, one
    layer's shapes): [S_b] in `dtype`, zero in the gaps."""
    rows = {j: x.reshape(-1).astype(dtype) for j, x in zip(buf.layout.bucket_params[b], arrays)}
    return assemble(buf.layout, b, rows, lambda n: jnp.zeros((n,), dtype))


def flatten(fp: FlatPlan, leaves: Sequence[jax.Array], dtype) -> list[jax.Array]:
    """Local param-shaped leaves (leaves order) -> one [S_b] ([L, S_b] stacked) array per plan bucket,
    zero in the gaps."""
    out = []
    for buf in fp.buffers:
        rows = {j: leaves[i].reshape(*buf.lead, -1).astype(dtype) for j, i in enumerate(buf.params)}
        zeros = lambda n, lead=buf.lead: jnp.zeros((*lead, n), dtype)  # noqa: E731
        out += [assemble(buf.layout, b, rows, zeros) for b in range(buf.n_buckets)]
    return out


def params_of(fp: FlatPlan, buf: FlatBuffer, b: int, bucket: jax.Array, dtypes: Sequence) -> dict[int, jax.Array]:
    """A full bucket b of `buf`, [*lead, S_b] -> {leaves-order index: its param [*lead, *layer shape]}."""
    start = buf.layout.bucket_indices[b][0]
    lead = bucket.shape[:-1]
    out = {}
    for j in buf.layout.bucket_params[b]:
        ps, pe, _ = buf.layout.param_index_map[j]
        i = buf.params[j]
        out[i] = bucket[..., ps - start : pe - start].reshape(*lead, *fp.layer_shape(i)).astype(dtypes[i])
    return out


def unflatten(fp: FlatPlan, buckets: Sequence[jax.Array], dtypes: Sequence) -> list[jax.Array]:
    """Inverse of `flatten`: full [S_b] ([L, S_b]) buckets -> local params (leaves order)."""
    leaves = [None] * len(fp.local_shapes)
    for bucket, (buf, b) in zip(buckets, fp.buckets):
        for i, x in params_of(fp, buf, b, bucket, dtypes).items():
            leaves[i] = x
    return leaves


def owned(buf: FlatBuffer, bucket: jax.Array, rank: jax.Array | int) -> jax.Array:
    """Rank `rank`'s shard of a full [S_b] ([L, S_b]) bucket of `buf`: [r*S_b/d, (r+1)*S_b/d) of the
    last axis (all of it under no_shard); `rank` is the rank in `buf.shard_axes`."""
    if not buf.sharded:
        return bucket
    size = bucket.shape[-1] // buf.d
    return jax.lax.dynamic_slice_in_dim(bucket, rank * size, size, axis=bucket.ndim - 1)


def values_on_shard(buf: FlatBuffer, b: int, per_param: Sequence[float], rank: jax.Array | int) -> jax.Array:
    """Per element of rank `rank`'s shard of `buf`'s bucket b, the value of the param it belongs to.

    Per-param constants (leaves order) laid out like the buffer (param-group multipliers, norm
    weights), built in the step from a few comparisons instead of stored: the values are
    constant over runs of consecutive params, and a gap or padding element takes its
    neighbour's value (its grad and param are zero, so no update reads it). `rank` is the
    rank in `buf.shard_axes`. Returns f32 [buf.shard_size(b)], the same for every layer of a
    stacked bucket (it broadcasts against [L, S_b/d]).
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


def to_local(buf: FlatBuffer, x: jax.Array) -> jax.Array:
    """A bucket array as shard_map hands it to one device, [1, S] ([L, 1, S] stacked) -> [S] ([L, S])."""
    return x[:, 0] if buf.layers is not None else x[0]


def from_local(buf: FlatBuffer, x: jax.Array) -> jax.Array:
    """Inverse of `to_local`."""
    return x[:, None] if buf.layers is not None else x[None]
