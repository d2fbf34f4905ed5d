"""What the compiled step sends over the wire, read from its program (nothing runs).

Every collective of the compiled step (`hlo.parse_collectives`), grouped by kind and mesh axes,
with its per-device ring wire bytes (docs/megatron.md, "Bytes on the wire"). `count` and
`wire_bytes` of a row are static: a collective inside a loop body (the micro-batch scan, the scan
over layers, the optimizer's per-layer gather) is one instruction however often the loop runs.
The per-step numbers (`wire_bytes_per_step`, and the measured/theory ratio) count each
instruction x the runs of its computation per step, read from the schedule
(`overlap.read_schedule`: the loops' trip counts), once per compiled step.

DP traffic (`hlo.is_dp_traffic`) is the collectives over DP axes but a MoE's all-to-all, which
moves tokens (activations) to their experts over ep and is counted on its own; a row's domain
("dense", "expert") is the one whose theory's collectives span its axes.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jzero.inspect import hlo, overlap
from jzero.inspect.comms.records import CollectiveRow, ParamGather, Theory, TokensMeasured, Traffic
from jzero.zero.flat import quantize

CODES = ("s8", "u8")  # the quantized gather's codes: int8, and fp8's bytes (`quantize.py`)


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled step's program, read once: its collectives, its schedule (what overlaps each
    collective, `overlap.read_schedule`), each collective's runs per step, by name, and its text."""

    collectives: list[hlo.Collective]
    schedule: overlap.Schedule
    runs: dict[str, int]
    ragged_all_to_all: int  # dropless MoE on a GPU (hlo.parse_collectives has no such kind)
    text: str  # `compiled.as_text()`


def read_program(c) -> Program:
    text = c.compiled.as_text()
    collectives = hlo.parse_collectives(text)
    sch = overlap.read_schedule(text, collectives)
    ragged = text.count("ragged-all-to-all-start(") + text.count("ragged-all-to-all(")
    return Program(collectives, sch, {o.collective.name: o.runs for o in sch.overlaps}, ragged, text)


def rows(collectives: list[hlo.Collective], runs: dict[str, int], mesh) -> list[CollectiveRow]:
    """One row per (kind, axes), ordered as `hlo.summarize`."""
    extra: dict[tuple, dict] = {}  # what `summarize` does not count: dtypes, runs and bytes per step
    for col in collectives:
        axes = hlo.axes_of_groups(col.replica_groups, mesh)
        r = extra.setdefault((col.kind, axes), {"dtypes": set(), "runs": 0, "wire_bytes_per_step": 0.0})
        r["dtypes"].update(col.dtype.split(","))
        r["runs"] += runs.get(col.name, 1)
        r["wire_bytes_per_step"] += runs.get(col.name, 1) * col.wire_bytes
    out = []
    for r in hlo.summarize(collectives, mesh):
        e = extra[(r["kind"], r["axes"])]
        out.append(CollectiveRow(r["kind"], list(r["axes"]), sorted(e["dtypes"]), r["count"], r["payload_bytes"],
                                 r["wire_bytes"], e["runs"], e["wire_bytes_per_step"]))  # fmt: skip
    return out


def spans(theory: Theory, mesh) -> dict[str, set] | None:
    """Each DP domain as the sets of mesh axes (of size > 1) its collectives span: the whole domain
    and, under HSDP, its inner axes and dp_outer (from the theory's terms); None where two domains
    span the same ranks (ep = 1: dense and expert params share them)."""

    def big(axes) -> frozenset:
        return frozenset(a for a in axes if mesh.shape[a] > 1)

    full = {name: big(dom.axes) for name, dom in theory.domains.items()}
    if len(set(full.values())) < len(full):
        return None
    return {name: {full[name]} | {big(t.axes) for t in dom.terms} for name, dom in theory.domains.items()}


def _by_domain(rows: list[CollectiveRow], spans: dict[str, set] | None, key: str) -> dict[str, float]:
    """DP wire bytes (`row.<key>`) per domain, a row counted for the domain whose spans hold its axes;
    {} where ep = 1 (`spans`) or a row's axes belong to two domains (dp_outer alone, HSDP with experts)."""
    if spans is None:
        return {}
    out = {name: 0.0 for name in spans}
    for r in rows:
        if not hlo.is_dp_traffic(r.kind, r.axes):
            continue
        owners = [name for name, sets in spans.items() if frozenset(r.axes) in sets]
        if len(owners) > 1:
            return {}
        if owners:
            out[owners[0]] += getattr(r, key)
    return out


def traffic(rows: list[CollectiveRow], spans: dict[str, set] | None, per_step: bool) -> Traffic:
    """The rows' wire bytes per instruction, or `per_step` (x their runs), by what they move."""
    key = "wire_bytes_per_step" if per_step else "wire_bytes"
    by_kind: dict[str, float] = {}
    for r in rows:
        if hlo.is_dp_traffic(r.kind, r.axes):
            by_kind[r.kind] = by_kind.get(r.kind, 0.0) + getattr(r, key)
    dp = sum(by_kind.values())
    a2a = sum(getattr(r, key) for r in rows if r.kind == "all-to-all")
    other = sum(getattr(r, key) for r in rows) - dp - a2a
    return Traffic(dp, by_kind, _by_domain(rows, spans, key), a2a, other)


def tokens_measured(rows: list[CollectiveRow], ragged: int) -> TokensMeasured:
    """The all-to-alls the program runs (the theory's: `theory.tokens_theory`), and its `ragged` ones
    (dropless on a GPU; XLA:CPU has none and sends padded slices by a dense all-to-all)."""
    a2a = [r for r in rows if r.kind == "all-to-all"]
    return TokensMeasured(sum(r.count for r in a2a), sum(r.wire_bytes for r in a2a),
                          sum(r.wire_bytes_per_step for r in a2a), ragged)  # fmt: skip


def param_gather(c, collectives: list[hlo.Collective], runs: dict[str, int]) -> ParamGather | None:
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
    return ParamGather(cfg.zero.param_gather_dtype.value, quantize.BLOCK, codes, scales, wire, 2 * codes,
                       itemsize * codes, 2 * codes / wire if wire else None)  # fmt: skip
