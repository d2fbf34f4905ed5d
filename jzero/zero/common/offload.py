"""Optimizer-state host offload (`zero.offload_fraction`, Megatron's `--optimizer-offload-fraction`).

A share of the fp32 main params and of the optimizer state lives in host memory between steps
(JAX memory kind `pinned_host`, XLA's memory space S(5)); the step brings each offloaded array
to device memory for its update and puts the result back. It moves bytes, not math: the same
ops run on the same values.

Which share, as Megatron's `HybridDeviceOptimizer` chooses it: whole units in a fixed order,
each offloaded while the elements offloaded so far are below `fraction x total` (so the last
one may overshoot the fraction; 1.0 offloads everything, 0.0 nothing). Elements are counted
per device, in the fp32 main-param shard each unit's state has on one device:
  spec path: a unit is one parameter (its main param and every optimizer-state leaf that
    belongs to it: Adam's mu and nu), in `jax.tree.leaves` order of the params (a scanned
    stack of layers `[L, ...]` is one parameter);
  flat path: a unit is one bucket (its main-param shard and its state shards), dense buckets
    first, in bucket order.
Scalars (step counts) and state leaves that belong to no parameter stay on the device.

Shardings: an offloaded leaf keeps its spec, `W[D_dp, F_tp]` or a bucket's `[tp, S_b]` split
over DP, with `memory_kind="pinned_host"`; every other leaf keeps its sharding as is (no memory
kind). At fraction 0 nothing has a memory kind and the step is the program without offload.

Compile-only GPU devices (deviceless compilation, `jzero.inspect.targets`) expose no memories,
and a NamedSharding on their mesh drops any memory kind silently (jaxlib canonicalizes it to
None); there the host shardings are built on the mesh's `AbstractMesh`, which keeps the kind,
and XLA:GPU compiles the host placement (docs/offload.md, "Deviceless GPU compilation").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from jzero.zero.common.state import ZeroState
from jzero.zero.common.strategies import ShardingPlan, path_name

PyTree = Any
HOST = "pinned_host"


def choose(numels: Sequence[int], fraction: float) -> list[bool]:
    """Megatron's rule: unit i is offloaded if the elements offloaded before it are below
    `fraction x sum(numels)`, units taken in order."""
    threshold = fraction * sum(numels)
    chosen, offloaded = [], 0
    for n in numels:
        take = offloaded < threshold
        chosen.append(take)
        offloaded += n if take else 0
    return chosen


def host_sharding(s: NamedSharding) -> NamedSharding:
    """`s` in host memory (`pinned_host`); on compile-only devices, on the mesh's AbstractMesh
    (module docstring)."""
    host = NamedSharding(s.mesh, s.spec, memory_kind=HOST)
    if host.memory_kind == HOST:
        return host
    return NamedSharding(s.mesh.abstract_mesh, s.spec, memory_kind=HOST)


@dataclasses.dataclass(frozen=True)
class Offload:
    """Which leaves of a run's `ZeroState` live in host memory.

    Attributes:
      fraction: the configured `zero.offload_fraction`.
      mask: a ZeroState of bools, one per leaf (True: in host memory between steps).
      units: the names of the offloaded units (parameter paths, or "bucket <b>"), in order.
      params: the `jax.tree.leaves` indices of the params whose whole state is in host memory.
      offloaded_numel, total_numel: fp32 main-param elements per device of the offloaded units and
        of all (padding included on the flat path).
    """

    fraction: float
    mask: ZeroState
    units: tuple[str, ...]
    params: frozenset[int]
    offloaded_numel: int
    total_numel: int

    @property
    def active(self) -> bool:
        return any(jax.tree.leaves(self.mask))

    def shardings(self, shardings: ZeroState) -> ZeroState:
        """`shardings` with the offloaded leaves' in `pinned_host` (`host_sharding`)."""
        return jax.tree.map(lambda s, host: host_sharding(s) if host else s, shardings, self.mask)

    def to_device(self, state: ZeroState, after: PyTree = None) -> tuple[ZeroState, PyTree]:
        """Inside jit: (`state` with the offloaded leaves copied to device memory, same sharding; `after`).

        The copies start only once `after` (the step's reduced grads) is computed: an
        `optimization_barrier` ties the host arrays to it. Without it XLA:GPU starts every copy
        at the top of the program, and the device copies stay live through forward and backward
        (LLaMA-2-7B ZeRO-2 on 8 x H100, all offloaded: device peak 30.15 GiB, temp 17.60 GiB;
        with the barrier 21.50 and 8.95 GiB; 30.90 and 8.93 GiB without offload).
        """
        if not self.active:
            return state, after
        leaves, treedef = jax.tree.flatten(state)
        host = [i for i, h in enumerate(jax.tree.leaves(self.mask)) if h]
        if after is not None:
            after, held = jax.lax.optimization_barrier((after, [leaves[i] for i in host]))
            for i, x in zip(host, held):
                leaves[i] = x
        for i in host:
            leaves[i] = jax.device_put(leaves[i], jax.memory.Space.Device)
        return jax.tree.unflatten(treedef, leaves), after

    def to_host(self, state: ZeroState) -> ZeroState:
        """Inside jit: the offloaded leaves copied back to host memory."""
        return self._put(state, jax.memory.Space.Host)

    def _put(self, state: ZeroState, space) -> ZeroState:
        if not self.active:
            return state
        return jax.tree.map(lambda x, host: jax.device_put(x, space) if host else x, state, self.mask)


def state_mask(shardings: ZeroState, main: PyTree, inner: PyTree) -> ZeroState:
    """A ZeroState of bools shaped like `shardings`: `main` for the main params (if kept), `inner` for
    the inner state, False elsewhere (the loss scaler)."""
    mask = jax.tree.map(lambda _: False, shardings)
    return mask._replace(main_params=None if shardings.main_params is None else main, inner_state=inner)


def make_offload(fraction: float, names: list[str], numels: list[int], mask_of, params_of) -> Offload:
    """The `Offload` of units `names` (of `numels` elements per device) at `fraction`, by `choose`;
    `mask_of(chosen)` gives its state mask, `params_of(unit)` the leaves indices of a unit's params."""
    chosen = choose(numels, fraction)
    return Offload(
        fraction=fraction,
        mask=mask_of(chosen),
        units=tuple(n for n, c in zip(names, chosen) if c),
        params=frozenset(i for u, c in enumerate(chosen) if c for i in params_of(u)),
        offloaded_numel=sum(n for n, c in zip(numels, chosen) if c),
        total_numel=sum(numels),
    )


def no_offload(shardings: ZeroState) -> Offload:
    """An inactive `Offload` for a layout that keeps its whole state in device memory (the owned path)."""
    none = lambda tree: jax.tree.map(lambda _: False, tree)  # noqa: E731
    return make_offload(0.0, [], [], lambda _: state_mask(shardings, none(shardings.main_params),
                                                          none(shardings.inner_state)), lambda _: ())  # fmt: skip


def spec_offload(
    plan: ShardingPlan, inner: optax.GradientTransformation, shardings: ZeroState, fraction: float
) -> Offload:
    """The spec path's `Offload`: whole parameters, in leaves order (module docstring).

    Arguments:
      shardings: the ZeroState's shardings without offload (`optimizer.opt_state_shardings`).
    A state leaf belongs to the param whose key path its own ends with (`ShardingPlan.param_of`);
    it is offloaded with that param unless it is a scalar.
    """
    leaves = jax.tree_util.tree_flatten_with_path(plan.tensors)[0]
    names = [path_name(path) for path, _ in leaves]
    numels = [math.prod(NamedSharding(plan.mesh, plan.state_spec(t)).shard_shape(t.shape)) for _, t in leaves]
    abstract_main = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, jnp.float32), plan.tensors)
    abstract_inner = jax.eval_shape(inner.init, abstract_main)

    def mask_of(chosen):
        host = {tuple(path) for (path, _), c in zip(leaves, chosen) if c}

        def inner_leaf(path, leaf):
            return bool(leaf.shape) and plan.param_of(tuple(path)) in host

        main = jax.tree.unflatten(jax.tree.structure(plan.tensors), chosen)
        return state_mask(shardings, main, jax.tree_util.tree_map_with_path(inner_leaf, abstract_inner))

    return make_offload(fraction, names, numels, mask_of, lambda u: (u,))
