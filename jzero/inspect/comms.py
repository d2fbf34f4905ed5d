"""What each ZeRO stage sends over the wire: the compiled program's collectives beside the theory.

Measured: every collective of the compiled step (`hlo.parse_collectives`), grouped by
kind and mesh axes, with its per-device ring wire bytes (docs/megatron.md, "Bytes on the wire"). Counts
are static: a collective inside a loop body (the microbatch scan, a scan over layers)
is one instruction however often the loop runs.

Theory: the data-parallel wire bytes per device of one grad reduction and one param
gather, with d the DP-domain size (dp_outer x dp x ep), G the tp-local grad bytes in
`precision.grad_reduce_dtype` and P the tp-local param bytes in `precision.param_dtype`:

    no_shard (DDP)        all-reduce G                         2(d-1)/d G
    optim (ZeRO-1)        reduce-scatter G + all-gather P       (d-1)/d G + (d-1)/d P
    optim_grads (ZeRO-2)  reduce-scatter G + all-gather P       (d-1)/d G + (d-1)/d P

ZeRO-1 is Megatron's distributed optimizer: the full local grad buffer accumulates over
the micro-batches and is reduce-scattered once, after the last; with G = P (fp32 params
and grads) that is exactly DDP's all-reduce. ZeRO-2 reduce-scatters every micro-batch
(so only the shard accumulates): once per micro-batch at run time; the theory, like the
static count of instructions, is one reduction. The theory leaves out the model's tp
collectives, the loss mean and the grad-norm scalar; the flat path's buckets are padded
to lcm(d, 128), which the theory leaves out too. The measured/theory ratio compares the
collectives over DP axes only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jzero.config import ShardingStrategy, to_dict
from jzero.inspect import hlo, overlap, peak
from jzero.inspect.compile import CPU, CompiledStep
from jzero.mesh import DENSE_DP_AXES

SCHEMA = "jzero.hlo/2"
LABELS = {"no_shard": "DDP", "optim": "ZeRO-1", "optim_grads": "ZeRO-2"}


def theory(c: CompiledStep) -> dict:
    """Theoretical DP wire bytes per device per step for `c`'s strategy (module docstring).

    Returns: {d, grad_bytes (G), param_bytes (P), formula, by_kind {kind: bytes}, wire_bytes}.
    """
    cfg, plan = c.cfg, c.run.zero.plan
    d = cfg.dp_domain_size
    numel = plan.tp_local_numel()
    g = numel * jnp.dtype(cfg.precision.grad_reduce_dtype.value).itemsize
    p = numel * jnp.dtype(cfg.precision.param_dtype.value).itemsize
    one = (d - 1) / d
    strategy = cfg.zero.strategy
    if strategy == ShardingStrategy.NO_SHARD:
        by_kind, formula = {"all-reduce": 2 * one * g}, "2(d-1)/d*G"
    else:  # optim, optim_grads
        by_kind, formula = {"reduce-scatter": one * g, "all-gather": one * p}, "(d-1)/d*G + (d-1)/d*P"
    return {"d": d, "grad_bytes": g, "param_bytes": p, "formula": formula, "by_kind": by_kind,
            "wire_bytes": sum(by_kind.values())}  # fmt: skip


def _is_dp(axes: tuple[str, ...]) -> bool:
    return bool(axes) and set(axes) <= set(DENSE_DP_AXES)


def _notes(c: CompiledStep, dp_by_kind: dict, th: dict, rows: list[dict]) -> list[str]:
    """Plain-language reasons where the program departs from the theory."""
    notes = []
    cfg = c.cfg
    param_dtype = cfg.precision.param_dtype.value
    gathered = {d for r in rows if r["kind"] == "all-gather" and _is_dp(tuple(r["axes"])) for d in r["dtypes"]}
    if param_dtype != "float32" and "f32" in gathered:
        notes.append(
            f"the params are all-gathered in f32, not {param_dtype}: XLA gathers the fp32 main params and casts "
            "after (seen on XLA:CPU, which also promotes bf16 all-reduces to f32), twice the theory's bytes"
        )
    if th["by_kind"].get("reduce-scatter") and not dp_by_kind.get("reduce-scatter"):
        why = "XLA:CPU has no reduce-scatter pass, docs/xla.md" if c.target == CPU else "XLA kept the all-reduce"
        notes.append(
            f"no reduce-scatter: the grads are all-reduced in full, then each rank slices its shard ({why}); "
            "--path flat or a GPU target shows the reduce-scatter"
        )
    micro = cfg.train.microbatches
    if micro > 1 and cfg.zero.strategy == ShardingStrategy.OPTIM_GRADS:
        notes.append(
            f"the grads are reduced in the micro-batch loop, {micro}x per step at run time; counts and bytes "
            "here, like the theory, are per instruction (one reduction)"
        )
    fp = c.run.zero.flat
    if fp is not None:
        size = fp.layout.numel
        padding = size - c.run.zero.plan.tp_local_numel()
        notes.append(
            f"flat buffer: {size} elements per tp rank in {len(fp.layout.bucket_indices)} bucket(s), {padding} of "
            "them padding (64-element param starts, bucket ends at multiples of lcm(d, 128)), which travels too"
        )
    if any(not r["axes"] for r in rows):
        notes.append("axes '-': a group of one device (a size-1 mesh axis, e.g. tp=1): no bytes move")
    return notes


def analyze(c: CompiledStep) -> dict:
    """The collectives of one compiled step, the theory and their ratio (one JSON-able dict)."""
    collectives = hlo.parse_collectives(c.compiled.as_text())
    dtypes: dict[tuple, set] = {}
    for col in collectives:
        key = (col.kind, hlo.axes_of_groups(col.replica_groups, c.run.mesh))
        dtypes.setdefault(key, set()).update(col.dtype.split(","))
    rows = [
        {**r, "axes": list(r["axes"]), "dtypes": sorted(dtypes[(r["kind"], r["axes"])])}
        for r in hlo.summarize(collectives, c.run.mesh)
    ]
    dp_by_kind: dict[str, float] = {}
    for r in rows:
        if _is_dp(tuple(r["axes"])):
            dp_by_kind[r["kind"]] = dp_by_kind.get(r["kind"], 0.0) + r["wire_bytes"]
    th = theory(c)
    dp_wire = sum(dp_by_kind.values())
    return {
        "compile_s": round(c.compile_s, 3),
        "collectives": rows,
        "dp_wire_bytes": dp_wire,
        "dp_wire_bytes_by_kind": dp_by_kind,
        "other_wire_bytes": sum(r["wire_bytes"] for r in rows) - dp_wire,
        "theory": th,
        "ratio": dp_wire / th["wire_bytes"] if th["wire_bytes"] else None,
        "notes": _notes(c, dp_by_kind, th, rows),
        "schedule": overlap.schedule_report(c),  # what XLA overlaps each collective with
        "peak": peak.peak_report(c),  # what temp memory holds at its peak
    }


def header(c: CompiledStep) -> dict:
    """What the programs were compiled for (shared by every strategy of one command)."""
    cfg = c.cfg
    device = c.run.mesh.devices.flat[0]
    return {
        "target": c.target,
        "topology": c.topology,
        "device_kind": device.device_kind,
        "n_devices": cfg.n_devices,
        "path": cfg.zero.path.value,
        "mesh": dict(c.run.mesh.shape),
        "d": cfg.dp_domain_size,
        "params": sum(t.numel for t in jax.tree.leaves(c.run.zero.plan.tensors)),
        "config": to_dict(cfg),
    }


def report(compiled: dict[str, CompiledStep]) -> dict:
    """The `jzero hlo --json` document: {schema, <header>, strategies: {name: analyze(...)}}."""
    first = next(iter(compiled.values()))
    return {"schema": SCHEMA, **header(first), "strategies": {s: analyze(c) for s, c in compiled.items()}}


# --------------------------------------------------------------------------- text


def count(n: int) -> str:
    """Parameter counts: 16.9k, 841k, 6.74B, 69.0B."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            x = n / scale
            return f"{x:.{2 if x < 10 else 1 if x < 100 else 0}f}{unit}"
    return str(n)


def human(n: float) -> str:
    """Bytes in binary units: 512 B, 3.21 MiB, 12.55 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def format_report(doc: dict) -> str:
    """The table `jzero hlo` prints: one block per strategy, then the comparison."""
    mesh = " ".join(f"{k}={v}" for k, v in doc["mesh"].items())
    where = doc["target"] if doc["topology"] is None else f"{doc['target']} ({doc['topology']})"
    any_th = next(iter(doc["strategies"].values()))["theory"]
    lines = [
        f"compiled train step, {count(doc['params'])} params, path={doc['path']}, target {where}, "
        f"{doc['device_kind']}, mesh {mesh}, d={doc['d']}",
        f"per device: G = {human(any_th['grad_bytes'])} (tp-local grads, "
        f"{doc['config']['precision']['grad_reduce_dtype']}), P = {human(any_th['param_bytes'])} "
        f"(tp-local params, {doc['config']['precision']['param_dtype']})",
        "",
    ]
    header = f"  {'collective':<17}{'axes':<12}{'dtype':<9}{'count':>6}{'payload':>14}{'wire/device':>14}"
    for name, s in doc["strategies"].items():
        lines += [f"== {name} ({LABELS.get(name, name)}), compiled in {s['compile_s']:.1f} s ==", header]
        for r in s["collectives"]:
            axes = ",".join(r["axes"]) or "-"
            dtype = ",".join(r["dtypes"])
            lines.append(
                f"  {r['kind']:<17}{axes:<12}{dtype:<9}{r['count']:>6}"
                f"{human(r['payload_bytes']):>14}{human(r['wire_bytes']):>14}"
            )
        if not s["collectives"]:
            lines.append("  (no collectives)")
        th = s["theory"]
        ratio = "n/a" if s["ratio"] is None else f"{s['ratio']:.3f}"
        lines.append(
            f"  DP wire/device {human(s['dp_wire_bytes'])}; theory {th['formula']} = {human(th['wire_bytes'])}; "
            f"measured/theory {ratio}"
        )
        lines += [f"  note: {n}" for n in s["notes"]]
        lines += overlap.format_lines(s) + peak.format_lines(s)
        lines.append("")
    lines.append(f"  {'strategy':<14}{'DP wire/device':>16}{'theory':>14}{'ratio':>8}   DP collectives")
    for name, s in doc["strategies"].items():
        kinds = ", ".join(f"{k} {human(v)}" for k, v in s["dp_wire_bytes_by_kind"].items() if v >= 1024)
        ratio = "n/a" if s["ratio"] is None else f"{s['ratio']:.3f}"
        lines.append(
            f"  {name:<14}{human(s['dp_wire_bytes']):>16}{human(s['theory']['wire_bytes']):>14}{ratio:>8}   {kinds}"
        )
    return "\n".join(lines)
