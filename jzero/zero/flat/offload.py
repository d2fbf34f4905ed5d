"""The flat path's host offload (`zero.offload_fraction`): whole buckets, in bucket order (`common/offload.py`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from jzero.zero.common import offload as offload_lib
from jzero.zero.common.offload import Offload
from jzero.zero.common.state import ZeroState
from jzero.zero.flat.plan import FlatPlan


def flat_offload(fp: FlatPlan, inner: optax.GradientTransformation, shardings: ZeroState, fraction: float) -> Offload:
    """The flat path's `Offload`: whole buckets, in bucket order (module docstring); `shardings`: the
    ZeroState's without offload (`flat/state.opt_state_shardings`).

    A bucket's size is the elements one device steps (`FlatPlan.shard_shape`: a scanned stack's bucket,
    [L, S_b/d], is one unit of offload, every layer). A state leaf belongs to bucket b if it sits at
    index b of a per-bucket list (the flat path's layout, `flat/state.opt_state_shardings`) and is not a
    scalar. A param lies in one bucket (Megatron's buckets close after a param).
    """
    shapes = [fp.shard_shape(b) for b in range(fp.n_buckets)]
    shard_sizes = [math.prod(s) for s in shapes]
    shards = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    abstract_inner = jax.eval_shape(inner.init, shards)

    def mask_of(chosen):
        def inner_leaf(path, leaf):
            b = getattr(path[-1], "idx", None) if path else None
            return bool(leaf.shape) and b is not None and b < len(chosen) and chosen[b]

        inner = jax.tree_util.tree_map_with_path(inner_leaf, abstract_inner)
        return offload_lib.state_mask(shardings, list(chosen), inner)

    def params_of(b):
        buf, local = fp.buckets[b]
        return tuple(buf.params[j] for j in buf.layout.bucket_params[local])

    names = [f"bucket {b}" for b in range(fp.n_buckets)]
    return offload_lib.make_offload(fraction, names, shard_sizes, mask_of, params_of)
