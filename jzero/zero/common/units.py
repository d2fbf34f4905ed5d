"""FSDP units: where a unit's params are gathered and its grads reduced, inside the backward.

A unit is a group of params used together: one transformer block (Megatron-FSDP's
`fsdp_unit_modules`, one `fully_shard` call in FSDP2). The model marks where a unit runs with

    y = unit(fn, unit_params, *args)        # = fn(unit_params, *args) outside a ZeRO step

(the block's params, and the scan body's slice of them when the layers are stacked). Outside a
ZeRO step (one device, inference) the params are arrays and `unit` is a plain call. Inside the
spec path's step each param of a unit arrives as a `UnitParam`, a pytree of arrays and a static
`Hook`:

  value: the param as it rests between steps: this rank's shard `W[D_dp, F_tp]` where the params
         rest sharded (ZeRO-3, and ZeRO-1/2 with `overlap_param_gather`), else the whole `W[D, F_tp]`.
  sink:  zeros shaped like what the grad becomes: the rank's shard of the DP-reduced grad (ZeRO-1/2/3),
         the whole reduced grad (DDP), or this rank's own unreduced grad (a micro-batch that only
         accumulates). The step differentiates the loss with respect to the sinks, so what reaches
         a sink is the unit's grad, scaled and reduced the moment the unit's backward is done. A
         micro-batch that only accumulates gets the grad unscaled, in the param's dtype (sink dtype
         alike), and the step scales it (`scale_grad`) as it adds it to its accumulator: the
         backward then holds the param dtype's local grads beside the fp32 accumulator, as Megatron
         holds `param.grad` beside `main_grad`, not a second fp32 copy.
  acc:   DDP and ZeRO-1 over several micro-batches: this rank's grads accumulated over the earlier
         micro-batches, added before the last one's reduction (Megatron's grad buffer); else None.
  gsink: zeros shaped like the whole param, whose cotangent is the gathered param (as this rank's
         copy: it is typed DP-varying, as an all_gather's result is): the first
         micro-batch of ZeRO-1/2 with `overlap_param_gather` hands the params it gathered to the
         later micro-batches this way, so they are gathered once per step; else None.

`unit` materializes each param (an all_gather over the inner DP axes where it rests sharded),
runs `fn`, and in backward reduces the param's grad: DDP all-reduces it over its DP domain; the
ZeRO stages reduce-scatter it over the inner DP axes, then all-reduce it across `dp_outer` (HSDP,
outer_strategy no_shard) or reduce-scatter it there too (outer_strategy optim). DDP under HSDP
reduces the same way (reduce-scatter inside, all-reduce across dp_outer) and all-gathers the
reduced shard back over the inner axes (`Hook.regather`): the all-reduce's bytes, of which only
1/d_i crosses dp_outer. With
`reshard_after_forward` (ZeRO-3) the gathered params are not kept for backward
(`RESHARD_POLICY`): they are gathered again when the unit's backward runs, as FSDP2 does.
Params outside every unit (embeddings, final norm, head) are materialized by the step before the
loss runs, and their grads reduced when their backward is complete.

The flat path reduces a unit's grads per flat bucket, not per param: the loss gets the whole unit
as one `GroupParam` leaf (at its first param; `GroupRef`s at the others) holding one `BucketParam`
per bucket, whose static hook (`GroupHook`, the flat path's `flat/hooks.BucketHook`) gathers the
bucket, cuts it into its params and, in backward, lays their grads into the bucket and reduces it:
the same custom_vjp with sinks, carry and extraction, one per bucket. `unit` materializes a unit's
groups as it materializes its `UnitParam`s.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax._src.lax.parallel import all_gather_invariant  # not public in jax 0.10-0.11: all_gather typed invariant
from jax.extend.core import Var, get_opaque_trace_state, jaxprs_in_params

from jzero.errors import ConfigError
from jzero.zero.common.strategies import path_name

PyTree = Any
# reshard_after_forward: backward keeps the unit's matmul outputs and recomputes the rest from them,
# so no value computed from the gathered params (the params, or their reshapes that a matmul keeps
# for its backward) outlives the forward; backward gathers the params again. (A policy that only
# refuses the gathered values themselves lets those reshapes through.)
RESHARD_POLICY = jax.checkpoint_policies.dots_saveable


@dataclasses.dataclass(frozen=True)
class Hook:
    """What `materialize` does to one param (static; hashable).

    Attributes:
      dim: the shard dim counted from the end (so slicing stacked layers leaves it unchanged),
        None if the grad is not split over DP (it is then all-reduced in one psum: DDP without
        HSDP, or a param with no divisible dim).
      inner: the DP axes the value (when `gather`) and the first grad reduce-scatter span.
      outer: the replica axes across which the inner-reduced grad is then reduced.
      outer_scatter: reduce-scatter across `outer` (HSDP optim) instead of all-reducing.
      gather: `value` is a shard to all_gather over `inner`.
      to_varying: the DP axes the materialized param is invariant over: cast to varying there,
        so the cotangent that reaches the hook is this rank's own grad, not an all-reduced one.
      scale: Megatron's gradient scaling factor, 1 / (DP size x microbatches).
      reduce_dtype: the dtype of the grad reduction (`precision.grad_reduce_dtype`).
      reshard: ZeRO-3's `reshard_after_forward`.
      regather: DDP under HSDP: the grad, reduce-scattered on `dim` over `inner` and all-reduced across
        `outer`, is all-gathered back over `inner` (typed invariant, as the whole reduced grad DDP's
        sink is): a hierarchical all-reduce.
      tp_spec: the param's model-parallel spec over the axes XLA partitions (tp), one entry per
        dim, or None if tp splits no dim but (jointly) the shard dim. The collectives run in a
        shard_map manual over those axes too, on each tp rank's block: XLA would otherwise
        gather a tp-split dim before a collective over the DP axes (docs/xla.md, "Collectives
        inside a partially manual shard_map").
      reduce: reduce the grad over DP; False: the sink gets this rank's own grad, unscaled in the
        param's dtype (a micro-batch that only accumulates; the step scales it).
      extract: the gsink's cotangent is the gathered param (module docstring).
      keep: the gathered param is kept for the backward even when the unit recomputes its forward
        (`unit(..., remat=True)`): ZeRO-1/2's overlap_param_gather, which gathers once per step.
      probe: materializing gives zeros that do not read the param (`check_loss`' trace). Static, so
        no jaxpr jax caches for a traced function (a scan body, a jit) is shared with the real step's.
    """

    dim: int | None
    inner: tuple[str, ...]
    outer: tuple[str, ...]
    outer_scatter: bool
    gather: bool
    to_varying: tuple[str, ...]
    scale: float
    reduce_dtype: str
    reshard: bool
    regather: bool = False
    tp_spec: tuple | None = None
    reduce: bool = True
    extract: bool = False
    keep: bool = False
    probe: bool = False


def _tp_local(f: Callable[[jax.Array], jax.Array], x: jax.Array, hook: Hook) -> jax.Array:
    """f(x) with f run on each tp rank's block of x (see `Hook.tp_spec`); f keeps the block's tp dims."""
    if hook.tp_spec is None:
        return f(x)
    spec = jax.sharding.PartitionSpec(*hook.tp_spec[len(hook.tp_spec) - x.ndim :])  # stacked dims sliced off
    axes = {a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}
    mesh = jax.sharding.get_abstract_mesh()
    return jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, axis_names=axes)(x)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UnitParam:
    """A unit's param as the loss sees it inside a ZeRO step (module docstring)."""

    value: jax.Array
    sink: jax.Array
    hook: Hook = dataclasses.field(metadata=dict(static=True))
    acc: jax.Array | None = None
    gsink: jax.Array | None = None


def is_unit_param(x) -> bool:
    return isinstance(x, UnitParam)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _materialize(hook: Hook, value: jax.Array, sink: jax.Array, acc, gsink) -> jax.Array:
    return _gathered(hook, value)


def _gathered(hook: Hook, value: jax.Array) -> jax.Array:
    """The param as the model computes with it: gathered where it rests sharded, cast to varying."""
    full = value
    if hook.gather and hook.dim is not None:
        full = _tp_local(lambda v: jax.lax.all_gather(v, hook.inner, axis=v.ndim + hook.dim, tiled=True), value, hook)
    return jax.lax.pcast(full, hook.to_varying, to="varying") if hook.to_varying else full


def _materialize_fwd(hook, value, sink, acc, gsink):
    out = _gathered(hook, value)
    return out, (acc, out if hook.extract else None)


def scale_grad(g: jax.Array, scale: float, dtype) -> jax.Array:
    """Megatron's gradient scaling of a local grad: times `scale` in fp32, cast to the reduce `dtype`."""
    return (g.astype(jnp.float32) * scale).astype(dtype)


def _materialize_bwd(hook, residuals, g):
    """The unit's grad of this param -> the sink's cotangent (reduced; or this rank's own, unscaled) and,
    when extracting, the gathered param as the gsink's."""
    acc, full = residuals
    if not hook.reduce:  # only accumulates: the step scales it into its accumulator (module docstring)
        return None, g, None, full
    g = scale_grad(g, hook.scale, hook.reduce_dtype)
    if acc is not None:
        g = acc + g
    return None, _reduced(hook, g), None, full


def _reduced(hook: Hook, g: jax.Array) -> jax.Array:
    """`g` reduced over DP as the hook says (`_reduce`), on each tp rank's block."""
    return _tp_local(functools.partial(_reduce, hook), g, hook)


def _reduce(hook: Hook, g: jax.Array) -> jax.Array:
    if hook.dim is None:
        return jax.lax.psum(g, hook.inner + hook.outer)
    dim = g.ndim + hook.dim
    g = jax.lax.psum_scatter(g, hook.inner, scatter_dimension=dim, tiled=True)
    if hook.regather:
        return all_gather_invariant(jax.lax.psum(g, hook.outer), hook.inner, axis=dim, tiled=True)
    if hook.outer and hook.outer_scatter:
        return jax.lax.psum_scatter(g, hook.outer, scatter_dimension=dim, tiled=True)
    return jax.lax.psum(g, hook.outer) if hook.outer else g


_materialize.defvjp(_materialize_fwd, _materialize_bwd)


# ---------------------------------------------------------------- a unit's params as one group (flat path)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BucketParam:
    """One flat bucket of a unit as the loss sees it inside the flat path's step: like `UnitParam`, for
    a bucket of several params materialized and reduced together by its static `hook` (a `GroupHook`).

    value: what the hook gathers: the bucket's params (as they rest whole), this rank's shard of the
      bucket, or the whole bucket already gathered (handed on by an earlier micro-batch).
    sink, acc, gsink: as `UnitParam`'s, shaped like the bucket (or its owned shard).
    """

    value: Any
    sink: jax.Array
    hook: Any = dataclasses.field(metadata=dict(static=True))
    acc: jax.Array | None = None
    gsink: jax.Array | None = None


class GroupHook:
    """What a `BucketParam`'s hook does (the flat path's `flat/hooks.BucketHook`); static and hashable.

    gather(value) -> full: the bucket as one array (or the params, when they rest whole);
    split(full) -> tuple: its params as the model computes with them, in the bucket's order;
    join(params) -> full: `split`'s inverse (the bucket from its params, as `gather` gives it);
    reduce_grads(grads, acc) -> the sink's cotangent from the params' grads (tuple, the bucket's order);
    reduce_acc(acc) -> the sink's cotangent of the carry alone (`micro_batch_loss`);
    extract / keep / reshard / probe: as `Hook`'s (the gsink's cotangent is `full`).
    """

    extract: bool = False
    keep: bool = False
    reshard: bool = False
    probe: bool = False


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupParam:
    """A whole unit's params as one leaf, at the place of its first param: its buckets, materialized
    together when the unit runs. The unit's other params are `GroupRef`s to it.

    members: per param of the unit (the group's order, this leaf's first), (bucket, position in the
    bucket's params).
    """

    buckets: tuple[BucketParam, ...]
    key: str = dataclasses.field(metadata=dict(static=True))
    members: tuple[tuple[int, int], ...] = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupRef:
    """A unit's param other than its first: member `member` of the `GroupParam` named `key` (no arrays)."""

    key: str = dataclasses.field(metadata=dict(static=True))
    member: int = dataclasses.field(metadata=dict(static=True))


def is_unit_leaf(x) -> bool:
    return isinstance(x, (UnitParam, GroupParam, GroupRef))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _materialize_bucket(hook: GroupHook, value, sink: jax.Array, acc, gsink) -> tuple:
    return hook.split(hook.gather(value))


def _bucket_fwd(hook, value, sink, acc, gsink):
    params = hook.split(hook.gather(value))
    # Extracting, the residual is the params, not the bucket: the unit's recompute keeps the same
    # params (`Hook.keep`), so the layer loop saves one copy of them instead of two.
    return params, (acc, params if hook.extract else None)


def _bucket_bwd(hook, residuals, g):
    """The bucket's params' grads -> the sink's cotangent (reduced, or this rank's own) and, when
    extracting, the gathered bucket (its params laid back in) as the gsink's."""
    acc, params = residuals
    return None, hook.reduce_grads(tuple(g), acc), None, None if params is None else hook.join(params)


_materialize_bucket.defvjp(_bucket_fwd, _bucket_bwd)


def _bucket_params(b: BucketParam) -> tuple:
    if b.hook.probe:
        return tuple(map(jnp.zeros_like, b.hook.split(b.hook.gather(b.value))))
    return _materialize_bucket(b.hook, b.value, b.sink, b.acc, b.gsink)


def _group_arrays(g: GroupParam) -> list[jax.Array]:
    """A `GroupParam`'s params (the group's order), each bucket materialized by its hook."""
    out = [_bucket_params(b) for b in g.buckets]
    return [out[b][pos] for b, pos in g.members]


def materialize(x):
    """A `UnitParam`'s whole param, as the model computes with it (other leaves unchanged)."""
    if not isinstance(x, UnitParam):
        return x
    if x.hook.probe:
        return jnp.zeros_like(_gathered(x.hook, x.value))
    return _materialize(x.hook, x.value, x.sink, x.acc, x.gsink)


def _replaced(x, hook: dict, **fields):
    """The unit leaf `x` (a `UnitParam`, or each bucket of a `GroupParam`) with `fields` and its hooks' `hook`
    fields replaced; other leaves unchanged."""
    if isinstance(x, UnitParam):
        return dataclasses.replace(x, hook=dataclasses.replace(x.hook, **hook), **fields)
    if isinstance(x, GroupParam):
        buckets = tuple(dataclasses.replace(b, hook=dataclasses.replace(b.hook, **hook), **fields) for b in x.buckets)
        return dataclasses.replace(x, buckets=buckets)
    return x


def check_loss(loss: Callable[[PyTree], Any], view: PyTree) -> frozenset[str]:
    """Refuses `loss(view)` if it reads a unit's params other than through `unit` (an L2 penalty over
    all params, say): there the loss sees what a `UnitParam` holds (this rank's shard where they rest
    sharded, and the zero sinks), and the grads would miss that use. `view`: the params as the step's
    loss takes them. Traces the loss once more, with every unit's params materialized as zeros that do
    not depend on them (`Hook.probe`), and asks jax's dead-code elimination which of the view's arrays
    the result still needs; a ConfigError (a ValueError: `jzero train` prints it as one line) names the
    first unit param it needs. Nothing to check without units. A primitive whose dead-code elimination
    keeps every input (a `custom_vjp` or `optimization_barrier` the loss passes unit params through)
    counts as a read.

    Returns the unit params (by their path in `view`) with a carry or extraction (`_carries`) whose
    first calls (those that keep them: `_first_calls`) would not run exactly once per step (`_claims`):
    one in a loop body on params the loop does not slice (a closure, or its carry), which runs once per
    iteration; one in some branches of a `cond` only; two in different traces (the loss's own and a
    transform's it gives the params to). This trace marks each first call (`_claimed`) and counts the
    marks, and warns naming those params. `micro_batch_loss` adds their carry and extraction once,
    outside their calls. In this trace `unit` does not recompute (`Hook.probe`): a checkpoint would take
    the sinks of the params it gets, which no mark needs."""
    from jax._src.interpreters.partial_eval import dce_jaxpr_consts  # no public API for dead-code elimination

    tops, _ = jax.tree_util.tree_flatten_with_path(view, is_leaf=is_unit_leaf)
    owners, counted = [], []  # per array of the view: the unit param holding it, or None; a sink of one that
    for path, x in tops:  # carries (`_carries`)
        name = path_name(path)
        unit_leaf = isinstance(x, (UnitParam, GroupParam))
        for inner, _ in jax.tree_util.tree_flatten_with_path(x)[0]:
            owners.append(name if unit_leaf else None)
            counted.append(unit_leaf and _carries(x) and getattr(inner[-1], "name", None) == "sink")
    if not any(owners):
        return frozenset()
    probing = jax.tree.map(lambda x: _replaced(x, {"probe": True}), view, is_leaf=is_unit_leaf)
    arrays, treedef = jax.tree.flatten(probing)

    def probe(arrays):
        with one_loss():
            return loss(treedef.unflatten(arrays))

    jaxpr = jax.make_jaxpr(probe)(arrays).jaxpr
    _, _, used = dce_jaxpr_consts(jaxpr, [True] * len(jaxpr.outvars))
    read = [name for name, use in zip(owners, used) if name and use]
    if read:
        raise ConfigError(
            f"jzero.zero.unit: the loss reads unit param {read[0]!r} outside `unit` (a penalty over all "
            "params, say); in a ZeRO step a unit's params exist only inside its unit call (outside it they "
            "are this rank's shard): compute with them in the unit's fn, or put the term in the optax chain "
            "(weight decay: optax.add_decayed_weights)"
        )
    irregular: set = set()
    counts = _claims(jaxpr, {v: (v, False) for v, c in zip(jaxpr.invars, counted) if c}, irregular)
    irregular |= {top for top, n in counts.items() if n > 1}
    outside = frozenset(owners[jaxpr.invars.index(top)] for top in irregular)
    if outside:
        warnings.warn(
            f"jzero.zero.unit: {len(outside)} unit param(s) ({', '.join(sorted(outside)[:3])}"
            f"{', ...' if len(outside) > 3 else ''}) have a first `unit` call that does not run once per step (a "
            "loop closing over them or carrying them, a cond with the unit in some branches, a second call in a "
            "transform): they train right, at one more reduction and gather of them per step after the backward, "
            "which `jzero hlo`'s theory does not count (docs/fsdp.md)",
            stacklevel=2,
        )
    return outside


# What takes a stacked param's layer slice in a loop body (`p[i]`, `jnp.take`): each iteration another value.
_SLICING = frozenset({"dynamic_slice", "gather"})


def _claimed(sink):  # `_first_calls`' mark, in `check_loss`' trace, of a call that keeps its carry: a jit by this name
    return sink


def _claims(jaxpr, tracked: dict, irregular: set) -> dict:
    """Per top-level sink, how many `_claimed` marks run per step (per layer, for a stacked param a loop
    slices) in `jaxpr` and the jaxprs of its calls, branches and loop bodies. Adds to `irregular` the sinks
    with a mark that runs once per iteration of a loop on a value the loop does not slice (a closure, a
    carry), or in some branches of a `cond` but not all. `tracked`: jaxpr's vars that hold a top-level sink
    or a value computed from one -> (the sink, whether every iteration of the innermost enclosing loop sees
    the same value)."""
    counts: dict = {}

    def add(more: dict):
        for top, n in more.items():
            counts[top] = counts.get(top, 0) + n

    def inside(sub, operands):  # a sub-jaxpr whose invars are `operands` (tracked or None)
        return _claims(sub, {v: t for v, t in zip(sub.invars, operands) if t is not None}, irregular)

    for eqn in jaxpr.eqns:
        ins = [tracked.get(v) if isinstance(v, Var) else None for v in eqn.invars]
        hit = next((t for t in ins if t is not None), None)
        if hit is None:  # nothing computed from a sink: no mark of it either
            continue
        p, name = eqn.params, eqn.primitive.name
        if name in ("jit", "pjit") and p.get("name") == _claimed.__name__:
            top, fixed = hit
            if fixed:
                irregular.add(top)
            add({top: 1})
        elif name in ("scan", "while"):
            if name == "scan":
                body, (consts, carry, xs) = p["jaxpr"].jaxpr, _scan_operands(p, ins)
                inner = [t and (t[0], True) for t in consts + carry] + [t and (t[0], False) for t in xs]
            else:
                body, inner = p["body_jaxpr"].jaxpr, [t and (t[0], True) for t in ins[p["cond_nconsts"] :]]
            add(inside(body, inner))
        elif name == "cond":
            branches = [inside(b.jaxpr, ins[1:]) for b in p["branches"]]
            per_branch = {top: [b.get(top, 0) for b in branches] for b in branches for top in b}
            irregular.update(top for top, ns in per_branch.items() if len(set(ns)) > 1)
            add({top: max(ns) for top, ns in per_branch.items()})
        else:
            subs = list(jaxprs_in_params(p))
            for sub in subs:  # a call (jit, checkpoint, custom_vjp, shard_map, ...): its operands as they are
                if len(sub.invars) == len(ins):
                    add(inside(sub, ins))
            sliced = name in _SLICING or any(e.primitive.name in _SLICING for sub in subs for e in sub.eqns)
            for v in eqn.outvars:  # a value computed from the sink: a layer's slice of it, or the same
                tracked[v] = (hit[0], hit[1] and not sliced)
    return counts


def _scan_operands(params: dict, operands: list) -> tuple[list, list, list]:
    """A scan eqn's `operands` as (consts, carry, xs), in its body's order."""
    if "num_consts" in params:  # jax 0.10
        consts, carry = params["num_consts"], params["num_carry"]
        return operands[:consts], operands[consts : consts + carry], operands[consts + carry :]
    return tuple(list(part) for part in params["ft_in"].update(operands).unpack())  # jax 0.11: a FlatTree


def materialize_all(tree: PyTree, which: Callable[[Any], bool] = lambda hook: True) -> PyTree:
    """`tree` with its `UnitParam`s, and the `GroupParam`s with their `GroupRef`s, whose hook `which`
    picks materialized (the rest unchanged). A `GroupRef` whose `GroupParam` is not in `tree` is an error:
    the unit was given part of a unit's params."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_unit_leaf)
    groups = {x.key: _group_arrays(x) for x in leaves if isinstance(x, GroupParam) and which(x.buckets[0].hook)}
    known = {x.key for x in leaves if isinstance(x, GroupParam)}

    def one(x):
        if isinstance(x, UnitParam):
            return materialize(x) if which(x.hook) else x
        if isinstance(x, (GroupParam, GroupRef)) and x.key not in known:
            raise ConfigError(
                f"jzero.zero.unit: got part of the params of unit {x.key!r} (the flat path names a unit param's unit "
                "by build_zero's unit_key, by default its path up to its first integer key, else its first key); "
                "pass all of the unit's params to one unit call, or a unit_key that names each unit call's params"
            )
        if isinstance(x, GroupParam):
            return groups[x.key][0] if x.key in groups else x
        if isinstance(x, GroupRef):
            return groups[x.key][x.member] if x.key in groups else x
        return x

    return treedef.unflatten([one(x) for x in leaves])


def _hooks(params: PyTree) -> list:
    leaves = jax.tree.leaves(params, is_leaf=is_unit_leaf)
    return [x.hook for x in leaves if isinstance(x, UnitParam)] + [
        b.hook for x in leaves if isinstance(x, GroupParam) for b in x.buckets
    ]


# The unit params the `unit` calls of one micro-batch's loss have materialized: by the id of their sink, the sink
# (kept, so that no id is reused while the loss traces) and the traces it was materialized in. None outside a
# step's loss (`one_loss`).
_CALLED: contextvars.ContextVar[dict[int, tuple[jax.Array, list]] | None] = contextvars.ContextVar(
    "jzero_unit_calls", default=None
)


@contextlib.contextmanager
def one_loss() -> Iterator[None]:
    """The scope of one micro-batch's loss in a ZeRO step (both paths trace the loss inside it): a unit
    whose params reach `unit` again in the same trace (a block run twice by the loss, or by one scan
    body: its weights shared) adds the earlier micro-batches' grads (`UnitParam.acc`) and hands its
    gathered params on (`gsink`) in its first call only, so that what the step sums over the calls is
    the param's grad once and the param once. Calls in different traces (the two branches of a `cond`,
    a body jax traces twice) each keep theirs: one of them runs. Where that is not so (a loop body that
    runs the first call once per iteration, say), `check_loss` finds it and `micro_batch_loss` adds
    them instead."""
    token = _CALLED.set({})
    try:
        yield
    finally:
        _CALLED.reset(token)


def _carries(x) -> bool:
    """Whether the unit leaf `x` adds a carry or hands its params on (its first call's job)."""
    return any(p.acc is not None or p.gsink is not None for p in _parts(x))


def _first_calls(params: PyTree) -> PyTree:
    """`params` with the unit leaves that an earlier `unit` call of this loss materialized in the current
    trace stripped of their carry and extraction. In `check_loss`' trace each leaf that keeps them is
    marked (`_claimed`)."""
    called = _CALLED.get()
    if called is None:
        return params

    here = get_opaque_trace_state()

    def one(x):
        if not isinstance(x, (UnitParam, GroupParam)):
            return x
        sink = x.sink if isinstance(x, UnitParam) else x.buckets[0].sink
        traces = called.setdefault(id(sink), (sink, []))[1]
        if any(here == t for t in traces):
            return _replaced(x, {"extract": False}, acc=None, gsink=None)
        traces.append(here)
        if _carries(x) and _hooks([x])[0].probe:
            jax.jit(_claimed)(sink)
        return x

    return jax.tree.map(one, params, is_leaf=is_unit_leaf)


def micro_batch_loss(loss: Callable[[PyTree], tuple], view: PyTree, outside: frozenset[str]) -> tuple:
    """`loss(view) -> (value, aux)` as one micro-batch's loss in a ZeRO step (`one_loss`), to differentiate
    with respect to the view's sinks (and gsinks).

    `outside`: the unit params (by path in `view`) whose first calls would not run once per step
    (`check_loss`: a loop body that closes over a shared block's params runs it once per iteration, say).
    Their calls keep no carry and hand nothing on; their earlier micro-batches' grads are reduced and
    their params gathered here instead, once, after the backward (`_outside`: one more collective for
    such a unit, which its calls' own reductions do not include). Their terms add 0 to `value`."""
    tops, treedef = jax.tree_util.tree_flatten_with_path(view, is_leaf=is_unit_leaf)
    late = [x for path, x in tops if path_name(path) in outside]
    stripped = [_replaced(x, {"extract": False}, acc=None, gsink=None) if path_name(path) in outside else x
                for path, x in tops]  # fmt: skip
    with one_loss():
        value, aux = loss(treedef.unflatten(stripped))
    if not late:
        return value, aux
    term = sum(_outside(p.hook, p.value, p.sink, p.acc, p.gsink) for x in late for p in _parts(x))
    return value + term.astype(value.dtype), aux


def _parts(x) -> list:
    """A unit leaf's parts with a hook each: the `UnitParam`, or a `GroupParam`'s buckets."""
    return [x] if isinstance(x, UnitParam) else list(x.buckets)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _outside(hook, value, sink, acc, gsink) -> jax.Array:
    """0, whose backward gives the sink and the gsink what a unit's first call adds to theirs
    (`micro_batch_loss`)."""
    return jnp.zeros((), jnp.float32)


def _outside_fwd(hook, value, sink, acc, gsink):
    return jnp.zeros((), jnp.float32), (value if gsink is not None else None, acc)


def _outside_bwd(hook, residuals, g):
    """The sink's cotangent: the carry reduced as the unit's backward reduces a grad; the gsink's: the
    param gathered, as `unit`'s forward gathers it."""
    value, acc = residuals
    if isinstance(hook, Hook):
        reduced = None if acc is None else _reduced(hook, acc)
        full = None if value is None else _gathered(hook, value)
    else:
        reduced = None if acc is None else hook.reduce_acc(acc)
        full = None if value is None else hook.gather(value)
    return None, reduced, None, full


_outside.defvjp(_outside_fwd, _outside_bwd)


def unit(fn: Callable, params: PyTree, *args, remat: bool = False, prevent_cse: bool = True, **kwargs):
    """`fn(params, *args, **kwargs)` as one FSDP unit (module docstring); `args` are arrays.

    remat: recompute the whole unit in backward, keeping only its inputs (Megatron's full
    recompute, `jax.checkpoint`), ZeRO or not. Under ZeRO-3 it subsumes `reshard_after_forward`
    (the params are gathered again with the rest); params gathered for the whole step
    (`Hook.keep`: ZeRO-1/2's overlap_param_gather) are gathered before the recomputed part and
    kept, as Megatron's persistent params are. A second checkpoint inside the model's own would
    gather ZeRO-3's params a third time, so a model that recomputes its units says so here rather
    than wrapping `unit`.

    prevent_cse: as `jax.checkpoint`'s. Pass False where the unit runs in a `jax.lax.scan` body
    (the scan keeps the recompute apart already, jax's own advice): the barrier it would add hides
    the backward's gathers from XLA's collective pipeliner, so under ZeRO-3 a layer's re-gather could
    not start during the previous layer's backward (LLaMA-2-7B on 8 x H100: 10.2% of the DP wire
    exposed with it, 8.8% without, 3.4% with a layer's gathers combined too; docs/overlap.md). Keep
    True for unrolled units: XLA could otherwise merge a recompute with the forward it repeats.

    A unit may run more than once per loss (shared weights): each call's backward reduces its part of
    the grad, and only the first in a trace adds the accumulated micro-batches or hands the params on
    (`one_loss`)."""
    params = _first_calls(params)
    hooks = _hooks(params)

    def run(params, *args):
        return fn(materialize_all(params), *args, **kwargs)

    if any(h.probe for h in hooks):  # `check_loss`' trace: what the loss reads, not what it recomputes (a
        return run(params, *args)  # checkpoint would take the sinks, which `_claims` follows)
    if remat:
        return jax.checkpoint(run, prevent_cse=prevent_cse)(materialize_all(params, lambda hook: hook.keep), *args)
    if any(h.reshard for h in hooks):
        return jax.checkpoint(run, policy=RESHARD_POLICY, prevent_cse=prevent_cse)(params, *args)
    return run(params, *args)
