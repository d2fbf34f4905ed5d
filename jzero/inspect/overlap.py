"""What XLA scheduled around each collective, and which DP collectives it left exposed.

Read from the compiled program (`read_schedule(compiled.as_text())`); nothing runs. A module
printed with `is_scheduled=true` lists each non-fusion computation's instructions in execution
order. XLA:GPU runs a collective asynchronously as a pair, `all-gather-start` ...
`all-gather-done` (also `all-reduce-`, `collective-permute-`), or `async-start` ...
`async-done` around a computation holding the collective (reduce-scatter, all-to-all;
`as_text()` prints that pair as `reduce-scatter-start` / `reduce-scatter-done`). What XLA
placed between the start and its done, in the same computation, runs while the collective is
on the wire: its **window**. A pair marked `"is_sync":true` (XLA:GPU found nothing to overlap)
and a plain collective (every collective on XLA:CPU) are synchronous and have an empty window.
A collective inside a `while` body (a micro-batch or layer scan) is paired and measured within
that body, once per iteration; `runs` says how often the body runs per step. (A start whose done
is not in its computation, as a pipelined collective's, overlaps the rest of it.)

Compute is counted in **flops of dots and convolutions**: a dot is 2 x (result elements) x
(product of the lhs contracting dims), a convolution 2 x (result elements) x (kernel
elements / output features), a cuBLAS GEMM custom call like a dot, cuDNN's fused attention
(`model.attention: cudnn`) as the batched matmuls it runs (`_attention_flops`); fusions and called
computations count what they contain, a `while` its body x its trip count (XLA's
`known_trip_count`; where XLA dropped it, as it does for a loop it peeled, the count of a loop
`i < N` whose counter starts from a constant, as JAX's scans count; else 1, and said), a
`conditional` its largest branch. Everything else
(elementwise fusions, reductions, copies) counts 0 flops; the window's instruction count
(all but parameter, constant, tuple, get-tuple-element and bitcast) shows it.
A collective is **exposed** when its window holds no dot or convolution flops.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from jzero.inspect import hlo
from jzero.inspect.hlo_module import Instr, Module, dims, ints

_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}


# --------------------------------------------------------------------------- flops


def _own_flops(i: Instr, m: Module) -> float:
    """Flops of a dot, convolution or cuBLAS GEMM; 0 for anything else (module docstring)."""
    if i.opcode == "dot" or (i.opcode == "custom-call" and re.search(r'custom_call_target="__cublas\$', i.attrs)):
        key = r"lhs_contracting_dims=\{([^}]*)\}" if i.opcode == "dot" else r'"lhs_contracting_dimensions":\[([^\]]*)\]'
        contracting = re.search(key, i.attrs)
        lhs = dims(m.shape(i.operands[0]))
        k = math.prod(lhs[d] for d in ints(contracting.group(1))) if contracting and lhs else 1
        return 2.0 * math.prod(dims(i.result)) * k
    if i.opcode == "custom-call" and re.search(r'custom_call_target="__cudnn\$fmha', i.attrs):
        return _attention_flops(i, m)
    labels = re.search(r"dim_labels=\w+_(\w+)->", i.attrs)
    if labels and (i.opcode == "convolution" or i.opcode == "custom-call"):
        kernel = dims(m.shape(i.operands[1]))
        out_features = kernel[labels.group(1).index("o")] if kernel else 1
        return 2.0 * math.prod(dims(i.result)) * math.prod(kernel) / max(out_features, 1)
    return 0.0


def _attention_flops(i: Instr, m: Module) -> float:
    """Flops of cuDNN's fused attention (a `__cudnn$fmha*` custom call): its batched matmuls, each 2 x the
    scores' elements [B, H, Tq, Tk] x the head dim K (Q's elements / (B H Tq)): 2 forward (Q K^T, P V),
    4 backward (dV, dP, dQ, dK) and in the flash kernel a fifth, the scores again; under a causal mask
    half of it (the kernel skips the masked tiles). 0 where the backend config does not give the scores'
    shape."""
    scores = re.search(r'"intermediate_tensor_shape":\s*\{"element_type":\s*"\w+",\s*"dimensions":\s*\[([^\]]*)\]',
                       i.attrs)  # fmt: skip
    q = dims(m.shape(i.operands[0])) if i.operands else ()
    shape = ints(scores.group(1)) if scores else []
    if len(shape) != 4 or not q or math.prod(q) % math.prod(shape[:3]):
        return 0.0
    head_dim = math.prod(q) // math.prod(shape[:3])
    backward = re.search(r'custom_call_target="__cudnn\$fmha\w*Backward"', i.attrs) is not None
    flash = re.search(r'"is_flash_attention":\s*true', i.attrs) is not None
    matmuls = (5 if flash else 4) if backward else 2
    causal = 0.5 if re.search(r'"mask_type":\s*"\w*CAUSAL"', i.attrs) else 1.0
    return 2.0 * matmuls * math.prod(shape) * head_dim * causal


class Flops:
    """Dot/conv flops per instruction and per computation (memoized; linear in the module)."""

    def __init__(self, m: Module):
        self.m, self._comp = m, {}
        self.unknown_trips: set[str] = set()  # loops without a known trip count

    def trips(self, i: Instr) -> int | None:
        n = re.search(r'"known_trip_count":\{"n":"(\d+)"', i.attrs)
        return int(n.group(1)) if n else _counted_trips(self.m, i)

    def of(self, i: Instr) -> float:
        """Flops of one execution of `i`, including what it calls."""
        called = [self.computation(c) for c in i.called]
        if i.opcode == "while":
            trips = self.trips(i)
            if trips is None:
                self.unknown_trips.add(i.name)
            return (trips or 1) * sum(called)
        if i.opcode == "conditional":
            return max(called, default=0.0)
        return _own_flops(i, self.m) + sum(called)

    def computation(self, name: str) -> float:
        if name not in self._comp:
            self._comp[name] = 0.0  # guards against cycles
            self._comp[name] = sum(self.of(i) for i in self.m.computations.get(name, []))
        return self._comp[name]


def _through_copies(m: Module, name: str) -> Instr | None:
    i = m.instr.get(name)
    while i is not None and i.opcode in ("copy", "bitcast") and i.operands:
        i = m.instr.get(i.operands[0])
    return i


def _constant(i: Instr | None) -> int | None:
    return int(i.operands[0]) if i is not None and i.opcode == "constant" and i.operands[0].isdigit() else None


def _counted_trips(m: Module, loop: Instr) -> int | None:
    """The trip count of a `while` XLA gave none: its condition `i < N` (a compare, or a fusion of
    one) with i a tuple element the loop starts from a constant c: N - c (JAX's counters step by
    1). None for any other loop."""
    cond = re.search(r"\bcondition=%?([\w.\-]+)", loop.attrs)
    root = m.root(cond.group(1)) if cond else None
    if root is None or not loop.operands:
        return None
    compare, outer = root, {}
    if root.opcode == "fusion" and root.called:  # the fused computation's parameter k is the fusion's operand k
        compare = m.root(root.called[0])
        outer = {i.name: root.operands[int(i.operands[0])] for i in m.computations.get(root.called[0], [])
                 if i.opcode == "parameter" and i.operands and i.operands[0].isdigit()}  # fmt: skip
    if compare is None or compare.opcode != "compare" or "direction=LT" not in compare.attrs:
        return None
    counter = m.instr.get(outer.get(compare.operands[0], compare.operands[0]))
    bound = _constant(_through_copies(m, outer.get(compare.operands[1], compare.operands[1])))
    init = m.instr.get(loop.operands[0])
    if counter is None or counter.opcode != "get-tuple-element" or bound is None or init is None:
        return None
    index = re.search(r"\bindex=(\d+)", counter.attrs)
    if init.opcode != "tuple" or index is None or int(index.group(1)) >= len(init.operands):
        return None
    start = _constant(_through_copies(m, init.operands[int(index.group(1))]))
    return bound - start if start is not None and bound > start else None


# --------------------------------------------------------------------------- overlap


@dataclass(frozen=True)
class Overlap:
    """One collective and what XLA scheduled while it runs (per execution of its computation).

    Attributes:
      collective: the collective (`hlo.Collective`: kind, payload, replica groups).
      computation: where its start and done are scheduled (the entry or a loop body).
      runs: executions per step of that computation (the product of the enclosing loops'
        trip counts; 1 where XLA does not know one).
      is_async: a start/done pair not marked `is_sync`.
      window_flops: dot/conv flops between start and done; 0 for a synchronous collective.
      window_instructions: instructions between them (parameter, constant, tuple,
        get-tuple-element and bitcast not counted).
      start, end: the positions of its start and its done in the computation's schedule (the window
        is what lies between; end = start + 1 for a synchronous collective, the computation's length
        for a done outside it).
    """

    collective: hlo.Collective
    computation: str
    runs: int
    is_async: bool
    window_flops: float
    window_instructions: int
    start: int = 0
    end: int = 1

    @property
    def exposed(self) -> bool:
        return self.window_flops == 0


@dataclass(frozen=True)
class Schedule:
    """The collectives of a compiled module and what overlaps them.

    Attributes:
      overlaps: one per collective, in module order.
      step_flops: dot/conv flops of one step (the entry computation, loops x trip counts).
      scheduled: the module is printed in schedule order (`is_scheduled=true`).
      entry: the entry computation's name (a collective elsewhere is in a loop or a call).
      unknown_trip_counts: loops XLA gave no trip count (counted once).
      prefix_flops: per computation holding a collective, the dot/conv flops of its first n
        instructions at index n (so a window (start, end) holds prefix[end] - prefix[start + 1]).
    """

    overlaps: tuple[Overlap, ...]
    step_flops: float
    scheduled: bool
    entry: str
    unknown_trip_counts: int
    prefix_flops: dict[str, tuple[float, ...]] = field(default_factory=dict)


def read_schedule(hlo_text: str, collectives: list[hlo.Collective] | None = None) -> Schedule:
    """The collectives of a compiled module with their windows (module docstring); `collectives`:
    `hlo.parse_collectives(hlo_text)` where the caller has it already."""
    m = Module(hlo_text)
    flops = Flops(m)
    if collectives is None:
        collectives = hlo.parse_collectives(hlo_text)
    by_name = {c.name: c for c in collectives}
    by_computation = {c.computation: c for c in by_name.values()}
    runs = _runs(m, flops)
    out, prefixes = [], {}
    for comp, body in m.computations.items():
        if comp != m.entry and all(c.opcode in ("fusion", "async-start") for c in m.callers.get(comp, [])):
            continue  # fused (never scheduled) or an async wrapper (its collective is measured at the start)
        prefix_flops, prefix_count, position = [0.0], [0], {}
        for n, i in enumerate(body):
            position[i.name] = n
            prefix_flops.append(prefix_flops[-1] + flops.of(i))
            prefix_count.append(prefix_count[-1] + (i.opcode not in _FREE))
        done_of = {i.operands[0]: i for i in body if i.operands and re.search(r"-(done|update)$", i.opcode)}
        for n, i in enumerate(body):
            collective = by_name.get(i.name)
            if i.opcode == "async-start":
                collective = next((by_computation[c] for c in i.called if c in by_computation), None)
            if collective is None or i.opcode.endswith("-done"):
                continue
            end, is_async = n + 1, False
            if i.opcode.endswith("-start"):
                done = done_of.get(i.name)
                while done is not None and done.opcode.endswith("-update"):
                    done = done_of.get(done.name)
                # A done outside this computation (a pipelined collective): the rest of it overlaps.
                end = position[done.name] if done is not None else len(body)
                is_async = '"is_sync":true' not in i.attrs
            out.append(
                Overlap(
                    collective=collective,
                    computation=comp,
                    runs=runs.get(comp, 1),
                    is_async=is_async,
                    window_flops=prefix_flops[end] - prefix_flops[n + 1],
                    window_instructions=prefix_count[end] - prefix_count[n + 1],
                    start=n,
                    end=end,
                )
            )
            prefixes[comp] = tuple(prefix_flops)
    step_flops = flops.computation(m.entry)
    return Schedule(tuple(out), step_flops, m.scheduled, m.entry, len(flops.unknown_trips), prefixes)


def _runs(m: Module, flops: Flops) -> dict[str, int]:
    """Executions per step of each computation: the entry once, a loop body x its trip count."""
    runs: dict[str, int] = {m.entry: 1}

    def of(comp: str) -> int:
        if comp not in runs:
            runs[comp] = 0  # guards against cycles
            runs[comp] = sum(
                of(i.computation) * ((flops.trips(i) or 1) if i.opcode == "while" else 1)
                for i in m.callers.get(comp, [])
            )
        return runs[comp]

    for comp in m.computations:
        of(comp)
    return runs


# --------------------------------------------------------------------------- a compiled step


def schedule_report(c, sch: Schedule | None = None) -> dict:
    """The `schedule` entry of `jzero hlo --json` for one compiled step (docs/inspect.md); `sch`: its
    `read_schedule`, where the caller has read it already."""
    sch = read_schedule(c.compiled.as_text()) if sch is None else sch
    rows = []
    for o in sch.overlaps:
        col = o.collective
        rows.append(
            {
                "kind": col.kind,
                "axes": list(hlo.axes_of_groups(col.replica_groups, c.run.mesh)),
                "dtype": col.dtype,
                "payload_bytes": col.payload_bytes,
                "wire_bytes": col.wire_bytes,
                "computation": o.computation,
                "runs": o.runs,
                "async": o.is_async,
                "window_flops": o.window_flops,
                "window_instructions": o.window_instructions,
                "overlap_fraction": o.window_flops * o.runs / sch.step_flops if sch.step_flops else 0.0,
                "exposed": o.exposed,
            }
        )
    exposed = [r for r in rows if r["exposed"] and hlo.is_dp_traffic(r["kind"], r["axes"])]
    return {
        "scheduled": sch.scheduled,
        "entry": sch.entry,
        "step_flops": sch.step_flops,
        "unknown_trip_counts": sch.unknown_trip_counts,
        "collectives": rows,
        "exposed_dp_wire_bytes": sum(r["wire_bytes"] for r in exposed),
        "exposed_dp_wire_bytes_per_step": sum(r["wire_bytes"] * r["runs"] for r in exposed),
    }


def format_lines(s: dict) -> list[str]:
    """The `jzero hlo` text's lines on one strategy's DP collectives: their overlap, the exposed bytes
    (per step, counting loop runs, and per instruction)."""
    h, sch = hlo._human, s["schedule"]
    lines = [
        f"  {'DP collective':<17}{'axes':<12}{'where':<10}{'count':>6}{'async':>7}{'exposed':>9}"
        f"{'overlapped flops':>19}{'wire/device':>14}{'wire/step':>14}"
    ]
    groups: dict[tuple, list[dict]] = {}
    for r in sch["collectives"]:
        if hlo.is_dp_traffic(r["kind"], r["axes"]):
            where = "step" if r["computation"] == sch["entry"] else f"loop x{r['runs']}"
            groups.setdefault((r["kind"], ",".join(r["axes"]), where), []).append(r)
    for (kind, axes, where), rs in groups.items():
        flops = sum(r["window_flops"] * r["runs"] for r in rs)
        share = flops / sch["step_flops"] if sch["step_flops"] else 0.0
        lines.append(
            f"  {kind:<17}{axes:<12}{where:<10}{len(rs):>6}{sum(r['async'] for r in rs):>7}"
            f"{sum(r['exposed'] for r in rs):>9}{f'{flops:.3g} ({share:.1%})':>19}"
            f"{h(sum(r['wire_bytes'] for r in rs)):>14}{h(sum(r['wire_bytes'] * r['runs'] for r in rs)):>14}"
        )
    exposed, per_step = sch["exposed_dp_wire_bytes"], sch["exposed_dp_wire_bytes_per_step"]
    dp = s.get("dp_wire_bytes", 0.0)
    dp_step = s.get("per_step", {}).get("dp_wire_bytes", dp)
    order = "" if sch["scheduled"] else " NOT a scheduled module: its order may not be the execution order"
    n = sch.get("unknown_trip_counts", 0)
    # e.g. dropless MoE's tile loops, whose trip count the routing sets (docs/moe.md)
    once = f" ({n} loop(s) with a data-dependent trip count counted once)" if n else ""
    lines.append(
        f"  exposed DP wire/device {h(per_step)} of {h(dp_step)} per step ({h(exposed)} of {h(dp)} per "
        f"instruction); step {sch['step_flops']:.3g} dot/conv flops{once}{order}"
    )
    return lines
