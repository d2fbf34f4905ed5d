"""What each ZeRO stage sends over the wire: the compiled program's collectives beside the theory.

Measured: every collective of the compiled step (`hlo.parse_collectives`), grouped by
kind and mesh axes, with its per-device ring wire bytes (docs/megatron.md, "Bytes on the wire"). Counts
are static: a collective inside a loop body (the microbatch scan, a scan over layers)
is one instruction however often the loop runs.

Theory: the data-parallel wire bytes per device of one grad reduction and one param
gather, per data-parallel domain: dense params over d = dp_outer x dp x ep, expert params
over edp = dp_outer x dp, with G the grad bytes one model-parallel rank holds in the domain
(tp-local; for experts, its E/ep experts) in `precision.grad_reduce_dtype` and P those params'
bytes in `precision.param_dtype`, summed over the domains:

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
DP traffic only (`hlo.is_dp_traffic`): collectives over DP axes but a MoE's all-to-all,
which moves tokens (activations) to their experts over ep and is reported on its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jzero.config import ShardingStrategy, to_dict
from jzero.inspect import hlo, overlap, peak
from jzero.inspect.compile import CPU, CompiledStep
from jzero.mesh import EXPERT_DP_AXES, axes_size
from jzero.train import moe
from jzero.train.model import is_moe_block
from jzero.train.report import DOMAIN_NAMES

SCHEMA = "jzero.hlo/2"
LABELS = {"no_shard": "DDP", "optim": "ZeRO-1", "optim_grads": "ZeRO-2"}


def theory(c: CompiledStep) -> dict:
    """Theoretical DP wire bytes per device per step for `c`'s strategy (module docstring).

    Returns: {d, grad_bytes (G), param_bytes (P), formula, by_kind {kind: bytes}, wire_bytes,
    domains}: G, P, by_kind and wire_bytes summed over the domains, d the dense domain's size;
    `domains` gives each domain's {axes, d, grad_bytes, param_bytes, by_kind, wire_bytes}
    ("dense", and "expert" for a MoE model).
    """
    cfg, plan = c.cfg, c.run.zero.plan
    grad_b = jnp.dtype(cfg.precision.grad_reduce_dtype.value).itemsize
    param_b = jnp.dtype(cfg.precision.param_dtype.value).itemsize
    ddp = cfg.zero.strategy == ShardingStrategy.NO_SHARD
    domains = {}
    for axes, numel in plan.numel_by_domain().items():
        d = axes_size(plan.mesh, axes)
        g, p, one = numel * grad_b, numel * param_b, (d - 1) / d
        by_kind = {"all-reduce": 2 * one * g} if ddp else {"reduce-scatter": one * g, "all-gather": one * p}
        domains[DOMAIN_NAMES[axes]] = {"axes": list(axes), "d": d, "grad_bytes": g, "param_bytes": p,
                                       "by_kind": by_kind, "wire_bytes": sum(by_kind.values())}  # fmt: skip
    domains = dict(sorted(domains.items()))  # dense before expert
    by_kind: dict[str, float] = {}
    for dom in domains.values():
        for kind, b in dom["by_kind"].items():
            by_kind[kind] = by_kind.get(kind, 0.0) + b
    if "expert" not in domains:
        formula = "2(d-1)/d*G" if ddp else "(d-1)/d*G + (d-1)/d*P"
    elif ddp:
        formula = "2(d-1)/d*G_dense + 2(edp-1)/edp*G_expert"
    else:
        formula = "(d-1)/d*(G_dense + P_dense) + (edp-1)/edp*(G_expert + P_expert)"
    return {
        "d": cfg.dp_domain_size,
        "grad_bytes": sum(dom["grad_bytes"] for dom in domains.values()),
        "param_bytes": sum(dom["param_bytes"] for dom in domains.values()),
        "formula": formula,
        "by_kind": by_kind,
        "wire_bytes": sum(by_kind.values()),
        "domains": domains,
    }


def tokens_theory(c: CompiledStep) -> dict | None:
    """What one all-to-all of a MoE block moves, None for a dense model or ep = 1.

    Each rank sends its tokens' expert slots `[E, C, D]` (`moe.dispatch`, in param_dtype, C
    the capacity of its micro-batch's tokens) to the experts' ep ranks and gets the outputs
    back: 2 all-to-alls forward, their 2 transposes backward, and 2 more where remat
    recomputes the forward, per MoE block and micro-batch.

    Returns: {ep, slot_bytes (the operand B), wire_bytes ((ep-1)/ep B, one all-to-all),
    per_step (all-to-alls per step), per_step_wire_bytes}.
    """
    cfg, m = c.cfg, c.cfg.model
    ep = cfg.mesh.ep
    if m.moe.num_experts == 0 or ep == 1:
        return None
    tokens = cfg.train.global_batch // (cfg.dp_domain_size * cfg.train.microbatches) * m.seq_len
    cap = moe.capacity(tokens, m.moe.num_experts, m.moe.top_k, m.moe.capacity_factor)
    slot = m.moe.num_experts * cap * m.d_model * jnp.dtype(cfg.precision.param_dtype.value).itemsize
    n_moe = sum(is_moe_block(m, i) for i in range(m.n_layers))
    per_step = n_moe * cfg.train.microbatches * (6 if m.remat else 4)
    one = hlo.ring_wire_bytes("all-to-all", slot, ep)
    return {"ep": ep, "slot_bytes": slot, "wire_bytes": one, "per_step": per_step,
            "per_step_wire_bytes": per_step * one}  # fmt: skip


def _spans(domains: dict, mesh) -> dict[str, set] | None:
    """Each DP domain as the mesh axes (of size > 1) a collective over its ranks spans; None where
    two domains span the same (ep = 1: dense and expert params share their ranks)."""
    spans = {name: {a for a in dom["axes"] if mesh.shape[a] > 1} for name, dom in domains.items()}
    return None if len({frozenset(v) for v in spans.values()}) < len(spans) else spans


def _notes(c: CompiledStep, dp_by_kind: dict, th: dict, rows: list[dict]) -> list[str]:
    """Plain-language reasons where the program departs from the theory."""
    notes = []
    cfg = c.cfg
    param_dtype = cfg.precision.param_dtype.value
    gathered = {d for r in rows if r["kind"] == "all-gather" and hlo.is_dp_traffic(r["kind"], r["axes"])
                for d in r["dtypes"]}  # fmt: skip
    if param_dtype != "float32" and "f32" in gathered:
        notes.append(
            f"the params are all-gathered in f32, not {param_dtype}: XLA gathers the fp32 main params and casts "
            "after (seen on XLA:CPU, which also promotes bf16 all-reduces to f32), twice the theory's bytes"
        )
    moved = {d for r in rows if r["kind"] == "all-to-all" for d in r["dtypes"]}
    if param_dtype != "float32" and "f32" in moved:
        notes.append(
            f"the tokens' all-to-all moves f32, not {param_dtype} (seen on XLA:CPU, which promotes bf16 "
            "collectives; XLA:GPU keeps bf16): twice the tokens theory's bytes"
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
        numel = c.run.zero.plan.numel_by_domain()
        for buf in fp.buffers:
            size, ranks = buf.layout.numel, " x ".join(buf.model_axes)
            notes.append(
                f"flat {buf.kind} buffer: {size} elements per {ranks} rank in {buf.n_buckets} bucket(s), "
                f"{size - numel[buf.dp_axes]} of them padding (64-element param starts, bucket ends at multiples "
                f"of lcm({'d' if buf.kind == 'dense' else 'edp'}={buf.d}, 128)), which travels too"
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
    th = theory(c)
    dp_by_kind: dict[str, float] = {}
    spans = _spans(th["domains"], c.run.mesh)
    by_domain = {} if spans is None else {name: 0.0 for name in spans}
    for r in rows:
        if hlo.is_dp_traffic(r["kind"], r["axes"]):
            dp_by_kind[r["kind"]] = dp_by_kind.get(r["kind"], 0.0) + r["wire_bytes"]
            for name, axes in (spans or {}).items():
                by_domain[name] += r["wire_bytes"] if set(r["axes"]) == axes else 0.0
    dp_wire = sum(dp_by_kind.values())
    a2a = [r for r in rows if r["kind"] == "all-to-all"]
    a2a_wire = sum(r["wire_bytes"] for r in a2a)
    schedule = overlap.schedule_report(c)
    tokens = tokens_theory(c)
    if tokens is not None:
        runs = [r["wire_bytes"] * r["runs"] for r in schedule["collectives"] if r["kind"] == "all-to-all"]
        tokens["measured"] = {"count": sum(r["count"] for r in a2a), "wire_bytes": a2a_wire,
                              "per_step_wire_bytes": sum(runs)}  # fmt: skip
    return {
        "compile_s": round(c.compile_s, 3),
        "collectives": rows,
        "dp_wire_bytes": dp_wire,
        "dp_wire_bytes_by_kind": dp_by_kind,
        "dp_wire_bytes_by_domain": by_domain,  # by the axes (dense dp x ep, expert dp); {} where ep = 1
        "all_to_all_wire_bytes": a2a_wire,  # tokens to and from the experts: activations, not DP traffic
        "other_wire_bytes": sum(r["wire_bytes"] for r in rows) - dp_wire - a2a_wire,
        "theory": th,
        "tokens": tokens,
        "ratio": dp_wire / th["wire_bytes"] if th["wire_bytes"] else None,
        "notes": _notes(c, dp_by_kind, th, rows),
        "schedule": schedule,  # what XLA overlaps each collective with
        "peak": peak.peak_report(c),  # what temp memory holds at its peak
    }


def header(c: CompiledStep) -> dict:
    """What the programs were compiled for (shared by every strategy of one command)."""
    cfg = c.cfg
    device = c.run.mesh.devices.flat[0]
    tensors = jax.tree.leaves(c.run.zero.plan.tensors)
    expert = any(t.dp_axes == EXPERT_DP_AXES for t in tensors)
    return {
        "target": c.target,
        "topology": c.topology,
        "device_kind": device.device_kind,
        "n_devices": cfg.n_devices,
        "path": cfg.zero.path.value,
        "mesh": dict(c.run.mesh.shape),
        "d": cfg.dp_domain_size,
        "edp": axes_size(c.run.mesh, EXPERT_DP_AXES) if expert else None,  # the expert-DP domain's size
        "params": sum(t.numel for t in tensors),
        "expert_params": sum(t.numel for t in tensors if t.dp_axes == EXPERT_DP_AXES),
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
    prec = doc["config"]["precision"]
    experts = "" if doc.get("edp") is None else f", {count(doc['expert_params'])} of them in experts"
    edp = "" if doc.get("edp") is None else f", edp={doc['edp']}"
    lines = [
        f"compiled train step, {count(doc['params'])} params{experts}, path={doc['path']}, target {where}, "
        f"{doc['device_kind']}, mesh {mesh}, d={doc['d']}{edp}",
        f"per device: G = {human(any_th['grad_bytes'])} (tp-local grads, {prec['grad_reduce_dtype']}), "
        f"P = {human(any_th['param_bytes'])} (tp-local params, {prec['param_dtype']})",
    ]
    if "expert" in any_th["domains"]:
        lines += [
            f"  {name:<7}over {','.join(dom['axes']):<17}{('d=' if name == 'dense' else 'edp=') + str(dom['d']):<9}"
            f"G = {human(dom['grad_bytes'])}, P = {human(dom['param_bytes'])}"
            + ("" if name == "dense" else " (this rank's experts: E/ep of them)")
            for name, dom in any_th["domains"].items()
        ]
    lines.append("")
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
        if len(th["domains"]) > 1:
            by_domain = s["dp_wire_bytes_by_domain"]
            for name, dom in th["domains"].items():
                measured = human(by_domain[name]) if by_domain else "n/a (ep=1: the same ranks)"
                lines.append(
                    f"    {name:<7}over {','.join(dom['axes']):<17}measured {measured:>12}, "
                    f"theory {human(dom['wire_bytes'])}"
                )
        tok = s["tokens"]
        if tok is not None:
            m = tok["measured"]
            lines.append(
                f"  tokens (not DP): all-to-all over ep {human(m['wire_bytes'])} in {m['count']} instruction(s); "
                f"theory (ep-1)/ep*[E,C,D] = {human(tok['wire_bytes'])} each; per step "
                f"{human(m['per_step_wire_bytes'])} vs {tok['per_step']} x {human(tok['wire_bytes'])} = "
                f"{human(tok['per_step_wire_bytes'])}"
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
