"""The flat path's collectives on one device's buckets, inside a shard_map over the whole mesh: the
HSDP rule of `common/collectives.py` applied per bucket, on its last axis.

Per bucket, over that bucket's DP domain (dp_outer x dp x ep for a dense bucket, dp_outer x dp
for an expert bucket; `FlatBuffer`):

  reduce:  a psum_scatter over the inner DP axes; under HSDP then a psum_scatter across dp_outer
           (outer_strategy optim: the state is split there too) or a psum (no_shard). Rank r of
           the domain keeps its shard `[r*S/d, (r+1)*S/d)`. Under DDP a psum over the whole domain.
  gather:  the inverse layout: an all_gather across dp_outer (if split there), then the inner axes.
  norm:    the global grad norm, every element counted once across dp, ep and tp.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jzero.zero.common import collectives as common
from jzero.zero.common import loss_scale as scaler
from jzero.zero.flat.local import values_on_shard
from jzero.zero.flat.plan import FlatBuffer, FlatPlan


def reduce_bucket(buf: FlatBuffer, g: jax.Array) -> jax.Array:
    """A bucket's DP reduction: [S_b] local grads -> the owned [S_b/d] shard (all [S_b] under DDP); on
    the last axis, so [L, S_b] -> [L, S_b/d] too."""
    if not buf.sharded:  # DDP: Megatron's one all-reduce per bucket over the whole domain
        return common.reduce(g, None, buf.dp_axes, (), outer_scatter=False)
    outer_scatter = set(buf.outer_axes) <= set(buf.shard_axes)
    return common.reduce(g, g.ndim - 1, buf.inner_axes, buf.outer_axes, outer_scatter=outer_scatter)


def summed_axes(buf: FlatBuffer) -> tuple[str, ...]:
    """The axes `reduce_bucket` sums over without scattering: its result is invariant over them."""
    if not buf.sharded:
        return buf.dp_axes
    return () if set(buf.outer_axes) <= set(buf.shard_axes) else buf.outer_axes


def reduce(fp: FlatPlan, buckets: Sequence[jax.Array]) -> list[jax.Array]:
    """`reduce_bucket` for every plan bucket."""
    return [reduce_bucket(buf, g) for (buf, _), g in zip(fp.buckets, buckets)]


def gather_outer(buf: FlatBuffer, m: jax.Array) -> jax.Array:
    """The owned [S_b/d] shard -> this rank's [S_b/d_inner] part of the bucket (`FlatBuffer.param_spec`):
    gathered across dp_outer where the state is split there (HSDP optim), else `m` itself."""
    if set(buf.outer_axes) & set(buf.shard_axes):
        return common.gather(m, m.ndim - 1, (), buf.outer_axes)
    return m


def gather_inner(buf: FlatBuffer, m: jax.Array) -> jax.Array:
    """A rank's [S_b/d_inner] part of the bucket -> the whole [S_b] bucket, over the inner DP axes."""
    return common.gather(m, m.ndim - 1, buf.inner_axes)


def gather_bucket(buf: FlatBuffer, m: jax.Array) -> jax.Array:
    """Inverse of the sharded reduction's layout: the owned [S_b/d] shard -> the whole [S_b] bucket
    (on the last axis)."""
    if not buf.sharded:
        return m
    return gather_inner(buf, gather_outer(buf, m))


def bucket_ranks(fp: FlatPlan) -> list[jax.Array]:
    """Per plan bucket, this device's rank in that bucket's DP domain (`FlatBuffer.shard_axes`)."""
    ranks = {buf.kind: jax.lax.axis_index(buf.shard_axes) for buf in fp.buffers}
    return [ranks[buf.kind] for buf, _ in fp.buckets]


def on_shards(fp: FlatPlan, per_param: Sequence[float], ranks: Sequence[jax.Array]) -> list[jax.Array]:
    """Per-param constants (leaves order) laid out like each bucket's owned shard (`values_on_shard`)."""
    return [values_on_shard(buf, b, per_param, r) for (buf, b), r in zip(fp.buckets, ranks)]


def global_norm(fp: FlatPlan, grads: Sequence[jax.Array], ranks: Sequence[jax.Array]) -> jax.Array:
    """Every element once across dp, ep and tp: each bucket's sums of squares (its tp-split and its
    tp-replicated elements apart) summed over the axes its elements are distinct on
    (`FlatBuffer.norm_axes`), as Megatron's `get_grad_norm_fp32` counts tp duplicates once."""
    squares: dict[tuple[str, ...], jax.Array] = {}

    def add(axes, value):
        squares[axes] = squares.get(axes, 0.0) + value

    for (buf, b), g, rank in zip(fp.buckets, grads, ranks):
        kinds = {fp.tp_sharded[buf.params[j]] for j in buf.layout.bucket_params[b]}
        if len(kinds) == 1:  # one kind: no weights (a weight broadcast to a stacked [L, S] would cost memory)
            add(buf.norm_axes(tp_split=kinds.pop()), jnp.sum(g * g))
            continue
        per_position = jnp.sum(g * g, axis=tuple(range(g.ndim - 1)))  # a stacked bucket's layers summed first
        split = values_on_shard(buf, b, fp.tp_sharded, rank)
        add(buf.norm_axes(tp_split=True), jnp.sum(per_position * split))
        add(buf.norm_axes(tp_split=False), jnp.sum(per_position * (1 - split)))
    return jnp.sqrt(sum(jax.lax.psum(sq, axes) if axes else sq for axes, sq in squares.items()))


def any_nonfinite(grads: Sequence[jax.Array], mesh_axes: tuple[str, ...]) -> jax.Array:
    """Whether any element of any rank's grads is inf or nan: one flag for the whole step (a pmax over
    every mesh axis), so all ranks skip a loss-scaled step together."""
    return jax.lax.pmax(scaler.found_inf(grads).astype(jnp.int32), mesh_axes) > 0
