"""What XLA scheduled around each collective, and what fills temp memory at the peak.

Both are read from the compiled program; nothing runs.

**Overlap** (`read_schedule(compiled.as_text())`). A module printed with `is_scheduled=true` lists
each non-fusion computation's instructions in execution order. XLA:GPU runs a collective
asynchronously as a pair, `all-gather-start` ... `all-gather-done` (also `all-reduce-`,
`collective-permute-`), or `async-start` ... `async-done` around a computation holding
the collective (reduce-scatter, all-to-all; `as_text()` prints that pair as
`reduce-scatter-start` / `reduce-scatter-done`). What XLA placed between the start and its
done, in the same computation, runs while the collective is on the wire: its **window**.
A pair marked `"is_sync":true` (XLA:GPU found nothing to overlap) and a plain collective
(every collective on XLA:CPU) are synchronous and have an empty window. A collective
inside a `while` body (a micro-batch or layer scan) is paired and measured within that
body, once per iteration; `runs` says how often the body runs per step. (A start whose done
is not in its computation, as a pipelined collective's, overlaps the rest of it.)

Compute is counted in **flops of dots and convolutions**: a dot is 2 x (result elements) x
(product of the lhs contracting dims), a convolution 2 x (result elements) x (kernel
elements / output features), a cuBLAS GEMM custom call like a dot; fusions and called
computations count what they contain, a `while` its body x its known trip count
(1 when XLA does not know it), a `conditional` its largest branch. Everything else
(elementwise fusions, reductions, copies) counts 0 flops; the window's instruction count
(all but parameter, constant, tuple, get-tuple-element and bitcast) shows it.
A collective is **exposed** when its window holds no dot or convolution flops.

**Peak** (`peak(buffer_assignment, live_ranges, hlo_text, ...)`), from XLA's dump of the
buffer assignment (`*-buffer-assignment.txt`: which values share the temp allocation, at
which offsets) and of the live ranges (`*-live-range.txt`: each value's [start, end] on
the flattened schedule). The peak is the schedule step where the temp allocation holds the
most bytes of live values (values of one buffer share an offset and count once); its
allocation size is `memory_analysis().temp_size_in_bytes`, and the difference is the
heap's fragmentation. Each live value is traced to the instruction that computed it
(through get-tuple-element, tuple, bitcast, copy, loop-carried while values and async
operand slots) and classified by that instruction's JAX `op_name` and source function
(the innermost frame of its `stack_frame_id`); the first rule that matches wins:

    attention       made in a function named like "attention", two dims of size T and at
                    least `attention_elements` elements (the [B, H, T, T] scores, softmax
                    probabilities, mask and their gradients, not a [B, T, D] output)
    reduced_grads   the result of an all-reduce or reduce-scatter, or jzero's grad code
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
import glob
import math
import os
import re
import tempfile
from collections import Counter
from dataclasses import dataclass

from jzero.inspect import hlo

CATEGORIES = ("local_grads", "reduced_grads", "activations", "attention", "backward", "other")
# Functions of jzero's grad code (spec path: jzero/zero/step.py; flat path: jzero/zero/flat_step.py).
GRAD_CODE = ("reduced_grads", "build_flat_step.<locals>.local_grad_buckets", "build_flat_step.<locals>.grads_body")
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}
_ALIAS = {"bitcast", "copy", "copy-done"}
_REDUCTIONS = {"all-reduce", "reduce-scatter"}


@dataclass(frozen=True)
class Instr:
    """One HLO instruction: name, opcode, result shape text, operand names, attribute text."""

    name: str
    opcode: str
    result: str
    operands: tuple[str, ...]
    attrs: str
    computation: str
    root: bool


class Module:
    """An HLO module's computations (instructions in schedule order), by name.

    Attributes:
      computations: {name: [Instr]}; entry: the entry computation's name.
      scheduled: the module header says `is_scheduled=true`.
      instr: {name: Instr}; callers: {computation: the Instrs that call it}.
      functions: {stack_frame_id: innermost source function name}.
    """

    def __init__(self, text: str):
        self.scheduled = bool(re.search(r"^HloModule [^\n]*is_scheduled=true", text, re.M))
        entry = re.search(r"^ENTRY %?([\w.\-]+)", text, re.M)
        self.computations: dict[str, list[Instr]] = {}
        for comp, lines in hlo._computations(text):
            out = self.computations[comp] = []
            for line in lines:
                parsed = hlo._parse_instruction(line)
                if parsed is not None:
                    name, result, opcode, operands, attrs = parsed
                    names = tuple(o.split()[-1].lstrip("%") for o in hlo._split_top(hlo._COMMENT.sub("", operands)))
                    root = line.lstrip().startswith("ROOT ")
                    out.append(Instr(name, opcode, result, names, attrs, comp, root))
        self.entry = entry.group(1) if entry else next(iter(self.computations), "")
        self.instr = {i.name: i for body in self.computations.values() for i in body}
        self.callers: dict[str, list[Instr]] = {}
        for i in self.instr.values():
            for c in _called(i):
                self.callers.setdefault(c, []).append(i)
        self.functions = _stack_frame_functions(text)

    def root(self, computation: str) -> Instr | None:
        return next((i for i in reversed(self.computations.get(computation, [])) if i.root), None)

    def shape(self, name: str) -> str:
        return self.instr[name].result if name in self.instr else ""


def _called(i: Instr) -> list[str]:
    """Computations an instruction runs (not `to_apply` combiners of reductions, which are scalar)."""
    keys = ("calls", "body", "condition", "true_computation", "false_computation")
    found = [m.group(2) for m in re.finditer(rf"\b({'|'.join(keys)})=%?([\w.\-]+)", i.attrs)]
    if i.opcode == "call":
        found += re.findall(r"\bto_apply=%?([\w.\-]+)", i.attrs)
    for group in re.findall(r"(?:branch_computations|called_computations)=\{([^}]*)\}", i.attrs):
        found += [g.strip().lstrip("%") for g in group.split(",") if g.strip()]
    return found


def _stack_frame_functions(text: str) -> dict[int, str]:
    """{stack_frame_id: function name} from the module's FunctionNames/FileLocations/StackFrames tables."""
    tables: dict[str, dict[int, str]] = {}
    for section in ("FunctionNames", "FileLocations", "StackFrames"):
        body = re.search(rf"^{section}\n(.*?)(?:\n\n|\Z)", text, re.M | re.S)
        rows = body.group(1).splitlines() if body else []
        tables[section] = {int(r.split(None, 1)[0]): r.split(None, 1)[1] for r in rows if r[:1].isdigit()}
    functions = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
    location = {k: int(re.search(r"function_name_id=(\d+)", v).group(1)) for k, v in tables["FileLocations"].items()}
    frames = {k: int(re.search(r"file_location_id=(\d+)", v).group(1)) for k, v in tables["StackFrames"].items()}
    return {k: functions.get(location.get(loc, 0), "") for k, loc in frames.items()}


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def _squeezed(dims) -> tuple[int, ...]:
    """A shape's dims other than 1, sorted: how a param's shape is matched whatever XLA's layout."""
    return tuple(sorted(d for d in dims if d != 1))


def _dims(shape: str) -> tuple[int, ...]:
    arrays = hlo._arrays(shape)
    return arrays[0][1] if arrays else ()


# --------------------------------------------------------------------------- flops


def _own_flops(i: Instr, m: Module) -> float:
    """Flops of a dot, convolution or cuBLAS GEMM; 0 for anything else (module docstring)."""
    if i.opcode == "dot" or (i.opcode == "custom-call" and re.search(r'custom_call_target="__cublas\$', i.attrs)):
        key = r"lhs_contracting_dims=\{([^}]*)\}" if i.opcode == "dot" else r'"lhs_contracting_dimensions":\[([^\]]*)\]'
        contracting = re.search(key, i.attrs)
        lhs = _dims(m.shape(i.operands[0]))
        k = math.prod(lhs[d] for d in _ints(contracting.group(1))) if contracting and lhs else 1
        return 2.0 * math.prod(_dims(i.result)) * k
    labels = re.search(r"dim_labels=\w+_(\w+)->", i.attrs)
    if labels and (i.opcode == "convolution" or i.opcode == "custom-call"):
        kernel = _dims(m.shape(i.operands[1]))
        out_features = kernel[labels.group(1).index("o")] if kernel else 1
        return 2.0 * math.prod(_dims(i.result)) * math.prod(kernel) / max(out_features, 1)
    return 0.0


class Flops:
    """Dot/conv flops per instruction and per computation (memoized; linear in the module)."""

    def __init__(self, m: Module):
        self.m, self._comp = m, {}
        self.unknown_trips: set[str] = set()  # loops without a known trip count

    def trips(self, i: Instr) -> int | None:
        n = re.search(r'"known_trip_count":\{"n":"(\d+)"', i.attrs)
        return int(n.group(1)) if n else None

    def of(self, i: Instr) -> float:
        """Flops of one execution of `i`, including what it calls."""
        called = [self.computation(c) for c in _called(i)]
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
    """

    collective: hlo.Collective
    computation: str
    runs: int
    is_async: bool
    window_flops: float
    window_instructions: int

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
    """

    overlaps: tuple[Overlap, ...]
    step_flops: float
    scheduled: bool
    entry: str
    unknown_trip_counts: int


def read_schedule(hlo_text: str) -> Schedule:
    """The collectives of a compiled module with their windows (module docstring)."""
    m = Module(hlo_text)
    flops = Flops(m)
    by_name = {c.name: c for c in hlo.parse_collectives(hlo_text)}
    by_computation = {c.computation: c for c in by_name.values()}
    runs = _runs(m, flops)
    out = []
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
                collective = next((by_computation[c] for c in _called(i) if c in by_computation), None)
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
                )
            )
    step_flops = flops.computation(m.entry)
    return Schedule(tuple(out), step_flops, m.scheduled, m.entry, len(flops.unknown_trips))


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


# --------------------------------------------------------------------------- peak

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
    attention_elements: int,
) -> Peak:
    """What temp memory holds at its peak (module docstring), from XLA's after-optimizations dump.

    Arguments:
      buffer_assignment, live_range, hlo_text: the `*after_optimizations-buffer-assignment.txt`,
        `*after_optimizations-live-range.txt` and `*after_optimizations.txt` of one compile.
      param_shapes: each param's per-device shape (tp-local; a scanned stack and one layer of it)
        as sorted non-1 dims; a value with one of these is param-shaped.
      seq_len: T; attention_elements: fewest elements of an attention buffer (B x H_tp x T x T).
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
    return name, tuple(_ints(index))


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


def _is_reduction(m: Module, i: Instr | None) -> bool:
    """`i` is an all-reduce or reduce-scatter (sync, -start/-done, or an async wrapper's start/done)."""
    while i is not None and i.opcode in ("async-done", "async-update") and i.operands:
        i = m.instr.get(i.operands[0])
    if i is None:
        return False
    if i.opcode == "async-start":
        return any(j.opcode in _REDUCTIONS for c in _called(i) for j in m.computations.get(c, []))
    return re.sub(r"-(start|done)$", "", i.opcode) in _REDUCTIONS


def _classify(m: Module, key, size, shape, param_shapes, seq_len, attention_elements) -> Buffer:
    name, index = _split_key(key)
    o = _origin(m, name, index) or Instr(name, "", "", (), "", "", False)
    op_name = re.search(r'op_name="((?:[^"\\]|\\.)*)"', o.attrs)
    op_name = op_name.group(1) if op_name else ""
    frame = re.search(r"stack_frame_id=(\d+)", o.attrs)
    function = m.functions.get(int(frame.group(1)), "") if frame else ""
    dims = _dims(shape)
    backward = "transpose(" in op_name and "rematted_computation" not in op_name
    grad_code = function.startswith(GRAD_CODE)
    scores = sum(d == seq_len for d in dims) >= 2 and math.prod(dims) >= attention_elements
    if "attention" in function.lower() and scores:
        category = "attention"
    elif _is_reduction(m, o) or (grad_code and any(_is_reduction(m, _origin(m, p, ())) for p in o.operands)):
        category = "reduced_grads"
    elif (grad_code and any(d != 1 for d in dims)) or (backward and _squeezed(dims) in param_shapes):
        category = "local_grads"
    elif ("jvp(" in op_name and "transpose(" not in op_name) or "rematted_computation" in op_name:
        category = "activations"
    elif backward:
        category = "backward"
    else:
        category = "other"
    shape = shape.split("{")[0] if not shape.startswith("(") else shape[:60]
    return Buffer(key, size, shape, category, o.name, op_name, function)


# --------------------------------------------------------------------------- a compiled step


def dump_after_optimizations(lowered) -> dict[str, str]:
    """Compiles `lowered` (a `jax.stages.Lowered`) with XLA's dump on; its after-optimizations texts.

    The buffer assignment is not in `Compiled`'s API on GPU (`memory_analysis()`'s
    `serialized_buffer_assignment_proto` is empty there, and has no live ranges on CPU), so
    this compiles once more with `compiler_options={"xla_dump_to": tmpdir}`, which changes
    what XLA writes, not what it builds.

    Returns: {"buffer_assignment", "live_range", "hlo"}: the texts `peak` reads.
    """
    suffixes = {
        "buffer_assignment": "after_optimizations-buffer-assignment.txt",
        "live_range": "after_optimizations-live-range.txt",
        "hlo": "after_optimizations.txt",
    }
    out = {}
    with tempfile.TemporaryDirectory(prefix="jzero-xla-dump-") as tmp:
        lowered.compile(compiler_options={"xla_dump_to": tmp})
        for key, suffix in suffixes.items():
            found = sorted(glob.glob(os.path.join(tmp, f"*{suffix}")))
            if not found:
                raise RuntimeError(f"XLA wrote no *{suffix} to its dump directory")
            with open(found[-1]) as f:
                out[key] = f.read()
    return out


def _relower(c):
    """`c`'s step lowered again on the same abstract arguments (shapes, dtypes, shardings)."""
    import jax

    (avals, _), (shardings, _) = c.compiled.in_avals, c.compiled.input_shardings
    return c.run.zero.step.lower(
        *jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), avals, shardings)
    )


def _param_shapes(c) -> set[tuple[int, ...]]:
    """Sorted non-1 dims of each param's tp-local shape, and of one layer of it (leading dim dropped)."""
    import jax

    mesh = c.run.mesh
    out = set()
    for t in jax.tree.leaves(c.run.zero.plan.tensors):
        spec = tuple(t.tp_spec) + (None,) * (len(t.shape) - len(t.tp_spec))
        local = [
            d // math.prod(mesh.shape[a] for a in ((e,) if isinstance(e, str) else (e or ())))
            for d, e in zip(t.shape, spec)
        ]
        out |= {_squeezed(local), _squeezed(local[1:] if len(local) > 1 else local)}
    return out


def _is_dp(axes: tuple[str, ...]) -> bool:
    from jzero.mesh import DENSE_DP_AXES

    return bool(axes) and set(axes) <= set(DENSE_DP_AXES)


def schedule_report(c) -> dict:
    """The `schedule` entry of `jzero hlo --json` for one compiled step (docs/inspect.md)."""
    sch = read_schedule(c.compiled.as_text())
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
    exposed = [r for r in rows if r["exposed"] and _is_dp(tuple(r["axes"]))]
    return {
        "scheduled": sch.scheduled,
        "entry": sch.entry,
        "step_flops": sch.step_flops,
        "unknown_trip_counts": sch.unknown_trip_counts,
        "collectives": rows,
        "exposed_dp_wire_bytes": sum(r["wire_bytes"] for r in exposed),
        "exposed_dp_wire_bytes_per_step": sum(r["wire_bytes"] * r["runs"] for r in exposed),
    }


def peak_report(c, largest: int = 5) -> dict:
    """The `peak` entry of `jzero hlo --json` for one compiled step (docs/inspect.md)."""
    cfg = c.cfg
    texts = dump_after_optimizations(_relower(c))
    tp = c.run.mesh.shape.get("tp", 1)
    rows_per_rank = cfg.train.global_batch // (cfg.dp_domain_size * cfg.train.microbatches)
    t = cfg.model.seq_len
    p = peak(
        texts["buffer_assignment"],
        texts["live_range"],
        texts["hlo"],
        param_shapes=_param_shapes(c),
        seq_len=t,
        attention_elements=max(rows_per_rank, 1) * max(cfg.model.n_heads // tp, 1) * t * t,
    )
    return {
        "temp_bytes": c.compiled.memory_analysis().temp_size_in_bytes,
        "allocation_bytes": p.allocation_bytes,
        "live_bytes": p.live_bytes,
        "by_category": p.by_category(),
        "largest": [dataclasses.asdict(b) for b in p.buffers[:largest]],
    }


def format_lines(s: dict) -> list[str]:
    """A few lines for one strategy of the `jzero hlo` text: DP overlap, exposed bytes, the peak."""
    h, sch = hlo._human, s["schedule"]
    lines = [
        f"  {'DP collective':<17}{'axes':<12}{'where':<10}{'count':>6}{'async':>7}{'exposed':>9}"
        f"{'overlapped flops':>19}{'wire/device':>14}"
    ]
    groups: dict[tuple, list[dict]] = {}
    for r in sch["collectives"]:
        if _is_dp(tuple(r["axes"])):
            where = "step" if r["computation"] == sch["entry"] else f"loop x{r['runs']}"
            groups.setdefault((r["kind"], ",".join(r["axes"]), where), []).append(r)
    for (kind, axes, where), rs in groups.items():
        flops = sum(r["window_flops"] * r["runs"] for r in rs)
        share = flops / sch["step_flops"] if sch["step_flops"] else 0.0
        lines.append(
            f"  {kind:<17}{axes:<12}{where:<10}{len(rs):>6}{sum(r['async'] for r in rs):>7}"
            f"{sum(r['exposed'] for r in rs):>9}{f'{flops:.3g} ({share:.1%})':>19}"
            f"{h(sum(r['wire_bytes'] for r in rs)):>14}"
        )
    exposed, per_step = sch["exposed_dp_wire_bytes"], sch["exposed_dp_wire_bytes_per_step"]
    loops = f" ({h(per_step)} per step with loop runs)" if per_step != exposed else ""
    order = "" if sch["scheduled"] else " NOT a scheduled module: its order may not be the execution order"
    lines.append(
        f"  exposed DP wire/device {h(exposed)} of {h(s.get('dp_wire_bytes', 0.0))}{loops}; "
        f"step {sch['step_flops']:.3g} dot/conv flops{order}"
    )
    pk = s["peak"]
    parts = ", ".join(f"{k} {h(v)}" for k, v in pk["by_category"].items() if v >= 1024)
    gap = pk["allocation_bytes"] - pk["live_bytes"]
    lines.append(
        f"  temp at its peak {h(pk['live_bytes'])} of XLA's {h(pk['temp_bytes'])}"
        f"{f' ({h(gap)} fragmentation)' if gap >= 2**20 else ''}: {parts or 'nothing'}"
    )
    return lines
