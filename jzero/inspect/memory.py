"""Bytes per device of a compiled train step, beside Megatron's formula, and whether it fits.

Two views of one compiled step (`compile.compile_step`), both per device:

- the state as laid out, from shapes and shardings (exact, nothing allocated):
    params             the model copy, `plan.param_shardings()`, in param_dtype (split over
                       the inner DP axes under ZeRO-3)
    main_params        the fp32 master copy (only when params are not fp32)
    optimizer_moments  the inner optax state (Adam's mu and nu; its step counter)
    grads              the grad buffer the microbatches accumulate into (Megatron's),
                       in grad_reduce_dtype: full local grads under DDP and ZeRO-1, the
                       owned shard under ZeRO-2 and ZeRO-3 (`Zero.grad_buffer_structs`). It
                       lives inside the step, so XLA may never materialise it whole: compare
                       `temp` below.
  beside Megatron's formula (docs/megatron.md, "Bytes per parameter"; `report.formula_split`;
  for ZeRO-3 the ZeRO paper's stage 3, everything / d), summed over the data-parallel domains:
  dense params sharded over d = dp_outer x dp x ep, a MoE's expert params (this rank's E/ep
  experts) over edp = dp_outer x dp (`report.formula_domains`, the `formula_domains` of the
  JSON); under HSDP what is sharded over the inner axes only is / d_i (`d_state`, `d_params`);
- the compiled program (`memory_analysis()`): arguments (the state and the batch), outputs
  (the new state, aliased to the donated arguments), temp (activations, local grads,
  collective buffers) and the peak. XLA:GPU reports the peak of its schedule; XLA:CPU's
  `peak_memory_in_bytes` leaves temp out, so the peak shown is the larger of XLA's and
  arguments + outputs - aliased + temp (an upper bound, equal to XLA's on GPU).
"""

from __future__ import annotations

import jax.numpy as jnp

from jzero.inspect.comms import LABELS, count, header, human
from jzero.inspect.compile import CPU, CompiledStep
from jzero.train.report import formula_domains, formula_split, shard_bytes

SCHEMA = "jzero.memory/1"
PARTS = ("params", "main_params", "optimizer_moments", "grads")


def state_bytes(c: CompiledStep) -> dict:
    """Per-device bytes of params, main params, optimizer moments and grads (module docstring)."""
    opt = c.state.opt_state
    return {
        "params": shard_bytes(c.state.params),
        "main_params": 0 if opt.main_params is None else shard_bytes(opt.main_params),
        "optimizer_moments": shard_bytes(opt.inner_state),
        "grads": shard_bytes(c.run.zero.grad_buffer_structs(jnp.dtype(c.cfg.precision.grad_reduce_dtype.value))),
    }


def compiled_bytes(c: CompiledStep) -> dict:
    """The compiled program's `memory_analysis()` per device, with the peak (module docstring)."""
    m = c.compiled.memory_analysis()
    out = {
        "argument": m.argument_size_in_bytes,
        "output": m.output_size_in_bytes,
        "alias": m.alias_size_in_bytes,
        "temp": m.temp_size_in_bytes,
        "generated_code": m.generated_code_size_in_bytes,
        "xla_peak": getattr(m, "peak_memory_in_bytes", 0),
    }
    bound = out["argument"] + out["output"] - out["alias"] + out["temp"]
    out["peak"] = max(out["xla_peak"], bound)
    return out


def analyze(c: CompiledStep, memory_bytes: int | None) -> dict:
    """One strategy's memory document; `memory_bytes` is the device's memory (None on cpu)."""
    state = state_bytes(c)
    formula, domains = formula_split(c.run), formula_domains(c.run)
    compiled = compiled_bytes(c)
    return {
        "compile_s": round(c.compile_s, 3),
        "state": {**state, "total": sum(state.values())},
        "formula": {**formula, "total": sum(formula.values())},
        "formula_domains": {n: {**dom, "total": sum(dom[k] for k in PARTS)} for n, dom in domains.items()},
        "compiled": compiled,
        "fits": None if memory_bytes is None else compiled["peak"] <= memory_bytes,
    }


def report(compiled: dict[str, CompiledStep]) -> dict:
    """The `jzero memory --json` document: {schema, <header>, memory_bytes, strategies: {...}}."""
    first = next(iter(compiled.values()))
    memory = None
    if first.target != CPU:
        from jzero.inspect.targets import TARGETS

        memory = TARGETS[first.target].memory_bytes
    return {
        "schema": SCHEMA,
        **header(first),
        "memory_bytes": memory,
        "strategies": {s: analyze(c, memory) for s, c in compiled.items()},
    }


def _hsdp(doc: dict) -> str:
    d_o = doc["mesh"].get("dp_outer", 1)
    if d_o == 1:
        return ""
    return f" (HSDP: d_i={doc['d'] // d_o} x d_o={d_o}, outer_strategy {doc['config']['zero']['outer_strategy']})"


def format_report(doc: dict) -> str:
    mesh = " ".join(f"{k}={v}" for k, v in doc["mesh"].items())
    where = doc["target"] if doc["topology"] is None else f"{doc['target']} ({doc['topology']})"
    prec = doc["config"]["precision"]
    memory = "" if doc["memory_bytes"] is None else f", {human(doc['memory_bytes'])} per device"
    lines = [
        f"per-device memory of the compiled train step, {count(doc['params'])} params "
        f"({prec['param_dtype']} params, {prec['grad_reduce_dtype']} grads), path={doc['path']}",
        f"target {where}, {doc['device_kind']}{memory}, mesh {mesh}, d={doc['d']}"
        + ("" if doc.get("edp") is None else f", edp={doc['edp']} ({count(doc['expert_params'])} params in experts)")
        + _hsdp(doc),
        "",
    ]
    for name, s in doc["strategies"].items():
        lines += [f"== {name} ({LABELS.get(name, name)}), compiled in {s['compile_s']:.1f} s ==",
                  f"  {'state (shardings x shapes)':<28}{'jzero':>14}{'Megatron formula':>20}"]  # fmt: skip
        for part in (*PARTS, "total"):
            lines.append(f"  {part:<28}{human(s['state'][part]):>14}{human(s['formula'][part]):>20}")
        hsdp = doc["mesh"].get("dp_outer", 1) > 1
        if len(s["formula_domains"]) > 1 or hsdp:
            for dname, dom in s["formula_domains"].items():  # P_local params per rank, sharded over d or edp
                label = f"  {dname} ({count(dom['numel'])}, {'d' if dname == 'dense' else 'edp'}={dom['d']}"
                if hsdp:  # what the state and the params are split over (inner axes, or all of them)
                    label += f", /{dom['d_state']} state, /{dom['d_params']} params"
                label += ")"
                lines.append(f"  {label}{human(dom['total']):>{max(62 - len(label), 12)}}")
        cb = s["compiled"]
        lines.append(
            f"  compiled: arguments {human(cb['argument'])}, outputs {human(cb['output'])} "
            f"(aliased {human(cb['alias'])}), temp {human(cb['temp'])}, peak {human(cb['peak'])}"
        )
        if s["fits"] is not None:
            lines.append(f"  fits {doc['target']}: {'yes' if s['fits'] else 'NO'}")
        lines.append("")
    cols = f"  {'strategy':<20}{'state':>14}{'formula':>14}{'temp':>14}{'peak':>14}"
    lines.append(cols + ("" if doc["memory_bytes"] is None else "  fits"))
    for name, s in doc["strategies"].items():
        row = (
            f"  {name:<20}{human(s['state']['total']):>14}{human(s['formula']['total']):>14}"
            f"{human(s['compiled']['temp']):>14}{human(s['compiled']['peak']):>14}"
        )
        lines.append(row + ("" if s["fits"] is None else f"  {'yes' if s['fits'] else 'NO'}"))
    return "\n".join(lines)
