"""Flat-path state <-> model space (per parameter, global shapes), for checkpoints.

Megatron saves its distributed optimizer "fully reshardable": per parameter, whatever
the buffer layout. jzero does the same, so a flat-path checkpoint restores onto any dp
size, strategy or path (the padding of a bucket depends on dp; docs/xla.md, "orbax:
restoring onto another sharding"). These functions work on global arrays; jit them with
the target shardings and XLA moves only shards.

A per-param state tree (Adam's `mu`, say) is `prefix + param path` in model space and
`prefix + [bucket]` on the flat path; scalars (step counts) keep their path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jzero.mesh import TP_AXIS
from jzero.zero.flat_plan import FlatPlan, assemble
from jzero.zero.state import ZeroState

PyTree = Any


def _tp_dim(spec: P) -> int | None:
    dims = [i for i, e in enumerate(spec) if e is not None]
    return dims[0] if dims else None


def buckets_to_params(fp: FlatPlan, buckets: list[jax.Array]) -> list[jax.Array]:
    """[tp, S_b] buckets -> global per-param arrays (leaves order)."""
    n_tp = fp.plan.mesh.shape[TP_AXIS]
    tensors = jax.tree.leaves(fp.plan.tensors)
    out = [None] * len(fp.local_shapes)
    for b, (start, _) in enumerate(fp.layout.bucket_indices):
        for i in fp.layout.bucket_params[b]:
            ps, pe, _ = fp.layout.param_index_map[i]
            piece = buckets[b][:, ps - start : pe - start].reshape(n_tp, *fp.local_shapes[i])
            k = _tp_dim(tensors[i].tp_spec) if fp.tp_sharded[i] else None
            out[i] = piece[0] if k is None else jnp.moveaxis(piece, 0, k).reshape(tensors[i].shape)
    return out


def params_to_buckets(fp: FlatPlan, leaves: list[jax.Array]) -> list[jax.Array]:
    """Global per-param arrays (leaves order) -> [tp, S_b] buckets, zero in the gaps."""
    n_tp = fp.plan.mesh.shape[TP_AXIS]
    tensors = jax.tree.leaves(fp.plan.tensors)
    rows = []
    for i, (x, t) in enumerate(zip(leaves, tensors)):
        k = _tp_dim(t.tp_spec) if fp.tp_sharded[i] else None
        if k is None:
            piece = jnp.broadcast_to(x, (n_tp, *x.shape))
        else:
            piece = jnp.moveaxis(x.reshape(*x.shape[:k], n_tp, x.shape[k] // n_tp, *x.shape[k + 1 :]), k, 0)
        rows.append(piece.reshape(n_tp, -1))
    dtype = leaves[0].dtype
    return [assemble(fp.layout, b, rows, lambda n: jnp.zeros((n_tp, n), dtype)) for b in range(fp.n_buckets)]


def _abstract_inner(fp: FlatPlan, inner: optax.GradientTransformation, model_space: bool) -> PyTree:
    if model_space:
        params = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, jnp.float32), fp.plan.tensors)
    else:
        params = [jax.ShapeDtypeStruct(s, jnp.float32) for s in fp.bucket_shapes()]
    return jax.eval_shape(inner.init, params)


def _split_model(fp: FlatPlan, path: tuple, leaf) -> tuple[tuple, int] | None:
    """(prefix, param index) of a model-space leaf shaped like its param, else None."""
    owner = fp.plan.param_of(path)
    if owner is None or tuple(leaf.shape) != fp.plan.tensor(owner).shape:
        return None
    return path[: len(path) - len(owner)], fp.plan.index(owner)


def _split_flat(path: tuple, leaf) -> tuple[tuple, int] | None:
    """(prefix, bucket) of a flat-path bucket leaf, else None (a scalar)."""
    return (path[:-1], path[-1].idx) if leaf.ndim else None


def _convert(state: PyTree, dst_abstract: PyTree, split_src: Callable, split_dst: Callable, n_src: int, convert):
    """Regroups `state`'s per-param trees through `convert` (n_src leaves in, dst's out)."""
    trees: dict[tuple, list] = {}
    others = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        where = split_src(tuple(path), leaf)
        if where is None:
            others[tuple(path)] = leaf
        else:
            trees.setdefault(where[0], [None] * n_src)[where[1]] = leaf
    converted = {prefix: convert(leaves) for prefix, leaves in trees.items()}
    paths, treedef = jax.tree_util.tree_flatten_with_path(dst_abstract)
    out = []
    for path, leaf in paths:
        where = split_dst(tuple(path), leaf)
        out.append(others[tuple(path)] if where is None else converted[where[0]][where[1]])
    return jax.tree.unflatten(treedef, out)


def flat_to_model_space(fp: FlatPlan, inner: optax.GradientTransformation, opt_state: ZeroState) -> ZeroState:
    """Flat-path optimizer state -> the spec path's per-param ZeroState (same values)."""
    inner_state = _convert(
        opt_state.inner_state,
        _abstract_inner(fp, inner, model_space=True),
        _split_flat,
        lambda path, leaf: _split_model(fp, path, leaf),
        fp.n_buckets,
        lambda buckets: buckets_to_params(fp, buckets),
    )
    main = opt_state.main_params
    treedef = jax.tree.structure(fp.plan.tensors)
    main = None if main is None else jax.tree.unflatten(treedef, buckets_to_params(fp, main))
    return ZeroState(main, inner_state)


def model_space_to_flat(fp: FlatPlan, inner: optax.GradientTransformation, state: ZeroState) -> ZeroState:
    """The spec path's per-param ZeroState -> flat-path buckets (inverse of flat_to_model_space)."""
    inner_state = _convert(
        state.inner_state,
        _abstract_inner(fp, inner, model_space=False),
        lambda path, leaf: _split_model(fp, path, leaf),
        _split_flat,
        len(fp.local_shapes),
        lambda leaves: params_to_buckets(fp, leaves),
    )
    main = None if state.main_params is None else params_to_buckets(fp, jax.tree.leaves(state.main_params))
    return ZeroState(main, inner_state)
