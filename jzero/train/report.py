"""The end-of-run summary: loss, and per-device bytes measured from the arrays' shards
beside Megatron's formula and the DDP figure (docs/megatron.md, "Bytes per parameter").

"grads" is the grad buffer the microbatches accumulate into (full local grads under DDP and
ZeRO-1, the owned shard under ZeRO-2 and ZeRO-3). It lives only inside the step, so its bytes are
read from the shardings the step pins on it (`Zero.grad_buffer_structs`), not from an array.

Formula, per data-parallel domain (dense params over d = dp_outer x dp x ep, expert params
over edp = dp_outer x dp), with P_local the params one model-parallel rank holds in that domain
(`ShardingPlan.numel_by_domain`: tp-local, and for experts this rank's E/ep experts):
  params P_local * param_bytes (/ d_params under optim_grads_params);
  grads P_local * grad_bytes (/ d_state under optim_grads and optim_grads_params);
  optimizer state P_local * (main_bytes + moment_bytes) (/ d_state unless no_shard),
  where main_bytes is 4 for non-fp32 params (fp32 master copy), else 0 (Megatron keeps
  no second copy of fp32 params) but 4 with `zero.param_gather_dtype` (quantized model copy).
  d_state = d_params = d without HSDP; with HSDP (dp_outer = d_o > 1) d_params = d_i = d / d_o,
  the inner axes ZeRO-3's params are split over, and d_state = d_i, or d under
  `zero.outer_strategy: optim`, which also splits the state and the reduced grads across
  dp_outer. ZeRO-3 with bf16 params and fp32 grads is 18 P_local / d, the ZeRO paper's stage 3,
  (2 + 2 + K) P / N, with 4-byte grads. The per-device bytes are the
  sum over the domains.
"""

from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp

from jzero.config import OuterStrategy
from jzero.mesh import DENSE_DP_AXES, EXPERT_DP_AXES, OUTER_AXIS, axes_size
from jzero.train.moe import AUX_METRIC
from jzero.zero.strategies import spec_axes


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


def formula_bytes(run, ddp: bool = False) -> dict:
    """Megatron's per-device bytes for params, grads and optimizer state (module docstring);
    `ddp` gives DDP's (nothing sharded)."""
    f = formula_split(run, ddp)
    return {
        "params": f["params"],
        "grads": f["grads"],
        "optimizer_state": f["main_params"] + f["optimizer_moments"],
    }


def measured_bytes(run, state) -> dict:
    grad_dtype = jnp.dtype(run.cfg.precision.grad_reduce_dtype.value)
    return {
        "params": per_device_bytes(state.params),
        "grads": shard_bytes(run.zero.grad_buffer_structs(grad_dtype)),
        "optimizer_state": per_device_bytes(state.opt_state[:2]),  # main params, inner state (not the scaler)
    }


def summarize(run, state, metrics: list[dict], compile_s: float) -> dict:
    """The run summary (JSON-able): losses, timings, per-device bytes, replicated tensors."""
    cfg = run.cfg
    measured = measured_bytes(run, state)
    times = [m["step_time_s"] for m in metrics[1:]] or [metrics[0]["step_time_s"]]
    return {
        "strategy": cfg.zero.strategy.value,
        "path": cfg.zero.path.value,
        "mesh": {k: v for k, v in run.mesh.shape.items()},
        "devices": _devices(run.mesh),
        "steps": len(metrics),
        "loss_first": metrics[0]["loss"],
        "loss_last": metrics[-1]["loss"],
        "compile_s": compile_s,
        "mean_step_time_s": sum(times) / len(times),
        "tokens_per_s": cfg.train.global_batch * cfg.model.seq_len * len(times) / sum(times),
        "bytes_per_device": {
            "measured": measured,
            "megatron_formula": formula_bytes(run),
            "ddp": formula_bytes(run, ddp=True),
        },
        "replicated_tensors": [{"name": n, "fp32_bytes": b} for n, b in run.zero.plan.replicated()],
        **_validation(metrics),
        **_offload(run, state),
        **_moe(metrics),
        **_loss_scale(metrics),
    }


def _offload(run, state) -> dict:
    """{"offload": {fraction, units, offloaded_numel, total_numel, host_bytes}} when
    `zero.offload_fraction` puts some optimizer state in host memory, else {}. host_bytes: the
    largest per-device share of the state's arrays whose memory kind is pinned_host (of
    `optimizer_state` above, which counts device and host bytes)."""
    o = run.zero.offload
    if not o.active:
        return {}
    host = [x for x in jax.tree.leaves(state.opt_state) if x.sharding.memory_kind == "pinned_host"]
    return {
        "offload": {
            "fraction": o.fraction,
            "units": list(o.units),
            "offloaded_numel": o.offloaded_numel,
            "total_numel": o.total_numel,
            "host_bytes": per_device_bytes(host),
        }
    }


def _loss_scale(metrics: list[dict]) -> dict:
    """{"loss_scale": {last, skipped_steps}} for an fp16 run (dynamic loss scaling), else {}."""
    if "loss_scale" not in metrics[0]:
        return {}
    skipped = sum(int(m["skipped"]) for m in metrics)
    return {"loss_scale": {"last": metrics[-1]["loss_scale"], "skipped_steps": skipped}}


def _validation(metrics: list[dict]) -> dict:
    """{"val_loss_last", "val_loss_step"}: the last validation loss of the run and its step, or {}."""
    evaluated = [m for m in metrics if "val_loss" in m]
    if not evaluated:
        return {}
    return {"val_loss_last": evaluated[-1]["val_loss"], "val_loss_step": evaluated[-1]["step"]}


def _moe(metrics: list[dict]) -> dict:
    """{"moe": {aux_loss_last, dropped_frac_mean}} for a MoE model's run, else {}: aux_loss_last is the
    load-balancing loss of the run's kind (`aux_loss`, `seq_aux_loss` or `global_aux_loss`)."""
    if "dropped_frac" not in metrics[0]:
        return {}
    dropped = sum(m["dropped_frac"] for m in metrics) / len(metrics)
    (aux,) = (name for name in AUX_METRIC.values() if name in metrics[-1])
    return {"moe": {"aux_loss_last": metrics[-1][aux], "dropped_frac_mean": dropped}}


def _devices(mesh) -> dict:
    """What the mesh runs on: {"platform": "cpu" or "gpu", "kind": e.g. "NVIDIA H100 80GB HBM3", "count"}."""
    d = mesh.devices.flat[0]
    return {"platform": d.platform, "kind": d.device_kind, "count": mesh.devices.size}


def _fmt(n: float) -> str:
    return f"{n / 2**20:10.3f} MiB"


def format_summary(s: dict) -> str:
    b = s["bytes_per_device"]
    mesh = " ".join(f"{k}={v}" for k, v in s["mesh"].items())
    d = s["devices"]
    on = f"{d['count']} x {d['platform']}" + ("" if d["kind"] == d["platform"] else f" ({d['kind']})")
    lines = [
        f"loss {s['loss_first']:.4f} -> {s['loss_last']:.4f} over {s['steps']} steps "
        f"({s['mean_step_time_s'] * 1e3:.1f} ms/step, {s['tokens_per_s']:.0f} tokens/s, "
        f"compile {s['compile_s']:.1f} s)",
        f"validation loss {s['val_loss_last']:.4f} at step {s['val_loss_step']}" if "val_loss_last" in s else "",
        f"per-device memory, strategy={s['strategy']} path={s['path']} mesh: {mesh} on {on}",
        f"  {'':18}{'measured':>14}{'Megatron formula':>20}{'DDP':>14}",
    ]
    for key in ("params", "grads", "optimizer_state"):
        row = f"{_fmt(b['measured'][key]):>14}{_fmt(b['megatron_formula'][key]):>20}{_fmt(b['ddp'][key]):>14}"
        lines.append(f"  {key:18}{row}")
    tot = {k: sum(v.values()) for k, v in b.items()}
    lines.append(f"  {'total':18}{_fmt(tot['measured']):>14}{_fmt(tot['megatron_formula']):>20}{_fmt(tot['ddp']):>14}")
    if "offload" in s:
        o = s["offload"]
        lines.append(
            f"  of optimizer_state in host memory (zero.offload_fraction={o['fraction']}): "
            f"{_fmt(o['host_bytes']).strip()}, "
            f"{len(o['units'])} {'buckets' if s['path'] == 'flat' else 'params'} "
            f"({100 * o['offloaded_numel'] / o['total_numel']:.1f}% of the elements)"
        )
    if "moe" in s:
        lines.append(
            f"MoE: load-balancing loss {s['moe']['aux_loss_last']:.4f} at the last step (1 = balanced), "
            f"{100 * s['moe']['dropped_frac_mean']:.2f}% of token copies over capacity (mean over steps)"
        )
    if "loss_scale" in s:
        ls = s["loss_scale"]
        lines.append(
            f"fp16 loss scaling: {ls['skipped_steps']} of {s['steps']} steps skipped (inf/nan grads), "
            f"loss scale {ls['last']:.0f} at the last step"
        )
    rep = s["replicated_tensors"]
    if rep:
        lines.append(f"  left replicated over DP (no divisible dim free of tp): {len(rep)} tensors")
        lines += [f"    {r['name']}: {r['fp32_bytes']} fp32 bytes" for r in rep]
    else:
        lines.append("  every tensor is sharded over its DP domain" if s["strategy"] != "no_shard" else "")
    return "\n".join(line for line in lines if line)


DOMAIN_NAMES = {DENSE_DP_AXES: "dense", EXPERT_DP_AXES: "expert"}


def formula_domains(run, ddp: bool = False) -> dict[str, dict]:
    """Megatron's per-device bytes of each data-parallel domain (module docstring).

    Returns: {"dense": ..., "expert": ...} (only the domains that hold params), each {axes,
    d (the domain's size), d_state (what the state and sharded grads are split over), d_params
    (what ZeRO-3's params are split over), numel (P_local), params, main_params,
    optimizer_moments, grads} (bytes per device); `ddp` gives DDP's (every d 1).
    """
    cfg, plan = run.cfg, run.zero.plan
    param_b = jnp.dtype(cfg.precision.param_dtype.value).itemsize
    grad_b = jnp.dtype(cfg.precision.grad_reduce_dtype.value).itemsize
    # fp32 params keep a master copy only under a quantized gather (the model copy is then not exact); DDP has none.
    quantized = cfg.zero.param_gather_dtype is not None and not ddp
    main_b = 0 if param_b == 4 and not quantized else 4
    abstract = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, jnp.float32), plan.tensors)
    inner = jax.eval_shape(run.zero.inner.init, abstract)
    total_numel = sum(t.numel for t in jax.tree.leaves(plan.tensors))
    moment_b = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(inner) if x.ndim) / total_numel
    outer = (OUTER_AXIS,) if plan.mesh.shape[OUTER_AXIS] > 1 else ()
    out = {}
    for axes, p in plan.numel_by_domain().items():
        d = axes_size(plan.mesh, axes)
        d_params = axes_size(plan.mesh, tuple(a for a in axes if a not in outer))
        d_state = d if plan.outer_strategy == OuterStrategy.OPTIM else d_params
        if ddp:
            d = d_params = d_state = 1
        shard_state = d_state if plan.shards_state else 1
        shard_grads = d_state if plan.shards_grads else 1
        shard_params = d_params if plan.shards_params else 1
        out[DOMAIN_NAMES[axes]] = {
            "axes": list(axes),
            "d": d,
            "d_state": d_state,
            "d_params": d_params,
            "numel": p,
            "params": p * param_b / shard_params,
            "main_params": p * main_b / shard_state,
            "optimizer_moments": p * moment_b / shard_state,
            "grads": p * grad_b / shard_grads,
        }
    return dict(sorted(out.items()))  # dense before expert


def formula_host(run) -> dict:
    """The part of Megatron's main params and optimizer moments that `zero.offload_fraction` puts in
    host memory, per device: each domain's bytes (`formula_domains`) x the share of its P_local in
    the params whose state is offloaded (`Zero.offload.params`). Keys: main_params, optimizer_moments."""
    plan, offloaded = run.zero.plan, run.zero.offload.params
    by_domain: dict[tuple[str, ...], int] = {}
    for i, t in enumerate(jax.tree.leaves(plan.tensors)):
        if i in offloaded:
            local = t.numel // math.prod(plan.mesh.shape[a] for a in spec_axes(t.tp_spec))
            by_domain[t.dp_axes] = by_domain.get(t.dp_axes, 0) + local
    out = {"main_params": 0.0, "optimizer_moments": 0.0}
    for dom in formula_domains(run).values():
        share = by_domain.get(tuple(dom["axes"]), 0) / dom["numel"]
        for k in out:
            out[k] += dom[k] * share
    return out


def formula_split(run, ddp: bool = False) -> dict:
    """Megatron's per-device bytes summed over the domains (`formula_domains`).

    Keys: params, main_params, optimizer_moments, grads (bytes per device); `ddp` gives DDP's.
    """
    parts = ("params", "main_params", "optimizer_moments", "grads")
    domains = formula_domains(run, ddp).values()
    return {k: sum(dom[k] for dom in domains) for k in parts}
