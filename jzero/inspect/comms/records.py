"""The typed records of `jzero hlo`'s report, and their JSON (docs/inspect.md, "--json schemas").

Theory (`theory.py`) and measurement (`measure.py`) build these; rendering (`text.py`) reads
them; `Record.to_json` writes them as the `--json` document and `from_json` reads one back. A
record's fields are its JSON keys, in the document's order, except where a class says otherwise
(`StrategyComms`, `HloReport` spread their parts over one JSON object). Bytes are per device.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

SCHEMA = "jzero.hlo/2"


class Record:
    """A dataclass that writes itself as JSON (its fields in order) and reads itself back."""

    def to_json(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, raw: dict):
        hints = typing.get_type_hints(cls)
        return cls(**{f.name: _typed(hints[f.name], raw[f.name]) for f in dataclasses.fields(cls) if f.name in raw})


def _plain(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _typed(tp: Any, value: Any) -> Any:
    """`value` read from JSON as the field type `tp` (records, lists and dicts of them, optionals)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if value is None:
        return None
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return _typed(inner, value)
    if origin is list:
        return [_typed(args[0], v) for v in value]
    if origin is dict:
        return {k: _typed(args[1], v) for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, Record):
        return tp.from_json(value)
    return value


# --------------------------------------------------------------------------- theory


@dataclasses.dataclass(frozen=True)
class Term(Record):
    """One collective of the theory per step: `runs` x a ring `kind` of a `bytes` buffer over `n` ranks;
    `coefficient` and `operand` are its formula's text, e.g. "(d-1)/d" and "G"."""

    kind: str
    axes: list[str]
    n: int
    what: str  # "grads", "params", "unit params, again for backward"
    bytes: float  # the ring formulas' full buffer B, per run
    runs: int  # per step
    wire_bytes: float  # runs x ring bytes of B over n
    coefficient: str
    operand: str


@dataclasses.dataclass(frozen=True)
class DomainTheory(Record):
    """The theory of one data-parallel domain ("dense" over d, "expert" over edp): G, P, P_q, P_unit
    of one model-parallel rank, and its collectives per step."""

    axes: list[str]
    d: int
    d_inner: int  # HSDP: d = d_inner x d_outer
    d_outer: int
    grad_bytes: float  # G
    param_bytes: float  # P
    gather_bytes: float  # what the params' all-gathers carry: P, or P_q with zero.param_gather_dtype
    unit_param_bytes: float  # P_unit, of P in FSDP units
    terms: list[Term]
    formula: str
    by_kind: dict[str, float]
    wire_bytes: float


@dataclasses.dataclass(frozen=True)
class Theory(Record):
    """The DP wire bytes per device per step (`theory.py`): G, P, by_kind and wire_bytes summed over
    the domains, d the dense domain's size."""

    d: int
    microbatches: int
    grad_bytes: float
    param_bytes: float
    gather_bytes: float
    unit_param_bytes: float
    formula: str
    by_kind: dict[str, float]
    wire_bytes: float
    domains: dict[str, DomainTheory]  # "dense", then "expert" for a model with experts


@dataclasses.dataclass(frozen=True)
class TokensMeasured(Record):
    count: int  # all-to-all instructions
    wire_bytes: float  # per instruction, summed
    per_step_wire_bytes: float  # x their runs per step
    ragged_count: int = 0  # dropless on a GPU: ragged all-to-alls, whose bytes the routing decides


@dataclasses.dataclass(frozen=True)
class Tokens(Record):
    """Expert parallelism's all-to-all (the model's `token_exchange`): theory, and what was measured."""

    ep: int
    slot_bytes: float  # one all-to-all's operand B, per rank
    wire_bytes: float  # (ep-1)/ep B: one all-to-all
    per_step: int  # all-to-alls per step
    per_step_wire_bytes: float
    measured: TokensMeasured | None = None
    dropless: bool = False  # a ragged exchange of the routed copies (`slot_bytes` under uniform routing)


# --------------------------------------------------------------------------- measurement


@dataclasses.dataclass(frozen=True)
class CollectiveRow(Record):
    """The compiled step's collectives of one (kind, axes): per instruction (static) and per step."""

    kind: str
    axes: list[str]
    dtypes: list[str]
    count: int  # instructions: one in a loop body counts once
    payload_bytes: float
    wire_bytes: float  # per device, per instruction, summed
    runs: int  # executions per step of the instructions, summed (loop trip counts)
    wire_bytes_per_step: float


STATIC = ("kind", "axes", "dtypes", "count", "payload_bytes", "wire_bytes")  # a `collectives` row's keys
PER_STEP = ("kind", "axes", "count", "runs", "wire_bytes_per_step")  # a `per_step.collectives` row's keys


@dataclasses.dataclass(frozen=True)
class Traffic(Record):
    """Wire bytes of the rows by what they move: DP traffic (by kind, by domain: {} where the axes
    cannot tell the domains apart), the MoE tokens' all-to-all, and the rest (tp, mixed axes)."""

    dp_wire_bytes: float
    dp_wire_bytes_by_kind: dict[str, float]
    dp_wire_bytes_by_domain: dict[str, float]
    all_to_all_wire_bytes: float
    other_wire_bytes: float


@dataclasses.dataclass(frozen=True)
class ParamGather(Record):
    """The quantized param all-gather measured (`zero.param_gather_dtype`), per step."""

    dtype: str
    block: int
    codes_wire_bytes: float
    scales_wire_bytes: float
    wire_bytes: float
    bf16_wire_bytes: float  # the same elements at 2 bytes, no scales
    param_dtype_wire_bytes: float  # at the param dtype's bytes
    saving_vs_bf16: float | None


# --------------------------------------------------------------------------- one strategy, the report


@dataclasses.dataclass(frozen=True)
class StrategyComms(Record):
    """One compiled strategy: its collectives, their traffic per instruction (`static`) and per step,
    the theory and their ratio, notes, and the schedule's and peak's entries (`overlap`, `peak`)."""

    compile_s: float
    collectives: list[CollectiveRow]
    static: Traffic
    per_step: Traffic
    theory: Theory
    tokens: Tokens | None
    param_gather: ParamGather | None
    ratio: float | None  # per step, measured / theory
    notes: list[str]
    schedule: dict
    peak: dict

    def to_json(self) -> dict:
        plain = super().to_json()
        rows = [r.to_json() for r in self.collectives]
        return {
            "compile_s": self.compile_s,
            "collectives": [{k: r[k] for k in STATIC} for r in rows],
            **plain["static"],
            "per_step": {"collectives": [{k: r[k] for k in PER_STEP} for r in rows], **plain["per_step"]},
            **{k: plain[k] for k in ("theory", "tokens", "param_gather", "ratio", "notes", "schedule", "peak")},
        }

    @classmethod
    def from_json(cls, raw: dict) -> StrategyComms:
        step, hints = raw["per_step"], typing.get_type_hints(cls)
        rows = [CollectiveRow.from_json({**r, **s}) for r, s in zip(raw["collectives"], step["collectives"])]
        parts = ("compile_s", "theory", "tokens", "param_gather", "ratio", "notes", "schedule", "peak")
        return cls(
            collectives=rows,
            static=Traffic.from_json(raw),
            per_step=Traffic.from_json(step),
            **{k: _typed(hints[k], raw[k]) for k in parts},
        )


@dataclasses.dataclass(frozen=True)
class Header(Record):
    """What the programs were compiled for (shared by every strategy of one command; `jzero memory`'s too)."""

    target: str  # "cpu" or a GPU target
    topology: str | None  # "slices x hosts x gpus" of a GPU target
    device_kind: str
    n_devices: int
    path: str
    mesh: dict[str, int]
    d: int  # the data-parallel domain's size
    edp: int | None  # the expert-DP domain's size; None without expert params
    params: int  # global parameter count
    expert_params: int  # of them in experts
    config: dict  # `jzero.config.to_dict` of the first strategy's config


@dataclasses.dataclass(frozen=True)
class HloReport(Record):
    """The `jzero hlo --json` document: {"schema", <header>, "strategies": {name: <StrategyComms>}}."""

    header: Header
    strategies: dict[str, StrategyComms]

    def to_json(self) -> dict:
        strategies = {name: s.to_json() for name, s in self.strategies.items()}
        return {"schema": SCHEMA, **self.header.to_json(), "strategies": strategies}

    @classmethod
    def from_json(cls, raw: dict) -> HloReport:
        if raw.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} document (schema {raw.get('schema')!r})")
        strategies = {name: StrategyComms.from_json(s) for name, s in raw["strategies"].items()}
        return cls(Header.from_json(raw), strategies)
