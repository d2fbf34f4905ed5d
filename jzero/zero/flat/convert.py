"""Flat-path state <-> model space (per parameter, global shapes), for checkpoints.

Megatron saves its distributed optimizer "fully reshardable": per parameter, whatever
the buffer layout. jzero does the same, for the dense and the expert buffer alike (in
model space an expert param is global, all E experts), so a flat-path checkpoint
restores onto any dp or ep size, strategy or path (the padding of a bucket depends on
dp; docs/xla.md, "orbax: restoring onto another sharding"). These functions work on
global arrays; jit them with the target shardings and XLA moves only shards.

A per-param state tree (Adam's `mu`, say) is `prefix + param path` in model space and
`prefix + [bucket]` on the flat path; scalars (step counts) keep their path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jzero.mesh import entry_axes, spec_axes
from jzero.zero.common.state import ZeroState
from jzero.zero.flat.local import assemble
from jzero.zero.flat.plan import FlatPlan

PyTree = Any


def _padded(spec: P, ndim: int) -> list:
    return list(spec) + [None] * (ndim - len(spec))


def _rows_to_param(piece: jax.Array, axes: tuple[str, ...], spec: P, shape: tuple[int, ...]) -> jax.Array:
    """A param's blocks `[*(size of each of axes), *local shape]` -> the global param `[*shape]`.

    Blocks along an axis the param's spec does not name are copies (tp-replicated): the first is
    taken. A dim split over axes (a, b) holds the block of rank (i, j) at block index i * |b| + j.
    """
    used = spec_axes(spec)
    piece = piece[tuple(slice(None) if a in used else 0 for a in axes)]
    kept = [a for a in axes if a in used]
    perm = []
    for k, entry in enumerate(_padded(spec, len(shape))):
        perm += [kept.index(a) for a in entry_axes(entry)] + [len(kept) + k]
    return piece.transpose(perm).reshape(shape)


def _param_to_rows(x: jax.Array, axes: tuple[str, ...], sizes: dict[str, int], spec: P) -> jax.Array:
    """Inverse of `_rows_to_param`: the global param -> `[prod(sizes of axes), local numel]`, one row
    per rank of `axes` (row-major), copied along the axes the spec does not name."""
    split, labels = [], []
    for k, (n, entry) in enumerate(zip(x.shape, _padded(spec, x.ndim))):
        names = entry_axes(entry)
        split += [sizes[a] for a in names] + [n // math.prod(sizes[a] for a in names)]
        labels += [*names, k]
    local = [n for n, label in zip(split, labels) if isinstance(label, int)]
    front = [labels.index(a) for a in axes if a in labels]
    y = x.reshape(split).transpose(front + [i for i, label in enumerate(labels) if isinstance(label, int)])
    y = y.reshape(*(sizes[a] if a in labels else 1 for a in axes), *local)
    return jnp.broadcast_to(y, (*(sizes[a] for a in axes), *local)).reshape(math.prod(sizes[a] for a in axes), -1)


def buckets_to_params(fp: FlatPlan, buckets: list[jax.Array]) -> list[jax.Array]:
    """Bucket arrays (every buffer's, `fp.bucket_shapes()`) -> global per-param arrays (leaves order)."""
    sizes = dict(fp.plan.mesh.shape)
    tensors = jax.tree.leaves(fp.plan.tensors)
    out = [None] * len(fp.local_shapes)
    for bucket, (buf, b) in zip(buckets, fp.buckets):
        start = buf.layout.bucket_indices[b][0]
        blocks = [sizes[a] for a in buf.model_axes]
        for j in buf.layout.bucket_params[b]:
            ps, pe, _ = buf.layout.param_index_map[j]
            i = buf.params[j]
            piece = bucket[..., ps - start : pe - start].reshape(*buf.lead, *blocks, *fp.layer_shape(i))
            if buf.lead:  # [L, *blocks, *layer] -> [*blocks, L, *layer]: the blocks of the stacked param
                piece = jnp.moveaxis(piece, 0, len(blocks))
            out[i] = _rows_to_param(piece, buf.model_axes, tensors[i].tp_spec, tensors[i].shape)
    return out


def params_to_buckets(fp: FlatPlan, leaves: list[jax.Array]) -> list[jax.Array]:
    """Global per-param arrays (leaves order) -> every buffer's bucket arrays, zero in the gaps."""
    sizes = dict(fp.plan.mesh.shape)
    tensors = jax.tree.leaves(fp.plan.tensors)
    dtype = leaves[0].dtype
    out = []
    for buf in fp.buffers:
        rows = [_param_to_rows(leaves[i], buf.model_axes, sizes, tensors[i].tp_spec) for i in buf.params]
        if buf.lead:  # [rows, L * layer numel] -> [L, rows, layer numel]
            rows = [r.reshape(r.shape[0], *buf.lead, -1).swapaxes(0, 1) for r in rows]
        n_rows = math.prod(sizes[a] for a in buf.model_axes)
        zeros = lambda n, n_rows=n_rows, lead=buf.lead: jnp.zeros((*lead, n_rows, n), dtype)  # noqa: E731
        out += [assemble(buf.layout, b, rows, zeros) for b in range(buf.n_buckets)]
    return out


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
    return ZeroState(main, inner_state, opt_state.grad_scaler, opt_state.spike)


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
    return ZeroState(main, inner_state, state.grad_scaler, state.spike)
