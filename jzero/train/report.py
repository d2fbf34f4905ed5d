"""The end-of-run summary: loss, and per-device bytes measured from the arrays' shards
beside Megatron's formula and the DDP figure (docs/megatron.md, "Bytes per parameter").

"grads" is the grad buffer the microbatches accumulate into (full local grads under DDP and
ZeRO-1, the owned shard under ZeRO-2). It lives only inside the step, so its bytes are read
from the shardings the step pins on it (`Zero.grad_buffer_structs`), not from an array.

Formula, with P_local the tp-local parameter count and d the DP-domain size:
  params P_local * param_bytes; grads P_local * grad_bytes (/ d under optim_grads);
  optimizer state P_local * (main_bytes + moment_bytes) (/ d unless no_shard),
  where main_bytes is 4 for non-fp32 params (fp32 master copy), else 0 (Megatron keeps
  no second copy of fp32 params).
"""

from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp

from jzero.mesh import DENSE_DP_AXES, axes_size


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


def formula_bytes(run, d: int | None = None) -> dict:
    """Megatron's per-device bytes for params, grads and optimizer state; d=1 gives DDP."""
    cfg, plan = run.cfg, run.zero.plan
    d = axes_size(plan.mesh, DENSE_DP_AXES) if d is None else d
    p = plan.tp_local_numel()
    param_b = jnp.dtype(cfg.precision.param_dtype.value).itemsize
    grad_b = jnp.dtype(cfg.precision.grad_reduce_dtype.value).itemsize
    main_b = 0 if param_b == 4 else 4
    abstract = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, jnp.float32), plan.tensors)
    inner = jax.eval_shape(run.zero.inner.init, abstract)
    total_numel = sum(t.numel for t in jax.tree.leaves(plan.tensors))
    moment_b = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(inner) if x.ndim) / total_numel
    shard_state = d if plan.shards_state else 1
    shard_grads = d if plan.shards_grads else 1
    return {
        "params": p * param_b,
        "grads": p * grad_b / shard_grads,
        "optimizer_state": p * (main_b + moment_b) / shard_state,
    }


def measured_bytes(run, state) -> dict:
    grad_dtype = jnp.dtype(run.cfg.precision.grad_reduce_dtype.value)
    return {
        "params": per_device_bytes(state.params),
        "grads": shard_bytes(run.zero.grad_buffer_structs(grad_dtype)),
        "optimizer_state": per_device_bytes(state.opt_state),
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
            "ddp": formula_bytes(run, d=1),
        },
        "replicated_tensors": [{"name": n, "fp32_bytes": b} for n, b in run.zero.plan.replicated()],
    }


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
        f"per-device memory, strategy={s['strategy']} path={s['path']} mesh: {mesh} on {on}",
        f"  {'':18}{'measured':>14}{'Megatron formula':>20}{'DDP':>14}",
    ]
    for key in ("params", "grads", "optimizer_state"):
        row = f"{_fmt(b['measured'][key]):>14}{_fmt(b['megatron_formula'][key]):>20}{_fmt(b['ddp'][key]):>14}"
        lines.append(f"  {key:18}{row}")
    tot = {k: sum(v.values()) for k, v in b.items()}
    lines.append(f"  {'total':18}{_fmt(tot['measured']):>14}{_fmt(tot['megatron_formula']):>20}{_fmt(tot['ddp']):>14}")
    rep = s["replicated_tensors"]
    if rep:
        lines.append(f"  left replicated over DP (no divisible dim free of tp): {len(rep)} tensors")
        lines += [f"    {r['name']}: {r['fp32_bytes']} fp32 bytes" for r in rep]
    else:
        lines.append("  every tensor is sharded over its DP domain" if s["strategy"] != "no_shard" else "")
    return "\n".join(line for line in lines if line)


def formula_split(run, d: int | None = None) -> dict:
    """`formula_bytes` with the optimizer state split into fp32 main params and moments.

    Keys: params, main_params, optimizer_moments, grads (bytes per device); d=1 gives DDP.
    """
    f = formula_bytes(run, d)
    plan = run.zero.plan
    d = axes_size(plan.mesh, DENSE_DP_AXES) if d is None else d
    main_b = 0 if jnp.dtype(run.cfg.precision.param_dtype.value).itemsize == 4 else 4
    main = plan.tp_local_numel() * main_b / (d if plan.shards_state else 1)
    return {
        "params": f["params"],
        "main_params": main,
        "optimizer_moments": f["optimizer_state"] - main,
        "grads": f["grads"],
    }

