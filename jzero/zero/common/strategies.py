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
| optim_grads_params  | W[D_dp, F_tp]| W[D_dp, F_tp] | W[D_dp, F_tp] | W[D_dp, F_tp]                      |
|   (ZeRO-3 / FSDP)   |              |               |               |                                    |

The grad buffer is what the microbatches accumulate into (Megatron's `grad_data`): the
rank's local grads under DDP and ZeRO-1, reduced once after the last microbatch (an
all-reduce for DDP, a reduce-scatter for ZeRO-1: the same wire bytes as DDP's all-reduce
with the param all-gather, docs/megatron.md, "Bytes on the wire"); the owned shard of the
reduced grads under ZeRO-2, which reduce-scatters every microbatch into it.

ZeRO-2 and ZeRO-3 reduce each FSDP unit's grads as soon as its backward is done, and ZeRO-3
gathers a unit's params just before it runs (`units.py`).

HSDP (`dp_outer > 1`, Megatron's `num_distributed_optimizer_instances`): the DP domain is
dp_outer x inner, inner = (dp, ep) for dense params and (dp,) for expert params. What the
table shards over D_dp is sharded over the inner axes only and replicated across dp_outer;
with `outer_strategy: optim` the fp32 main params and optimizer state (and ZeRO-2/3's
reduced grads) are also split across dp_outer, inner axes first: `W[D_(inner, dp_outer), F_tp]`.

Each tensor gets a dim that is free of tp (a dim the tp spec names counts as free where tp is
1) and divisible by the DP size it is split over: its major dim if that one is, else its
largest (else the largest tp-split dim divisible by that size x tp, split over DP then tp); the
leading stacked-layer dims of a unit's params are never it. The major dim first: XLA:GPU
reduce-scatters and all-gathers along a tensor's major dim, so a shard on an inner dim costs a
transpose of each grad before its reduction and of each gathered param after it (LLaMA-2-7B's
output projection and second MLP matmul, split on their last dim `d` while the larger dim was
tp's: ZeRO-3's step 284.8 -> 281.6 ms at an H100's roofline with tp 1, experiments/bench/README.md).
A tensor with no such dim stays replicated; `ShardingPlan.replicated()` lists it so nothing is
silently unsharded.
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

from jzero.errors import ConfigError
from jzero.mesh import DENSE_DP_AXES, EP_AXIS, OUTER_AXIS, TP_AXIS, axes_size, dp_axes, entry_axes, spec_axes
from jzero.zero.config import OuterStrategy, ShardingStrategy, Stage

PyTree = Any


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """How one parameter is laid out.

    Attributes:
      name: path like `blocks/0/mlp/fc1/kernel`.
      shape, dtype: of the model param (global shape).
      tp_spec: the model-parallel PartitionSpec: tp, and ep on an expert weight's expert
        dim, e.g. P(None, "tp") or P("ep", None, "tp").
      dp_axes: the param's data-parallel domain (its grads are averaged over it).
      inner_axes: the DP axes its ZeRO-3 model param and ZeRO-2/3 unit reduce-scatter span:
        `dp_axes` less dp_outer when HSDP replicates across it, else `dp_axes`.
      shard_axes: the DP axes its fp32 main param and optimizer state are split over, in
        layout order: `inner_axes`, then dp_outer under HSDP `outer_strategy: optim`.
      shard_dim: the dim split over `shard_axes` in the ZeRO layout (jointly with tp if
        tp already splits it), None if no dim fits.
      unit_dims: None if the param is in no FSDP unit; else the number of its leading
        stacked-layer dims (1 for a scanned stack, 0 for one block's param), never sharded.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    tp_spec: P
    dp_axes: tuple[str, ...]
    inner_axes: tuple[str, ...]
    shard_axes: tuple[str, ...]
    shard_dim: int | None
    unit_dims: int | None = None

    def _split(self, axes: tuple[str, ...]) -> P:
        spec = list(self.tp_spec) + [None] * (len(self.shape) - len(self.tp_spec))
        if self.shard_dim is not None:
            tp = spec[self.shard_dim]
            spec[self.shard_dim] = (*axes, *entry_axes(tp))
        return P(*spec)

    @property
    def zero_spec(self) -> P:
        """`tp_spec` with `shard_axes` added on `shard_dim` (== tp_spec if replicated)."""
        return self._split(self.shard_axes)

    @property
    def inner_spec(self) -> P:
        """`tp_spec` with `inner_axes` added on `shard_dim`: a ZeRO-3 model param."""
        return self._split(self.inner_axes)

    @property
    def local_grad_spec(self) -> P:
        """Spec of the stacked per-rank (unreduced) grads `[n_dp, *shape]`."""
        return P(self.dp_axes, *self.tp_spec)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _tp_size(mesh: Mesh, entry) -> int:
    return axes_size(mesh, entry_axes(entry))


def _free_of_tp(mesh: Mesh, entry) -> bool:
    """A dim's tp spec entry leaves it free: None, or the tp axis alone where it is 1 (not ep's: the expert dim)."""
    return entry is None or (set(entry_axes(entry)) == {TP_AXIS} and _tp_size(mesh, entry) == 1)


def choose_shard_dim(shape: tuple[int, ...], tp_spec: P, dp_size: int, mesh: Mesh, skip: int = 0) -> int | None:
    """The dim to split over the DP domain, or None if none fits.

    Of the dims free of tp (or named by a tp spec over a tp of 1) and divisible by `dp_size`:
    the major one (the first after `skip`) if it is one of them (module docstring: why), else
    the largest; failing all, the largest tp-split dim divisible by tp_size * dp_size (then
    split over DP and tp jointly). The first `skip` dims (stacked layers) are never chosen,
    nor an empty one.
    """
    if dp_size == 1:
        return None
    spec = list(tp_spec) + [None] * (len(shape) - len(tp_spec))
    dims = [i for i in range(skip, len(shape)) if shape[i] > 0]
    free = [i for i in dims if _free_of_tp(mesh, spec[i]) and shape[i] % dp_size == 0]
    if free:
        return skip if free[0] == skip else max(free, key=lambda i: (shape[i], -i))
    joint = [i for i in dims if spec[i] is not None and shape[i] % (_tp_size(mesh, spec[i]) * dp_size) == 0]
    return max(joint, key=lambda i: (shape[i], -i)) if joint else None


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """The shardings of every array of a ZeRO run, resolved once.

    Attributes:
      mesh: the (dp_outer, dp, ep, tp) mesh.
      stage: the ZeRO stage (`config.Stage`: what is sharded, whether the params rest sharded).
      tensors: a pytree with the params' structure whose leaves are `TensorPlan`s.
      outer_strategy: HSDP's, what is also sharded across dp_outer (module docstring).
    """

    mesh: Mesh
    stage: Stage
    tensors: PyTree
    outer_strategy: OuterStrategy = OuterStrategy.NO_SHARD

    def _tree(self, spec_of: Callable[[TensorPlan], P]) -> PyTree:
        return jax.tree.map(lambda t: NamedSharding(self.mesh, spec_of(t)), self.tensors)

    @property
    def splits_ep(self) -> bool:
        """Whether some param (an expert weight) is split over the ep axis."""
        return any(EP_AXIS in spec_axes(t.tp_spec) for t in jax.tree.leaves(self.tensors))

    @property
    def hsdp(self) -> bool:
        return self.mesh.shape[OUTER_AXIS] > 1

    def dense_shard_axes(self) -> tuple[str, ...]:
        """The axes a dense param's state is split over (`TensorPlan.shard_axes`), for state
        leaves that belong to no param."""
        outer = (OUTER_AXIS,) if self.hsdp else ()
        inner = tuple(a for a in DENSE_DP_AXES if a not in outer)
        return inner + outer if self.outer_strategy == OuterStrategy.OPTIM else inner

    def param_spec(self, t: TensorPlan) -> P:
        """Spec of `t`'s model param between steps: tp-sharded, and split over its inner DP axes where
        the params rest sharded (`Stage.params_rest_sharded`)."""
        return t.inner_spec if self.stage.params_rest_sharded else t.tp_spec

    def param_shardings(self) -> PyTree:
        """Model params between steps: tp-sharded; replicated over the DP domain, or split over the
        inner DP axes where they rest sharded (ZeRO-3; ZeRO-1/2 with `overlap_param_gather`)."""
        return self._tree(self.param_spec)

    def state_spec(self, t: TensorPlan) -> P:
        """Spec of `t`'s fp32 main param and optimizer moments."""
        return t.zero_spec if self.stage.shards_state else t.tp_spec

    def state_shardings(self) -> PyTree:
        """fp32 main params and per-param optimizer state (moments); the reduced gradients, as the
        optimizer reads them, are sharded alike."""
        return self._tree(self.state_spec)

    def grad_buffer_shardings(self) -> PyTree:
        """The grad buffer per device (module docstring): full local grads unless optim_grads.

        Under DDP and ZeRO-1 the step holds it as stacked local grads (`local_grad_shardings`),
        one full tensor per rank; this gives the same per-device bytes in the param's shape.
        """
        return self._tree(lambda t: t.zero_spec if self.stage.shards_grads else t.tp_spec)

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
        if not self.stage.shards_state:
            return []
        return [
            (t.name, 4 * t.numel)
            for t in jax.tree.leaves(self.tensors)
            if t.shard_dim is None and axes_size(self.mesh, t.shard_axes) > 1 and t.numel
        ]


def restrict(spec: P, axes: tuple[str, ...]) -> P:
    """`spec` naming only the mesh axes in `axes` (the manual axes of a shard_map)."""

    def keep(entry):
        kept = tuple(a for a in entry_axes(entry) if a in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return P(*(keep(e) for e in spec))


def path_name(path: tuple) -> str:
    """`blocks/0/mlp/fc1/kernel` from a jax key path."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _check_spec_fits(name: str, shape: tuple[int, ...], spec, mesh: Mesh) -> None:
    """Raises ConfigError where the tensor-parallel spec names more dims than the param has, or splits a dim
    over devices that do not divide it."""
    if len(spec) > len(shape):
        raise ConfigError(
            f"param {name}: its spec {spec} names {len(spec)} dims, but its shape {shape} has {len(shape)}"
        )
    for dim, entry in enumerate(spec):
        devices = _tp_size(mesh, entry)
        if shape[dim] % devices:
            raise ConfigError(
                f"param {name}: its spec {spec} splits dim {dim} of shape {shape} over {devices} devices, "
                f"which do not divide {shape[dim]}"
            )


def make_plan(
    mesh: Mesh,
    stage: Stage | ShardingStrategy | str,
    abstract_params: PyTree,
    tp_specs: PyTree,
    is_expert: PyTree | None = None,
    units: PyTree | None = None,
    outer_strategy: OuterStrategy = OuterStrategy.NO_SHARD,
) -> ShardingPlan:
    """Resolves the sharding of every param once.

    Args:
      mesh: the device mesh.
      stage: the ZeRO stage (`ZeroConfig.stage`), or a strategy: its stage with the params resting whole.
      abstract_params: params or ShapeDtypeStructs (global shapes).
      tp_specs: same structure, the tensor-parallel PartitionSpec of each param.
      is_expert: same structure, True for expert params (default: all dense).
      units: same structure, per param None (in no FSDP unit) or its number of leading
        stacked-layer dims (`TensorPlan.unit_dims`); default: no units.
      outer_strategy: HSDP's, when the mesh's dp_outer is > 1.
    """
    if is_expert is None:
        is_expert = jax.tree.map(lambda _: False, abstract_params)
    if units is None:
        units = jax.tree.map(lambda _: None, abstract_params)  # a tree of None: no leaves, see below
    outer = (OUTER_AXIS,) if mesh.shape[OUTER_AXIS] > 1 else ()
    stage, outer_strategy = stage if isinstance(stage, Stage) else Stage.of(stage), OuterStrategy(outer_strategy)

    def plan_one(path, x, spec, expert, unit_dims):
        if bool(expert) != (EP_AXIS in spec_axes(spec)):
            # An expert weight replicated over ep would be reduced over too few ranks, a dense
            # one split over ep over too many: refuse either mix-up here, not as wrong grads.
            raise ConfigError(
                f"param {path_name(path)}: is_expert={bool(expert)} but its spec {spec} "
                + ("does not split it over 'ep'" if expert else "splits it over 'ep'")
                + " (expert weights, and only they, have their expert dim split over 'ep')"
            )
        _check_spec_fits(path_name(path), tuple(x.shape), spec, mesh)
        axes = dp_axes(expert)
        inner = tuple(a for a in axes if a not in outer)
        shard = inner + outer if outer_strategy == OuterStrategy.OPTIM else inner
        skip = unit_dims or 0
        shard_dim = choose_shard_dim(tuple(x.shape), spec, axes_size(mesh, shard), mesh, skip)
        name, shape = path_name(path), tuple(x.shape)
        return TensorPlan(name, shape, np.dtype(x.dtype), spec, axes, inner, shard, shard_dim, unit_dims)

    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
    others = [treedef.flatten_up_to(tree) for tree in (tp_specs, is_expert, units)]  # units may hold None
    tensors = treedef.unflatten([plan_one(path, x, *rest) for (path, x), *rest in zip(leaves, *others)])
    return ShardingPlan(mesh, stage, tensors, outer_strategy)
