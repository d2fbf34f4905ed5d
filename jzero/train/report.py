"""The end-of-run summary: loss, and per-device bytes measured from the arrays' shards
beside Megatron's formula and the DDP figure (docs/megatron.md, "Bytes per parameter").

"grads" is the grad buffer the microbatches accumulate into (full local grads under DDP and
ZeRO-1, the owned shard under ZeRO-2 and ZeRO-3). It lives only inside the step, so its bytes are
read from the shardings the step pins on it (`Zero.grad_buffer_structs`), not from an array.

Megatron's formula is `jzero.zero.memory`'s.
"""

from __future__ import annotations

import jax

from jzero.train.moe import AUX_METRIC
from jzero.zero.memory import formula_bytes, per_device_bytes, shard_bytes


def measured_bytes(run, state) -> dict:
    return {
        "params": per_device_bytes(state.params),
        "grads": shard_bytes(run.zero.grad_buffer_structs()),
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
            "megatron_formula": formula_bytes(run.zero),
            "ddp": formula_bytes(run.zero, ddp=True),
        },
        "replicated_tensors": [{"name": n, "fp32_bytes": b} for n, b in run.zero.plan.replicated()],
        **_validation(metrics),
        **_offload(run, state),
        **_moe(metrics),
        **_loss_scale(metrics),
        **_spikes(metrics),
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
    skipped = sum(int(m["skipped"]) - int(m.get("spike_skipped", 0)) for m in metrics)  # spikes are finite
    return {"loss_scale": {"last": metrics[-1]["loss_scale"], "skipped_steps": skipped}}


def _spikes(metrics: list[dict]) -> dict:
    """{"spike_skipped_steps": [steps]} for a run with the grad-norm spike guard (`train.grad_norm_spike_factor`),
    else {}."""
    if "spike_skipped" not in metrics[0]:
        return {}
    return {"spike_skipped_steps": [m["step"] for m in metrics if m["spike_skipped"]]}


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
    if "spike_skipped_steps" in s:
        spikes = s["spike_skipped_steps"]
        shown = ", ".join(map(str, spikes[:10])) + (", ..." if len(spikes) > 10 else "")
        shown = f" (steps {shown})" if spikes else ""
        lines.append(f"grad-norm spike guard: {len(spikes)} of {s['steps']} steps skipped{shown}")
    rep = s["replicated_tensors"]
    if rep:
        lines.append(f"  left replicated over DP (no divisible dim free of tp): {len(rep)} tensors")
        lines += [f"    {r['name']}: {r['fp32_bytes']} fp32 bytes" for r in rep]
    else:
        lines.append("  every tensor is sharded over its DP domain" if s["strategy"] != "no_shard" else "")
    return "\n".join(line for line in lines if line)
