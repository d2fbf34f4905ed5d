"""A step's compute at the card's roofline: what the compiled XLA:GPU program costs with every kernel
at the larger of its matmul time at the card's peak and its HBM traffic at the memory bandwidth.

`timing` counts only the matmuls, at peak: a lower bound that leaves out every elementwise pass, norm,
softmax and optimizer update, which HBM bandwidth bounds. Here each kernel of the schedule (each
instruction of the entry computation and of the loops it runs, times their trip counts) costs

  max(flops / peak, bytes / bandwidth)

  flops: the dots and convolutions in it (fusion bodies included; cuDNN's attention as `overlap`
         counts it); a dot on fp32 operands at half the peak: XLA:GPU runs fp32 dots at TF32 by
         default, half the dense bf16 rate on an A100, H100 or H200;
  bytes: what it reads and writes, its operands and its result; a fusion's operand that it reads only
         through (dynamic) slices or gathers counts as those slices (the rows an embedding lookup or
         a label's logit picks), a dynamic-update-slice into an operand (in place) counts as the
         update written, and a scatter into one (the embedding's grad) as its updates read and written.

The collectives are `timing`'s (their bytes travel the links). No kernel overlaps another here and
none runs below its roofline, so the sum ranks programs and shows where their time goes (matmuls,
or passes over memory); it does not predict a profile: the GPU bench's steps measured on one H200
(2026-11-27, jax 0.11.2) took 1.41-1.43x (LLaMA-3.2-1B's shape) and 1.64-1.78x (GPT-2 small) the
roofline of the same programs compiled deviceless with jax 0.10.2 (docs/inspect.md, "Roofline").
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from jzero.inspect import hlo
from jzero.inspect.hlo_module import Instr, Module
from jzero.inspect.overlap import Flops, _own_flops
from jzero.inspect.targets import TARGETS
from jzero.inspect.timing import LINKS

# Opcodes that move no data through HBM on their own (views, tuples, scheduling tokens) or whose
# bytes go over the links (collectives, `timing`'s).
_FREE = {
    "parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all", "partition-id", "replica-id",
    "opt-barrier", "optimization-barrier", "add-dependency", "copy-start", "copy-done", "send", "send-done",
    "recv", "recv-done",
}  # fmt: skip
_COLLECTIVE = re.compile(r"^(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|ragged-all-to-all)")
_VIEWS = ("bitcast", "convert", "reshape")  # an operand read through these and then sliced is read as the slices
_IN_PLACE = ("dynamic-update-slice", "scatter")  # write into their first operand(s): `_in_place`


def _bytes(shape: str) -> int:
    return sum(hlo._array_bytes(dtype, dims) for dtype, dims in hlo._arrays(shape))


@dataclasses.dataclass(frozen=True)
class Roofline:
    """One compiled step at the roofline (module docstring).

    seconds: the kernels' roofline times summed; dot_flops: the step's dot/conv flops;
    fp32_dot_flops: those on fp32 operands (at half the peak); hbm_bytes: every kernel's reads and
    writes; peak_flops, hbm_bandwidth: the card's (flop/s, bytes/s).
    """

    seconds: float
    dot_flops: float
    fp32_dot_flops: float
    hbm_bytes: float
    peak_flops: float
    hbm_bandwidth: float

    def line(self) -> str:
        fp32 = f", {self.fp32_dot_flops / 1e12:.3g} of them on fp32 operands (TF32: half rate)"
        return (
            f"roofline ~ {1e3 * self.seconds:.4g} ms per step, each kernel at the larger of its matmuls at peak and "
            f"its HBM bytes at {self.hbm_bandwidth / 1e9:.0f} GB/s: {self.dot_flops / 1e12:.3g} TFLOP of matmuls"
            f"{fp32 if self.fp32_dot_flops else ''}, {self.hbm_bytes / 1e9:.3g} GB to and from HBM"
        )


class _Walk:
    """Sums the roofline over a module's schedule (`Flops` gives the loops' trip counts)."""

    def __init__(self, m: Module, peak_flops: float, bandwidth: float):
        self.m, self.trips, self.peak, self.bw = m, Flops(m), peak_flops, bandwidth
        self.dot_flops = self.fp32_flops = self.bytes = 0.0

    def computation(self, name: str, runs: int) -> float:
        return sum(self.instruction(i, runs) for i in self.m.computations.get(name, []))

    def instruction(self, i: Instr, runs: int) -> float:
        if i.opcode == "while":
            body = re.search(r"\bbody=%?([\w.\-]+)", i.attrs)
            trips = self.trips.trips(i) or 1
            return trips * self.computation(body.group(1), runs * trips) if body else 0.0
        if i.opcode == "conditional":  # the costliest branch, counted once, its flops and bytes too
            start = (self.dot_flops, self.fp32_flops, self.bytes)
            branches = []
            for c in i.called:
                self.dot_flops, self.fp32_flops, self.bytes = start
                branches.append((self.computation(c, runs), self.dot_flops, self.fp32_flops, self.bytes))
            seconds, self.dot_flops, self.fp32_flops, self.bytes = max(branches, default=(0.0, *start))
            return seconds
        if i.opcode in ("call", "async-start") and not self._collective(i):
            return sum(self.computation(c, runs) for c in i.called)
        if i.opcode in _FREE or i.opcode.endswith(("-done", "-update")) or self._collective(i):
            return 0.0
        flops, fp32 = self._dots(i)
        read, written = self._fusion_bytes(i) if i.opcode == "fusion" else self._plain_bytes(i)
        self.dot_flops += runs * flops
        self.fp32_flops += runs * fp32
        self.bytes += runs * (read + written)
        return max((flops + fp32) / self.peak, (read + written) / self.bw)  # an fp32 flop takes two

    def _collective(self, i: Instr) -> bool:
        if _COLLECTIVE.match(i.opcode):
            return True
        return i.opcode == "async-start" and any(
            _COLLECTIVE.match(x.opcode) for c in i.called for x in self.m.computations.get(c, [])
        )

    def _dots(self, i: Instr) -> tuple[float, float]:
        """(dot flops, the part on fp32 operands) of `i` and the fusions it calls."""
        own = _own_flops(i, self.m)
        fp32 = own if own and any(self.m.shape(o).startswith("f32") for o in i.operands[:2]) else 0.0
        if i.opcode == "fusion":
            for c in i.called:
                for x in self.m.computations.get(c, []):
                    f, f32 = self._dots(x)
                    own, fp32 = own + f, fp32 + f32
        return own, fp32

    def _plain_bytes(self, i: Instr) -> tuple[int, int]:
        return sum(_bytes(self.m.shape(o)) for o in set(i.operands)), _bytes(i.result)

    def _fusion_bytes(self, i: Instr) -> tuple[float, float]:
        """(read, written) by a fusion: its operands (as slices, where only sliced or gathered) and its
        results (as the updates, where a dynamic-update-slice or scatter writes into an operand in place;
        a scatter's also read)."""
        comp = i.called[0] if i.called else ""
        body = self.m.computations.get(comp, [])
        params = {int(x.operands[0]): x.name for x in body if x.opcode == "parameter" and x.operands[0].isdigit()}
        users = defaultdict(list)
        for x in body:
            for o in x.operands:
                users[o].append(x)
        root = self.m.root(comp)
        roots = [] if root is None else [self.m.instr[o] for o in root.operands] if root.opcode == "tuple" else [root]
        roots = [self._unviewed(r) for r in roots]
        parts = {r.name: self._in_place(r) for r in roots}
        parts = {name: part for name, part in parts.items() if part is not None}
        in_place = {self._unviewed(self.m.instr[b]).name for into, _ in parts.values() for b in into}
        read = 0.0
        for k, operand in enumerate(i.operands):
            p = params.get(k)
            if p in in_place and all(u.opcode in (*_IN_PLACE, "bitcast") for u in users[p]):
                continue  # the buffer written in place (seen through a bitcast too): only its update moves
            sliced = None if p is None else self._sliced(p, users, 0)
            read += _bytes(self.m.shape(operand)) if sliced is None else sliced
        updated = {name: sum(_bytes(self.m.shape(u)) for u in part[1]) for name, part in parts.items()}
        written = sum(updated.get(r.name, _bytes(r.result)) for r in roots)
        read += sum(updated[r.name] for r in roots if r.name in updated and r.opcode == "scatter")  # the old values
        return read, written

    def _in_place(self, r: Instr) -> tuple[list[str], list[str]] | None:
        """(the buffers root `r` writes into in place, what it writes there) for a dynamic-update-slice
        (operand, update, indices...) or a scatter (operands..., indices, updates...) into fusion
        parameters (seen through bitcasts); else None (a buffer made in the fusion is written whole)."""
        ops = r.operands
        if r.opcode == "dynamic-update-slice":
            into, what = ops[:1], ops[1:2]
        elif r.opcode == "scatter":
            n = (len(ops) - 1) // 2
            into, what = ops[:n], ops[n + 1 :]
        else:
            return None
        if all(self._unviewed(self.m.instr[b]).opcode == "parameter" for b in into):
            return into, what
        return None

    def _unviewed(self, x: Instr) -> Instr:
        """`x`, or what it is a bitcast of (a bitcast moves no data)."""
        while x.opcode == "bitcast" and x.operands and x.operands[0] in self.m.instr:
            x = self.m.instr[x.operands[0]]
        return x

    def _sliced(self, name: str, users: dict, depth: int) -> float | None:
        """Bytes of `name` read, if it is read only through (dynamic) slices or gathers (after views), at
        most all of it; else None."""
        if not users[name] or depth > 4:
            return None
        total = 0.0
        for u in users[name]:
            if u.opcode in ("slice", "dynamic-slice", "gather"):  # what it picks, or one of its start indices
                total += _bytes(u.result) if u.operands[0] == name else _bytes(self.m.shape(name))
            elif u.opcode in _VIEWS:
                inner = self._sliced(u.name, users, depth + 1)
                if inner is None:
                    return None
                total += inner * _bytes(self.m.shape(name)) / max(_bytes(u.result), 1)  # in `name`'s dtype
            else:
                return None
        return min(total, _bytes(self.m.shape(name)))  # a gather of repeated rows reads each once, at most


def roofline(hlo_text: str, peak_flops: float, hbm_bandwidth: float) -> Roofline:
    """The compiled module's roofline (module docstring); `peak_flops` the dense bf16 flop/s,
    `hbm_bandwidth` the memory's bytes/s."""
    m = Module(hlo_text)
    walk = _Walk(m, peak_flops, hbm_bandwidth)
    seconds = walk.computation(m.entry, 1)
    return Roofline(seconds, walk.dot_flops, walk.fp32_flops, walk.bytes, peak_flops, hbm_bandwidth)


def roofline_report(target: str, hlo_text: str, peak_tflops: float | None = None) -> dict | None:
    """The `roofline` entry of `jzero hlo --json`'s schedule (docs/inspect.md): `Roofline`'s fields and the
    line `jzero hlo` prints, at the target's peak (`timing.LINKS`, or `peak_tflops`) and HBM bandwidth
    (its target file's `memory_bandwidth`); None on a target without them (cpu)."""
    if target not in LINKS or target not in TARGETS:
        return None
    peak = LINKS[target].peak_flops if peak_tflops is None else peak_tflops * 1e12
    r = roofline(hlo_text, peak, TARGETS[target].hbm_bandwidth)
    return {**dataclasses.asdict(r), "line": r.line()}
