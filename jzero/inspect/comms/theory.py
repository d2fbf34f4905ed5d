"""The theory of what each ZeRO stage sends over the wire (`measure.py` reads what it does).

Theory: the data-parallel wire bytes per device per step, per data-parallel domain: dense
params over d = dp_outer x dp x ep, expert params over edp = dp_outer x dp. G: the grad bytes
one model-parallel rank holds in the domain (tp-local; for experts, its E/ep experts) in
`precision.grad_reduce_dtype`; P: those params' bytes in `precision.param_dtype`; P_unit: the
part of P inside FSDP units (the model's `units`: jzero's GPT's blocks, not its embeddings, final
norm or head; 0 for a model without units);
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
and also without it when the model remats its units (`jzero.model.remat`: the recomputed forward
gathers again); else its term is
M (d-1)/d P. With every param in a unit, P_unit = P: 2 (d-1)/d P, 1.5x DDP's bytes at G = P.

HSDP (dp_outer = d_o > 1; inner DP d_i = d / d_o): the grads reduce-scatter over the inner
axes, (d_i-1)/d_i G, then across dp_outer either all-reduce their 1/d_i, 2(d_o-1)/d_o G/d_i
(`zero.outer_strategy: no_shard`), or reduce-scatter it, (d_o-1)/d_o G/d_i (`optim`); the params
are all-gathered over the inner axes, (d_i-1)/d_i P (ZeRO-1/2 after the step, ZeRO-3 per unit as
above), and under `optim` first across dp_outer, (d_o-1)/d_o P/d_i, after the step. ZeRO-1/2
under `optim` move the flat formulas' bytes; under `no_shard` the outer all-reduce costs
(d_o-1)/d_o G/d_i more and no params are gathered across dp_outer, (d_o-1)/d_o P/d_i less.
ZeRO-3's per-unit gathers span the inner axes only. The spec path's DDP all-reduce is the same
hierarchy: reduce-scatter G over the inner axes, all-reduce G/d_i across dp_outer, all-gather the
reduced G over the inner axes; 2(d-1)/d G in all, DDP's bytes, of which 1/d_i crosses dp_outer.
The flat path's DDP is Megatron's one all-reduce over the whole domain (Megatron pads no DDP
buffer to split over DP). With `zero.overlap_grad_reduce: false` the spec path lets XLA pick
DDP's and ZeRO-1's collectives (one sum over the whole domain); the theory is the same hierarchy.

The owned path (`zero.path: owned`, whole params per owner) moves ZeRO-1's and ZeRO-2's bytes: a
reduce-scatter of the owners' segments (once, or per micro-batch) and one all-gather of them; its
segments are padded to the largest owner's, which the theory leaves out as the flat path's padding.

ZeRO-1 is Megatron's distributed optimizer: the full local grad buffer accumulates over the
micro-batches and is reduce-scattered once, after the last; with G = P (fp32 params and grads)
that is exactly DDP's all-reduce. The theory leaves out the model's tp collectives and the loss,
metric and grad-norm scalars; the flat path's buckets are padded to lcm(d, 128), which the theory
leaves out too. The measured/theory ratio compares the DP traffic only (`hlo.is_dp_traffic`):
collectives over DP axes but a MoE's all-to-all, which moves tokens (activations) to their
experts over ep and is reported on its own.

With `zero.param_gather_dtype` (flat path) the params travel as one-byte codes and an fp32 scale
per `quantize.BLOCK` elements of each rank's shard: the theory's P becomes P_q, (1 + 4 / BLOCK)
bytes per param, and `measure.param_gather` reports the codes' and scales' measured bytes beside
what the same elements would move in bf16 and in the param dtype.

Expert parallelism moves tokens, not params: what one all-to-all carries and how many run per
micro-batch is the model's estimate (`jzero.model.token_exchange`; jzero's GPT: its MoE blocks'
[E, C, D] slots); `tokens_theory` is None for a model without one, or with ep = 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jzero import model as protocol
from jzero.inspect import hlo
from jzero.inspect.comms.records import DomainTheory, Term, Theory, Tokens
from jzero.mesh import OUTER_AXIS, axes_size, spec_axes
from jzero.zero.config import OuterStrategy, ShardingStrategy, ZeroPath
from jzero.zero.flat import quantize
from jzero.zero.memory import DOMAIN_NAMES


@dataclasses.dataclass(frozen=True)
class _Symbols:
    """One domain's formula symbols: sizes d, d_i, d_o and operands G, P (or P_q), P_unit."""

    d: str
    d_i: str
    d_o: str
    G: str
    P: str
    P_unit: str

    @classmethod
    def of(cls, name: str, moe_model: bool, quantized: bool) -> _Symbols:
        suffix = f"_{name}" if moe_model else ""
        base = "d" if name == "dense" else "edp"
        return cls(base, f"{base}_i", "d_o", f"G{suffix}", f"P_q{suffix}" if quantized else f"P{suffix}",
                   f"P_unit{suffix}")  # fmt: skip


def _tp_local(plan, t) -> int:
    """Elements of `t` one model-parallel rank holds (`ShardingPlan.numel_by_domain`'s count)."""
    return t.numel // axes_size(plan.mesh, spec_axes(t.tp_spec))


def _term(kind: str, over, n: int, what: str, buffer: float, runs: int, operand: str, n_name: str) -> Term:
    coefficient = ("2" if kind == "all-reduce" else "") + f"({n_name}-1)/{n_name}"
    if runs > 1:
        coefficient = f"{runs}*{coefficient}"
    wire = runs * hlo.ring_wire_bytes(kind, buffer, n)
    return Term(kind, list(over), n, what, buffer, runs, wire, coefficient, operand)


def _terms(c, axes: tuple[str, ...], g: float, p: float, p_unit: float, sym: _Symbols) -> list[Term]:
    """One domain's collectives per step (module docstring); `g`, `p`, `p_unit`: G, P (or P_q), P_unit."""
    cfg, mesh = c.cfg, c.run.mesh
    strategy, micro = cfg.zero.strategy, cfg.train.microbatches
    outer = (OUTER_AXIS,) if mesh.shape[OUTER_AXIS] > 1 else ()
    inner = tuple(a for a in axes if a not in outer)
    d, d_i, d_o = axes_size(mesh, axes), axes_size(mesh, inner), axes_size(mesh, outer)
    outer_scatter = bool(outer) and cfg.zero.outer_strategy == OuterStrategy.OPTIM
    n_sym, per_i = (sym.d if not outer else sym.d_i), f"/{sym.d_i}"
    if strategy == ShardingStrategy.NO_SHARD:
        if not outer or cfg.zero.path == ZeroPath.FLAT:
            return [_term("all-reduce", axes, d, "grads", g, 1, sym.G, sym.d)]
        return [  # the spec path's hierarchical all-reduce (module docstring)
            _term("reduce-scatter", inner, d_i, "grads", g, 1, sym.G, sym.d_i),
            _term("all-reduce", outer, d_o, "grads", g / d_i, 1, sym.G + per_i, sym.d_o),
            _term("all-gather", inner, d_i, "reduced grads", g, 1, sym.G, sym.d_i),
        ]
    g_runs = 1 if strategy == ShardingStrategy.OPTIM else micro
    terms = [_term("reduce-scatter", inner, d_i, "grads", g, g_runs, sym.G, n_sym)]
    if outer:
        kind = "reduce-scatter" if outer_scatter else "all-reduce"
        terms.append(_term(kind, outer, d_o, "grads", g / d_i, g_runs, sym.G + per_i, sym.d_o))
    if outer_scatter:  # the updated params, from the state's 1/d to the inner shard (ZeRO-3) or whole (ZeRO-1/2)
        terms.append(_term("all-gather", outer, d_o, "params", p / d_i, 1, sym.P + per_i, sym.d_o))
    if strategy != ShardingStrategy.OPTIM_GRADS_PARAMS:
        return [*terms, _term("all-gather", inner, d_i, "params", p, 1, sym.P, n_sym)]
    # a unit's before it runs, the rest before the loss
    terms.append(_term("all-gather", inner, d_i, "params", p, micro, sym.P, n_sym))
    if p_unit and (cfg.zero.reshard_after_forward or protocol.remat(c.run.model)):
        again = "unit params, again for backward"
        terms.append(_term("all-gather", inner, d_i, again, p_unit, micro, sym.P_unit, n_sym))
    return terms


def _formula(terms: list[Term]) -> str:
    """The terms' formula, terms of one coefficient merged: "(d-1)/d*(G + P + P_unit)"."""
    by_coefficient: dict[str, list[str]] = {}
    for t in terms:
        by_coefficient.setdefault(t.coefficient, []).append(t.operand)
    parts = []
    for coefficient, operands in by_coefficient.items():
        parts.append(f"{coefficient}*{operands[0] if len(operands) == 1 else '(' + ' + '.join(operands) + ')'}")
    return " + ".join(parts)


def _by_kind(terms) -> dict[str, float]:
    out: dict[str, float] = {}
    for t in terms:
        out[t.kind] = out.get(t.kind, 0.0) + t.wire_bytes
    return out


def _domain(c, axes, numel: int, unit_numel: int, sym: _Symbols) -> DomainTheory:
    """The theory of the domain over `axes`, whose params one model-parallel rank holds `numel` of."""
    cfg, mesh = c.cfg, c.run.mesh
    grad_b = jnp.dtype(cfg.precision.grad_reduce_dtype.value).itemsize
    param_b = jnp.dtype(cfg.precision.param_dtype.value).itemsize
    quantized = cfg.zero.param_gather_dtype is not None
    gather_b = 1 + 4 / quantize.BLOCK if quantized else param_b  # bytes per param the all-gathers move
    g, p, pu = numel * grad_b, numel * param_b, unit_numel * param_b
    terms = _terms(c, axes, g, numel * gather_b, pu, sym)
    by_kind = _by_kind(terms)
    hsdp = mesh.shape[OUTER_AXIS] > 1
    inner = tuple(a for a in axes if a != OUTER_AXIS or not hsdp)
    return DomainTheory(
        axes=list(axes), d=axes_size(mesh, axes), d_inner=axes_size(mesh, inner), d_outer=mesh.shape[OUTER_AXIS],
        grad_bytes=g, param_bytes=p, gather_bytes=numel * gather_b, unit_param_bytes=pu, terms=terms,
        formula=_formula(terms), by_kind=by_kind, wire_bytes=sum(by_kind.values()),
    )  # fmt: skip


def theory(c) -> Theory:
    """Theoretical DP wire bytes per device per step for the compiled step `c`'s strategy (module
    docstring): each domain's (`DomainTheory`: "dense", and "expert" for a model with experts), and
    their sums."""
    cfg, plan = c.cfg, c.run.zero.plan
    numel = plan.numel_by_domain()
    unit_numel = dict.fromkeys(numel, 0)
    for t in jax.tree.leaves(plan.tensors):
        if t.unit_dims is not None:
            unit_numel[t.dp_axes] += _tp_local(plan, t)
    quantized = cfg.zero.param_gather_dtype is not None
    domains = {}
    for axes, n in numel.items():
        name = DOMAIN_NAMES[axes]
        domains[name] = _domain(c, axes, n, unit_numel[axes], _Symbols.of(name, len(numel) > 1, quantized))
    domains = dict(sorted(domains.items()))  # dense before expert
    by_kind: dict[str, float] = {}
    for dom in domains.values():
        for kind, b in dom.by_kind.items():
            by_kind[kind] = by_kind.get(kind, 0.0) + b
    return Theory(
        d=cfg.dp_domain_size,
        microbatches=cfg.train.microbatches,
        grad_bytes=sum(dom.grad_bytes for dom in domains.values()),
        param_bytes=sum(dom.param_bytes for dom in domains.values()),
        gather_bytes=sum(dom.gather_bytes for dom in domains.values()),  # P_q when quantized, else P
        unit_param_bytes=sum(dom.unit_param_bytes for dom in domains.values()),
        formula=" + ".join(dom.formula for dom in domains.values()),
        by_kind=by_kind,
        wire_bytes=sum(by_kind.values()),
        domains=domains,
    )


def tokens_theory(c) -> Tokens | None:
    """What expert parallelism's all-to-alls move per step (module docstring), from the model's
    `token_exchange` for the tokens one rank routes per micro-batch; None for a model without an
    exchange, or ep = 1. Its `measured` is left for `measure.py`."""
    cfg = c.cfg
    ep = cfg.mesh.ep
    if ep == 1:
        return None
    tokens = cfg.train.global_batch // (cfg.dp_domain_size * cfg.train.microbatches) * cfg.model.seq_len
    exchange = protocol.token_exchange(c.run.model, tokens)
    if exchange is None:
        return None
    per_step = exchange.per_microbatch * cfg.train.microbatches
    one = hlo.ring_wire_bytes("all-to-all", exchange.slot_bytes, ep)
    return Tokens(ep, exchange.slot_bytes, one, per_step, per_step * one, dropless=exchange.dropless)
