"""FSDP units: where a unit's params are gathered (ZeRO-3) and its grads reduce-scattered (ZeRO-2/3).

A unit is a group of params used together: one transformer block (Megatron-FSDP's
`fsdp_unit_modules`, one `fully_shard` call in FSDP2). The model marks where a unit runs with

    y = unit(fn, unit_params, *args)        # = fn(unit_params, *args) outside a ZeRO-2/3 step

(the block's params, and the scan body's slice of them when the layers are stacked). Outside
a ZeRO-2/3 step (one device, DDP, ZeRO-1, inference) the params are arrays and `unit` is a
plain call. Inside the spec path's ZeRO-2/3 step each param of a unit arrives as a
`UnitParam`, a pytree of two arrays and a static `Hook`:

  value: ZeRO-3: this rank's shard of the param, `W[D_dp, F_tp]`; ZeRO-2: the whole `W[D, F_tp]`.
  sink:  zeros shaped like the rank's shard of the reduced grad, in the grad reduce dtype. The
         step differentiates the loss with respect to the sinks, so what reaches a sink is the
         unit's grad, scaled and reduce-scattered the moment the unit's backward is done.

`unit` materializes each param (an all_gather over the inner DP axes under ZeRO-3), runs
`fn`, and in backward reduce-scatters the param's grad over the inner DP axes, then
all-reduces it across `dp_outer` (HSDP, outer_strategy no_shard) or reduce-scatters it
there too (outer_strategy optim). With `reshard_after_forward` the gathered params are not
kept for backward (`RESHARD_POLICY`): they are gathered again when the unit's backward
runs, as FSDP2 does. Params outside every unit (embeddings,
final norm, head) are materialized by the step before the loss runs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

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
        None if the param is not split over DP (its grad is then all-reduced).
      inner: the DP axes the value (ZeRO-3) and the first grad reduce-scatter span.
      outer: the replica axes across which the inner-reduced grad is then reduced.
      outer_scatter: reduce-scatter across `outer` (HSDP optim) instead of all-reducing.
      gather: ZeRO-3: `value` is a shard to all_gather over `inner`.
      to_varying: the DP axes the materialized param is invariant over: cast to varying there,
        so the cotangent that reaches the hook is this rank's own grad, not an all-reduced one.
      scale: Megatron's gradient scaling factor, 1 / (DP size x microbatches).
      reduce_dtype: the dtype of the grad reduction (`precision.grad_reduce_dtype`).
      reshard: ZeRO-3's `reshard_after_forward`.
      tp_spec: the param's model-parallel spec over the axes XLA partitions (tp), one entry per
        dim, or None if tp splits no dim but (jointly) the shard dim. The collectives run in a
        shard_map manual over those axes too, on each tp rank's block: XLA would otherwise
        gather a tp-split dim before a collective over the DP axes (docs/xla.md, "Collectives
        inside a partially manual shard_map").
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
    tp_spec: tuple | None = None


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
    """A unit's param as the loss sees it inside a ZeRO-2/3 step (module docstring)."""

    value: jax.Array
    sink: jax.Array
    hook: Hook = dataclasses.field(metadata=dict(static=True))


def is_unit_param(x) -> bool:
    return isinstance(x, UnitParam)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _materialize(hook: Hook, value: jax.Array, sink: jax.Array) -> jax.Array:
    full = value
    if hook.gather and hook.dim is not None:
        full = _tp_local(lambda v: jax.lax.all_gather(v, hook.inner, axis=v.ndim + hook.dim, tiled=True), value, hook)
    return jax.lax.pcast(full, hook.to_varying, to="varying") if hook.to_varying else full


def _materialize_fwd(hook, value, sink):
    return _materialize(hook, value, sink), None


def _materialize_bwd(hook, _, g):
    """The unit's grad of this param -> the rank's shard of the DP-reduced grad (the sink's cotangent)."""
    g = (g.astype(jnp.float32) * hook.scale).astype(hook.reduce_dtype)
    return None, _tp_local(functools.partial(_reduce, hook), g, hook)


def _reduce(hook: Hook, g: jax.Array) -> jax.Array:
    if hook.dim is None:
        return jax.lax.psum(g, hook.inner + hook.outer)
    dim = g.ndim + hook.dim
    g = jax.lax.psum_scatter(g, hook.inner, scatter_dimension=dim, tiled=True)
    if hook.outer and hook.outer_scatter:
        return jax.lax.psum_scatter(g, hook.outer, scatter_dimension=dim, tiled=True)
    return jax.lax.psum(g, hook.outer) if hook.outer else g


_materialize.defvjp(_materialize_fwd, _materialize_bwd)


def materialize(x):
    """A `UnitParam`'s whole param, as the model computes with it (other leaves unchanged)."""
    return _materialize(x.hook, x.value, x.sink) if isinstance(x, UnitParam) else x


def unit(fn: Callable, params: PyTree, *args, remat: bool = False, **kwargs):
    """`fn(params, *args, **kwargs)` as one FSDP unit (module docstring); `args` are arrays.

    remat: recompute the whole unit in backward, keeping only its inputs (Megatron's full
    recompute, `jax.checkpoint`), ZeRO or not. It subsumes `reshard_after_forward` (the params are
    gathered again with the rest); a second checkpoint inside the model's own would gather them a
    third time, so a model that recomputes its units says so here rather than wrapping `unit`."""
    leaves = [x for x in jax.tree.leaves(params, is_leaf=is_unit_param) if isinstance(x, UnitParam)]

    def run(params, *args):
        return fn(jax.tree.map(materialize, params, is_leaf=is_unit_param), *args, **kwargs)

    if remat:
        return jax.checkpoint(run)(params, *args)
    if any(x.hook.reshard for x in leaves):
        return jax.checkpoint(run, policy=RESHARD_POLICY)(params, *args)
    return run(params, *args)
