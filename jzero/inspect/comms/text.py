"""The text `jzero hlo` prints, rendered from the report's records (`records.HloReport`): a head on
the model and mesh, one block per strategy (its collectives, the theory beside them, notes, the
schedule's and the peak's lines), then one line per strategy comparing them."""

from __future__ import annotations

from jzero.inspect import overlap, peak
from jzero.inspect.comms.records import HloReport, StrategyComms, Theory
from jzero.mesh import OUTER_AXIS

LABELS = {"no_shard": "DDP", "optim": "ZeRO-1", "optim_grads": "ZeRO-2", "optim_grads_params": "ZeRO-3"}
_TABLE = (
    f"  {'collective':<17}{'axes':<12}{'dtype':<9}{'count':>6}{'payload':>14}{'wire/device':>14}"
    f"{'runs':>6}{'wire/step':>14}"
)


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
    """The table `jzero hlo` prints for its `--json` document: one block per strategy, then the comparison."""
    return render(HloReport.from_json(doc))


def render(r: HloReport) -> str:
    lines = _head(r)
    for name, s in r.strategies.items():
        lines += [*_strategy(r, name, s), ""]
    return "\n".join(lines + _comparison(r))


def _head(r: HloReport) -> list[str]:
    """What was compiled, for which mesh; G, P, P_unit and M (and each domain's with experts)."""
    h, th = r.header, next(iter(r.strategies.values())).theory
    mesh = " ".join(f"{k}={v}" for k, v in h.mesh.items())
    where = h.target if h.topology is None else f"{h.target} ({h.topology})"
    prec = h.config["precision"]
    experts = "" if h.edp is None else f", {count(h.expert_params)} of them in experts"
    edp = "" if h.edp is None else f", edp={h.edp}"
    hsdp = ""
    if h.mesh.get(OUTER_AXIS, 1) > 1:
        d_o = h.mesh[OUTER_AXIS]
        hsdp = f" (HSDP: d_i={h.d // d_o} inner x d_o={d_o}, outer_strategy {h.config['zero']['outer_strategy']})"
    micro = th.microbatches
    lines = [
        f"compiled train step, {count(h.params)} params{experts}, path={h.path}, target {where}, "
        f"{h.device_kind}, mesh {mesh}, d={h.d}{edp}{hsdp}",
        f"per device: G = {human(th.grad_bytes)} (tp-local grads, {prec['grad_reduce_dtype']}), "
        f"P = {human(th.param_bytes)} (tp-local params, {prec['param_dtype']}), "
        f"P_unit = {human(th.unit_param_bytes)} (of P in FSDP units); "
        f"M = {micro} micro-batch{'es' if micro > 1 else ''} per step",
    ]
    if "expert" in th.domains:
        lines += [
            f"  {name:<7}over {','.join(dom.axes):<17}{('d=' if name == 'dense' else 'edp=') + str(dom.d):<9}"
            f"G = {human(dom.grad_bytes)}, P = {human(dom.param_bytes)}"
            + ("" if name == "dense" else " (this rank's experts: E/ep of them)")
            for name, dom in th.domains.items()
        ]
    return [*lines, ""]


def _ratio(s: StrategyComms) -> str:
    return "n/a" if s.ratio is None else f"{s.ratio:.3f}"


def _strategy(r: HloReport, name: str, s: StrategyComms) -> list[str]:
    """One strategy's block: its collectives, the theory, the quantized gather, the tokens, notes, the
    schedule's and the peak's lines."""
    lines = [f"== {name} ({LABELS.get(name, name)}), compiled in {s.compile_s:.1f} s ==", _TABLE]
    for c in s.collectives:
        lines.append(
            f"  {c.kind:<17}{','.join(c.axes) or '-':<12}{','.join(c.dtypes):<9}{c.count:>6}"
            f"{human(c.payload_bytes):>14}{human(c.wire_bytes):>14}"
            f"{c.runs:>6}{human(c.wire_bytes_per_step):>14}"
        )
    if not s.collectives:
        lines.append("  (no collectives)")
    th = s.theory
    lines.append(
        f"  DP wire/step {human(s.per_step.dp_wire_bytes)} ({human(s.static.dp_wire_bytes)} per instruction); "
        f"theory {th.formula} = {human(th.wire_bytes)}; measured/theory {_ratio(s)}"
    )
    lines += _theory_terms(r, th) + _domains(r, s)
    pg = s.param_gather
    if pg is not None:
        prec = r.header.config["precision"]["param_dtype"]
        vs = "" if prec == "bfloat16" else f", in {prec} {human(pg.param_dtype_wire_bytes)}"
        lines.append(
            f"  params all-gathered as {pg.dtype} codes + an fp32 scale per {pg.block} elements: "
            f"{human(pg.codes_wire_bytes)} + {human(pg.scales_wire_bytes)} per step; the same gather in "
            f"bfloat16 {human(pg.bf16_wire_bytes)} ({pg.saving_vs_bf16:.2f}x the bytes){vs}"
        )
    tok = s.tokens
    if tok is not None and tok.dropless:
        m = tok.measured
        lines.append(
            f"  tokens (not DP), dropless: {m.ragged_count} ragged all-to-all(s) over ep of the routed copies, "
            f"(ep-1)/ep*[k N, D] = {human(tok.wire_bytes)} each under uniform routing, {tok.per_step} per "
            f"step; all-to-all {human(m.wire_bytes)} in {m.count} instruction(s) (counts and offsets; "
            "on XLA:CPU the padded slices)"
        )
    elif tok is not None:
        m = tok.measured
        lines.append(
            f"  tokens (not DP): all-to-all over ep {human(m.wire_bytes)} in {m.count} instruction(s); "
            f"theory (ep-1)/ep*[E,C,D] = {human(tok.wire_bytes)} each; per step "
            f"{human(m.per_step_wire_bytes)} vs {tok.per_step} x {human(tok.wire_bytes)} = "
            f"{human(tok.per_step_wire_bytes)}"
        )
    lines += [f"  note: {n}" for n in s.notes]
    plain = s.to_json()  # the schedule's and the peak's lines read their JSON entries
    t = plain["schedule"].get("timing")
    on_links = (
        [f"  {t['line']} (links {t['nvlink_gbs']:g} GB/s in a host, {t['network_gbs']:g} GB/s across; "
         f"peak {t['peak_tflops']:g} TFLOP/s)"] if t else []
    )  # fmt: skip
    r = plain["schedule"].get("roofline")
    on_card = [f"  {r['line']}"] if r else []
    return lines + overlap.format_lines(plain) + on_links + on_card + peak.format_lines(plain)


def _theory_terms(r: HloReport, th: Theory) -> list[str]:
    """The theory's collectives one by one, where there are more than two."""
    terms = [(n, t) for n, dom in th.domains.items() for t in dom.terms]
    if len(terms) <= 2:
        return []
    lines = []
    for dom_name, t in terms:
        each = t.wire_bytes / t.runs
        dom_label = f"{dom_name} " if len(th.domains) > 1 else ""
        axes = ",".join(a for a in t.axes if r.header.mesh.get(a, 1) > 1) or "-"
        lines.append(
            f"    theory {t.kind:<15}{axes:<12}{dom_label + t.what:<36}"
            f"{t.runs:>4} x {human(each):>12} = {human(t.wire_bytes)}"
        )
    return lines


def _domains(r: HloReport, s: StrategyComms) -> list[str]:
    """Measured beside theory per DP domain, for a model with experts."""
    domains = s.theory.domains
    if len(domains) <= 1:
        return []
    by_domain = s.per_step.dp_wire_bytes_by_domain
    why = "n/a (ep=1: the same ranks)" if r.header.mesh.get("ep", 1) == 1 else "n/a (dp_outer: both domains)"
    return [
        f"    {name:<7}over {','.join(dom.axes):<17}measured {human(by_domain[name]) if by_domain else why:>12}, "
        f"theory {human(dom.wire_bytes)}"
        for name, dom in domains.items()
    ]


def _comparison(r: HloReport) -> list[str]:
    """One line per strategy: DP wire bytes per step, theory, ratio, and by kind."""
    lines = [f"  {'strategy':<20}{'DP wire/step':>14}{'theory':>14}{'ratio':>8}   DP collectives per step"]
    for name, s in r.strategies.items():
        kinds = ", ".join(f"{k} {human(v)}" for k, v in s.per_step.dp_wire_bytes_by_kind.items() if v >= 1024)
        lines.append(
            f"  {name:<20}{human(s.per_step.dp_wire_bytes):>14}{human(s.theory.wire_bytes):>14}{_ratio(s):>8}   {kinds}"
        )
    return lines
