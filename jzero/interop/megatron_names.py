"""Which Megatron param each jzero param is, and which Megatron state each of optax's Adam leaves is.

A model's `names` is a pytree shaped like its params whose leaves are Megatron param names, or
`Renamed` where the layouts differ (jzero's GPT: `jzero.interop.gpt`); optax's Adam moments
`mu` and `nu` are Megatron's `exp_avg` and `exp_avg_sq`. Loading (`jzero.interop.megatron`) and
saving (`jzero.interop.megatron_save`) read both through this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from jzero.interop import InteropError
from jzero.zero import Zero

PyTree = Any
OPTAX_MOMENT = {"mu": "exp_avg", "nu": "exp_avg_sq"}  # optax.ScaleByAdamState's fields


class Renamed(NamedTuple):
    """How one jzero param is stored in Megatron: as the params `names`, in that order.

    to_megatron: the jzero array -> one array per name (applied to the params, the fp32 main params
      and each Adam moment alike, so it must be linear in the values: reshapes, transposes, copies).
    from_megatron: the inverse; it raises InteropError if the Megatron arrays hold what jzero's
      param cannot (a bias jzero's model has not, and that is not zero).
    """

    names: tuple[str, ...]
    to_megatron: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    from_megatron: Callable[[tuple[np.ndarray, ...]], np.ndarray]


def renamed(leaf: str | Renamed) -> Renamed:
    """A `names` leaf as a Renamed: a plain name is the same array under that name."""
    if isinstance(leaf, Renamed):
        return leaf
    if not isinstance(leaf, str):
        raise TypeError(f"a names leaf is a Megatron param name or a Renamed, not {type(leaf).__name__}")
    return Renamed((leaf,), lambda x: (x,), lambda xs: xs[0])


def names_per_param(names: PyTree, zero: Zero) -> list[Renamed]:
    """`names` as one Renamed per param (leaves order); it must be shaped like the params."""
    is_leaf = lambda x: isinstance(x, Renamed)  # noqa: E731 (a NamedTuple: a pytree node otherwise)
    want = jax.tree.structure(zero.plan.tensors)
    got = jax.tree.structure(names, is_leaf=is_leaf)
    if got != want:
        raise InteropError(f"names is not shaped like the params: {got.num_leaves} leaves {got}, params {want}"[:300])
    return [renamed(leaf) for leaf in jax.tree.leaves(names, is_leaf=is_leaf)]


def adam_moment(path) -> str | None:
    """'mu' or 'nu' if the optimizer-state leaf at `path` is one of optax's Adam moments."""
    return next((k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey) and k.name in OPTAX_MOMENT), None)
