"""Megatron's param groups: per-parameter weight-decay and learning-rate multipliers.

Megatron (`_get_param_groups`, docs/megatron.md "Param groups") gives each param a
`wd_mult` (0.0 for biases and 1-D params such as norm scales, else 1.0) and an `lr_mult`,
and steps each group with `lr * lr_mult` and `weight_decay * wd_mult`. Its distributed
optimizer applies them per element of each rank's shard. jzero does the same on both paths:

- `param_groups(...)` resolves one `ParamGroup` per param, once (model space);
- the ZeRO optimizer hands the inner optax transformation the multipliers laid out like
  the updates it steps (`GroupValues`, the `param_groups` extra argument): one scalar per
  param on the spec path, one vector per bucket shard on the flat path;
- `add_decayed_weights` and `scale_by_lr_mult` are the element-wise transformations that
  read them (`adamw` chains them as `optax.adamw` does); `muon` (Megatron's Muon, `muon.py`)
  reads them itself.

Any other transformation ignores the extra argument, and `build_zero` refuses param
groups that the inner transformation would silently ignore.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import optax

from jzero.zero.common.strategies import path_name
from jzero.zero.config import ParamGroupRule

PyTree = Any
EXTRA_ARG = "param_groups"  # the name under which the multipliers reach `update`


class ParamGroup(NamedTuple):
    """One param's multipliers: its lr is `lr * lr_mult`, its weight decay `weight_decay * wd_mult`."""

    lr_mult: float = 1.0
    wd_mult: float = 1.0


class GroupValues(NamedTuple):
    """The multipliers laid out like the updates a transformation receives (leaf by leaf:
    a scalar for a whole param, or a vector matching a flat bucket shard)."""

    lr_mult: PyTree
    wd_mult: PyTree


def param_groups(
    abstract_params: PyTree,
    *,
    weight_decay_1d: bool = False,
    rules: Sequence[ParamGroupRule] = (),
    ndims: PyTree | None = None,
) -> PyTree:
    """One `ParamGroup` per param, Megatron's defaults then `rules` (later rules win).

    Arguments:
      abstract_params: params or ShapeDtypeStructs.
      weight_decay_1d: decay biases and params of fewer than 2 dims too (Megatron and
        nanoGPT do not: `name.endswith("bias") or ndim < 2` gets `wd_mult` 0).
      rules: `ParamGroupRule`s; a rule whose `pattern` is found (`re.search`) in a param's
        name (`blocks/0/mlp/fc1/kernel`) sets the multipliers it gives.
      ndims: per param, its number of dims per layer (a scanned layer stack's leading [L]
        dim excluded); default the array's ndim.
    """
    if ndims is None:
        ndims = jax.tree.map(lambda p: len(p.shape), abstract_params)

    def group(path, p, ndim):
        name = path_name(path)
        no_wd = not weight_decay_1d and (name.endswith("bias") or ndim < 2)
        lr_mult, wd_mult = 1.0, 0.0 if no_wd else 1.0
        for rule in rules:
            if re.search(rule.pattern, name):
                lr_mult = lr_mult if rule.lr_mult is None else rule.lr_mult
                wd_mult = wd_mult if rule.wd_mult is None else rule.wd_mult
        return ParamGroup(lr_mult, wd_mult)

    return jax.tree_util.tree_map_with_path(group, abstract_params, ndims)


def is_trivial(groups: PyTree | None) -> bool:
    """No group changes anything (every multiplier 1)."""
    return groups is None or all(g == ParamGroup() for g in group_leaves(groups))


def group_leaves(groups: PyTree) -> list[ParamGroup]:
    return jax.tree.leaves(groups, is_leaf=lambda g: isinstance(g, ParamGroup))


def per_param_values(groups: PyTree) -> GroupValues:
    """The spec path's `GroupValues`: one Python float per param, params' structure."""
    is_group = lambda g: isinstance(g, ParamGroup)  # noqa: E731
    return GroupValues(
        jax.tree.map(lambda g: g.lr_mult, groups, is_leaf=is_group),
        jax.tree.map(lambda g: g.wd_mult, groups, is_leaf=is_group),
    )


def with_extra_args(inner) -> optax.GradientTransformationExtraArgs:
    """`inner` as a transformation whose `update` takes extra arguments (`param_groups`): itself where its
    `update` takes them (`**kwargs`: `optax.MultiSteps`, which forwards them to the chain it wraps, is no
    `GradientTransformationExtraArgs`), else `optax.with_extra_args_support`'s wrapper, which drops them."""
    if isinstance(inner, optax.GradientTransformationExtraArgs):
        return inner
    try:
        takes = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(inner.update).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin)
        takes = False
    if not takes:
        return optax.with_extra_args_support(inner)
    return optax.GradientTransformationExtraArgs(inner.init, inner.update)


def multipliers(extra_args: dict, field: str, updates: PyTree) -> PyTree:
    """The `field` (lr_mult or wd_mult) of the `param_groups` extra argument, laid out like `updates`; 1.0
    for every leaf without it."""
    values = extra_args.get(EXTRA_ARG)
    if values is None:
        return jax.tree.map(lambda _: 1.0, updates)
    return getattr(values, field)


def _map_unmasked(f, updates: PyTree, *rest: PyTree) -> PyTree:
    """`jax.tree.map(f, updates, *rest)` where `updates` holds arrays; an `optax.MaskedNode` (the leaves an
    enclosing `optax.masked` leaves out, whose `param_groups` still hold their values) stays as it is."""
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    return jax.tree.map(lambda u, *r: u if masked(u) else f(u, *r), updates, *rest, is_leaf=masked)


def add_decayed_weights(weight_decay: optax.ScalarOrSchedule = 0.0) -> optax.GradientTransformationExtraArgs:
    """`optax.add_decayed_weights` with Megatron's per-param `wd_mult`: `g + weight_decay * wd_mult * p`."""
    base = optax.add_decayed_weights(weight_decay)

    def update(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError("add_decayed_weights needs the params: pass them to update")
        _, new_state = base.update(updates, state, params)  # the schedule's step count
        s = weight_decay(state.count) if callable(weight_decay) else weight_decay
        mult = multipliers(extra_args, "wd_mult", updates)
        return _map_unmasked(lambda g, p, m: g + s * m * p, updates, params, mult), new_state

    return optax.GradientTransformationExtraArgs(base.init, update)


def scale_by_lr_mult() -> optax.GradientTransformationExtraArgs:
    """Multiplies each update by its param's `lr_mult` (place it after the learning rate)."""

    def update(updates, state, params=None, **extra_args):
        del params
        mult = multipliers(extra_args, "lr_mult", updates)
        return _map_unmasked(lambda u, m: u * m, updates, mult), state

    return optax.GradientTransformationExtraArgs(lambda _: optax.EmptyState(), update)


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
) -> optax.GradientTransformationExtraArgs:
    """`optax.adamw` with param groups: `-lr * lr_mult * (adam + weight_decay * wd_mult * p)`.

    With every multiplier 1 it computes exactly what `optax.adamw` computes.
    """
    return optax.chain(
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
        add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
        scale_by_lr_mult(),
    )


def __getattr__(name: str):
    """`groups.muon`: Megatron's Muon with param groups lives in `muon.py`, which imports this module."""
    if name == "muon":
        from jzero.zero.common.muon import muon

        return muon
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
