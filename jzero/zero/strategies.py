"""ZeRO stages as sharding specs: one `TensorPlan` per parameter, one `ShardingPlan` per run.

Notation (scaling-book): `W[D, F_tp]` is a weight whose F dim is split over tp.
Under ZeRO the fp32 copy becomes `W[D_dp, F_tp]`: one more dim split over the
param's data-parallel domain (`dp_outer x dp x ep` for dense params,
`dp_outer x dp` for expert params). Which arrays get that extra split is the
strategy (Megatron's `data_parallel_sharding_strategy`):

| strategy            | model params | grad buffer   | reduced grads | fp32 main params + optimizer state |
|---------------------|--------------|---------------|---------------|------------------------------------|
| no_shard (DDP)      | W[D, F_tp]   | W[D, F_tp]    | W[D, F_tp]    | W[D, F_tp]                         |
| optim (ZeRO-1)      | W[D, F_tp]   | W[D, F_tp]    | W[D_dp, F_tp] | W[D_dp, F_tp]                      |
| optim_grads (ZeRO-2)| W[D, F_tp]   | W[D_dp, F_tp] | W[D_dp, F_tp] | W[D_dp, F_tp]                      |

The grad buffer is what the microbatches accumulate into (Megatron's `grad_data`): the
rank's local grads under DDP and ZeRO-1, reduced once after the last microbatch (an
all-reduce for DDP, a reduce-scatter for ZeRO-1: the same wire bytes as DDP's all-reduce
with the param all-gather, docs/megatron.md, "Bytes on the wire"); the owned shard of the
reduced grads under ZeRO-2, which reduce-scatters every microbatch into it.

Each tensor gets its largest dim that is free of tp and divisible by the DP size
(else a tp-split dim divisible by tp x DP, split over both). A tensor with no such
dim stays replicated; `ShardingPlan.replicated()` lists it so nothing is silently unsharded.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.config import ConfigError, ShardingStrategy
from jzero.mesh import EP_AXIS, axes_size, dp_axes

PyTree = Any


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """How one parameter is laid out.

    Attributes:
      name: path like `blocks/0/mlp/fc1/kernel`.
      shape, dtype: of the model param (global shape).
      tp_spec: the model-parallel PartitionSpec: tp, and ep on an expert weight's expert
        dim, e.g. P(None, "tp") or P("ep", None, "tp").
      dp_axes: the param's data-parallel domain.
      shard_dim: the dim split over `dp_axes` in the ZeRO layout (jointly with tp if
        tp already splits it), None if no dim fits.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    tp_spec: P
    dp_axes: tuple[str, ...]
    shard_dim: int | None

    @property
    def zero_spec(self) -> P:
        """`tp_spec` with `dp_axes` added on `shard_dim` (== tp_spec if replicated)."""
        spec = list(self.tp_spec) + [None] * (len(self.shape) - len(self.tp_spec))
        if self.shard_dim is not None:
            tp = spec[self.shard_dim]
            tp = () if tp is None else (tp,) if isinstance(tp, str) else tuple(tp)
            spec[self.shard_dim] = (*tp, *self.dp_axes)
        return P(*spec)

    @property
    def local_grad_spec(self) -> P:
        """Spec of the stacked per-rank (unreduced) grads `[n_dp, *shape]`."""
        return P(self.dp_axes, *self.tp_spec)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _tp_size(mesh: Mesh, entry) -> int:
    return axes_size(mesh, (entry,) if isinstance(entry, str) else tuple(entry))


def choose_shard_dim(shape: tuple[int, ...], tp_spec: P, dp_size: int, mesh: Mesh) -> int | None:
    """The dim to split over the DP domain, or None if none fits.

    The largest dim free of tp and divisible by `dp_size`; failing that, the largest
    tp-split dim divisible by tp_size * dp_size (then split over tp and DP jointly).
    """
    if dp_size == 1:
        return None
    spec = list(tp_spec) + [None] * (len(shape) - len(tp_spec))
    free = [i for i, n in enumerate(shape) if spec[i] is None and n % dp_size == 0]
    if free:
        return max(free, key=lambda i: (shape[i], -i))
    joint = [i for i, n in enumerate(shape) if spec[i] is not None and n % (_tp_size(mesh, spec[i]) * dp_size) == 0]
    return max(joint, key=lambda i: (shape[i], -i)) if joint else None


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """The shardings of every array of a ZeRO run, resolved once.

    Attributes:
      mesh: the (dp_outer, dp, ep, tp) mesh.
      strategy: the ZeRO stage.
      tensors: a pytree with the params' structure whose leaves are `TensorPlan`s.
    """

    mesh: Mesh
    strategy: ShardingStrategy
    tensors: PyTree

    def _tree(self, spec_of: Callable[[TensorPlan], P]) -> PyTree:
        return jax.tree.map(lambda t: NamedSharding(self.mesh, spec_of(t)), self.tensors)

    @property
    def shards_state(self) -> bool:
        return self.strategy != ShardingStrategy.NO_SHARD

    @property
    def splits_ep(self) -> bool:
        """Whether some param (an expert weight) is split over the ep axis."""
        return any(EP_AXIS in spec_axes(t.tp_spec) for t in jax.tree.leaves(self.tensors))

    @property
    def shards_grads(self) -> bool:
        return self.strategy in (ShardingStrategy.OPTIM_GRADS, ShardingStrategy.OPTIM_GRADS_PARAMS)

    def param_shardings(self) -> PyTree:
        """Model params: tp-sharded, replicated over the DP domain."""
        return self._tree(lambda t: t.tp_spec)

    def state_spec(self, t: TensorPlan) -> P:
        """Spec of `t`'s fp32 main param and optimizer moments."""
        return t.zero_spec if self.shards_state else t.tp_spec

    def state_shardings(self) -> PyTree:
        """fp32 main params and per-param optimizer state (moments)."""
        return self._tree(self.state_spec)

    def grad_shardings(self) -> PyTree:
        """Reduced gradients, as the optimizer reads them: sharded wherever the state is."""
        return self._tree(lambda t: t.zero_spec if self.shards_state else t.tp_spec)

    def grad_buffer_shardings(self) -> PyTree:
        """The grad buffer per device (module docstring): full local grads unless optim_grads.

        Under DDP and ZeRO-1 the step holds it as stacked local grads (`local_grad_shardings`),
        one full tensor per rank; this gives the same per-device bytes in the param's shape.
        """
        return self._tree(lambda t: t.zero_spec if self.shards_grads else t.tp_spec)

    def local_grad_shardings(self) -> PyTree:
        """Per-rank unreduced grads stacked on a leading DP axis."""
        return self._tree(lambda t: t.local_grad_spec)

    def param_of(self, state_path: tuple) -> tuple | None:
        """The key path of the param an optimizer-state leaf at `state_path` belongs to, or None.

        Optimizers keep per-param state in trees shaped like the params (`mu['blocks'][0]...`),
        so the answer is the longest param key path that `state_path` ends with. Whether the
        leaf is shaped like that param (Adam's moments) or not (adafactor's factored moments)
        is for the caller to check.
        """
        paths = self._paths
        for k in range(len(state_path)):
            if state_path[k:] in paths:
                return state_path[k:]
        return None

    def tensor(self, path: tuple) -> TensorPlan:
        """The TensorPlan at a param key path."""
        return self._paths[path][1]

    def index(self, path: tuple) -> int:
        """The position of the param at `path` in `jax.tree.leaves` order."""
        return self._paths[path][0]

    @functools.cached_property
    def _paths(self) -> dict[tuple, tuple[int, TensorPlan]]:
        leaves = jax.tree_util.tree_flatten_with_path(self.tensors)[0]
        return {tuple(path): (i, t) for i, (path, t) in enumerate(leaves)}

    def tp_local_numel(self) -> int:
        """Parameters one model-parallel rank holds: each param's shard over the axes of its
        `tp_spec` (tp; and ep for an expert weight). The sum of `numel_by_domain`."""
        return sum(self.numel_by_domain().values())

    def numel_by_domain(self) -> dict[tuple[str, ...], int]:
        """Parameters one model-parallel rank holds, per data-parallel domain: {dp_axes: numel}.

        The P of Megatron's per-device formulas, one per domain (docs/megatron.md, "Bytes per
        parameter"): dense params `W[D, F_tp]` over `DENSE_DP_AXES`, expert params
        `W[E_ep, D, F_tp]` (this rank's experts) over `EXPERT_DP_AXES`. A dense model has one entry.
        """
        out: dict[tuple[str, ...], int] = {}
        for t in jax.tree.leaves(self.tensors):
            local = t.numel // math.prod(_tp_size(self.mesh, e) for e in t.tp_spec if e is not None)
            out[t.dp_axes] = out.get(t.dp_axes, 0) + local
        return out

    def replicated(self) -> list[tuple[str, int]]:
        """(name, fp32 bytes) of every tensor ZeRO leaves replicated over its DP domain."""
        if not self.shards_state:
            return []
        return [
            (t.name, 4 * t.numel)
            for t in jax.tree.leaves(self.tensors)
            if t.shard_dim is None and axes_size(self.mesh, t.dp_axes) > 1
        ]


def spec_axes(spec: P) -> tuple[str, ...]:
    """The mesh axes `spec` names, in order."""
    names = []
    for entry in spec:
        names += [] if entry is None else [entry] if isinstance(entry, str) else list(entry)
    return tuple(names)


def restrict(spec: P, axes: tuple[str, ...]) -> P:
    """`spec` naming only the mesh axes in `axes` (the manual axes of a shard_map)."""

    def keep(entry):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        kept = tuple(a for a in names if a in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return P(*(keep(e) for e in spec))


def path_name(path: tuple) -> str:
    """`blocks/0/mlp/fc1/kernel` from a jax key path."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def make_plan(
    mesh: Mesh,
    strategy: ShardingStrategy,
    abstract_params: PyTree,
    tp_specs: PyTree,
    is_expert: PyTree | None = None,
) -> ShardingPlan:
    """Resolves the sharding of every param once.

    Args:
      mesh: the device mesh.
      strategy: the ZeRO stage.
      abstract_params: params or ShapeDtypeStructs (global shapes).
      tp_specs: same structure, the tensor-parallel PartitionSpec of each param.
      is_expert: same structure, True for expert params (default: all dense).
    """
    if is_expert is None:
        is_expert = jax.tree.map(lambda _: False, abstract_params)

    def plan_one(path, x, spec, expert):
        if bool(expert) != (EP_AXIS in spec_axes(spec)):
            # An expert weight replicated over ep would be reduced over too few ranks, a dense
            # one split over ep over too many: refuse either mix-up here, not as wrong grads.
            raise ConfigError(
                f"param {path_name(path)}: is_expert={bool(expert)} but its spec {spec} "
                + ("does not split it over 'ep'" if expert else "splits it over 'ep'")
                + " (expert weights, and only they, have their expert dim split over 'ep')"
            )
        axes = dp_axes(expert)
        shard_dim = choose_shard_dim(tuple(x.shape), spec, axes_size(mesh, axes), mesh)
        return TensorPlan(path_name(path), tuple(x.shape), np.dtype(x.dtype), spec, axes, shard_dim)

    tensors = jax.tree_util.tree_map_with_path(
        plan_one, abstract_params, tp_specs, is_expert, is_leaf=lambda s: isinstance(s, P)
    )
    return ShardingPlan(mesh, strategy, tensors)
