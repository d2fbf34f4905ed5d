"""The jaxpr check of a ZeRO step's loss (`check_loss`): which unit params the loss reads outside `unit`,
and which units' first calls would not run once per step. The only code of jzero that reads jaxprs
through JAX's private modules (dead-code elimination, a scan's operands); everything it learns it
hands to `units.micro_batch_loss`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import Var, jaxprs_in_params

from jzero.errors import ConfigError, one_line
from jzero.zero.common.strategies import path_name
from jzero.zero.common.units import GroupParam, UnitParam, carries, claimed, is_unit_leaf, one_loss, replaced

PyTree = Any


def check_loss(loss: Callable[[PyTree], Any], view: PyTree) -> frozenset[str]:
    """Refuses `loss(view)` if it reads a unit's params other than through `unit` (an L2 penalty over
    all params, say): there the loss sees what a `UnitParam` holds (this rank's shard where they rest
    sharded, and the zero sinks), and the grads would miss that use. `view`: the params as the step's
    loss takes them. Traces the loss once more, with every unit's params materialized as zeros that do
    not depend on them (`UnitHook.probe`), and asks jax's dead-code elimination which of the view's arrays
    the result still needs; a ConfigError (a ValueError: `jzero train` prints it as one line) names the
    first unit param it needs. Nothing to check without units. A primitive whose dead-code elimination
    keeps every input (a `custom_vjp` or `optimization_barrier` the loss passes unit params through)
    counts as a read. A loss that passes no unit param to `unit` at all (`units=` given, `unit` never
    called) is refused by one ConfigError that says so, whether the model then reads them or fails on
    them in its own words (a Flax module's shape check, a `jnp` op on a unit leaf).

    Returns the unit params (by their path in `view`) with a carry or extraction (`carries`) whose
    first calls (those that keep them: `_first_calls`) would not run exactly once per step (`_claims`):
    one in a loop body on params the loop does not slice (a closure, or its carry), which runs once per
    iteration; one in some branches of a `cond` only; two in different traces (the loss's own and a
    transform's it gives the params to). This trace marks each first call (`claimed`) and counts the
    marks, and warns naming those params. `micro_batch_loss` adds their carry and extraction once,
    outside their calls. In this trace `unit` does not recompute (`UnitHook.probe`): a checkpoint would take
    the sinks of the params it gets, which no mark needs."""
    from jax._src.interpreters.partial_eval import dce_jaxpr_consts  # no public API for dead-code elimination

    tops, _ = jax.tree_util.tree_flatten_with_path(view, is_leaf=is_unit_leaf)
    owners, counted = [], []  # per array of the view: the unit param holding it, or None; a sink of one that
    for path, x in tops:  # carries (`carries`)
        name = path_name(path)
        unit_leaf = isinstance(x, (UnitParam, GroupParam))
        for inner, _ in jax.tree_util.tree_flatten_with_path(x)[0]:
            owners.append(name if unit_leaf else None)
            counted.append(unit_leaf and carries(x) and getattr(inner[-1], "name", None) == "sink")
    if not any(owners):
        return frozenset()
    probing = jax.tree.map(lambda x: replaced(x, {"probe": True}), view, is_leaf=is_unit_leaf)
    arrays, treedef = jax.tree.flatten(probing)
    try:
        with one_loss() as called:
            jaxpr = jax.make_jaxpr(lambda arrays: loss(treedef.unflatten(arrays)))(arrays).jaxpr
    except Exception as e:  # a model reading its unit params as arrays fails in its own words: say why
        if not called:
            raise _never_called(owners, e) from e
        raise
    _, _, used = dce_jaxpr_consts(jaxpr, [True] * len(jaxpr.outvars))
    read = [name for name, use in zip(owners, used) if name and use]
    if read and not called:
        raise _never_called(owners)
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


def _never_called(owners: list, error: Exception | None = None) -> ConfigError:
    """The error for a loss that passes no unit param to `unit`, with the model's own `error` if it failed."""
    marked = sorted({name for name in owners if name})
    failed = "" if error is None else f" (the loss failed with {one_line(error)})"
    return ConfigError(
        f"build_zero(units=...) puts params in FSDP units ({', '.join(marked[:2])}"
        f"{', ...' if len(marked) > 2 else ''}) but the loss passed none of them to a unit call: in a ZeRO step a "
        "unit's params exist only inside `jzero.zero.unit(fn, block_params, x)`, which runs fn(block_params, x) on "
        f"them; run each block through it (a Flax model: jzero.interop.flax, docs/flax.md) or leave units= out{failed}"
    )


# What takes a stacked param's layer slice in a loop body (`p[i]`, `jnp.take`): each iteration another value.
_SLICING = frozenset({"dynamic_slice", "gather"})


def _claims(jaxpr, tracked: dict, irregular: set) -> dict:
    """Per top-level sink, how many `claimed` marks run per step (per layer, for a stacked param a loop
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
        if name in ("jit", "pjit") and p.get("name") == claimed.__name__:
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
