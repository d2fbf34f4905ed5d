"""What temp memory holds at its peak, and what made each value live there; nothing runs.

`peak(buffer_assignment, live_range, hlo_text, ...)` reads XLA's after-optimizations dump of
one compile (`compile.XlaDump`; `Compiled` does not expose it on GPU): the buffer assignment
(`*-buffer-assignment.txt`: which values share the temp allocation, at which offsets) and the
live ranges (`*-live-range.txt`: each value's [start, end] on the flattened schedule). The peak
is the schedule step where the temp allocation holds the most bytes of live values (values of
one buffer share an offset and count once); its allocation size is
`memory_analysis().temp_size_in_bytes`, and the difference is the heap's fragmentation. Each
live value is traced to the instruction that computed it (through get-tuple-element, tuple,
bitcast, copy, loop-carried while values and async operand slots) and classified by that
instruction's JAX `op_name` and source function (the innermost frame of its `stack_frame_id`);
the first rule that matches wins:

    attention       made in a function named like "attention", two dims of size T and at
                    least `attention_elements` elements (the [B, H, T, T] scores, softmax
                    probabilities, mask and their gradients, not a [B, T, D] output)
    reduced_grads   the result of an all-reduce or reduce-scatter, a buffer a dynamic-update-slice
                    writes one into (ZeRO-2/3's per-unit reduce-scatters filling the stacked
                    [L, ...] grad shards inside the layer loop), or jzero's grad code
                    (`GRAD_CODE`) adding one into an accumulator (ZeRO-2's micro-batches)
    local_grads     made by jzero's grad code (the cast, scaling, bucketing and micro-batch
                    accumulation of the unreduced grads), or with the shape of a param (its
                    non-1 dims, in any order) and made by the backward pass (`transpose(`)
    activations     made by the forward pass (`jvp(`, no `transpose(`), or recomputed for
                    the backward pass (`rematted_computation`)
    backward        any other value made by the backward pass (activation gradients)
    other           the rest: optimizer math, gathered params, loss, collective staging
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from dataclasses import dataclass

from jzero import model as protocol
from jzero.inspect import hlo
from jzero.inspect.hlo_module import Instr, Module, dims, ints
from jzero.mesh import entry_axes

CATEGORIES = ("local_grads", "reduced_grads", "activations", "attention", "backward", "other")
# Functions of jzero's grad code, by qualified name: the spec layout's (jzero/zero/spec/grads.py) and the flat
# layout's (jzero/zero/flat/layout.py's `FlatProgram`).
GRAD_CODE = (
    "reduced_grads",
    "FlatProgram.grads",
)
_ALIAS = {"bitcast", "copy", "copy-done"}
_REDUCTIONS = {"all-reduce", "reduce-scatter"}
_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (.*)$")
_VALUE = re.compile(r"^ value: <\d+ (?P<name>[\w.\-]+)(?P<index>\{[\d,]*\})?(?: \(phi\))? @\d+> "
                    r"\(size=(?P<size>\d+),offset=(?P<offset>\d+)\): (?P<shape>.*)$")  # fmt: skip
_RANGE = re.compile(r"^\s+(?P<name>[\w.\-]+)(?P<index>\{[\d,]*\}):(?P<start>\d+)-(?P<end>\d+)$")


@dataclass(frozen=True)
class Buffer:
    """A value live in temp memory at the peak: its name `instr{index}`, bytes, shape, what made it."""

    value: str
    bytes: int
    shape: str
    category: str
    origin: str  # the instruction that computed it
    op_name: str
    function: str  # innermost source function of `origin`


@dataclass(frozen=True)
class Peak:
    """Temp memory at its peak (bytes per device).

    Attributes:
      allocation_bytes: the temp allocation(s) of the buffer assignment (= memory_analysis temp).
      live_bytes: bytes of values live at the peak step, each buffer once.
      step: the peak's position on XLA's flattened schedule.
      buffers: the live values, largest first.
    """

    allocation_bytes: int
    live_bytes: int
    step: int
    buffers: tuple[Buffer, ...]

    def by_category(self) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for b in self.buffers:
            out[b.category] += b.bytes
        return out


def _temp_values(buffer_assignment: str) -> tuple[int, list[tuple[str, int, int, str]]]:
    """(total temp allocation bytes, [(value key, size, offset, shape)]) of the temp allocations.

    Temp allocations are the ones XLA labels `preallocated-temp`; without one, every allocation
    that is not a parameter, an output, live out, thread-local or a constant.
    """
    allocations: list[tuple[int, str, list]] = []
    for line in buffer_assignment.splitlines():
        alloc = _ALLOCATION.match(line)
        if alloc:
            allocations.append((int(alloc.group(2)), alloc.group(3), []))
            continue
        if line.startswith("Total bytes used"):
            break
        value = _VALUE.match(line)
        if value and allocations:
            key = value.group("name") + (value.group("index") or "{}")
            allocations[-1][2].append((key, int(value.group("size")), int(value.group("offset")), value.group("shape")))
    temp = [a for a in allocations if a[1].startswith("preallocated-temp")]
    if not temp:
        other = ("parameter", "output", "maybe-live-out", "thread-local", "constant")
        temp = [a for a in allocations if not any(k in a[1] for k in other)]
    # Each allocation is its own address space: offsets are made distinct by allocation.
    values, base = [], 0
    for size, _, vals in temp:
        values += [(key, s, base + offset, shape) for key, s, offset, shape in vals]
        base += size
    return base, values


def _live_ranges(live_range: str) -> dict[str, tuple[int, int]]:
    body = live_range.split("BufferLiveRange:", 1)[-1].split("Live ranges at", 1)[0]
    out = {}
    for line in body.splitlines():
        r = _RANGE.match(line)
        if r:
            out[r.group("name") + r.group("index")] = (int(r.group("start")), int(r.group("end")))
    return out


def peak(
    buffer_assignment: str,
    live_range: str,
    hlo_text: str,
    *,
    param_shapes: set[tuple[int, ...]],
    seq_len: int,
    attention_elements: int | None,
) -> Peak:
    """What temp memory holds at its peak (module docstring), from XLA's after-optimizations dump.

    Arguments:
      buffer_assignment, live_range, hlo_text: the `*after_optimizations-buffer-assignment.txt`,
        `*after_optimizations-live-range.txt` and `*after_optimizations.txt` of one compile.
      param_shapes: each param's per-device shape (tp-local; a scanned stack and one layer of it)
        as sorted non-1 dims; a value with one of these is param-shaped.
      seq_len: T; attention_elements: fewest elements of an attention buffer (B x H_tp x T x T), None
        for a model without attention (`jzero.model.attention_elements`): nothing is `attention` then.
    """
    allocation, values = _temp_values(buffer_assignment)
    ranges = _live_ranges(live_range)
    events = []
    for n, (key, *_) in enumerate(values):
        if key in ranges:
            start, end = ranges[key]
            events += [(start, 1, n), (end + 1, -1, n)]
    if values and not events:
        raise ValueError("no temp value of the buffer assignment has a live range: has XLA's dump format changed?")
    events.sort(key=lambda e: (e[0], e[1]))
    # Values of one buffer share its offset; at any step at most one buffer occupies an address.
    holders: Counter = Counter()
    live = best = 0
    best_step = -1
    for k, (step, delta, n) in enumerate(events):
        _, size, offset, _ = values[n]
        holders[(offset, size)] += delta
        if holders[(offset, size)] == (1 if delta > 0 else 0):
            live += delta * size
        if live > best and (k + 1 == len(events) or events[k + 1][0] != step):
            best, best_step = live, step
    m = Module(hlo_text)
    seen, buffers = set(), []
    for key, size, offset, shape in values:
        start, end = ranges.get(key, (1, 0))
        if start <= best_step <= end and (offset, size) not in seen:
            seen.add((offset, size))
            buffers.append(_classify(m, key, size, shape, param_shapes, seq_len, attention_elements))
    buffers.sort(key=lambda b: -b.bytes)
    return Peak(allocation, best, best_step, tuple(buffers))


def _split_key(key: str) -> tuple[str, tuple[int, ...]]:
    name, index = key.split("{", 1)
    return name, tuple(ints(index))


def _origin(m: Module, name: str, index: tuple[int, ...], seen: frozenset = frozenset()) -> Instr | None:
    """The instruction that computed value `name{index}`, through aliases and loop carries."""
    i = m.instr.get(name)
    if i is None or (name, index) in seen:
        return i
    seen = seen | {(name, index)}
    if i.opcode == "get-tuple-element":
        return _origin(m, i.operands[0], (int(re.search(r"index=(\d+)", i.attrs).group(1)), *index), seen)
    if i.opcode == "tuple" and index:
        return _origin(m, i.operands[index[0]], index[1:], seen)
    if i.opcode in _ALIAS:
        return _origin(m, i.operands[0], index, seen)
    if i.opcode.endswith("-start") and len(index) >= 2 and index[0] == 0 and i.result.startswith("(("):
        return _origin(m, i.operands[index[1]], index[2:], seen)  # an operand slot of an async start
    loop = i if i.opcode == "while" else None
    if i.opcode == "parameter" and i.computation != m.entry:
        loop = next((c for c in m.callers.get(i.computation, []) if c.opcode == "while"), None)
    if loop is not None:
        body = re.search(r"\bbody=%?([\w.\-]+)", loop.attrs)
        root = m.root(body.group(1)) if body else None
        found = _origin(m, root.name, index, seen) if root is not None else None
        if found is None or found.opcode == "parameter" or found.opcode == "while":
            found = _origin(m, loop.operands[0], index, seen)  # carried unchanged: the initial value
        return found
    return i


def _sliced(m: Module, i: Instr) -> Instr | None:
    """What `i` slices: a `slice`'s operand, or that of a fusion whose root slices one of its parameters
    (XLA:GPU's `wrapped_slice`, as it cuts a combined all-reduce's flat result into its grads); None for
    anything else."""
    if i.opcode == "slice" and i.operands:
        return m.instr.get(i.operands[0])
    root = m.root(i.called[0]) if i.opcode == "fusion" and i.called else None
    param = m.instr.get(root.operands[0]) if root is not None and root.opcode == "slice" and root.operands else None
    if param is None or param.opcode != "parameter" or not param.operands[0].isdigit():
        return None
    k = int(param.operands[0])
    return m.instr.get(i.operands[k]) if k < len(i.operands) else None


def _is_reduction(m: Module, i: Instr | None) -> bool:
    """`i` is an all-reduce or reduce-scatter (sync, -start/-done, or an async wrapper's start/done), or a
    slice of one's result (`_sliced`)."""
    while i is not None:
        if i.opcode in ("async-done", "async-update") and i.operands:
            i = m.instr.get(i.operands[0])
        elif (whole := _sliced(m, i)) is not None:
            i = whole
        else:
            break
    if i is None:
        return False
    if i.opcode == "async-start":
        return any(j.opcode in _REDUCTIONS for c in i.called for j in m.computations.get(c, []))
    return re.sub(r"-(start|done)$", "", i.opcode) in _REDUCTIONS


def _written(m: Module, i: Instr) -> Instr | None:
    """What a dynamic-update-slice (or a fusion whose root is one) writes into its buffer: the
    origin of its update operand (as the per-unit reduce-scatters fill a stacked [L, ...] grad
    buffer one layer at a time inside the layer loop); None for anything else."""
    if i.opcode == "dynamic-update-slice" and len(i.operands) > 1:
        return _origin(m, i.operands[1], ())
    root = m.root(i.called[0]) if i.opcode == "fusion" and i.called else None
    if root is None or root.opcode != "dynamic-update-slice" or len(root.operands) < 2:
        return None
    u = m.instr.get(root.operands[1])
    while u is not None and u.opcode in ("bitcast", "copy", "convert", "reshape") and u.operands:
        u = m.instr.get(u.operands[0])
    if u is None or u.opcode != "parameter" or not u.operands[0].isdigit() or int(u.operands[0]) >= len(i.operands):
        return None
    return _origin(m, i.operands[int(u.operands[0])], ())


def _reduced(m: Module, i: Instr | None) -> bool:
    """`i` is a reduction, or a dynamic-update-slice writing one (`_written`)."""
    return i is not None and (_is_reduction(m, i) or _is_reduction(m, _written(m, i)))


def _classify(m: Module, key, size, shape, param_shapes, seq_len, attention_elements) -> Buffer:
    name, index = _split_key(key)
    o = _origin(m, name, index) or Instr(name, "", "", (), "", "", False)
    op_name = re.search(r'op_name="((?:[^"\\]|\\.)*)"', o.attrs)
    op_name = op_name.group(1) if op_name else ""
    frame = re.search(r"stack_frame_id=(\d+)", o.attrs)
    function = m.functions.get(int(frame.group(1)), "") if frame else ""
    value_dims = dims(shape)
    backward = "transpose(" in op_name and "rematted_computation" not in op_name
    grad_code = function.startswith(GRAD_CODE)
    scores = (
        attention_elements is not None
        and sum(d == seq_len for d in value_dims) >= 2
        and math.prod(value_dims) >= attention_elements
    )
    if "attention" in function.lower() and scores:
        category = "attention"
    elif _reduced(m, o) or (grad_code and any(_reduced(m, _origin(m, p, ())) for p in o.operands)):
        category = "reduced_grads"
    elif (grad_code and any(d != 1 for d in value_dims)) or (backward and _squeezed(value_dims) in param_shapes):
        category = "local_grads"
    elif ("jvp(" in op_name and "transpose(" not in op_name) or "rematted_computation" in op_name:
        category = "activations"
    elif backward:
        category = "backward"
    else:
        category = "other"
    shape = shape.split("{")[0] if not shape.startswith("(") else shape[:60]
    return Buffer(key, size, shape, category, o.name, op_name, function)


def _squeezed(dims) -> tuple[int, ...]:
    """A shape's dims other than 1, sorted: how a param's shape is matched whatever XLA's layout."""
    return tuple(sorted(d for d in dims if d != 1))


# --------------------------------------------------------------------------- a compiled step


def _param_shapes(c) -> set[tuple[int, ...]]:
    """Sorted non-1 dims of each param's tp-local shape, and of one layer of it (leading dim dropped)."""
    import jax

    mesh = c.run.mesh
    out = set()
    for t in jax.tree.leaves(c.run.zero.plan.tensors):
        spec = tuple(t.tp_spec) + (None,) * (len(t.shape) - len(t.tp_spec))
        local = [
            d // math.prod(mesh.shape[a] for a in entry_axes(e))
            for d, e in zip(t.shape, spec)
        ]
        out |= {_squeezed(local), _squeezed(local[1:] if len(local) > 1 else local)}
    return out


def peak_report(c, largest: int = 5) -> dict:
    """The `peak` entry of `jzero hlo --json` for one compiled step (docs/inspect.md)."""
    cfg = c.cfg
    if c.dump is None:
        raise ValueError("the step was compiled without XLA's dump: compile_step(..., dump=True)")
    tp = c.run.mesh.shape.get("tp", 1)
    rows_per_rank = cfg.train.global_batch // (cfg.dp_domain_size * cfg.train.microbatches)
    p = peak(
        c.dump.buffer_assignment,
        c.dump.live_range,
        c.dump.hlo,
        param_shapes=_param_shapes(c),
        seq_len=cfg.model.seq_len,
        attention_elements=protocol.attention_elements(c.run.model, max(rows_per_rank, 1), tp),
    )
    return {
        "temp_bytes": c.compiled.memory_analysis().temp_size_in_bytes,
        "allocation_bytes": p.allocation_bytes,
        "live_bytes": p.live_bytes,
        "by_category": p.by_category(),
        "largest": [dataclasses.asdict(b) for b in p.buffers[:largest]],
    }


def format_lines(s: dict) -> list[str]:
    """The `jzero hlo` text's line on one strategy's temp memory at its peak."""
    h, pk = hlo._human, s["peak"]
    parts = ", ".join(f"{k} {h(v)}" for k, v in pk["by_category"].items() if v >= 1024)
    gap = pk["allocation_bytes"] - pk["live_bytes"]
    return [
        f"  temp at its peak {h(pk['live_bytes'])} of XLA's {h(pk['temp_bytes'])}"
        f"{f' ({h(gap)} fragmentation)' if gap >= 2**20 else ''}: {parts or 'nothing'}"
    ]
