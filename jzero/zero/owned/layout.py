"""The owned layout (`zero.path: owned`): whole-tensor ownership, for optimizers that need whole tensors.

Muon's Newton-Schulz, Adafactor's factored moments, Shampoo's preconditioners work on whole matrices, so
a rank must hold whole params to step them. Here each param, or each layer of a stacked `[L, ...]` param,
is owned whole by one rank of its DP domain (`plan.py`: who owns what, and where in the owner's segment),
and the step moves DDP's bytes:

    grads: each rank's local grads (the spec layout's backward, `spec/grads.run_phase`) packed into
           `[d, S]` by owner and reduce-scattered over the domain, in parts of `REDUCE_CHUNK` (or
           `zero.bucket_size` / d) elements per owner (ZeRO-1: once, after the last micro-batch; ZeRO-2:
           every micro-batch, into the `[S]` accumulator); under HSDP then all-reduced across
           dp_outer. Every rank holds its own segment `[S]` of the reduced grads.
    -> the global norm and inf/nan flag: scalar psums over the segments (every element counted once)
    -> the inner optax chain as it is, on the rank's pieces whole: the params tree with each piece the
           rank owns (a stacked param: its owned layers, `[k, ...]`) and `optax.MaskedNode()` for the
           rest (as `optax.masked` hands a transformation its params); each rank runs its own branch of
           a `lax.switch`, with no collective inside
    -> one all-gather of the updated `[S]` segments into the params tree, in the params' dtype (fp32 where
           the params' dtypes differ: one segment holds them all).

Megatron-Core 0.16.1's `LayerWiseDistributedOptimizer` owns the same way but all-reduces the whole
gradient and all-gathers uneven segments: 1.5x DDP's bytes (docs/owned.md).

Shardings (`n`: the ranks of the dense domain's inner axes, `S`: a domain's segment length):
  params:                  the params tree, replicated over DP (ZeRO-1/2: `Stage.params_rest_sharded`
                           is False on this layout)
  reduced grads:           per domain `[n, S]`, row q = rank q's segment, split over the inner dense axes
  fp32 main params:        per domain `[n, S]`, alike (kept only where some param is not fp32)
  inner state:             per dtype `[n, N]`: rank q's inner state, its leaves raveled and concatenated
The inner chain must treat params independently (no norm or coupling across params inside it; clip
with `clip_grad`): `probe.check_per_tensor` refuses one that does not, when the run is built.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.errors import ConfigError
from jzero.mesh import BATCH_AXES, OUTER_AXIS, axes_size, entry_axes
from jzero.zero.common import groups as groups_lib
from jzero.zero.common import loss_scale as scaler
from jzero.zero.common import spike
from jzero.zero.common.batch import split_batch
from jzero.zero.common.offload import no_offload
from jzero.zero.common.probe import check_per_tensor, check_runs_owning_nothing, transformation_name
from jzero.zero.common.schedule import Phase, run_schedule
from jzero.zero.common.state import TrainState, ZeroState, keeps_main_params, loss_parts, model_state_shardings
from jzero.zero.common.strategies import restrict
from jzero.zero.common.update import Update, clip_coefficient, finish, inner_update, kept_main
from jzero.zero.config import ShardingStrategy, Stage
from jzero.zero.engine import Layout, LayoutInputs
from jzero.zero.owned.plan import OwnedPlan, make_owned_plan
from jzero.zero.spec.grads import run_phase
from jzero.zero.spec.layout import evaluate_fn

PyTree = Any
MASKED = optax.MaskedNode()
# The grads reach their owners in parts of at most this many elements per owner (`zero.bucket_size` / d
# where set): the packed `[d, S]` buffer is never a second whole copy of the local grads (LLaMA-2-7B's
# would be 25 GiB in fp32); a part is `d x 4M` elements, 128 MiB at d = 8 in fp32.
REDUCE_CHUNK = 2**22


@dataclasses.dataclass(frozen=True)
class _StateLayout:
    """Where rank `branch`'s inner-state leaves sit in the per-dtype buffers: its treedef, and per leaf
    (dtype name, offset, shape) and its key path."""

    treedef: Any
    leaves: tuple[tuple[str, int, tuple[int, ...]], ...]
    paths: tuple[tuple, ...]

    @property
    def shapes(self) -> dict[tuple, tuple[int, ...]]:
        return {path: shape for path, (_, _, shape) in zip(self.paths, self.leaves)}


def _view(owned: OwnedPlan, branch: int, segments: list[jax.Array], treedef) -> PyTree:
    """The params tree as rank `branch` steps it (inside shard_map, or on global values in model-space
    conversions): each param it owns (a stacked one: its owned layers `[k, ...]`) read from its segments
    `[S]`, one per domain, `MASKED` elsewhere."""
    out = [MASKED] * len(owned.local_shapes)
    for d, dom in enumerate(owned.domains):
        pieces = dom.owned(owned.owner(dom, branch))
        for leaf in dict.fromkeys(p.leaf for p in pieces):
            mine = [p for p in pieces if p.leaf == leaf]
            start = mine[0].offset
            out[leaf] = segments[d][start : start + sum(p.numel for p in mine)].reshape(owned.view_shape(branch, leaf))
    return jax.tree.unflatten(treedef, out)


def _segment(owned: OwnedPlan, d: int, owner: int, leaves: list, dtype) -> jax.Array:
    """Per rank (inside shard_map) or on global values: owner `owner`'s segment `[S]` of domain `d` from the
    params' local `leaves` (all layers; ep-local experts)."""
    return _segment_part(owned, d, owner, leaves, dtype, 0, owned.domains[d].size)


def _segment_part(owned: OwnedPlan, d: int, owner: int, leaves: list, dtype, start: int, stop: int) -> jax.Array:
    """Elements `[start, stop)` of owner `owner`'s segment of domain `d` (`_segment`'s, without the rest),
    zero-padded past its pieces."""
    parts, at = [], start
    for p in owned.domains[d].owned(owner):
        lo, hi = max(start, p.offset), min(stop, p.offset + p.numel)
        if lo < hi:
            value = leaves[p.leaf] if p.layer is None else leaves[p.leaf][p.layer]
            parts.append(value.reshape(-1)[lo - p.offset : hi - p.offset].astype(dtype))
            at = hi
    return jnp.concatenate(parts + [jnp.zeros((stop - at,), dtype)])


def _pack_view(owned: OwnedPlan, branch: int, view: PyTree, dtype) -> list[jax.Array]:
    """Inverse of `_view`: per domain, rank `branch`'s segment `[S]` from its view."""
    leaves = jax.tree.leaves(view, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    out = []
    for dom in owned.domains:
        pieces = dom.owned(owned.owner(dom, branch))
        parts = [leaves[leaf].reshape(-1).astype(dtype) for leaf in dict.fromkeys(p.leaf for p in pieces)]
        pad = dom.size - sum(p.numel for p in pieces)
        out.append(jnp.concatenate(parts + [jnp.zeros((pad,), dtype)]))
    return out


def _unpack(owned: OwnedPlan, gathered: list[jax.Array], n_leaves: int) -> list[jax.Array]:
    """Per rank, inside shard_map: every param's local value (ep-local experts) from the all-gathered
    segments, per domain `[d, S]`."""
    out: list = [None] * n_leaves
    for d, dom in enumerate(owned.domains):
        layers: dict[int, list] = {}
        for p in dom.pieces:
            shape = owned.local_shapes[p.leaf][1:] if p.layer is not None else owned.local_shapes[p.leaf]
            value = gathered[d][p.owner, p.offset : p.offset + p.numel].reshape(shape)
            if p.layer is None:
                out[p.leaf] = value
            else:
                layers.setdefault(p.leaf, []).append((p.layer, value))
        for leaf, values in layers.items():
            out[leaf] = jnp.stack([v for _, v in sorted(values, key=lambda x: x[0])])
    return out


class _State:
    """The inner state's per-rank layouts and the per-dtype buffer sizes (module docstring)."""

    def __init__(self, inner: optax.GradientTransformation, owned: OwnedPlan, treedef):
        self.layouts: list[_StateLayout] = []
        sizes: dict[str, int] = {}
        for b in range(owned.ranks):
            abstract = self._abstract_view(owned, b, treedef)
            with_paths, tdef = jax.tree_util.tree_flatten_with_path(jax.eval_shape(inner.init, abstract))
            leaves = [x for _, x in with_paths]
            offsets: dict[str, int] = {}
            entries = []
            for x in leaves:
                name = jnp.dtype(x.dtype).name
                entries.append((name, offsets.get(name, 0), tuple(x.shape)))
                offsets[name] = offsets.get(name, 0) + math.prod(x.shape)
            self.layouts.append(_StateLayout(tdef, tuple(entries), tuple(tuple(p) for p, _ in with_paths)))
            for name, n in offsets.items():
                sizes[name] = max(sizes.get(name, 1), n)
        self.sizes = dict(sorted(sizes.items()))

    @staticmethod
    def _abstract_view(owned: OwnedPlan, branch: int, treedef) -> PyTree:
        shapes = [owned.view_shape(branch, leaf) for leaf in range(len(owned.local_shapes))]
        out = [MASKED if shape is None else jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes]
        return jax.tree.unflatten(treedef, out)

    def unpack(self, branch: int, rows: dict[str, jax.Array]) -> optax.OptState:
        layout = self.layouts[branch]
        leaves = [rows[name][off : off + math.prod(shape)].reshape(shape) for name, off, shape in layout.leaves]
        return jax.tree.unflatten(layout.treedef, leaves)

    def pack(self, branch: int, state: optax.OptState) -> dict[str, jax.Array]:
        parts: dict[str, list] = {name: [] for name in self.sizes}
        for x, (name, _, _) in zip(jax.tree.leaves(state), self.layouts[branch].leaves):
            parts[name].append(jnp.asarray(x).reshape(-1).astype(name))  # as init laid it out, whatever update returns
        out = {}
        for name, size in self.sizes.items():
            used = sum(x.size for x in parts[name])
            out[name] = jnp.concatenate(parts[name] + [jnp.zeros((size - used,), name)])
        return out


def _state_cost(inner: optax.GradientTransformation, plan) -> list[float]:
    """Per param, its inner state's elements per element of it (Adam: 2, a Muon matrix: 1), which
    `plan.make_owned_plan` balances beside the elements."""
    tensors = jax.tree.leaves(plan.tensors)
    abstract = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, jnp.float32), plan.tensors)
    state = [0] * len(tensors)
    for path, x in jax.tree_util.tree_flatten_with_path(jax.eval_shape(inner.init, abstract))[0]:
        owner = plan.param_of(tuple(path))
        if owner is not None and x.shape:
            state[plan.index(owner)] += x.size
    return [n / max(1, t.numel) for n, t in zip(state, tensors)]


def owned_layout(inputs: LayoutInputs) -> Layout:
    """The owned layout of a run (module docstring): its shardings and traceable programs."""
    plan, options, config, model_state, inner = (
        inputs.plan,
        inputs.options,
        inputs.config,
        inputs.model_state,
        inputs.inner,
    )
    mesh, stage, loss_scale = plan.mesh, plan.stage, options.loss_scale
    cost = _state_cost(inner, plan)
    owned = make_owned_plan(plan, config.owned_balance, cost)
    whole = check_per_tensor(inner, plan, owned, inputs.groups)
    if whole:  # a chain that couples a stack's layers (Adafactor's block RMS): its owner holds the stack whole
        owned = make_owned_plan(plan, config.owned_balance, cost, whole)
    treedef = jax.tree.structure(plan.tensors)
    tensors = jax.tree.leaves(plan.tensors)
    n_leaves, axes, n = len(tensors), owned.axes, owned.ranks
    if any(not any(owned.owned_layers(b, i) for i in range(n_leaves)) for b in range(n)):
        check_runs_owning_nothing(inner, plan, n)
    keep_main = keeps_main_params(tensors)
    state = _State(inner, owned, treedef)
    values = None if inputs.groups is None else groups_lib.per_param_values(inputs.groups)
    outer = (OUTER_AXIS,) if plan.hsdp else ()
    rows, replicated = P(axes), NamedSharding(mesh, P())
    row_sh = NamedSharding(mesh, rows)
    param_specs = [restrict(t.tp_spec, BATCH_AXES) for t in tensors]
    local_plan = dataclasses.replace(plan, stage=Stage.of(ShardingStrategy.NO_SHARD, overlap_grad_reduce=False))
    reduce_dtype = jnp.dtype(options.grad_reduce_dtype)
    gather_dtype = tensors[0].dtype if len({t.dtype for t in tensors}) == 1 else jnp.float32

    def shard_map(fn, in_specs, out_specs):
        # check_vma=False: the gathered params are the same on every rank, which JAX 0.10-0.11's public
        # all_gather does not type (as the flat layout's: docs/xla.md, "shard_map and check_vma")
        return jax.shard_map(
            fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(BATCH_AXES), check_vma=False
        )

    def branch_index():
        return jax.lax.axis_index(axes)

    # --- grads -------------------------------------------------------------------------------------
    chunk = None if config.bucket_size is None else max(1, config.bucket_size // max(dom.d for dom in owned.domains))

    def rank_to_owners(local):  # this rank's local grads [1, *local] -> per domain its reduced segment [1, S]
        leaves = [x[0] for x in local]
        out = []
        for d, dom in enumerate(owned.domains):
            step = chunk or -(-dom.size // max(1, -(-dom.size // REDUCE_CHUNK)))
            segs = []
            for start in range(0, dom.size, step):  # a [d, step] part of the [d, S] buffer at a time
                stop = min(dom.size, start + step)
                buf = jnp.stack([_segment_part(owned, d, r, leaves, reduce_dtype, start, stop) for r in range(dom.d)])
                segs.append(jax.lax.psum_scatter(buf, dom.axes, scatter_dimension=0, tiled=True))  # [1, stop - start]
            seg = jnp.concatenate(segs, axis=1)  # [1, S]
            out.append(jax.lax.psum(seg, outer) if outer else seg)
        return tuple(out)

    local_specs = [restrict(t.local_grad_spec, BATCH_AXES) for t in tensors]
    to_owners_fn = shard_map(rank_to_owners, (local_specs,), tuple(rows for _ in owned.domains))

    def to_owners(g):  # stacked local grads [n_dp, *shape] (a tree) -> per domain [n, S]
        return to_owners_fn(jax.tree.leaves(g))

    loss_metrics = loss_parts(inputs.loss_fn, options.has_aux, model_state)

    def grads(params, batch, loss_scale_value, model_state_value):
        mbs = split_batch(batch, axes_size(mesh, BATCH_AXES), options.microbatches)
        mbs = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, BATCH_AXES))), mbs)

        def run(phase, params, mb, acc=None):
            loss, metrics, g, _ = run_phase(
                loss_metrics,
                local_plan,
                options,
                config,
                Phase.FIRST,
                params,
                mb,
                loss_scale=loss_scale_value,
                model_state=model_state_value,
            )
            return loss, metrics, to_owners(g) if stage.shards_grads else g, None

        def zeros():
            return tuple(
                jax.lax.with_sharding_constraint(jnp.zeros((n, dom.size), reduce_dtype), row_sh)
                for dom in owned.domains
            )

        losses, (metrics, stats), g = run_schedule(run, params, mbs, stage, zeros, to_owners)
        stats = jax.tree.map(lambda x: jnp.sum(x.reshape(-1, *x.shape[2:]), axis=0), stats)
        return (jnp.mean(losses), jax.tree.map(jnp.mean, metrics), stats), g

    # --- the optimizer step ------------------------------------------------------------------------
    def branch_step(b, leaves, segs, mains, state_rows):
        if not keep_main:  # the fp32 params are the main params: this rank's own pieces of them
            mains = [
                _segment(owned, d, owned.owner(dom, b), leaves, jnp.float32) for d, dom in enumerate(owned.domains)
            ]
        main_view = _view(owned, b, mains, treedef)
        grad_view = _view(owned, b, segs, treedef)
        group_view = None
        if values is not None:
            mask = jax.tree.unflatten(treedef, [bool(owned.owned_layers(b, i)) for i in range(n_leaves)])
            group_view = jax.tree.map(lambda v, m: v if m else MASKED, values, groups_lib.GroupValues(mask, mask))
        updates, new_inner = inner_update(inner, grad_view, state.unpack(b, state_rows), main_view, group_view)
        new_main = optax.apply_updates(main_view, updates)
        return tuple(_pack_view(owned, b, new_main, jnp.float32)), state.pack(b, new_inner)

    def rank_update(params, grads, opt_state):
        leaves = list(params)
        segs = [g[0].astype(jnp.float32) for g in grads]
        mains = [m[0] for m in opt_state.main_params] if keep_main else None
        state_rows = {k: v[0] for k, v in opt_state.inner_state.items()}
        skip = None
        if loss_scale is not None:
            segs = scaler.unscale(segs, opt_state.grad_scaler.loss_scale)
            skip = jax.lax.psum(scaler.found_inf(segs).astype(jnp.int32), axes) > 0
        norm = jnp.sqrt(jax.lax.psum(sum(jnp.sum(jnp.square(s)) for s in segs), axes))
        if options.clip_grad is not None:
            coeff = clip_coefficient(norm, options.clip_grad)
            segs = [s * coeff for s in segs]
        branches = [functools.partial(branch_step, b) for b in range(n)]
        new_main, new_rows = jax.lax.switch(branch_index(), branches, leaves, segs, mains, state_rows)
        old = ZeroState(opt_state.main_params, opt_state.inner_state, opt_state.grad_scaler, opt_state.spike)
        update = Update(new_main, None, norm, skip)
        if keep_main:
            new_main = kept_main(loss_scale, update, old, tuple(mains), options.skip_nonfinite, options.spike_guard)
        gathered = [
            jax.lax.all_gather(m.astype(gather_dtype), dom.axes, tiled=False) for m, dom in zip(new_main, owned.domains)
        ]
        new_leaves = [x.astype(t.dtype) for x, t in zip(_unpack(owned, gathered, n_leaves), tensors)]
        new_state = ZeroState(
            tuple(m[None] for m in new_main) if keep_main else None, {k: v[None] for k, v in new_rows.items()}
        )
        new_params, new_state, metrics = finish(
            loss_scale, update, tuple(leaves), old, tuple(new_leaves), new_state, options.skip_nonfinite,
            options.spike_guard,
        )
        return new_params, new_state, metrics

    opt_specs = ZeroState(
        tuple(rows for _ in owned.domains) if keep_main else None,
        {k: rows for k in state.sizes},
        None if loss_scale is None else scaler.LossScaleState(*[P()] * len(scaler.LossScaleState._fields)),
        None if options.spike_guard is None else spike.SpikeState(*[P()] * len(spike.SpikeState._fields)),
    )
    update_fn = shard_map(
        rank_update,
        (tuple(param_specs), tuple(rows for _ in owned.domains), opt_specs),
        (tuple(param_specs), opt_specs, P()),
    )

    def update(params, opt_state, g):
        new_params, new_state, metrics = update_fn(tuple(jax.tree.leaves(params)), g, opt_state)
        return jax.tree.unflatten(treedef, list(new_params)), new_state, metrics

    # --- init, shardings, model space --------------------------------------------------------------
    def rank_init(params):
        leaves = list(params)

        def branch(b, leaves):
            segs = [_segment(owned, d, owned.owner(dom, b), leaves, jnp.float32) for d, dom in enumerate(owned.domains)]
            return tuple(segs), state.pack(b, inner.init(_view(owned, b, segs, treedef)))

        mains, inner_rows = jax.lax.switch(branch_index(), [functools.partial(branch, b) for b in range(n)], leaves)
        return tuple(m[None] for m in mains), {k: v[None] for k, v in inner_rows.items()}

    init_fn = shard_map(
        rank_init, (tuple(param_specs),), (tuple(rows for _ in owned.domains), {k: rows for k in state.sizes})
    )

    def init_opt(params):
        mains, inner_rows = init_fn(tuple(jax.tree.leaves(params)))
        return ZeroState(
            mains if keep_main else None, inner_rows, None if loss_scale is None else scaler.init(loss_scale),
            None if options.spike_guard is None else spike.init(options.spike_guard),
        )  # fmt: skip

    opt_shardings = ZeroState(
        tuple(row_sh for _ in owned.domains) if keep_main else None,
        {k: row_sh for k in state.sizes},
        None if loss_scale is None else scaler.shardings(mesh),
        None if options.spike_guard is None else spike.shardings(mesh),
    )
    shardings = TrainState(
        local_plan.param_shardings(),  # tp-split, replicated over DP
        opt_shardings,
        replicated,
        model_state_shardings(model_state, replicated),
    )
    offload = no_offload(opt_shardings)

    def grad_buffer(dtype) -> PyTree:
        if stage.shards_grads:
            return tuple(jax.ShapeDtypeStruct((n, dom.size), dtype, sharding=row_sh) for dom in owned.domains)
        return jax.tree.map(
            lambda t: jax.ShapeDtypeStruct(t.shape, dtype, sharding=NamedSharding(mesh, t.tp_spec)), plan.tensors
        )

    convert = _ModelSpace(owned, state, inner, plan, treedef, keep_main)
    return Layout(
        shardings=shardings,
        grad_shardings=tuple(row_sh for _ in owned.domains),
        init_opt=init_opt,
        grads=grads,
        update=update,
        evaluate=evaluate_fn(inputs.loss_fn, local_plan, options, False, model_state),
        offload=offload,
        grad_buffer=grad_buffer,
        to_model_space=convert.to_model_space,
        from_model_space=convert.from_model_space,
        owned=owned,
    )


class _ModelSpace:
    """The owned state <-> the spec layout's per-parameter state in global shapes (checkpoints, resume onto
    another layout). Traceable on global arrays (the caller sets the output shardings): every piece is read
    from (written to) the rows of the ranks that own it, each ep rank's slice of an expert param from its own
    row (row q: the dense owner q; the expert owner q // ep's pieces of ep slice q % ep).

    Each inner-state leaf is classified once, when the layout is built: laid out like its param (Adam's
    moments, Muon's momentum: assembled from the owners' pieces), or the same model-space value on every
    rank that holds it (step counts, Adafactor's placeholders: any rank's). Any other leaf is refused with
    a ConfigError naming it, not converted wrong later."""

    def __init__(self, owned: OwnedPlan, state: _State, inner, plan, treedef, keep_main: bool):
        self.owned, self.state, self.plan, self.treedef, self.keep_main = owned, state, plan, treedef, keep_main
        self.tensors = jax.tree.leaves(plan.tensors)
        self.ep = plan.mesh.shape["ep"]
        abstract = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, jnp.float32), plan.tensors)
        self.model_inner = jax.eval_shape(inner.init, abstract)
        self.kinds = self._classify(transformation_name(inner))

    def _ep_dim(self, leaf: int) -> int | None:
        spec = tuple(self.tensors[leaf].tp_spec)
        return next((i for i, e in enumerate(spec) if "ep" in entry_axes(e)), None)

    def _param_leaf(self, path) -> int | None:
        owner = self.plan.param_of(tuple(path))
        return None if owner is None else self.plan.index(owner)

    def _classify(self, what: str) -> dict[tuple, int | None]:
        """Per model-space inner-state path: its param's leaf index where it is laid out like the param on
        every rank, None where every rank holding it holds the model-space value (module docstring)."""
        kinds = {}
        for path, like in jax.tree_util.tree_flatten_with_path(self.model_inner)[0]:
            path, i = tuple(path), self._param_leaf(path)
            held = {b: lay.shapes[path] for b, lay in enumerate(self.state.layouts) if path in lay.shapes}
            if i is not None and held and self._laid_like(i, tuple(like.shape), held):
                kinds[path] = i
            elif held and all(shape == tuple(like.shape) for shape in held.values()):
                kinds[path] = None
            else:
                raise ConfigError(
                    f"zero.path=owned cannot convert {what}'s state leaf {jax.tree_util.keystr(path)} "
                    f"{tuple(like.shape)} to model space for checkpoints: on a rank it is neither laid out like its "
                    "param's owned layers nor the same whole value; use zero.path=spec"
                )
        return kinds

    def _laid_like(self, i: int, shape: tuple[int, ...], held: dict[int, tuple[int, ...]]) -> bool:
        """Whether a state leaf of model-space `shape` follows param `i`'s pieces on every rank holding it:
        its owned layers on the leading dim (a stacked param's; Adafactor's factored rows too), or its view."""
        t = self.tensors[i]
        if self.owned.stacked[i] and self._ep_dim(i) is None and shape and shape[0] == t.shape[0]:
            return all(s == (len(self.owned.owned_layers(b, i)), *shape[1:]) for b, s in held.items())
        return shape == t.shape and all(s == self.owned.view_shape(b, i) for b, s in held.items())

    def _ranks_of(self, leaf: int) -> list[tuple[int, int, list]]:
        """(branch, ep index, owned layers) of every rank holding part of `leaf` (each ep slice once)."""
        out, seen = [], set()
        dom = self.owned.domains[self.owned.domain_of(leaf)]
        for b in range(self.owned.ranks):
            layers = self.owned.owned_layers(b, leaf)
            j = b % self.ep if self._ep_dim(leaf) is not None else 0
            if layers and (self.owned.owner(dom, b), j) not in seen:
                seen.add((self.owned.owner(dom, b), j))
                out.append((b, j, layers))
        return out

    def _assemble(self, leaf: int, parts: dict[int, jax.Array]) -> jax.Array:
        """The global value of `leaf` (or of a state leaf laid out like it) from each holding rank's part."""
        by_ep: dict[int, dict] = {}
        for b, j, layers in self._ranks_of(leaf):
            for k, layer in enumerate(layers):
                by_ep.setdefault(j, {})[layer] = parts[b] if layer is None else parts[b][k]
        slices = [p[None] if None in p else jnp.stack([p[k] for k in sorted(p)]) for _, p in sorted(by_ep.items())]
        ep_dim = self._ep_dim(leaf)
        return slices[0] if ep_dim is None else jnp.concatenate(slices, axis=ep_dim)

    def _local(self, leaf: int, value: jax.Array, b: int, layers: bool = False) -> jax.Array:
        """Rank `b`'s part of a global `leaf`-shaped value: its ep slice, and with `layers` only its owned layers."""
        ep_dim = self._ep_dim(leaf)
        if ep_dim is not None:
            size = value.shape[ep_dim] // self.ep
            value = jax.lax.slice_in_dim(value, (b % self.ep) * size, (b % self.ep + 1) * size, axis=ep_dim)
        if layers and self.owned.stacked[leaf]:
            value = value[np.asarray(self.owned.owned_layers(b, leaf))]
        return value

    def to_model_space(self, opt_state: ZeroState) -> ZeroState:
        """The owned `ZeroState` (global arrays) -> the spec layout's, per parameter in global shapes."""
        owned, n_leaves = self.owned, len(self.tensors)
        main = None
        if self.keep_main:
            views = {
                b: jax.tree.leaves(_view(owned, b, [m[b] for m in opt_state.main_params], self.treedef),
                                   is_leaf=lambda x: isinstance(x, optax.MaskedNode))
                for b in range(owned.ranks)
            }  # fmt: skip
            parts = [{b: views[b][i] for b, _, _ in self._ranks_of(i)} for i in range(n_leaves)]
            main = jax.tree.unflatten(self.treedef, [self._assemble(i, p) for i, p in enumerate(parts)])
        states = [self.state.unpack(b, {k: v[b] for k, v in opt_state.inner_state.items()}) for b in range(owned.ranks)]
        by_path = [dict((tuple(p), x) for p, x in jax.tree_util.tree_flatten_with_path(s)[0]) for s in states]

        def leaf(path, like):
            path, i = tuple(path), self.kinds[tuple(path)]
            if i is None:
                return next(bp[path] for bp in by_path if path in bp)
            return self._assemble(i, {b: by_path[b][path] for b, _, _ in self._ranks_of(i)})

        return ZeroState(
            main, jax.tree_util.tree_map_with_path(leaf, self.model_inner), opt_state.grad_scaler, opt_state.spike
        )

    def from_model_space(self, opt_state: ZeroState) -> ZeroState:
        """Inverse of `to_model_space`: every rank's segments and state rows, stacked `[n, ...]`."""
        owned, mains = self.owned, None
        if self.keep_main:
            leaves = jax.tree.leaves(opt_state.main_params)
            mains = tuple(
                jnp.stack([
                    _segment(owned, d, owned.owner(dom, b), [self._local(i, x, b) for i, x in enumerate(leaves)],
                             jnp.float32)
                    for b in range(owned.ranks)
                ])
                for d, dom in enumerate(owned.domains)
            )  # fmt: skip
        model = dict((tuple(p), x) for p, x in jax.tree_util.tree_flatten_with_path(opt_state.inner_state)[0])
        rows: dict[str, list] = {k: [] for k in self.state.sizes}
        for b in range(owned.ranks):
            layout = self.state.layouts[b]
            leaves = []
            for path in layout.paths:
                i = self.kinds[path]
                leaves.append(model[path] if i is None else self._local(i, model[path], b, layers=True))
            for k, v in self.state.pack(b, jax.tree.unflatten(layout.treedef, leaves)).items():
                rows[k].append(v)
        return ZeroState(mains, {k: jnp.stack(v) for k, v in rows.items()}, opt_state.grad_scaler, opt_state.spike)
