"""Whole-tensor ownership (`zero.path: owned`): which rank of its DP domain owns each param, and where.

A *piece* is what one rank owns whole: a param, or one layer of a stacked `[L, ...]` param (one in an
FSDP unit with `unit_dims == 1`) along its layer axis. Dense params are owned over the dense domain's
inner axes (dp_outer x dp x ep, less dp_outer under HSDP), expert params over the expert domain's
(dp_outer x dp, less dp_outer), as Megatron deals `expt_dp` apart; an expert piece is a rank's ep-local
slice, owned by its expert-DP rank on every ep rank alike.

Each domain lays its pieces out in one *segment* per owner: the owner's pieces in (param, layer) order,
contiguous, zero-padded to the largest segment `S`. The grads reach their owner by one reduce-scatter of
a `[d, S]` buffer (row r = owner r's pieces), the owner steps its pieces whole, and one all-gather of
the `[S]` segments returns every param: `d * S` elements each way, DDP's wire bytes when the segments
balance (`Domain.loads`).

Balance (`OwnedBalance`):
  elements: each piece, largest first, goes to the owner whose larger share, of the domain's elements
    or of its optimizer state (`state`: per param, its state elements per element: Adam's 2, a Muon
    matrix's 1), stays smallest with it (lowest rank on ties): the longest-processing-time rule on both,
    so the segments (the wire) and the state rows (the memory) both come out even.
  megatron: Megatron-Core 0.16.1's `LayerWiseDistributedOptimizer`: pieces stable-sorted by size and
    dealt round the loop `0, 1, ..., d-1, d-1, ..., 1, 0` (docs/owned.md).
Both are deterministic; a rank that owns nothing holds an all-padding segment and still takes part.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax

from jzero.errors import ConfigError
from jzero.mesh import axes_size, entry_axes, spec_axes
from jzero.zero.common.strategies import ShardingPlan, TensorPlan
from jzero.zero.config import OwnedBalance

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Piece:
    """One piece: `leaf` (index in `jax.tree.leaves` order), `layer` (along the stacked axis; None: the whole
    param), `numel` (elements as one rank holds it: ep-local for an expert param), its `owner` in the
    domain and its `offset` in the owner's segment."""

    leaf: int
    layer: int | None
    numel: int
    owner: int
    offset: int


@dataclasses.dataclass(frozen=True)
class Domain:
    """The pieces of one DP domain, dealt over its `axes` (size `d`); `size`: the segment length S."""

    axes: tuple[str, ...]
    d: int
    pieces: tuple[Piece, ...]
    size: int

    def owned(self, owner: int) -> tuple[Piece, ...]:
        """The pieces `owner` holds, in segment order."""
        return self._by_owner.get(owner, ())

    @functools.cached_property
    def _by_owner(self) -> dict[int, tuple[Piece, ...]]:
        out: dict[int, list[Piece]] = {}
        for p in self.pieces:
            out.setdefault(p.owner, []).append(p)
        return {r: tuple(ps) for r, ps in out.items()}

    def loads(self) -> list[int]:
        """Elements each owner holds (before padding)."""
        return [sum(p.numel for p in self.owned(r)) for r in range(self.d)]


@dataclasses.dataclass(frozen=True)
class OwnedPlan:
    """Who owns what, resolved once.

    domains: the dense domain's pieces, then the expert domain's (if any param is an expert's).
    local_shapes: per leaf, its shape as one rank holds it (tp-split dims local; ep-local experts).
    stacked: per leaf, whether its pieces are its layers (axis 0).
    axes: the inner dense DP axes: a rank's `branch` is its linear index over them (its dense owner
      index); the expert owner index is `branch // stride` (ep is the last dense axis).
    balance: the rule that dealt the pieces.
    """

    domains: tuple[Domain, ...]
    local_shapes: tuple[tuple[int, ...], ...]
    stacked: tuple[bool, ...]
    axes: tuple[str, ...]
    ranks: int
    balance: OwnedBalance

    def owner(self, domain: Domain, branch: int) -> int:
        """The owner index in `domain` of the rank with dense index `branch`."""
        return branch // (self.ranks // domain.d)

    def pieces_of(self, branch: int) -> list[tuple[int, Domain, Piece]]:
        """(domain index, domain, piece) for every piece the rank `branch` owns."""
        return [(i, dom, p) for i, dom in enumerate(self.domains) for p in dom.owned(self.owner(dom, branch))]

    def owned_layers(self, branch: int, leaf: int) -> list[int | None]:
        """The layers (or [None]: the whole param) of `leaf` that rank `branch` owns, ascending."""
        return self._layers.get((branch, leaf), [])

    def view_shape(self, branch: int, leaf: int) -> tuple[int, ...] | None:
        """The shape rank `branch` steps `leaf` at: its local shape, a stack's leading dim cut to the owned
        layers; None where it owns none of it."""
        layers = self.owned_layers(branch, leaf)
        if not layers:
            return None
        shape = self.local_shapes[leaf]
        return (len(layers), *shape[1:]) if self.stacked[leaf] else shape

    def domain_of(self, leaf: int) -> int:
        return self._domains[leaf]

    @functools.cached_property
    def _layers(self) -> dict[tuple[int, int], list[int | None]]:
        out: dict[tuple[int, int], list[int | None]] = {}
        for b in range(self.ranks):
            for _, _, p in self.pieces_of(b):
                out.setdefault((b, p.leaf), []).append(p.layer)
        return out

    @functools.cached_property
    def _domains(self) -> dict[int, int]:
        return {p.leaf: i for i, dom in enumerate(self.domains) for p in dom.pieces}


def _deal(numels: list[int], d: int, balance: OwnedBalance, states: list[float] | None = None) -> list[int]:
    """The owner of each piece (module docstring); `states`: each piece's optimizer-state elements."""
    if balance == OwnedBalance.MEGATRON:
        loop, owners = list(range(d)) + list(reversed(range(d))), [0] * len(numels)
        for k, i in enumerate(sorted(range(len(numels)), key=lambda i: numels[i])):
            owners[i] = loop[k % len(loop)]
        return owners
    states = states or [0.0] * len(numels)
    total = (max(1, sum(numels)), max(1.0, sum(states)))
    order = sorted(range(len(numels)), key=lambda i: -(numels[i] / total[0] + states[i] / total[1]))
    owners, loads = [0] * len(numels), [(0.0, 0.0)] * d

    def after(r: int, i: int) -> tuple[float, float]:  # owner r's elements and state, as shares, with piece i
        return (loads[r][0] + numels[i] / total[0], loads[r][1] + states[i] / total[1])

    for i in order:
        r = min(range(d), key=lambda r: (max(after(r, i)), sum(after(r, i)), r))
        owners[i], loads[r] = r, after(r, i)
    return owners


def _local_shape(plan: ShardingPlan, t: TensorPlan) -> tuple[int, ...]:
    entries = tuple(t.tp_spec) + (None,) * (len(t.shape) - len(t.tp_spec))
    return tuple(n // axes_size(plan.mesh, entry_axes(e)) for n, e in zip(t.shape, entries))


def make_owned_plan(
    plan: ShardingPlan, balance: OwnedBalance | str = OwnedBalance.ELEMENTS, state: list[float] | None = None,
    whole: frozenset[int] = frozenset(),
) -> OwnedPlan:
    """The ownership of `plan`'s params (module docstring).

    `state`: per param its optimizer-state elements per element (`elements` balances them too); `whole`: the
    stacked params (leaves indices) owned whole, not by layer (a chain that couples their layers).

    Raises ConfigError for a param split over tp (whole-tensor ownership needs the whole tensor on its
    owner: the layout runs with tp = 1) and for a stacked unit with more than one layer dim.
    """
    balance = OwnedBalance(balance)
    tensors: list[TensorPlan] = jax.tree.leaves(plan.tensors)
    for t in tensors:
        if "tp" in spec_axes(t.tp_spec) and plan.mesh.shape["tp"] > 1:
            raise ConfigError(
                f"zero.path=owned: param {t.name} is split over tp; whole-tensor ownership needs each param "
                "whole on its owner, so it runs with mesh.tp=1 (use zero.path=spec or flat with tensor parallelism)"
            )
        if t.numel == 0:
            raise ConfigError(f"zero.path=owned: param {t.name} has shape {tuple(t.shape)}, 0 elements: leave it out")
        if (t.unit_dims or 0) > 1:
            raise ConfigError(f"zero.path=owned: param {t.name} has {t.unit_dims} stacked-layer dims; at most 1")
    outer = ("dp_outer",) if plan.hsdp else ()
    dense = next((t.inner_axes for t in tensors if "ep" in t.dp_axes), None)
    dense = dense or tuple(a for a in ("dp_outer", "dp", "ep") if a not in outer)
    ranks = axes_size(plan.mesh, dense)
    local = tuple(_local_shape(plan, t) for t in tensors)
    stacked = tuple(bool(t.unit_dims) and len(t.shape) > 1 and i not in whole for i, t in enumerate(tensors))
    by_axes: dict[tuple[str, ...], list[int]] = {}
    for i, t in enumerate(tensors):
        by_axes.setdefault(t.inner_axes, []).append(i)
    domains = []
    for axes in sorted(by_axes, key=lambda a: a != dense):  # the dense domain first
        d = axes_size(plan.mesh, axes)
        if ranks % d:
            raise ConfigError(f"zero.path=owned: the DP domain {axes} ({d}) does not divide the dense one ({ranks})")
        items = [
            (i, layer, math.prod(local[i][1:] if stacked[i] else local[i]))
            for i in by_axes[axes]
            for layer in (range(local[i][0]) if stacked[i] else [None])
        ]
        states = None if state is None else [n * state[i] for i, _, n in items]
        owners = _deal([n for _, _, n in items], d, balance, states)
        offsets, pieces = [0] * d, []
        for (i, layer, n), r in sorted(zip(items, owners), key=lambda x: x[1]):  # stable: leaves, then layers
            pieces.append(Piece(i, layer, n, r, offsets[r]))
            offsets[r] += n
        domains.append(Domain(axes, d, tuple(pieces), max(offsets + [1])))
    return OwnedPlan(tuple(domains), local, stacked, dense, ranks, balance)


def describe(owned: OwnedPlan, names: list[str]) -> list[str]:
    """Lines for `jzero layout`: per domain and owner, its elements and the pieces it owns. An owner is its
    index in the domain: in the expert domain, the expert-DP index, the same pieces on every ep rank."""
    lines = []
    for dom in owned.domains:
        lines.append(
            f"domain {'x'.join(dom.axes)} ({dom.d} owners, segment {dom.size} elements, {owned.balance.value})"
        )
        for r, load in enumerate(dom.loads()):
            what = ", ".join(names[p.leaf] + ("" if p.layer is None else f"[{p.layer}]") for p in dom.owned(r))
            lines.append(f"  rank {r}: {load} elements: {what or '(nothing)'}")
    return lines
