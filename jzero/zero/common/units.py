"""FSDP units: where a unit's params are gathered and its grads reduced, inside the backward.

A unit is a group of params used together: one transformer block (Megatron-FSDP's
`fsdp_unit_modules`, one `fully_shard` call in FSDP2). The model marks where a unit runs with

    y = unit(fn, unit_params, *args)        # = fn(unit_params, *args) outside a ZeRO step

(the block's params, and the scan body's slice of them when the layers are stacked). Outside a
ZeRO step (one device, inference) the params are arrays and `unit` is a plain call. Inside a ZeRO
step each param of a unit arrives as a `UnitParam`, a pytree of arrays and a static `UnitHook`, the
one interface every layout's hooks have (gather, split, join, reduce_grads, reduce_acc). On the spec
path (`Hook`) a `UnitParam` is one param:

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
as one `GroupParam` leaf (at its first param; `GroupRef`s at the others) holding one `UnitParam`
per bucket, whose hook (`flat/hooks.BucketHook`) gathers the bucket, cuts it into its params and, in
backward, lays their grads into the bucket and reduces it: the same custom_vjp with sinks, carry and
extraction, one per bucket. The reductions and gathers are `common/collectives.py`'s, for both.

Which unit params the loss reads outside `unit`, and which units' first calls do not run once per
step, `unit_check.check_loss` finds; `micro_batch_loss` then adds their carry after the backward.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import get_opaque_trace_state

from jzero.errors import ConfigError
from jzero.mesh import spec_axes
from jzero.zero.common import collectives
from jzero.zero.common.strategies import path_name

PyTree = Any
# reshard_after_forward: backward keeps the unit's matmul outputs and recomputes the rest from them,
# so no value computed from the gathered params (the params, or their reshapes that a matmul keeps
# for its backward) outlives the forward; backward gathers the params again. (A policy that only
# refuses the gathered values themselves lets those reshapes through.)
RESHARD_POLICY = jax.checkpoint_policies.dots_saveable


class UnitHook:
    """What one `UnitParam`'s hook does, static and hashable: the one interface of every layout's hooks
    (the spec path's `Hook`, one param; the flat path's `flat/hooks.BucketHook`, one flat bucket).

    gather(value) -> full: what the model computes with, as one value (an all-gather where it rests sharded);
    split(full) -> tuple: the params in it, as the model computes with them (one, for a single param);
    join(params) -> full: `split`'s inverse (the gsink's cotangent when extracting);
    reduce_grads(grads, acc) -> the sink's cotangent from the params' grads (scaled, the carry added, reduced
      over DP; or this rank's own, unscaled, where the phase only accumulates);
    reduce_acc(acc) -> the sink's cotangent of the carry alone (`micro_batch_loss`).
    extract: the gsink's cotangent is `join` of the materialized params (ZeRO-1/2's first micro-batch).
    keep: the gathered params are kept for the backward even where the unit recomputes (`unit(..., remat=True)`).
    reshard: ZeRO-3's `reshard_after_forward`: gathered again for the unit's backward.
    probe: materializing gives zeros that do not read the value (`unit_check.check_loss`' trace). Static, so
      no jaxpr jax caches for a traced function (a scan body, a jit) is shared with the real step's.
    """

    extract: bool = False
    keep: bool = False
    reshard: bool = False
    probe: bool = False


@dataclasses.dataclass(frozen=True)
class Hook(UnitHook):
    """The spec path's `UnitHook` of one param (static; hashable): the param is its own group of one.

    Attributes:
      dim: the shard dim counted from the end (so slicing stacked layers leaves it unchanged),
        None if the grad is not split over DP (it is then all-reduced in one psum: DDP without
        HSDP, or a param with no divisible dim).
      inner: the DP axes the value (when `gathers`) and the first grad reduce-scatter span.
      outer: the replica axes across which the inner-reduced grad is then reduced.
      outer_scatter: reduce-scatter across `outer` (HSDP optim) instead of all-reducing.
      gathers: `value` is a shard to all_gather over `inner`.
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
    gathers: bool
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

    def gather(self, value: jax.Array) -> jax.Array:
        return _gathered(self, value)

    def split(self, full: jax.Array) -> tuple:
        return (full,)

    def join(self, params: tuple) -> jax.Array:
        return params[0]

    def reduce_grads(self, grads: tuple, acc) -> jax.Array:
        (g,) = grads
        if not self.reduce:  # only accumulates: the step scales it into its accumulator (module docstring)
            return g
        g = scale_grad(g, self.scale, self.reduce_dtype)
        return _reduced(self, g if acc is None else acc + g)

    def reduce_acc(self, acc: jax.Array) -> jax.Array:
        return _reduced(self, acc)


def _tp_local(f: Callable[[jax.Array], jax.Array], x: jax.Array, hook: Hook) -> jax.Array:
    """f(x) with f run on each tp rank's block of x (see `Hook.tp_spec`); f keeps the block's tp dims."""
    if hook.tp_spec is None:
        return f(x)
    spec = jax.sharding.PartitionSpec(*hook.tp_spec[len(hook.tp_spec) - x.ndim :])  # stacked dims sliced off
    axes = set(spec_axes(spec))
    mesh = jax.sharding.get_abstract_mesh()
    return jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, axis_names=axes)(x)


def _gathered(hook: Hook, value: jax.Array) -> jax.Array:
    """The param as the model computes with it: gathered where it rests sharded, cast to varying."""
    full = value
    if hook.gathers and hook.dim is not None:
        full = _tp_local(lambda v: collectives.gather(v, v.ndim + hook.dim, hook.inner), value, hook)
    return jax.lax.pcast(full, hook.to_varying, to="varying") if hook.to_varying else full


def scale_grad(g: jax.Array, scale: float, dtype) -> jax.Array:
    """Megatron's gradient scaling of a local grad: times `scale` in fp32, cast to the reduce `dtype`."""
    return (g.astype(jnp.float32) * scale).astype(dtype)


def _reduced(hook: Hook, g: jax.Array) -> jax.Array:
    """`g` reduced over DP as the hook says (`_reduce`), on each tp rank's block."""
    return _tp_local(functools.partial(_reduce, hook), g, hook)


def _reduce(hook: Hook, g: jax.Array) -> jax.Array:
    dim = None if hook.dim is None else g.ndim + hook.dim
    return collectives.reduce(
        g, dim, hook.inner, hook.outer, outer_scatter=hook.outer_scatter, regather=hook.regather
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UnitParam:
    """What one hook materializes, as the loss sees it inside a ZeRO step (module docstring): one param
    (the spec path's, a leaf of the params tree) or one flat bucket of a unit (in a `GroupParam`).

    value: what `hook.gather` takes: the param or the bucket's params as they rest whole, this rank's
      shard, or the whole bucket already gathered (handed on by an earlier micro-batch).
    sink, acc, gsink: shaped like what the grad becomes, the carry, the whole param or bucket.
    """

    value: Any
    sink: jax.Array
    hook: UnitHook = dataclasses.field(metadata=dict(static=True))
    acc: jax.Array | None = None
    gsink: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupParam:
    """A whole unit's params as one leaf, at the place of its first param: its buckets, materialized
    together when the unit runs. The unit's other params are `GroupRef`s to it.

    members: per param of the unit (the group's order, this leaf's first), (bucket, position in the
    bucket's params).
    """

    buckets: tuple[UnitParam, ...]
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
def _materialize(hook: UnitHook, value, sink: jax.Array, acc, gsink) -> tuple:
    return hook.split(hook.gather(value))


def _materialize_fwd(hook, value, sink, acc, gsink):
    params = hook.split(hook.gather(value))
    # Extracting, the residual is the params, not the bucket: the unit's recompute keeps the same
    # params (`UnitHook.keep`), so the layer loop saves one copy of them instead of two.
    return params, (acc, params if hook.extract else None)


def _materialize_bwd(hook, residuals, g):
    """The params' grads -> the sink's cotangent (reduced, or this rank's own) and, when extracting, the
    gathered params joined as the gsink's."""
    acc, params = residuals
    return None, hook.reduce_grads(tuple(g), acc), None, None if params is None else hook.join(params)


_materialize.defvjp(_materialize_fwd, _materialize_bwd)


def _arrays(x: UnitParam) -> tuple:
    """A `UnitParam`'s params, as its hook materializes them."""
    if x.hook.probe:
        return tuple(map(jnp.zeros_like, x.hook.split(x.hook.gather(x.value))))
    return _materialize(x.hook, x.value, x.sink, x.acc, x.gsink)


def _group_arrays(g: GroupParam) -> list[jax.Array]:
    """A `GroupParam`'s params (the group's order), each bucket materialized by its hook."""
    out = [_arrays(b) for b in g.buckets]
    return [out[b][pos] for b, pos in g.members]


def materialize(x):
    """A `UnitParam`'s whole param, as the model computes with it (other leaves unchanged)."""
    return _arrays(x)[0] if isinstance(x, UnitParam) else x


def replaced(x, hook: dict, **fields):
    """The unit leaf `x` (a `UnitParam`, or each bucket of a `GroupParam`) with `fields` and its hooks' `hook`
    fields replaced; other leaves unchanged."""
    if isinstance(x, UnitParam):
        return dataclasses.replace(x, hook=dataclasses.replace(x.hook, **hook), **fields)
    if isinstance(x, GroupParam):
        buckets = tuple(dataclasses.replace(b, hook=dataclasses.replace(b.hook, **hook), **fields) for b in x.buckets)
        return dataclasses.replace(x, buckets=buckets)
    return x


def claimed(sink):  # `_first_calls`' mark, in `check_loss`' trace, of a call that keeps its carry: a jit by this name
    return sink


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
                "by build_zero's unit_key, by default its path up to its first integer key or Linen-numbered name "
                "(blocks/3, params/blocks_3), else its first key); "
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
def one_loss() -> Iterator[dict]:
    """The scope of one micro-batch's loss in a ZeRO step (both paths trace the loss inside it): a unit
    whose params reach `unit` again in the same trace (a block run twice by the loss, or by one scan
    body: its weights shared) adds the earlier micro-batches' grads (`UnitParam.acc`) and hands its
    gathered params on (`gsink`) in its first call only, so that what the step sums over the calls is
    the param's grad once and the param once. Calls in different traces (the two branches of a `cond`,
    a body jax traces twice) each keep theirs: one of them runs. Where that is not so (a loop body that
    runs the first call once per iteration, say), `check_loss` finds it and `micro_batch_loss` adds
    them instead. Yields the unit leaves `unit` calls get in it, by id (`_CALLED`): empty if none."""
    called: dict = {}
    token = _CALLED.set(called)
    try:
        yield called
    finally:
        _CALLED.reset(token)


def carries(x) -> bool:
    """Whether the unit leaf `x` adds a carry or hands its params on (its first call's job)."""
    return any(p.acc is not None or p.gsink is not None for p in _parts(x))


def _first_calls(params: PyTree) -> PyTree:
    """`params` with the unit leaves that an earlier `unit` call of this loss materialized in the current
    trace stripped of their carry and extraction. In `check_loss`' trace each leaf that keeps them is
    marked (`claimed`)."""
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
            return replaced(x, {"extract": False}, acc=None, gsink=None)
        traces.append(here)
        if carries(x) and _hooks([x])[0].probe:
            jax.jit(claimed)(sink)
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
    stripped = [replaced(x, {"extract": False}, acc=None, gsink=None) if path_name(path) in outside else x
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
    reduced = None if acc is None else hook.reduce_acc(acc)
    full = None if value is None else hook.gather(value)
    return None, reduced, None, full


_outside.defvjp(_outside_fwd, _outside_bwd)


def unit(fn: Callable, params: PyTree, *args, remat: bool = False, policy=None, prevent_cse: bool = True, **kwargs):
    """`fn(params, *args, **kwargs)` as one FSDP unit (module docstring); `args` are arrays.

    remat: recompute the whole unit in backward, keeping only its inputs (Megatron's full
    recompute, `jax.checkpoint`), ZeRO or not. Under ZeRO-3 it subsumes `reshard_after_forward`
    (the params are gathered again with the rest); params gathered for the whole step
    (`UnitHook.keep`: ZeRO-1/2's overlap_param_gather) are gathered before the recomputed part and
    kept, as Megatron's persistent params are. A second checkpoint inside the model's own would
    gather ZeRO-3's params a third time, so a model that recomputes its units says so here rather
    than wrapping `unit`.

    policy: with `remat`, `jax.checkpoint`'s policy: what the recompute keeps besides the inputs (e.g.
    `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`, Megatron's selective recompute); None: nothing.

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
        recompute = jax.checkpoint(run, policy=policy, prevent_cse=prevent_cse)
        return recompute(materialize_all(params, lambda hook: hook.keep), *args)
    if any(h.reshard for h in hooks):
        return jax.checkpoint(run, policy=RESHARD_POLICY, prevent_cse=prevent_cse)(params, *args)
    return run(params, *args)
