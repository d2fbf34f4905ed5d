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
  beside Megatron's formula (docs/megatron.md, "Bytes per parameter"; `jzero.zero.memory.formula_split`;
  for ZeRO-3 the ZeRO paper's stage 3, everything / d), summed over the data-parallel domains:
  dense params sharded over d = dp_outer x dp x ep, a MoE's expert params (this rank's E/ep
  experts) over edp = dp_outer x dp (`jzero.zero.memory.formula_domains`, the `formula_domains` of the
  JSON); under HSDP what is sharded over the inner axes only is / d_i (`d_state`, `d_params`);
- the compiled program (`memory_analysis()`): arguments (the state and the batch), outputs
  (the new state, aliased to the donated arguments), temp (activations, local grads,
  collective buffers) and the peak. XLA:GPU reports the peak of its schedule; XLA:CPU's
  `peak_memory_in_bytes` leaves temp out, so the peak shown is the larger of XLA's and
  arguments + outputs - aliased + temp (an upper bound, equal to XLA's on GPU). XLA's peak
  counts host-memory allocations too, so the peak shown leaves them out.

With `zero.offload_fraction` > 0 part of the main params and moments is in host memory
(`jzero.zero.common.offload`): the state's `host` part is read from the shardings' memory kind, the
formula's (`jzero.zero.memory.formula_host`) is its share of Megatron's, and the compiled program's host
arguments and outputs are its parameters and results in memory space S(5) (`pinned_host`) in
the entry computation layout. XLA:GPU reports them in `memory_analysis()`'s host_* fields and
leaves them out of the device figures; XLA:CPU (one memory) counts them in the device figures
with the host_* fields 0, so they are moved from the device columns to the host ones there.
The compiled argument/output/alias/temp/peak figures are device memory on both.
"""

from __future__ import annotations

import re

import jax

from jzero.inspect import hlo
from jzero.inspect.comms import LABELS, count, header, human
from jzero.inspect.compile import CPU, CompiledStep
from jzero.zero.common.offload import HOST
from jzero.zero.memory import formula_domains, formula_host, formula_split, shard_bytes

SCHEMA = "jzero.memory/1"
PARTS = ("params", "main_params", "optimizer_moments", "grads")
HOST_PARTS = ("main_params", "optimizer_moments")
HOST_SPACE = "S(5)"  # XLA's memory space of pinned_host


def state_bytes(c: CompiledStep) -> dict:
    """Per-device bytes of params, main params, optimizer moments and grads (module docstring)."""
    opt = c.state.opt_state
    return {
        "params": shard_bytes(c.state.params),
        "main_params": 0 if opt.main_params is None else shard_bytes(opt.main_params),
        "optimizer_moments": shard_bytes(opt.inner_state),
        "grads": shard_bytes(c.run.zero.grad_buffer_structs()),
    }


def host_state_bytes(c: CompiledStep) -> dict:
    """Per-device bytes of the main params and optimizer moments whose sharding is in host memory."""
    opt = c.state.opt_state

    def on_host(tree):
        return shard_bytes([x for x in jax.tree.leaves(tree) if x.sharding.memory_kind == HOST])

    return {"main_params": on_host(opt.main_params), "optimizer_moments": on_host(opt.inner_state)}


def entry_host_bytes(hlo_text: str) -> dict:
    """Per-device bytes of the entry computation's parameters and results in host memory (S(5)), and of
    the results among them aliased to a parameter: {"argument", "output", "alias"}."""
    head = re.search(r"entry_computation_layout=\{", hlo_text)
    if head is None:
        return {"argument": 0, "output": 0, "alias": 0}
    layout = hlo._COMMENT.sub("", hlo_text[head.end() : hlo._balanced(hlo_text, head.end() - 1, "{", "}") - 1])
    params_end = hlo._balanced(layout, 0, "(", ")")
    results = layout[params_end:].split("->", 1)[1].strip()
    if results.startswith("("):
        results = results[1:-1]

    def host_bytes(shapes: str) -> list[int]:  # per top-level shape: its bytes if in host memory, else 0
        return [
            sum(hlo._array_bytes(dt, dims) for dt, dims in hlo._arrays(x)) if HOST_SPACE in x else 0
            for x in hlo._split_top(shapes)
        ]

    args, outs = host_bytes(layout[1 : params_end - 1]), host_bytes(results)
    aliases = re.search(r"input_output_alias=\{(.*?)\}\s*,\s*entry_computation_layout", hlo_text)
    aliased = {int(i or 0) for i in re.findall(r"\{(\d*)\}:\s*\(", aliases.group(1))} if aliases else set()
    return {"argument": sum(args), "output": sum(outs), "alias": sum(outs[i] for i in aliased if i < len(outs))}


def compiled_bytes(c: CompiledStep) -> dict:
    """The compiled program's `memory_analysis()` per device, with the peak; device memory, and
    the host_* bytes apart (module docstring)."""
    m = c.compiled.memory_analysis()
    host = entry_host_bytes(c.compiled.as_text())
    # XLA:CPU counts host parameters in argument_size and reports no host_* bytes.
    in_device = m.host_argument_size_in_bytes == 0 and host["argument"] > 0
    out = {
        "argument": m.argument_size_in_bytes - (host["argument"] if in_device else 0),
        "output": m.output_size_in_bytes - (host["output"] if in_device else 0),
        "alias": m.alias_size_in_bytes - (host["alias"] if in_device else 0),
        "temp": m.temp_size_in_bytes,
        "generated_code": m.generated_code_size_in_bytes,
        "xla_peak": getattr(m, "peak_memory_in_bytes", 0),
        "host_argument": m.host_argument_size_in_bytes or host["argument"],
        "host_output": m.host_output_size_in_bytes or host["output"],
        "host_alias": m.host_alias_size_in_bytes or host["alias"],
        "host_temp": m.host_temp_size_in_bytes,
    }
    bound = out["argument"] + out["output"] - out["alias"] + out["temp"]
    # XLA's peak counts every allocation, host memory's too (XLA:GPU: peak = arguments + host
    # arguments + temp at its peak, LLaMA-2-7B offloaded, docs/offload.md): the device's is without them.
    host_resident = out["host_argument"] + out["host_output"] - out["host_alias"]
    out["peak"] = max(out["xla_peak"] - host_resident, bound)
    return out


def analyze(c: CompiledStep, memory_bytes: int | None) -> dict:
    """One strategy's memory document; `memory_bytes` is the device's memory (None on cpu)."""
    state, host, offload = state_bytes(c), host_state_bytes(c), c.run.zero.offload
    formula, domains, formula_on_host = formula_split(c.run.zero), formula_domains(c.run.zero), formula_host(c.run.zero)
    compiled = compiled_bytes(c)
    return {
        "compile_s": round(c.compile_s, 3),
        "state": {**state, "total": sum(state.values())},
        "formula": {**formula, "total": sum(formula.values())},
        "host": {  # of state and formula above: the part in host memory (zero.offload_fraction)
            "fraction": c.cfg.zero.offload_fraction,
            "units": list(offload.units) if offload.active else [],  # params (spec) or buckets (flat)
            "elements": offload.offloaded_numel / offload.total_numel if offload.active else 0.0,
            "state": {**host, "total": sum(host.values())},
            "formula": {**formula_on_host, "total": sum(formula_on_host.values())},
        },
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
        host = s["host"]
        if host["state"]["total"]:  # zero.offload_fraction > 0
            label = f"of which in host memory ({host['fraction']:g})"
            lines.append(f"  {label:<28}{human(host['state']['total']):>14}{human(host['formula']['total']):>20}")
            unit = "buckets" if doc["path"] == "flat" else "params"
            lines.append(f"    ({len(host['units'])} {unit}, {100 * host['elements']:.1f}% of the elements)")
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
        if cb["host_argument"] or cb["host_output"]:
            lines.append(
                f"  compiled, host memory: arguments {human(cb['host_argument'])}, outputs {human(cb['host_output'])} "
                f"(aliased {human(cb['host_alias'])}), temp {human(cb['host_temp'])}"
            )
        if s["fits"] is not None:
            lines.append(f"  fits {doc['target']}: {'yes' if s['fits'] else 'NO'}")
        lines.append("")
    offload = any(s["host"]["state"]["total"] for s in doc["strategies"].values())
    cols = f"  {'strategy':<20}{'state':>14}{'formula':>14}{'temp':>14}{'peak':>14}"
    cols += f"{'host':>14}" if offload else ""
    lines.append(cols + ("" if doc["memory_bytes"] is None else "  fits"))
    for name, s in doc["strategies"].items():
        row = (
            f"  {name:<20}{human(s['state']['total']):>14}{human(s['formula']['total']):>14}"
            f"{human(s['compiled']['temp']):>14}{human(s['compiled']['peak']):>14}"
        ) + (f"{human(s['host']['state']['total']):>14}" if offload else "")
        lines.append(row + ("" if s["fits"] is None else f"  {'yes' if s['fits'] else 'NO'}"))
    return "\n".join(lines)
