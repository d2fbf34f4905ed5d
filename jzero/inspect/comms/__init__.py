"""What each ZeRO stage sends over the wire: the compiled program's collectives beside the theory
(`jzero hlo`; docs/inspect.md).

    theory.py    what the strategy must send per step (the formulas, per DP domain; the model's
                 token exchange)
    measure.py   what the compiled program sends: its collectives per instruction and per step
    notes.py     why the two differ, in plain language (platform, layout, loops)
    records.py   the typed records all of them pass, and their JSON
    text.py      the text report, rendered from the records

The functions here give the JSON (`jzero hlo --json`, the records' `to_json`): `analyze` one
compiled step, `report` every strategy of one command; `format_report` renders such a document.
"""

from __future__ import annotations

import dataclasses

import jax

from jzero.config import to_dict
from jzero.inspect import overlap, peak, roofline, timing
from jzero.inspect.comms import measure, notes, theory
from jzero.inspect.comms.records import SCHEMA, Header, HloReport, StrategyComms
from jzero.inspect.comms.text import LABELS, count, format_report, human
from jzero.inspect.compile import CompiledStep
from jzero.mesh import EXPERT_DP_AXES, axes_size

__all__ = ["LABELS", "SCHEMA", "analyze", "count", "format_report", "header", "human", "param_gather", "report"]


def strategy_comms(c: CompiledStep, links: timing.Overrides = timing.DEFAULT) -> StrategyComms:
    """The collectives of one compiled step, the theory and their ratio.

    The program is read once (`measure.read_program`): its collectives, and the schedule that
    gives each one's runs per step (loop trip counts) and what overlaps it; on a GPU target the
    schedule's entry also estimates their time on the pod's links (`timing`, with `links`'
    overrides of the target's figures)."""
    program = measure.read_program(c)
    rows = measure.rows(program.collectives, program.runs, c.run.mesh)
    th = theory.theory(c)
    spans = measure.spans(th, c.run.mesh)
    static, per_step = measure.traffic(rows, spans, per_step=False), measure.traffic(rows, spans, per_step=True)
    tokens = theory.tokens_theory(c)
    if tokens is not None:
        tokens = dataclasses.replace(tokens, measured=measure.tokens_measured(rows, program.ragged_all_to_all))
    return StrategyComms(
        compile_s=round(c.compile_s, 3),
        collectives=rows,
        static=static,
        per_step=per_step,
        theory=th,
        tokens=tokens,
        param_gather=measure.param_gather(c, program.collectives, program.runs),
        ratio=per_step.dp_wire_bytes / th.wire_bytes if th.wire_bytes else None,
        notes=notes.collect(c, static, per_step, th, rows),
        schedule={  # what XLA overlaps each collective with, and what the exposed ones cost in time
            **overlap.schedule_report(c, program.schedule),
            "timing": timing.timing_report(c.target, program.schedule, c.run.mesh, links),
            "roofline": roofline.roofline_report(c.target, program.text, links.peak_tflops),
        },
        peak=peak.peak_report(c),  # what temp memory holds at its peak
    )


def analyze(c: CompiledStep) -> dict:
    """One compiled step's entry of `jzero hlo --json`'s `strategies` (`strategy_comms`, as JSON)."""
    return strategy_comms(c).to_json()


def param_gather(c: CompiledStep, collectives: list, runs: dict[str, int]) -> dict | None:
    """The quantized param all-gather measured (`measure.param_gather`, as JSON); None without it."""
    record = measure.param_gather(c, collectives, runs)
    return None if record is None else record.to_json()


def header_record(c: CompiledStep) -> Header:
    """What the programs were compiled for (shared by every strategy of one command)."""
    cfg = c.cfg
    tensors = jax.tree.leaves(c.run.zero.plan.tensors)
    expert = any(t.dp_axes == EXPERT_DP_AXES for t in tensors)
    return Header(
        target=c.target,
        topology=c.topology,
        device_kind=c.run.mesh.devices.flat[0].device_kind,
        n_devices=cfg.n_devices,
        path=cfg.zero.path.value,
        mesh=dict(c.run.mesh.shape),
        d=cfg.dp_domain_size,
        edp=axes_size(c.run.mesh, EXPERT_DP_AXES) if expert else None,
        params=sum(t.numel for t in tensors),
        expert_params=sum(t.numel for t in tensors if t.dp_axes == EXPERT_DP_AXES),
        config=to_dict(cfg),
    )


def header(c: CompiledStep) -> dict:
    """The header of `jzero hlo --json` and `jzero memory --json` (`header_record`, as JSON)."""
    return header_record(c).to_json()


def report(compiled: dict[str, CompiledStep], links: timing.Overrides = timing.DEFAULT) -> dict:
    """The `jzero hlo --json` document: {schema, <header>, strategies: {name: analyze(...)}};
    `links` overrides the GPU target's link and peak figures of the time estimate."""
    first = next(iter(compiled.values()))
    strategies = {s: strategy_comms(c, links) for s, c in compiled.items()}
    return HloReport(header_record(first), strategies).to_json()
