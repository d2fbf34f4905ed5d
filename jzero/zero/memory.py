"""Per-device bytes of a ZeRO run: Megatron's formula, and what arrays and shardings hold.

Formula, per data-parallel domain (dense params over d = dp_outer x dp x ep, expert params
over edp = dp_outer x dp), with P_local the params one model-parallel rank holds in that domain
(`ShardingPlan.numel_by_domain`: tp-local, and for experts this rank's E/ep experts):
  params P_local * param_bytes (/ d_params where they rest sharded: optim_grads_params, and optim and
    optim_grads with `zero.overlap_param_gather`, whose forward gathers them back);
  grads P_local * grad_bytes (/ d_state under optim_grads and optim_grads_params);
  optimizer state P_local * (main_bytes + moment_bytes) (/ d_state unless no_shard),
  where main_bytes is 4 for non-fp32 params (fp32 master copy), else 0 (Megatron keeps
  no second copy of fp32 params) but 4 with `zero.param_gather_dtype` (quantized model copy).
  d_state = d_params = d without HSDP; with HSDP (dp_outer = d_o > 1) d_params = d_i = d / d_o,
  the inner axes ZeRO-3's params are split over, and d_state = d_i, or d under
  `zero.outer_strategy: optim`, which also splits the state and the reduced grads across
  dp_outer. ZeRO-3 with bf16 params and fp32 grads is 18 P_local / d, the ZeRO paper's stage 3,
  (2 + 2 + K) P / N, with 4-byte grads. The per-device bytes are the
  sum over the domains. The flat path's P_local is its padded buckets' elements wherever it holds
  buckets (the state, the grads, params resting as bucket shards; `flat_numel_by_domain`); the owned
  path's, d times its largest owner's segment (`owned_numel_by_domain`: whole params per owner).
"""

from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp

from jzero.mesh import DENSE_DP_AXES, EXPERT_DP_AXES, OUTER_AXIS, axes_size, spec_axes
from jzero.zero.build import Zero
from jzero.zero.common.state import keeps_main_params
from jzero.zero.config import OuterStrategy


def per_device_bytes(tree) -> int:
    """Largest number of bytes any one device holds of the arrays in `tree`."""
    by_device = collections.Counter()
    for a in jax.tree.leaves(tree):
        for shard in a.addressable_shards:
            by_device[shard.device] += shard.data.nbytes
    return max(by_device.values(), default=0)


def shard_bytes(tree) -> int:
    """Bytes one device holds of `tree` (ShapeDtypeStructs or arrays with NamedShardings)."""
    total = 0
    for x in jax.tree.leaves(tree):
        total += math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
    return total


def formula_bytes(zero: Zero, ddp: bool = False) -> dict:
    """Megatron's per-device bytes for params, grads and optimizer state (module docstring);
    `ddp` gives DDP's (nothing sharded)."""
    f = formula_split(zero, ddp)
    return {
        "params": f["params"],
        "grads": f["grads"],
        "optimizer_state": f["main_params"] + f["optimizer_moments"],
    }


DOMAIN_NAMES = {DENSE_DP_AXES: "dense", EXPERT_DP_AXES: "expert"}


def formula_domains(zero: Zero, ddp: bool = False) -> dict[str, dict]:
    """Megatron's per-device bytes of each data-parallel domain (module docstring).

    Returns: {"dense": ..., "expert": ...} (only the domains that hold params), each {axes,
    d (the domain's size), d_state (what the state and sharded grads are split over), d_params
    (what ZeRO-3's params are split over), numel (P_local), params, main_params,
    optimizer_moments, grads} (bytes per device); `ddp` gives DDP's (every d 1). On the flat path the
    state, the grads and the params where they rest as bucket shards count its padded buckets
    (`flat_numel_by_domain`), as it holds them; `numel` stays the params' own P_local.
    """
    plan = zero.plan
    tensors = jax.tree.leaves(plan.tensors)
    param_b = tensors[0].dtype.itemsize  # the model copy's dtype (one for the whole model, as Megatron's formula)
    grad_b = zero.options.grad_reduce_dtype.itemsize
    # fp32 params keep a master copy only under a quantized gather (the model copy is then not exact); DDP has none.
    main_b = 4 if keeps_main_params(tensors, zero.config.param_gather_dtype is not None and not ddp) else 0
    abstract = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, jnp.float32), plan.tensors)
    inner = jax.eval_shape(zero.inner.init, abstract)
    total_numel = sum(t.numel for t in jax.tree.leaves(plan.tensors))
    moment_b = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(inner) if x.ndim) / total_numel
    outer = (OUTER_AXIS,) if plan.mesh.shape[OUTER_AXIS] > 1 else ()
    padded = {} if zero.flat is None or ddp else flat_numel_by_domain(zero.flat)
    if zero.layout.owned is not None and not ddp:
        padded = owned_numel_by_domain(zero)
    owned_local = zero.layout.owned is not None and not plan.stage.shards_grads  # ZeRO-1's local grads: unpadded
    out = {}
    for axes, p in plan.numel_by_domain().items():
        s = padded.get(axes, p)  # the flat path steps, reduces and stores its buckets, padding included
        p_params = s if zero.flat is not None and zero.flat.plan.stage.params_rest_sharded and not ddp else p
        d = axes_size(plan.mesh, axes)
        d_params = axes_size(plan.mesh, tuple(a for a in axes if a not in outer))
        d_state = d if plan.outer_strategy == OuterStrategy.OPTIM else d_params
        if ddp:
            d = d_params = d_state = 1
        shard_state = d_state if plan.stage.shards_state else 1
        shard_grads = d_state if plan.stage.shards_grads else 1
        shard_params = d_params if plan.stage.params_rest_sharded else 1
        out[DOMAIN_NAMES[axes]] = {
            "axes": list(axes),
            "d": d,
            "d_state": d_state,
            "d_params": d_params,
            "numel": p,
            "params": p_params * param_b / shard_params,
            "main_params": s * main_b / shard_state,
            "optimizer_moments": s * moment_b / shard_state,
            "grads": (p if owned_local else s) * grad_b / shard_grads,
        }
    return dict(sorted(out.items()))  # dense before expert


def owned_numel_by_domain(zero: Zero) -> dict[tuple[str, ...], int]:
    """The owned path's P_local per data-parallel domain as it lays it out: d segments of the largest
    owner's elements (`owned/plan.Domain.size`), so the owners' imbalance counts as padding."""
    tensors = jax.tree.leaves(zero.plan.tensors)
    return {tensors[dom.pieces[0].leaf].dp_axes: dom.d * dom.size for dom in zero.layout.owned.domains}


def flat_numel_by_domain(fp) -> dict[tuple[str, ...], int]:
    """The flat path's P_local per data-parallel domain as it lays it out: every group's buckets, padding
    (64-element param starts, bucket ends at lcm(d, 128)) and every layer of a stacked group included."""
    out: dict[tuple[str, ...], int] = {}
    for buf in fp.buffers:
        out[buf.dp_axes] = out.get(buf.dp_axes, 0) + math.prod(buf.lead) * buf.layout.numel
    return out


def formula_host(zero: Zero) -> dict:
    """The part of Megatron's main params and optimizer moments that `zero.offload_fraction` puts in
    host memory, per device: each domain's bytes (`formula_domains`) x the share of its P_local in
    the params whose state is offloaded (`Zero.offload.params`). Keys: main_params, optimizer_moments."""
    plan, offloaded = zero.plan, zero.offload.params
    by_domain: dict[tuple[str, ...], int] = {}
    for i, t in enumerate(jax.tree.leaves(plan.tensors)):
        if i in offloaded:
            local = t.numel // math.prod(plan.mesh.shape[a] for a in spec_axes(t.tp_spec))
            by_domain[t.dp_axes] = by_domain.get(t.dp_axes, 0) + local
    out = {"main_params": 0.0, "optimizer_moments": 0.0}
    for dom in formula_domains(zero).values():
        share = by_domain.get(tuple(dom["axes"]), 0) / dom["numel"] if dom["numel"] else 0.0  # its params all empty
        for k in out:
            out[k] += dom[k] * share
    return out


def formula_split(zero: Zero, ddp: bool = False) -> dict:
    """Megatron's per-device bytes summed over the domains (`formula_domains`).

    Keys: params, main_params, optimizer_moments, grads (bytes per device); `ddp` gives DDP's.
    """
    parts = ("params", "main_params", "optimizer_moments", "grads")
    domains = formula_domains(zero, ddp).values()
    return {k: sum(dom[k] for dom in domains) for k in parts}
