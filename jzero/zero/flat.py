"""The explicit path (`zero.path: flat`): Megatron's flat buffers, bucketed psum_scatter / all_gather.

Each device (inside `jax.shard_map`, manual over every mesh axis) sees its tp-local
params. Its local grads are laid into one flat buffer with Megatron's layout
(`buffers.build_layout` over the tp-local element counts, params in
`jax.tree.leaves` order), bucket by bucket. Per bucket:

  ZeRO-2 (optim_grads): psum_scatter over the DP domain; rank r keeps its shard
      `[r*S/d, (r+1)*S/d)` (every microbatch, so only the shard is ever accumulated).
  ZeRO-1 (optim) / DDP (no_shard): psum of the whole bucket (after accumulation);
      ZeRO-1 then slices the rank's shard.

The inner optax transformation steps on the owned fp32 shards; the updated shards
are cast to the param dtype and all_gathered per bucket back into the params.

Global arrays (d = DP-domain size, S_b = padded size of bucket b):
  params:                  as the spec path, tp-sharded, replicated over DP
  main params / optimizer: one array per bucket, [tp, S_b] sharded P("tp", dp_axes)
                           (P("tp", None) under no_shard); main params only for non-fp32 params
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jzero.config import ConfigError
from jzero.mesh import BATCH_AXES, TP_AXIS, axes_size
from jzero.zero.buffers import Layout, build_layout
from jzero.zero.optimizer import ZeroState
from jzero.zero.step import TrainState, _split_batch, batch_sharding
from jzero.zero.strategies import ShardingPlan

PyTree = Any


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
        return self.plan.shards_state

    def bucket_spec(self) -> P:
        return P(TP_AXIS, self.dp_axes if self.sharded else None)

    def bucket_shapes(self) -> list[tuple[int, int]]:
        n_tp = self.plan.mesh.shape[TP_AXIS]
        return [(n_tp, end - start) for start, end in self.layout.bucket_indices]

    def norm_weights(self) -> list[np.ndarray]:
        """Per bucket, 1.0 on elements of tp-split params, 0.0 elsewhere (incl. padding)."""
        out = []
        for b, (start, end) in enumerate(self.layout.bucket_indices):
            w = np.zeros(end - start, np.float32)
            for i in self.layout.bucket_params[b]:
                ps, pe, _ = self.layout.param_index_map[i]
                w[ps - start : pe - start] = float(self.tp_sharded[i])
            out.append(w)
        return out


def make_flat_plan(plan: ShardingPlan, bucket_size: int | None, pad_for_high_nccl_busbw: bool) -> FlatPlan:
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
    tp_sharded = tuple(any(e is not None for e in t.tp_spec) and mesh.shape[TP_AXIS] > 1 for t in tensors)
    return FlatPlan(plan, layout, tuple(local_shapes), tp_sharded)


# ---------------------------------------------------------------- local (per-device) buffer ops


def _assemble(fp: FlatPlan, b: int, rows: list, zeros) -> jax.Array:
    """Bucket b from per-param rows (leaves order, flattened on the last axis), with
    `zeros(n)` in the 64-element alignment gaps and the end padding."""
    start, end = fp.layout.bucket_indices[b]
    pieces, cursor = [], start
    for i in fp.layout.bucket_params[b]:
        ps, pe, _ = fp.layout.param_index_map[i]
        if ps > cursor:
            pieces.append(zeros(ps - cursor))
        pieces.append(rows[i])
        cursor = pe
    if end > cursor:
        pieces.append(zeros(end - cursor))
    return jnp.concatenate(pieces, axis=-1)


def flatten(fp: FlatPlan, leaves: list[jax.Array], dtype) -> list[jax.Array]:
    """tp-local param-shaped leaves -> one [S_b] array per bucket, zero in alignment/padding gaps."""
    rows = [x.reshape(-1).astype(dtype) for x in leaves]
    return [_assemble(fp, b, rows, lambda n: jnp.zeros(n, dtype)) for b in range(len(fp.layout.bucket_indices))]


def unflatten(fp: FlatPlan, buckets: list[jax.Array], dtypes: list) -> list[jax.Array]:
    """Inverse of `flatten`: full [S_b] buckets -> tp-local params (leaves order)."""
    leaves = [None] * len(fp.local_shapes)
    for b, (start, _) in enumerate(fp.layout.bucket_indices):
        for i in fp.layout.bucket_params[b]:
            ps, pe, _ = fp.layout.param_index_map[i]
            leaves[i] = buckets[b][ps - start : pe - start].reshape(fp.local_shapes[i]).astype(dtypes[i])
    return leaves


def _owned(fp: FlatPlan, bucket: jax.Array) -> jax.Array:
    """This rank's shard of a full [S_b] bucket: [r*S_b/d, (r+1)*S_b/d)."""
    if not fp.sharded:
        return bucket
    size = bucket.shape[0] // fp.d
    return jax.lax.dynamic_slice_in_dim(bucket, jax.lax.axis_index(fp.dp_axes) * size, size)


# ---------------------------------------------------------------- the step


def check_elementwise(inner: optax.GradientTransformation, abstract_params: PyTree) -> None:
    """Refuses transformations whose updates change on a flat buffer (FACTS 8).

    Runs two updates of `inner` and of `optax.flatten(inner)` on a miniature tree of
    the same structure and ranks (each dim cut to 3) and compares the updates per
    tensor: per-tensor masks, trust ratios or factored moments differ far above
    rounding (seen: adamw 1e-9, a weight-decay mask 1e-4, lamb 4e-3).
    """
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal([min(n, 3) for n in x.shape]), jnp.float32), abstract_params)
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params) for _ in range(2)]
    flat = optax.flatten(inner)
    state, flat_state, p, worst = inner.init(params), flat.init(params), params, 0.0
    for g in grads:
        u, state = inner.update(g, state, p)
        u_flat, flat_state = flat.update(g, flat_state, p)
        for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(u_flat)):
            worst = max(worst, float(jnp.linalg.norm(a - b) / (jnp.linalg.norm(b) + 1e-30)))
        p = optax.apply_updates(p, u)
    if worst > 1e-6:
        raise ConfigError(
            "zero.path=flat needs an element-wise optimizer: this optax transformation gives different updates "
            f"on a flat buffer (relative difference {worst:.1e}: per-tensor masks, trust ratios or factored "
            "moments); use zero.path=spec"
        )


def flat_state_shardings(inner: optax.GradientTransformation, fp: FlatPlan, keep_main: bool) -> ZeroState:
    mesh = fp.plan.mesh
    bucket_sh = NamedSharding(mesh, fp.bucket_spec())
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in fp.bucket_shapes()]
    abstract = jax.eval_shape(inner.init, shapes)
    inner_sh = optax.tree_map_params(
        inner, lambda _: bucket_sh, abstract, transform_non_params=lambda _: NamedSharding(mesh, P())
    )
    return ZeroState([bucket_sh] * len(shapes) if keep_main else None, inner_sh)


def _specs(shardings: PyTree) -> PyTree:
    return jax.tree.map(lambda s: s.spec, shardings)


def build_flat_train_step(
    loss_fn,
    inner: optax.GradientTransformation,
    fp: FlatPlan,
    state_shardings: TrainState,
    *,
    microbatches: int = 1,
    grad_reduce_dtype=jnp.float32,
    clip_grad: float | None = None,
):
    """The flat path's jitted step, its optimizer init and its grads (see `FlatStep`).

    Args:
      loss_fn: (params, local batch, tp_axis) -> mean loss; with tp_axis set, the model
        sums its row-parallel outputs over it (runs on tp-local params).
    """
    mesh, plan = fp.plan.mesh, fp.plan
    treedef = jax.tree.structure(plan.tensors)
    dtypes = [t.dtype for t in jax.tree.leaves(plan.tensors)]
    param_specs = _specs(plan.param_shardings())
    opt_specs = _specs(state_shardings.opt_state)
    n_buckets = len(fp.layout.bucket_indices)
    reduce_spec = P(TP_AXIS, fp.dp_axes if plan.shards_grads else None)
    scale = 1.0 / (fp.d * microbatches)
    keep_main = state_shardings.opt_state.main_params is not None

    def reduce(buckets):
        if plan.shards_grads:
            return [jax.lax.psum_scatter(g, fp.dp_axes, scatter_dimension=0, tiled=True) for g in buckets]
        return [jax.lax.psum(g, fp.dp_axes) for g in buckets]

    def local_grad_buckets(params, mb):
        # Params are DP-invariant; differentiating them directly would make AD insert the
        # DP all-reduce itself (the transpose of the implicit cast to varying). Casting them
        # to DP-varying first gives this rank's local grads, which the buckets then reduce.
        params = jax.tree.map(lambda p: jax.lax.pcast(p, fp.dp_axes, to="varying"), params)
        loss, g = jax.value_and_grad(loss_fn)(params, mb, TP_AXIS)
        g = [(x.astype(jnp.float32) * scale).astype(grad_reduce_dtype) for x in jax.tree.leaves(g)]
        return loss, flatten(fp, g, grad_reduce_dtype)

    def grads_body(params, batch):
        """Reduced grad buckets: ZeRO-2 owned shards [1, S_b/d], else full [1, S_b]."""
        mbs = jax.tree.map(lambda x: x[:, 0], _split_batch(batch, 1, microbatches))  # [M, b, ...] this rank's
        # The first microbatch seeds the accumulator (so it has the carry's sharding type).
        first, rest = jax.tree.map(lambda x: x[0], mbs), jax.tree.map(lambda x: x[1:], mbs)
        loss, acc = local_grad_buckets(params, first)
        if plan.shards_grads:  # reduce-scatter every microbatch: only the owned shard accumulates
            acc = reduce(acc)

        def body(acc, mb):
            loss, g = local_grad_buckets(params, mb)
            return [a + x for a, x in zip(acc, reduce(g) if plan.shards_grads else g)], loss

        if microbatches > 1:
            acc, losses = jax.lax.scan(body, acc, rest)
            loss = (loss + losses.sum()) / microbatches
        red = acc if plan.shards_grads else reduce(acc)  # DDP / ZeRO-1: reduce once
        return jax.lax.pmean(loss, BATCH_AXES), [r[None] for r in red]

    grads_fn = jax.shard_map(
        grads_body,
        mesh=mesh,
        in_specs=(param_specs, P(BATCH_AXES)),
        out_specs=(P(), [reduce_spec] * n_buckets),
    )

    norm_w = fp.norm_weights()

    def update_body(params, opt_state, grads):
        leaves = jax.tree.leaves(params)
        grads = [g[0].astype(jnp.float32) for g in grads]
        if not plan.shards_grads:
            grads = [_owned(fp, g) for g in grads]
        # Global norm: tp-split params summed over tp too, tp duplicates counted once.
        weights = [_owned(fp, jnp.asarray(w)) for w in norm_w]
        sq_split = sum(jnp.sum(g * g * w) for g, w in zip(grads, weights))
        sq_dup = sum(jnp.sum(g * g * (1 - w)) for g, w in zip(grads, weights))
        dp = fp.dp_axes if fp.sharded else ()  # no_shard: every rank holds all of it
        norm = jnp.sqrt(jax.lax.psum(sq_split, (*dp, TP_AXIS)) + (jax.lax.psum(sq_dup, dp) if dp else sq_dup))
        if clip_grad is not None:
            grads = [g * jnp.minimum(1.0, clip_grad / (norm + 1e-6)) for g in grads]
        if keep_main:
            main = [m[0] for m in opt_state.main_params]
        else:
            main = [_owned(fp, b) for b in flatten(fp, leaves, jnp.float32)]
        inner_state = jax.tree.map(lambda x: x[0] if x.ndim else x, opt_state.inner_state)
        updates, inner_state = inner.update(grads, inner_state, main)
        main = optax.apply_updates(main, updates)
        # All-gather each updated bucket in the param dtype, back into the params.
        gathered = [
            jax.lax.all_gather(m.astype(dtypes[0]), fp.dp_axes, tiled=True) if fp.sharded else m.astype(dtypes[0])
            for m in main
        ]
        new_params = jax.tree.unflatten(treedef, unflatten(fp, gathered, dtypes))
        inner_state = jax.tree.map(lambda x: x[None] if x.ndim else x, inner_state)
        new_main = [m[None] for m in main] if keep_main else None
        return new_params, ZeroState(new_main, inner_state), norm

    # check_vma=False: the output params of tp-replicated tensors are identical on every tp
    # rank by construction (their grads were summed over tp above), which vma typing
    # cannot see through the concatenated buffer. Gradients are taken in grads_fn,
    # which keeps check_vma on (FACTS 3).
    update_fn = jax.shard_map(
        update_body,
        mesh=mesh,
        in_specs=(param_specs, opt_specs, [reduce_spec] * n_buckets),
        out_specs=(param_specs, opt_specs, P()),
        check_vma=False,
    )

    def init_body(params):
        main = [_owned(fp, b) for b in flatten(fp, jax.tree.leaves(params), jnp.float32)]
        inner_state = jax.tree.map(lambda x: x[None] if x.ndim else x, inner.init(main))
        return ZeroState([m[None] for m in main] if keep_main else None, inner_state)

    init_opt = jax.shard_map(init_body, mesh=mesh, in_specs=(param_specs,), out_specs=opt_specs, check_vma=False)

    def step(state: TrainState, batch):
        loss, grads = grads_fn(state.params, batch)
        params, opt_state, norm = update_fn(state.params, state.opt_state, grads)
        return TrainState(params, opt_state, state.step + 1), {"loss": loss, "grad_norm": norm}

    replicated = NamedSharding(mesh, P())
    step_jit = jax.jit(
        step,
        in_shardings=(state_shardings, batch_sharding(mesh)),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
    grads_jit = jax.jit(
        grads_fn,
        in_shardings=(state_shardings.params, batch_sharding(mesh)),
        out_shardings=(replicated, [NamedSharding(mesh, reduce_spec)] * n_buckets),
    )
    return FlatStep(init_opt, step_jit, lambda params, batch: grads_jit(params, batch)[1])


class FlatStep(NamedTuple):
    """init_opt(params) -> ZeroState (call under jit); step(state, batch) -> (state, metrics);
    grads(params, batch) -> reduced grad buckets (for measuring them)."""

    init_opt: Any
    step: Any
    grads: Any


# ---------------------------------------------------------------- model space (checkpoints)
# Global-view conversions between the flat buckets [tp, S_b] and per-param arrays in
# their global shapes; jit them with the target shardings and XLA moves only shards.


def _tp_dim(spec: P) -> int | None:
    dims = [i for i, e in enumerate(spec) if e is not None]
    return dims[0] if dims else None


def buckets_to_params(fp: FlatPlan, buckets: list[jax.Array]) -> list[jax.Array]:
    """[tp, S_b] buckets -> global per-param arrays (leaves order)."""
    n_tp = fp.plan.mesh.shape[TP_AXIS]
    out = [None] * len(fp.local_shapes)
    for b, (start, _) in enumerate(fp.layout.bucket_indices):
        for i in fp.layout.bucket_params[b]:
            ps, pe, _ = fp.layout.param_index_map[i]
            t = jax.tree.leaves(fp.plan.tensors)[i]
            piece = buckets[b][:, ps - start : pe - start].reshape(n_tp, *fp.local_shapes[i])
            k = _tp_dim(t.tp_spec) if fp.tp_sharded[i] else None
            out[i] = piece[0] if k is None else jnp.moveaxis(piece, 0, k).reshape(t.shape)
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
    zeros = lambda n: jnp.zeros((n_tp, n), rows[0].dtype)  # noqa: E731
    return [_assemble(fp, b, rows, zeros) for b in range(len(fp.layout.bucket_indices))]


def _convert_state(inner, state, src_abstract, dst_abstract, n_src: int, convert) -> PyTree:
    """Maps every per-param group of `state` (n_src leaves) through `convert` into dst's structure."""

    def marks(abstract):
        return jax.tree.leaves(optax.tree_map_params(inner, lambda _: True, abstract, transform_non_params=lambda _: False))

    src_marks, dst_marks = marks(src_abstract), marks(dst_abstract)
    src = jax.tree.leaves(state)
    groups, others, j = [], [], 0
    while j < len(src):  # each per-param tree (mu, nu, ...) is a contiguous run of leaves
        if src_marks[j]:
            if not all(src_marks[j : j + n_src]):
                raise ValueError("optimizer state does not map onto the flat buffers one tree per moment")
            groups.append(src[j : j + n_src])
            j += n_src
        else:
            others.append(src[j])
            j += 1
    converted = [y for g in groups for y in convert(g)]
    if len(converted) != sum(dst_marks) or len(others) != len(dst_marks) - sum(dst_marks):
        raise ValueError("optimizer state does not map onto the flat buffers one tree per moment")
    it_param, it_other = iter(converted), iter(others)
    leaves = [next(it_param) if m else next(it_other) for m in dst_marks]
    return jax.tree.unflatten(jax.tree.structure(dst_abstract), leaves)


def flat_to_model_space(fp: FlatPlan, inner: optax.GradientTransformation, opt_state: ZeroState) -> ZeroState:
    """Flat-path optimizer state -> the spec path's per-param ZeroState (same values)."""
    treedef = jax.tree.structure(fp.plan.tensors)
    abstract_params = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, jnp.float32), fp.plan.tensors)
    n_buckets = len(fp.layout.bucket_indices)
    src_abstract = jax.eval_shape(inner.init, [jax.ShapeDtypeStruct(s, jnp.float32) for s in fp.bucket_shapes()])
    dst_abstract = jax.eval_shape(inner.init, abstract_params)
    inner_state = _convert_state(
        inner, opt_state.inner_state, src_abstract, dst_abstract, n_buckets, lambda g: buckets_to_params(fp, g)
    )
    main = opt_state.main_params
    main = None if main is None else jax.tree.unflatten(treedef, buckets_to_params(fp, main))
    return ZeroState(main, inner_state)


def model_space_to_flat(fp: FlatPlan, inner: optax.GradientTransformation, state: ZeroState) -> ZeroState:
    """The spec path's per-param ZeroState -> flat-path buckets (inverse of flat_to_model_space)."""
    abstract_params = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, jnp.float32), fp.plan.tensors)
    n_params = len(jax.tree.leaves(fp.plan.tensors))
    src_abstract = jax.eval_shape(inner.init, abstract_params)
    dst_abstract = jax.eval_shape(inner.init, [jax.ShapeDtypeStruct(s, jnp.float32) for s in fp.bucket_shapes()])
    inner_state = _convert_state(
        inner, state.inner_state, src_abstract, dst_abstract, n_params, lambda g: params_to_buckets(fp, g)
    )
    main = None if state.main_params is None else params_to_buckets(fp, jax.tree.leaves(state.main_params))
    return ZeroState(main, inner_state)
