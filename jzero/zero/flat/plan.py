"""The flat-buffer view of a ShardingPlan: Megatron's buffers, one set per FSDP unit.

As in Megatron, which keys its buffers by (param dtype, grad dtype, is_expert), the params
are laid into up to two flat buffers (docs/megatron.md, "The flat buffer"):

  dense:   the dense params, tp-local, over the dense DP domain (dp_outer x dp x ep);
  expert:  the expert params, ep- and tp-local (`[E/ep, D, F/tp]`), over the expert DP
           domain (dp_outer x dp). A model without expert params has no expert buffer.

Per FSDP unit (`zero.overlap_grad_reduce`, and ZeRO-3; Megatron-FSDP's per-module buffers) the
params are first split into groups (`FlatGroup`): each unit's params (`TensorPlan.unit_dims` not
None; a unit is named by `unit_key`) form one group, the params in no unit (embeddings, final
norm, head) the "rest" group. Without units, or with `overlap_grad_reduce: false` below ZeRO-3,
every param is in the rest group: one layout over the whole model, as Megatron's DDP.

Each group's buffer is Megatron's layout (`buffers.build_layout`) over its params' local element
counts (params in `jax.tree.leaves` order), padded to `lcm(d, 128)` with d its own DP size and cut
into buckets (`zero.bucket_size` applies within a group; unset: one bucket per buffer, so one per
unit as Megatron-FSDP's: measured best on LLaMA-2-7B, docs/overlap.md, "Flat path per unit"). A
scanned stack (unit_dims 1, `[L, ...]`) is one unit laid out per layer: its layout is over one
layer's params, and its bucket arrays carry a leading [L] (the layer loop slices one layer's
bucket). Rank r of a buffer's DP domain owns `[r*S_b/d, (r+1)*S_b/d)` of each of its buckets b, in
every layer. The plan numbers the buckets of all buffers in one sequence: groups in the order of
their first param, dense before expert.

Global arrays (S_b = padded size of bucket b):
  dense bucket:     [tp, S_b]       P("tp", DENSE_DP_AXES)          (P("tp", None) unsharded)
                    (under HSDP the columns are split over the buffer's `shard_axes`)
  expert bucket:    [ep * tp, S_b]  P(("ep", "tp"), EXPERT_DP_AXES)  (P(("ep", "tp"), None));
                    row ep_rank * tp + tp_rank
  stacked bucket:   [L, rows, S_b]  P(None, rows, ...)
  inside shard_map: [1, S_b/d] the owned shard, or [1, S_b] whole (`local`: [S_b/d], [L, S_b/d])
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jzero.errors import ConfigError
from jzero.mesh import AXES, DENSE_DP_AXES, EP_AXIS, EXPERT_DP_AXES, TP_AXIS, axes_size, entry_axes, spec_axes
from jzero.zero.common.strategies import ShardingPlan, TensorPlan
from jzero.zero.flat.buffers import Layout, build_layout

PyTree = Any
MAX_BUCKET = 2**31 - 1  # positions inside a bucket are int32 (JAX's default integer)
DENSE, EXPERT = "dense", "expert"
REST = ""  # the group of the params in no FSDP unit


@dataclasses.dataclass(frozen=True)
class FlatBuffer:
    """One flat buffer (one Megatron buffer key of one group) and the mesh axes its buckets live on.

    Attributes:
      kind: "dense" or "expert".
      dp_axes: its DP domain: buckets are reduced over these axes.
      inner_axes: the DP axes a bucket is reduce-scattered over first: `dp_axes`, or under HSDP
        those less dp_outer (`strategies.TensorPlan.inner_axes`).
      shard_axes: the axes its buckets' state is split over, in layout order: `inner_axes`, then
        dp_outer under HSDP `outer_strategy: optim` (`strategies.TensorPlan.shard_axes`).
      model_axes: the mesh axes its params are split over, ("tp",) or ("ep", "tp"); a bucket
        array has one row per rank of them.
      layout: Megatron's layout over its params' local element counts, one layer's for a stacked
        group (`layout.dp_size` is `d`, or 1 under no_shard: no padding); its param j is leaf `params[j]`.
      params: leaves-order indices of its params.
      d: size of `shard_axes`: each rank owns 1/d of every bucket.
      sharded: whether its optimizer state is sharded over `shard_axes` (not under no_shard).
      group: the key of its group (`unit_key`; `REST` for the params in no unit).
      layers: L for a scanned stack's group (its arrays carry a leading [L]), else None.
      d_inner: size of `inner_axes`: a resting param bucket (`param_spec`) is split d_inner ways.
    """

    kind: str
    dp_axes: tuple[str, ...]
    inner_axes: tuple[str, ...]
    shard_axes: tuple[str, ...]
    model_axes: tuple[str, ...]
    layout: Layout
    params: tuple[int, ...]
    d: int
    sharded: bool
    group: str = REST
    layers: int | None = None
    d_inner: int = 1

    @property
    def n_buckets(self) -> int:
        return self.layout.num_buckets

    @property
    def lead(self) -> tuple[int, ...]:
        """The leading dims of its arrays: (L,) for a stacked group, else ()."""
        return () if self.layers is None else (self.layers,)

    def _spec(self, columns) -> P:
        rows = self.model_axes[0] if len(self.model_axes) == 1 else self.model_axes
        return P(*(None,) * len(self.lead), rows, columns)

    def bucket_spec(self, sharded: bool | None = None) -> P:
        """Spec of its bucket arrays: rows over `model_axes`, columns split over DP if `sharded`."""
        sharded = self.sharded if sharded is None else sharded
        return self._spec(self.shard_axes if sharded else None)

    def param_spec(self) -> P:
        """Spec of its model params resting as bucket shards (`Stage.params_rest_sharded`): split
        over the inner DP axes only, as ZeRO-3's params on the spec path."""
        return self._spec(self.inner_axes)

    def shard_size(self, b: int) -> int:
        """Elements of its bucket b one rank steps per layer: its owned shard, or all of it under no_shard."""
        start, end = self.layout.bucket_indices[b]
        return (end - start) // self.d if self.sharded else end - start

    def numel(self, b: int) -> int:
        """Elements of its bucket b per layer, padding included."""
        start, end = self.layout.bucket_indices[b]
        return end - start

    @property
    def outer_axes(self) -> tuple[str, ...]:
        """The DP axes reduced after the inner ones: dp_outer under HSDP, else none."""
        return tuple(a for a in self.dp_axes if a not in self.inner_axes)

    def norm_axes(self, tp_split: bool) -> tuple[str, ...]:
        """The axes over which one device's elements of this buffer are distinct (the psum of the
        squares in the global norm): its DP domain when sharded (else every rank holds the same),
        ep for experts, tp for tp-split params. A tp-replicated element is identical on every tp
        rank, so not summing over tp counts it once (Megatron's tp-duplicate rule)."""
        axes = set(self.shard_axes if self.sharded else ()) | {a for a in self.model_axes if a != TP_AXIS}
        return tuple(a for a in AXES if a in axes or (tp_split and a == TP_AXIS))


@dataclasses.dataclass(frozen=True)
class FlatGroup:
    """One group's buffers: an FSDP unit's (`key` its `unit_key`), or the params in no unit (`REST`).

    layers: L for a scanned stack (`[L, ...]` params, per-layer layout), else None.
    params: leaves-order indices of its params; buffers: its dense, then its expert buffer.
    """

    key: str
    layers: int | None
    params: tuple[int, ...]
    buffers: tuple[FlatBuffer, ...]


@dataclasses.dataclass(frozen=True)
class FlatPlan:
    """The flat-buffer view of a ShardingPlan.

    Attributes:
      plan: the per-tensor plan (tp specs, DP domains).
      groups: the FSDP units' groups and the rest group (module docstring), in the order of their first param.
      local_shapes: tp- and ep-local shape of each param (leaves order), stacked dims included.
      tp_sharded: per param (leaves order), whether tp splits it (its grad counts on every tp
        rank in the norm; a tp-replicated param counts once, Megatron's
        `param_is_not_tensor_parallel_duplicate`).
      stacked: per param (leaves order), whether its group is a scanned stack (its dim 0 is [L]).

    Where the stage's params rest sharded (`Stage.params_rest_sharded`) they rest as bucket shards
    (`FlatBuffer.param_spec`) and the forward gathers each group's.
    """

    plan: ShardingPlan
    groups: tuple[FlatGroup, ...]
    local_shapes: tuple[tuple[int, ...], ...]
    tp_sharded: tuple[bool, ...]
    stacked: tuple[bool, ...]

    @property
    def buffers(self) -> tuple[FlatBuffer, ...]:
        """Every group's buffers, in plan order."""
        return tuple(buf for g in self.groups for buf in g.buffers)

    @property
    def per_unit(self) -> bool:
        """Whether some group is an FSDP unit's (else one layout over the whole model)."""
        return any(g.key != REST for g in self.groups)

    def buffer(self, kind: str) -> FlatBuffer | None:
        return next((buf for buf in self.buffers if buf.kind == kind), None)

    @property
    def layout(self) -> Layout:
        """The first buffer's layout: without units the dense buffer's (the only one for a dense model)."""
        return self.buffers[0].layout

    @property
    def dp_axes(self) -> tuple[str, ...]:
        """The dense DP domain (the batch's); `d` is its size, which scales every grad."""
        return DENSE_DP_AXES

    @property
    def d(self) -> int:
        return axes_size(self.plan.mesh, self.dp_axes)

    @property
    def buckets(self) -> tuple[tuple[FlatBuffer, int], ...]:
        """Per plan bucket, (its buffer, its index in that buffer)."""
        return tuple((buf, b) for buf in self.buffers for b in range(buf.n_buckets))

    @property
    def n_buckets(self) -> int:
        """Buckets over all buffers."""
        return sum(buf.n_buckets for buf in self.buffers)

    @property
    def numel(self) -> int:
        """Elements one device holds in all its buffers, padding and every layer included."""
        return sum(int(np.prod(buf.lead, dtype=np.int64)) * buf.layout.numel for buf in self.buffers)

    def layer_shape(self, i: int) -> tuple[int, ...]:
        """Param i's local shape in one layer: its stacked [L] dim dropped if its group is a scanned stack."""
        return self.local_shapes[i][1:] if self.stacked[i] else self.local_shapes[i]

    def bucket_specs(self, sharded: bool | None = None) -> list[P]:
        """Spec of every bucket array (`FlatBuffer.bucket_spec`)."""
        return [buf.bucket_spec(sharded) for buf, _ in self.buckets]

    def param_specs(self) -> list[P]:
        """Spec of every resting param bucket (`FlatBuffer.param_spec`)."""
        return [buf.param_spec() for buf, _ in self.buckets]

    def bucket_shapes(self) -> list[tuple[int, ...]]:
        """Global shape of every bucket array: [tp, S_b] dense, [ep * tp, S_b] expert, [L, ...] stacked."""
        mesh = self.plan.mesh
        return [(*buf.lead, axes_size(mesh, buf.model_axes), buf.numel(b)) for buf, b in self.buckets]

    def shard_size(self, b: int) -> int:
        """Elements of bucket b one rank steps per layer: its owned shard, or all of it under no_shard."""
        buf, local = self.buckets[b]
        return buf.shard_size(local)

    def shard_shape(self, b: int) -> tuple[int, ...]:
        """Shape of bucket b's shard as one device steps it: [S_b/d] ([L, S_b/d] stacked; [S_b] under no_shard)."""
        buf, local = self.buckets[b]
        return (*buf.lead, buf.shard_size(local))


def _local_shape(shape: tuple[int, ...], spec: P, mesh) -> tuple[int, ...]:
    out = list(shape)
    for dim, entry in enumerate(spec):
        if entry is not None:
            out[dim] //= axes_size(mesh, entry_axes(entry))
    return tuple(out)


FLAX_COLLECTION = "params"  # Linen's `{"params": ...}`: a key above every param, never one block's
_NUMBERED = re.compile(r".+_\d+")  # Linen's name of item i of a list attribute (`blocks_3`), or of its i-th
# unnamed submodule of a class (`Block_3`)


def unit_key(path: tuple) -> str:
    """The FSDP unit a unit param belongs to on the flat path: its key path up to its first integer
    key (`blocks/3` for every param of the fourth block: a list, an NNX `nnx.List`), else up to its first
    key Linen numbered (`params/blocks_3`, `params/decoder/Block_3`), else its first key (`blocks` for a
    scanned stack). A leading `params` (Linen's `{"params": ...}`) stays in the name but never names a
    unit alone (`params/blocks`). A `unit` call that receives part of a unit's params fails at trace
    time; a tree these do not name apart needs `build_zero(..., unit_key=)`."""
    keys = [getattr(k, "idx", getattr(k, "key", None)) for k in path]
    skip = int(len(keys) > 1 and keys[0] == FLAX_COLLECTION)
    ints = [i for i, k in enumerate(keys) if isinstance(k, int) and not isinstance(k, bool)]
    numbered = [i for i, k in enumerate(keys) if i >= skip and isinstance(k, str) and _NUMBERED.fullmatch(k)]
    end = (ints or numbered or [skip])[0]
    return jax.tree_util.keystr(tuple(path[: end + 1]), simple=True, separator="/")


def group_keys(plan: ShardingPlan, per_unit: bool, key_of: Callable[[tuple], str] | None = None) -> list[str]:
    """Per param (leaves order), its group: `key_of(path)` (default `unit_key`) of a unit param when
    `per_unit`, else `REST`."""
    key_of = unit_key if key_of is None else key_of
    leaves = jax.tree_util.tree_flatten_with_path(plan.tensors)[0]
    keys = [str(key_of(path)) if per_unit and t.unit_dims is not None else REST for path, t in leaves]
    empty = [t.name for (_, t), k in zip(leaves, keys) if k == REST and t.unit_dims is not None and per_unit]
    if empty:
        raise ConfigError(f"unit_key named no unit (an empty name) for unit param {empty[0]}; name every unit")
    return keys


def _check_buffer_member(kind: str, model_axes: tuple[str, ...], t: TensorPlan) -> None:
    axes = spec_axes(t.tp_spec)
    if not set(axes) <= set(model_axes) or (kind == EXPERT and EP_AXIS not in axes):
        raise ConfigError(
            f"zero.path=flat: {kind} param {t.name} has model-parallel spec {t.tp_spec}; "
            f"a {kind} param may only be split over {model_axes}"
            + (" and must be split over ep" if kind == EXPERT else "")
        )


def _group_layers(key: str, members: list[int], tensors: list[TensorPlan]) -> int | None:
    """L of a stacked group (every member `[L, ...]` with unit_dims 1), None for a group of unstacked params."""
    dims = {tensors[i].unit_dims or 0 for i in members}
    if dims == {0}:
        return None
    if dims != {1}:
        raise ConfigError(
            f"zero.path=flat: the params of unit {key!r} have {sorted(dims)} stacked-layer dims; the flat path "
            "lays out a unit whose params all have 0 or all have 1 (a scanned stack [L, ...])"
        )
    layers = {tensors[i].shape[0] for i in members}
    if len(layers) != 1:
        raise ConfigError(f"zero.path=flat: the params of unit {key!r} stack different numbers of layers {layers}")
    return layers.pop()


def _buffers(plan, key, members, layers, layer_numel, bucket_size, pad) -> tuple[FlatBuffer, ...]:
    """One group's dense and expert buffers (each present only if it has params)."""
    tensors, mesh, out, sharded = jax.tree.leaves(plan.tensors), plan.mesh, [], plan.stage.shards_state
    for kind, dp_axes, model_axes in ((DENSE, DENSE_DP_AXES, (TP_AXIS,)), (EXPERT, EXPERT_DP_AXES, (EP_AXIS, TP_AXIS))):
        mine = tuple(i for i in members if tensors[i].dp_axes == dp_axes)
        if not mine:
            continue
        for i in mine:
            _check_buffer_member(kind, model_axes, tensors[i])
        inner_axes, shard_axes = tensors[mine[0]].inner_axes, tensors[mine[0]].shard_axes
        d, d_inner = axes_size(mesh, shard_axes), axes_size(mesh, inner_axes)
        layout = build_layout(
            [layer_numel[i] for i in mine], d if sharded else 1, bucket_size, pad_for_high_nccl_busbw=pad
        )
        out.append(FlatBuffer(
            kind, dp_axes, inner_axes, shard_axes, model_axes, layout, mine, d, sharded, key, layers, d_inner
        ))  # fmt: skip
    return tuple(out)


def make_flat_plan(
    plan: ShardingPlan,
    bucket_size: int | None,
    pad_for_high_nccl_busbw: bool,
    unit_key: Callable[[tuple], str] | None = None,
) -> FlatPlan:
    """Megatron's layouts for the local params of `plan` (module docstring): per group (one per FSDP
    unit where the stage reduces per unit, `Stage.per_unit`, a unit param's named by `unit_key(path)`,
    default the module's `unit_key`, and the rest), a dense buffer and, for expert params, an expert
    buffer, each padded for its own DP size. bucket_size None: one bucket per buffer.

    Raises ConfigError for what the flat path does not support: more than one param dtype,
    a param split over mesh axes its buffer does not know (an expert param not split over ep,
    a dense one split over ep), a unit mixing stacked and unstacked params, or a bucket too large
    for int32 positions.
    """
    tensors = jax.tree.leaves(plan.tensors)
    if len({t.dtype for t in tensors}) != 1:
        raise ConfigError("zero.path=flat needs one param dtype (one buffer); got " + str({t.dtype for t in tensors}))
    mesh = plan.mesh
    local_shapes = tuple(_local_shape(t.shape, t.tp_spec, mesh) for t in tensors)
    odd = [t.name for t in tensors if t.dp_axes not in (DENSE_DP_AXES, EXPERT_DP_AXES)]
    if odd:
        raise ConfigError(f"zero.path=flat: params {odd} are in neither the dense nor the expert DP domain")
    keys = group_keys(plan, plan.stage.per_unit, unit_key)
    groups = []
    for key in dict.fromkeys(keys):  # in the order of their first param
        members = [i for i, k in enumerate(keys) if k == key]
        layers = _group_layers(key, members, tensors) if key != REST else None
        skip = 0 if layers is None else 1
        numel = {i: int(np.prod(local_shapes[i][skip:], dtype=np.int64)) for i in members}
        buffers = _buffers(plan, key, members, layers, numel, bucket_size, pad_for_high_nccl_busbw)
        groups.append(FlatGroup(key, layers, tuple(members), buffers))
    largest = max(buf.numel(b) for g in groups for buf in g.buffers for b in range(buf.n_buckets))
    if largest > MAX_BUCKET:
        raise ConfigError(
            f"zero.bucket_size: a flat bucket of {largest} elements exceeds {MAX_BUCKET}; set zero.bucket_size "
            "(Megatron's default with overlap is max(40_000_000, 1_000_000 * dp))"
        )
    tp_sharded = tuple(TP_AXIS in spec_axes(t.tp_spec) and mesh.shape[TP_AXIS] > 1 for t in tensors)
    stacked = tuple(any(i in g.params and g.layers is not None for g in groups) for i in range(len(tensors)))
    return FlatPlan(plan, tuple(groups), local_shapes, tp_sharded, stacked)
