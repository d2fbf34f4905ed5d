"""What each ZeRO stage sends over the wire: the compiled program's collectives beside the theory.

Measured: every collective of the compiled step (`hlo.parse_collectives`), grouped by
kind and mesh axes, with its per-device ring wire bytes (docs/megatron.md, "Bytes on the
wire"). `count` and `wire_bytes` of a row are static: a collective inside a loop body (the
micro-batch scan, the scan over layers, the optimizer's per-layer gather) is one instruction
however often the loop runs. The per-step numbers (`per_step`, and the measured/theory ratio)
count each instruction x the runs of its computation per step, read from the schedule
(`overlap.read_schedule`: XLA's known trip counts), once per compiled step.

Theory: the data-parallel wire bytes per device per step, per data-parallel domain: dense
params over d = dp_outer x dp x ep, expert params over edp = dp_outer x dp. G: the grad bytes
one model-parallel rank holds in the domain (tp-local; for experts, its E/ep experts) in
`precision.grad_reduce_dtype`; P: those params' bytes in `precision.param_dtype`; P_unit: the
part of P inside FSDP units (every transformer block; not the embeddings, final norm or head);
M: micro-batches per step. Without HSDP (dp_outer = 1):

    no_shard (DDP)              all-reduce G                       2(d-1)/d G
    optim (ZeRO-1)              reduce-scatter G, all-gather P      (d-1)/d G + (d-1)/d P
    optim_grads (ZeRO-2)        per micro-batch reduce-scatter G,   M (d-1)/d G + (d-1)/d P
                                all-gather P after the step
    optim_grads_params (ZeRO-3) per micro-batch reduce-scatter G,   M (d-1)/d G + M (d-1)/d (P + P_unit)
                                all-gather P before each unit's
                                forward and P_unit again before
                                its backward

ZeRO-3 gathers a unit's params a second time for its backward with `zero.reshard_after_forward`,
and also without it under `model.remat` (the recomputed forward gathers again); else its term is
M (d-1)/d P. With every param in a unit, P_unit = P: 2 (d-1)/d P, 1.5x DDP's bytes at G = P.

HSDP (dp_outer = d_o > 1; inner DP d_i = d / d_o): the grads reduce-scatter over the inner
axes, (d_i-1)/d_i G, then across dp_outer either all-reduce their 1/d_i, 2(d_o-1)/d_o G/d_i
(`zero.outer_strategy: no_shard`), or reduce-scatter it, (d_o-1)/d_o G/d_i (`optim`); the params
are all-gathered over the inner axes, (d_i-1)/d_i P (ZeRO-1/2 after the step, ZeRO-3 per unit as
above), and under `optim` first across dp_outer, (d_o-1)/d_o P/d_i, after the step. The spec path
lets XLA pick DDP's and ZeRO-1's collectives (one sum over the whole domain); the theory is the
same hierarchy. ZeRO-1/2 under `optim` move the flat formulas' bytes; under `no_shard` the outer
all-reduce costs (d_o-1)/d_o G/d_i more and no params are gathered across dp_outer, (d_o-1)/d_o
P/d_i less. ZeRO-3's per-unit gathers span the inner axes only.

ZeRO-1 is Megatron's distributed optimizer: the full local grad buffer accumulates over the
micro-batches and is reduce-scattered once, after the last; with G = P (fp32 params and grads)
that is exactly DDP's all-reduce. The theory leaves out the model's tp collectives and the loss,
metric and grad-norm scalars; the flat path's buckets are padded to lcm(d, 128), which the theory
leaves out too. The measured/theory ratio compares the DP traffic only (`hlo.is_dp_traffic`):
collectives over DP axes but a MoE's all-to-all, which moves tokens (activations) to their
experts over ep and is reported on its own.

With `zero.param_gather_dtype` (flat path) the params travel as one-byte codes and an fp32 scale
per `quantize.BLOCK` elements of each rank's shard: the theory's P becomes P_q, (1 + 4 / BLOCK)
bytes per param, and `param_gather` reports the codes' and scales' measured bytes beside what the
same elements would move in bf16 and in the param dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jzero.config import to_dict
from jzero.inspect import hlo, overlap, peak
from jzero.inspect.compile import CPU, CompiledStep
from jzero.mesh import BATCH_AXES, EXPERT_DP_AXES, OUTER_AXIS, axes_size
from jzero.train import moe
from jzero.train.model import is_moe_block
from jzero.zero.common.strategies import restrict, spec_axes
from jzero.zero.config import OuterStrategy, ShardingStrategy, ZeroPath
from jzero.zero.flat import quantize
from jzero.zero.memory import DOMAIN_NAMES, flat_numel_by_domain

SCHEMA = "jzero.hlo/2"
LABELS = {"no_shard": "DDP", "optim": "ZeRO-1", "optim_grads": "ZeRO-2", "optim_grads_params": "ZeRO-3"}


def _tp_local(plan, t) -> int:
    """Elements of `t` one model-parallel rank holds (`ShardingPlan.numel_by_domain`'s count)."""
    return t.numel // axes_size(plan.mesh, spec_axes(t.tp_spec))


def _terms(c: CompiledStep, axes: tuple[str, ...], g: float, p: float, p_unit: float, sym: dict) -> list[dict]:
    """One domain's collectives per step (module docstring): [{kind, axes, n, what, bytes, runs, wire_bytes,
    coefficient, operand}], `bytes` the ring formulas' full buffer B per run, `runs` per step, `coefficient`
    and `operand` the term's formula text (e.g. "(d-1)/d", "G")."""
    cfg, mesh = c.cfg, c.run.mesh
    strategy, micro = cfg.zero.strategy, cfg.train.microbatches
    outer = (OUTER_AXIS,) if mesh.shape[OUTER_AXIS] > 1 else ()
    inner = tuple(a for a in axes if a not in outer)
    d, d_i, d_o = axes_size(mesh, axes), axes_size(mesh, inner), axes_size(mesh, outer)
    outer_scatter = bool(outer) and cfg.zero.outer_strategy == OuterStrategy.OPTIM
    n_sym = sym["d"] if not outer else sym["d_i"]
    terms: list[dict] = []

    def add(kind, over, n, what, buffer, runs, operand, n_name):
        coefficient = ("2" if kind == "all-reduce" else "") + f"({n_name}-1)/{n_name}"
        if runs > 1:
            coefficient = f"{runs}*{coefficient}"
        terms.append({"kind": kind, "axes": list(over), "n": n, "what": what, "bytes": buffer, "runs": runs,
                      "wire_bytes": runs * hlo.ring_wire_bytes(kind, buffer, n),
                      "coefficient": coefficient, "operand": operand})  # fmt: skip

    G, P, Pu, per_i = sym["G"], sym["P"], sym["P_unit"], f"/{sym['d_i']}"
    if strategy == ShardingStrategy.NO_SHARD:
        add("all-reduce", axes, d, "grads", g, 1, G, sym["d"])
        return terms
    g_runs = 1 if strategy == ShardingStrategy.OPTIM else micro
    add("reduce-scatter", inner, d_i, "grads", g, g_runs, G, n_sym)
    if outer:
        kind = "reduce-scatter" if outer_scatter else "all-reduce"
        add(kind, outer, d_o, "grads", g / d_i, g_runs, G + per_i, sym["d_o"])
    if outer_scatter:  # the updated params, from the state's 1/d to the inner shard (ZeRO-3) or whole (ZeRO-1/2)
        add("all-gather", outer, d_o, "params", p / d_i, 1, P + per_i, sym["d_o"])
    if strategy != ShardingStrategy.OPTIM_GRADS_PARAMS:
        add("all-gather", inner, d_i, "params", p, 1, P, n_sym)
        return terms
    add("all-gather", inner, d_i, "params", p, micro, P, n_sym)  # a unit's before it runs, the rest before the loss
    if p_unit and (cfg.zero.reshard_after_forward or cfg.model.remat):
        add("all-gather", inner, d_i, "unit params, again for backward", p_unit, micro, Pu, n_sym)
    return terms


def _formula(terms: list[dict]) -> str:
    """The terms' formula, terms of one coefficient merged: "(d-1)/d*(G + P + P_unit)"."""
    by_coefficient: dict[str, list[str]] = {}
    for t in terms:
        by_coefficient.setdefault(t["coefficient"], []).append(t["operand"])
    parts = []
    for coefficient, operands in by_coefficient.items():
        parts.append(f"{coefficient}*{operands[0] if len(operands) == 1 else '(' + ' + '.join(operands) + ')'}")
    return " + ".join(parts)


def theory(c: CompiledStep) -> dict:
    """Theoretical DP wire bytes per device per step for `c`'s strategy (module docstring).

    Returns: {d, microbatches, grad_bytes (G), param_bytes (P), gather_bytes (what the params'
    all-gathers carry: P, or P_q with `zero.param_gather_dtype`), unit_param_bytes (P_unit), formula,
    by_kind {kind: bytes}, wire_bytes, domains}: G, P, by_kind and wire_bytes summed over the
    domains, d the dense domain's size; `domains` gives each domain's {axes, d, d_inner, d_outer,
    grad_bytes, param_bytes, gather_bytes, unit_param_bytes, terms, formula, by_kind, wire_bytes} ("dense", and
    "expert" for a MoE model), `terms` its collectives per step (`_terms`).
    """
    cfg, plan = c.cfg, c.run.zero.plan
    mesh = plan.mesh
    grad_b = jnp.dtype(cfg.precision.grad_reduce_dtype.value).itemsize
    param_b = jnp.dtype(cfg.precision.param_dtype.value).itemsize
    quantized = cfg.zero.param_gather_dtype is not None
    gather_b = 1 + 4 / quantize.BLOCK if quantized else param_b  # bytes per param the all-gathers move
    numel = plan.numel_by_domain()
    unit_numel = {axes: 0 for axes in numel}
    for t in jax.tree.leaves(plan.tensors):
        if t.unit_dims is not None:
            unit_numel[t.dp_axes] += _tp_local(plan, t)
    moe_model = len(numel) > 1
    hsdp = mesh.shape[OUTER_AXIS] > 1
    domains = {}
    for axes, n in numel.items():
        name = DOMAIN_NAMES[axes]
        suffix = f"_{name}" if moe_model else ""
        base = "d" if name == "dense" else "edp"
        sym = {"d": base, "d_i": f"{base}_i", "d_o": "d_o", "G": f"G{suffix}", "P": f"P{suffix}",
               "P_unit": f"P_unit{suffix}"}  # fmt: skip
        if quantized:
            sym["P"] = f"P_q{suffix}"
        g, p, pu = n * grad_b, n * param_b, unit_numel[axes] * param_b
        terms = _terms(c, axes, g, n * gather_b, pu, sym)
        by_kind: dict[str, float] = {}
        for t in terms:
            by_kind[t["kind"]] = by_kind.get(t["kind"], 0.0) + t["wire_bytes"]
        inner = tuple(a for a in axes if a != OUTER_AXIS or not hsdp)
        domains[name] = {"axes": list(axes), "d": axes_size(mesh, axes), "d_inner": axes_size(mesh, inner),
                         "d_outer": mesh.shape[OUTER_AXIS], "grad_bytes": g, "param_bytes": p,
                         "gather_bytes": n * gather_b, "unit_param_bytes": pu, "terms": terms,
                         "formula": _formula(terms), "by_kind": by_kind,
                         "wire_bytes": sum(by_kind.values())}  # fmt: skip
    domains = dict(sorted(domains.items()))  # dense before expert
    by_kind = {}
    for dom in domains.values():
        for kind, b in dom["by_kind"].items():
            by_kind[kind] = by_kind.get(kind, 0.0) + b
    return {
        "d": cfg.dp_domain_size,
        "microbatches": cfg.train.microbatches,
        "grad_bytes": sum(dom["grad_bytes"] for dom in domains.values()),
        "param_bytes": sum(dom["param_bytes"] for dom in domains.values()),
        "gather_bytes": sum(dom["gather_bytes"] for dom in domains.values()),  # P_q when quantized, else P
        "unit_param_bytes": sum(dom["unit_param_bytes"] for dom in domains.values()),
        "formula": " + ".join(dom["formula"] for dom in domains.values()),
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


CODES = ("s8", "u8")  # the quantized gather's codes: int8, and fp8's bytes (`quantize.py`)


def param_gather(c: CompiledStep, collectives: list[hlo.Collective], runs: dict[str, int]) -> dict | None:
    """The quantized param all-gather measured, None without `zero.param_gather_dtype`.

    Per device per step (each DP all-gather x its runs): `codes_wire_bytes` (1 byte per element)
    and `scales_wire_bytes` (fp32) as the program moves them; `bf16_wire_bytes` and
    `param_dtype_wire_bytes`, the same elements' codes at 2 and at the param dtype's bytes each,
    no scales (the unquantized gather of the same buckets); `saving_vs_bf16`, their ratio to the
    codes and scales.
    """
    cfg, mesh = c.cfg, c.run.mesh
    if cfg.zero.param_gather_dtype is None:
        return None
    codes = scales = 0.0
    for col in collectives:
        if col.kind == "all-gather" and hlo.is_dp_traffic(col.kind, hlo.axes_of_groups(col.replica_groups, mesh)):
            codes += runs.get(col.name, 1) * col.wire_bytes_of(CODES)
            scales += runs.get(col.name, 1) * col.wire_bytes_of(("f32",))
    wire = codes + scales
    itemsize = jnp.dtype(cfg.precision.param_dtype.value).itemsize
    return {"dtype": cfg.zero.param_gather_dtype.value, "block": quantize.BLOCK, "codes_wire_bytes": codes,
            "scales_wire_bytes": scales, "wire_bytes": wire, "bf16_wire_bytes": 2 * codes,
            "param_dtype_wire_bytes": itemsize * codes,
            "saving_vs_bf16": 2 * codes / wire if wire else None}  # fmt: skip


def _spans(domains: dict, mesh) -> dict[str, set] | None:
    """Each DP domain as the sets of mesh axes (of size > 1) its collectives span: the whole domain
    and, under HSDP, its inner axes and dp_outer (from the theory's terms); None where two domains
    span the same ranks (ep = 1: dense and expert params share them)."""

    def big(axes) -> frozenset:
        return frozenset(a for a in axes if mesh.shape[a] > 1)

    full = {name: big(dom["axes"]) for name, dom in domains.items()}
    if len(set(full.values())) < len(full):
        return None
    return {name: {full[name]} | {big(t["axes"]) for t in dom["terms"]} for name, dom in domains.items()}


def _by_domain(rows: list[dict], spans: dict[str, set] | None, key: str) -> dict[str, float]:
    """DP wire bytes (`row[key]`) per domain, a row counted for the domain whose spans hold its axes;
    {} where ep = 1 (`_spans`) or a row's axes belong to two domains (dp_outer alone, HSDP with experts)."""
    if spans is None:
        return {}
    out = {name: 0.0 for name in spans}
    for r in rows:
        if not hlo.is_dp_traffic(r["kind"], r["axes"]):
            continue
        owners = [name for name, sets in spans.items() if frozenset(r["axes"]) in sets]
        if len(owners) > 1:
            return {}
        if owners:
            out[owners[0]] += r[key]
    return out


def _joint_with_tp(plan, t) -> bool:
    """Whether the spec path splits `t`'s DP shard dim jointly with a model-parallel axis of size > 1
    (a tp-split dim no free dim could replace, e.g. a small bias): its per-unit collectives then
    run on the tp-gathered tensor (`units.Hook.tp_spec` None)."""
    if t.shard_dim is None or plan.mesh is None:
        return False
    model_axes = tuple(a for a in plan.mesh.axis_names if a not in BATCH_AXES)
    spec = tuple(restrict(t.tp_spec, model_axes)) + (None,) * len(t.shape)
    entry = spec[t.shard_dim]
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return axes_size(plan.mesh, names) > 1


def _notes(c: CompiledStep, dp_by_kind: dict, step_by_kind: dict, th: dict, rows: list[dict]) -> list[str]:
    """Plain-language reasons where the program departs from the theory (`dp_by_kind`: DP wire bytes
    per instruction, `step_by_kind` per step)."""
    notes = []
    cfg, plan = c.cfg, c.run.zero.plan
    param_dtype = cfg.precision.param_dtype.value
    gathered = {d for r in rows if r["kind"] == "all-gather" and hlo.is_dp_traffic(r["kind"], r["axes"])
                for d in r["dtypes"]}  # fmt: skip
    if param_dtype != "float32" and "f32" in gathered and cfg.zero.param_gather_dtype is None:  # else: the scales
        notes.append(
            f"the params are all-gathered in f32, not {param_dtype}: XLA:CPU promotes bf16 collectives to f32 "
            "(ZeRO-3's gathers of the bf16 params too) or gathers the fp32 main params and casts after; XLA:GPU "
            "gathers bf16. Twice the theory's bytes for the gathers"
        )
    moved = {d for r in rows if r["kind"] == "all-to-all" for d in r["dtypes"]}
    if param_dtype != "float32" and "f32" in moved:
        notes.append(
            f"the tokens' all-to-all moves f32, not {param_dtype} (seen on XLA:CPU, which promotes bf16 "
            "collectives; XLA:GPU keeps bf16): twice the tokens theory's bytes"
        )
    if th["by_kind"].get("reduce-scatter") and not dp_by_kind.get("reduce-scatter"):
        if c.target == CPU:
            why = "XLA:CPU has no reduce-scatter pass, docs/xla.md; --path flat or a GPU target shows it"
        elif plan.hsdp:
            why = (
                "XLA:GPU too: under HSDP the spec path sums the grads over the whole DP domain into a sharding "
                "split over the inner axes only, which XLA does not turn into a reduce-scatter; --path flat "
                "reduces hierarchically"
            )
        else:
            why = "XLA kept the all-reduce; --path flat shows the reduce-scatter"
        notes.append(f"no reduce-scatter: the grads are all-reduced in full, then each rank slices its shard ({why})")
    micro = cfg.train.microbatches
    if micro > 1 and plan.shards_grads:
        notes.append(
            f"the grads are reduced in the micro-batch loop, {micro}x per step"
            + (" (and the units' params gathered)" if plan.shards_params else "")
            + "; `count` and `wire/device` are per instruction, `runs`, `wire/step` and the theory per step"
        )
    gather_th, gather_step = th["by_kind"].get("all-gather", 0.0), step_by_kind.get("all-gather", 0.0)
    if plan.shards_params and cfg.zero.reshard_after_forward and cfg.model.remat and gather_step > 1.001 * gather_th:
        notes.append(
            f"the all-gathers move {gather_step / gather_th:.2f}x the theory's: model.remat's recompute already "
            "gathers each unit's params again for its backward, and zero.reshard_after_forward's checkpoint, "
            "nested inside it, gathers some of them a third time; with model.remat, "
            "zero.reshard_after_forward=false gathers each unit twice"
        )
    if plan.shards_params and micro > 1 and c.target == CPU and gather_step < 0.999 * gather_th:
        notes.append(
            "fewer all-gather bytes than the theory: XLA:CPU hoists the gather of the params outside the units "
            f"(embeddings, final norm, head) out of the micro-batch loop, once per step, not {micro}x "
            "(XLA:GPU gathers them per micro-batch, as the theory)"
        )
    spec_units = plan.shards_grads and cfg.zero.path == ZeroPath.SPEC
    joint = [t for t in jax.tree.leaves(plan.tensors) if spec_units and _joint_with_tp(plan, t)]
    if joint:
        names = ", ".join(t.name for t in joint[:3]) + (", ..." if len(joint) > 3 else "")
        notes.append(
            f"{len(joint)} tensor(s) split over DP jointly with tp on one dim ({names}): XLA gathers each over "
            "the model-parallel axes before its DP reduce-scatter (and gathers it over DP whole), so those "
            "collectives move the tensor's whole dim, not its tp-local part (a few bytes above the theory)"
        )
    replicated = plan.replicated()
    if replicated:
        notes.append(
            f"{len(replicated)} tensor(s) have no dim divisible by the DP size and stay replicated "
            f"({', '.join(n for n, _ in replicated[:3])}{', ...' if len(replicated) > 3 else ''}): their grads "
            "are all-reduced, 2(d-1)/d not (d-1)/d, and they are never gathered"
        )
    fp = c.run.zero.flat
    if fp is not None:
        numel, padded = plan.numel_by_domain(), flat_numel_by_domain(fp)
        for kind in dict.fromkeys(buf.kind for buf in fp.buffers):
            bufs = [buf for buf in fp.buffers if buf.kind == kind]
            buf, size = bufs[0], padded[bufs[0].dp_axes]
            per = f" in {len(fp.groups)} groups (FSDP units and the rest)" if fp.per_unit else ""
            notes.append(
                f"flat {kind} buffers: {size} elements per {' x '.join(buf.model_axes)} rank{per}, "
                f"{sum(b.n_buckets for b in bufs)} bucket(s), {size - numel[buf.dp_axes]} of them padding (64-element "
                f"param starts, bucket ends at multiples of lcm({'d' if kind == 'dense' else 'edp'}={buf.d}, 128)), "
                "which travels too"
            )
    if any(not r["axes"] for r in rows):
        notes.append("axes '-': a group of one device (a size-1 mesh axis, e.g. tp=1): no bytes move")
    return notes


def _rows(collectives: list[hlo.Collective], runs: dict[str, int], mesh) -> list[dict]:
    """One row per (kind, axes), ordered as `hlo.summarize`: {kind, axes, dtypes, count, payload_bytes,
    wire_bytes} per instruction (static), and `runs` (executions per step) and `wire_bytes_per_step`."""
    rows = {}
    for col in collectives:
        axes = hlo.axes_of_groups(col.replica_groups, mesh)
        r = rows.setdefault((col.kind, axes), {"dtypes": set(), "runs": 0, "wire_bytes_per_step": 0.0})
        r["dtypes"].update(col.dtype.split(","))
        r["runs"] += runs.get(col.name, 1)
        r["wire_bytes_per_step"] += runs.get(col.name, 1) * col.wire_bytes
    return [{**r, "axes": list(r["axes"]), "dtypes": sorted(rows[(r["kind"], r["axes"])]["dtypes"]),
             "runs": rows[(r["kind"], r["axes"])]["runs"],
             "wire_bytes_per_step": rows[(r["kind"], r["axes"])]["wire_bytes_per_step"]}
            for r in hlo.summarize(collectives, mesh)]  # fmt: skip


STATIC = ("kind", "axes", "dtypes", "count", "payload_bytes", "wire_bytes")  # a `collectives` row's keys


def analyze(c: CompiledStep) -> dict:
    """The collectives of one compiled step, the theory and their ratio (one JSON-able dict).

    The program is read once: its collectives, and the schedule (`overlap.read_schedule`) that
    gives each one's runs per step (loop trip counts) and what overlaps it."""
    text = c.compiled.as_text()
    collectives = hlo.parse_collectives(text)
    sch = overlap.read_schedule(text, collectives)
    runs = {o.collective.name: o.runs for o in sch.overlaps}
    full = _rows(collectives, runs, c.run.mesh)
    rows = [{k: r[k] for k in STATIC} for r in full]
    th = theory(c)
    spans = _spans(th["domains"], c.run.mesh)
    dp = [r for r in full if hlo.is_dp_traffic(r["kind"], r["axes"])]
    dp_by_kind: dict[str, float] = {}
    step_by_kind: dict[str, float] = {}
    for r in dp:
        dp_by_kind[r["kind"]] = dp_by_kind.get(r["kind"], 0.0) + r["wire_bytes"]
        step_by_kind[r["kind"]] = step_by_kind.get(r["kind"], 0.0) + r["wire_bytes_per_step"]
    dp_wire, dp_step = sum(dp_by_kind.values()), sum(step_by_kind.values())
    a2a = [r for r in full if r["kind"] == "all-to-all"]
    a2a_wire = sum(r["wire_bytes"] for r in a2a)
    a2a_step = sum(r["wire_bytes_per_step"] for r in a2a)
    schedule = overlap.schedule_report(c, sch)
    tokens = tokens_theory(c)
    if tokens is not None:
        tokens["measured"] = {"count": sum(r["count"] for r in a2a), "wire_bytes": a2a_wire,
                              "per_step_wire_bytes": a2a_step}  # fmt: skip
    return {
        "compile_s": round(c.compile_s, 3),
        "collectives": rows,  # per instruction: a collective in a loop body counts once
        "dp_wire_bytes": dp_wire,  # per instruction, as the rows
        "dp_wire_bytes_by_kind": dp_by_kind,
        "dp_wire_bytes_by_domain": _by_domain(full, spans, "wire_bytes"),  # by the axes; {} where ep = 1
        "all_to_all_wire_bytes": a2a_wire,  # tokens to and from the experts: activations, not DP traffic
        "other_wire_bytes": sum(r["wire_bytes"] for r in rows) - dp_wire - a2a_wire,
        "per_step": {  # the same x the runs of each instruction's computation per step (loop trip counts)
            "collectives": [{k: r[k] for k in ("kind", "axes", "count", "runs", "wire_bytes_per_step")} for r in full],
            "dp_wire_bytes": dp_step,
            "dp_wire_bytes_by_kind": step_by_kind,
            "dp_wire_bytes_by_domain": _by_domain(full, spans, "wire_bytes_per_step"),
            "all_to_all_wire_bytes": a2a_step,
            "other_wire_bytes": sum(r["wire_bytes_per_step"] for r in full) - dp_step - a2a_step,
        },
        "theory": th,  # per step
        "tokens": tokens,
        "param_gather": param_gather(c, collectives, runs),  # the quantized gather beside bf16; None if off
        "ratio": dp_step / th["wire_bytes"] if th["wire_bytes"] else None,  # per step, measured / theory
        "notes": _notes(c, dp_by_kind, step_by_kind, th, rows),
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
    hsdp = ""
    if doc["mesh"].get(OUTER_AXIS, 1) > 1:
        outer = doc["config"]["zero"]["outer_strategy"]
        d_o = doc["mesh"][OUTER_AXIS]
        hsdp = f" (HSDP: d_i={doc['d'] // d_o} inner x d_o={d_o}, outer_strategy {outer})"
    micro = any_th.get("microbatches", 1)
    lines = [
        f"compiled train step, {count(doc['params'])} params{experts}, path={doc['path']}, target {where}, "
        f"{doc['device_kind']}, mesh {mesh}, d={doc['d']}{edp}{hsdp}",
        f"per device: G = {human(any_th['grad_bytes'])} (tp-local grads, {prec['grad_reduce_dtype']}), "
        f"P = {human(any_th['param_bytes'])} (tp-local params, {prec['param_dtype']}), "
        f"P_unit = {human(any_th.get('unit_param_bytes', 0))} (of P in FSDP units); "
        f"M = {micro} micro-batch{'es' if micro > 1 else ''} per step",
    ]
    if "expert" in any_th["domains"]:
        lines += [
            f"  {name:<7}over {','.join(dom['axes']):<17}{('d=' if name == 'dense' else 'edp=') + str(dom['d']):<9}"
            f"G = {human(dom['grad_bytes'])}, P = {human(dom['param_bytes'])}"
            + ("" if name == "dense" else " (this rank's experts: E/ep of them)")
            for name, dom in any_th["domains"].items()
        ]
    lines.append("")
    header = (
        f"  {'collective':<17}{'axes':<12}{'dtype':<9}{'count':>6}{'payload':>14}{'wire/device':>14}"
        f"{'runs':>6}{'wire/step':>14}"
    )
    for name, s in doc["strategies"].items():
        lines += [f"== {name} ({LABELS.get(name, name)}), compiled in {s['compile_s']:.1f} s ==", header]
        step = s.get("per_step", {})
        per_step = {(r["kind"], tuple(r["axes"])): r for r in step.get("collectives", [])}
        for r in s["collectives"]:
            axes = ",".join(r["axes"]) or "-"
            dtype = ",".join(r["dtypes"])
            static = {"runs": r["count"], "wire_bytes_per_step": r["wire_bytes"]}
            ps = per_step.get((r["kind"], tuple(r["axes"])), static)
            lines.append(
                f"  {r['kind']:<17}{axes:<12}{dtype:<9}{r['count']:>6}"
                f"{human(r['payload_bytes']):>14}{human(r['wire_bytes']):>14}"
                f"{ps['runs']:>6}{human(ps['wire_bytes_per_step']):>14}"
            )
        if not s["collectives"]:
            lines.append("  (no collectives)")
        th = s["theory"]
        ratio = "n/a" if s["ratio"] is None else f"{s['ratio']:.3f}"
        dp_step = step.get("dp_wire_bytes", s["dp_wire_bytes"])
        lines.append(
            f"  DP wire/step {human(dp_step)} ({human(s['dp_wire_bytes'])} per instruction); theory {th['formula']} "
            f"= {human(th['wire_bytes'])}; measured/theory {ratio}"
        )
        terms = [(n, t) for n, dom in th["domains"].items() for t in dom.get("terms", [])]
        if len(terms) > 2:
            for dom_name, t in terms:
                each = t["wire_bytes"] / t["runs"]
                dom_label = f"{dom_name} " if len(th["domains"]) > 1 else ""
                axes = ",".join(a for a in t["axes"] if doc["mesh"].get(a, 1) > 1) or "-"
                lines.append(
                    f"    theory {t['kind']:<15}{axes:<12}{dom_label + t['what']:<36}"
                    f"{t['runs']:>4} x {human(each):>12} = {human(t['wire_bytes'])}"
                )
        if len(th["domains"]) > 1:
            by_domain = step.get("dp_wire_bytes_by_domain", s["dp_wire_bytes_by_domain"])
            why = "n/a (ep=1: the same ranks)" if doc["mesh"].get("ep", 1) == 1 else "n/a (dp_outer: both domains)"
            for name, dom in th["domains"].items():
                measured = human(by_domain[name]) if by_domain else why
                lines.append(
                    f"    {name:<7}over {','.join(dom['axes']):<17}measured {measured:>12}, "
                    f"theory {human(dom['wire_bytes'])}"
                )
        pg = s.get("param_gather")
        if pg is not None:
            prec = doc["config"]["precision"]["param_dtype"]
            vs = "" if prec == "bfloat16" else f", in {prec} {human(pg['param_dtype_wire_bytes'])}"
            lines.append(
                f"  params all-gathered as {pg['dtype']} codes + an fp32 scale per {pg['block']} elements: "
                f"{human(pg['codes_wire_bytes'])} + {human(pg['scales_wire_bytes'])} per step; the same gather in "
                f"bfloat16 {human(pg['bf16_wire_bytes'])} ({pg['saving_vs_bf16']:.2f}x the bytes){vs}"
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
    lines.append(f"  {'strategy':<20}{'DP wire/step':>14}{'theory':>14}{'ratio':>8}   DP collectives per step")
    for name, s in doc["strategies"].items():
        step = s.get("per_step", {})
        by_kind = step.get("dp_wire_bytes_by_kind", s["dp_wire_bytes_by_kind"])
        kinds = ", ".join(f"{k} {human(v)}" for k, v in by_kind.items() if v >= 1024)
        ratio = "n/a" if s["ratio"] is None else f"{s['ratio']:.3f}"
        dp_step = step.get("dp_wire_bytes", s["dp_wire_bytes"])
        lines.append(f"  {name:<20}{human(dp_step):>14}{human(s['theory']['wire_bytes']):>14}{ratio:>8}   {kinds}")
    return "\n".join(lines)
