"""A compiled HLO module as data: its computations, each instruction's operands and callees.

`Module(text)` reads the text of `compiled.as_text()` or of XLA's `*after_optimizations.txt`
dump. A module printed with `is_scheduled=true` lists each non-fusion computation's
instructions in execution order, which `overlap` reads; `peak` traces values through it to the
instruction that computed them. The line-level parsing (computations, instruction lines,
shapes) is `hlo`'s, shared with the collectives parser.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jzero.inspect import hlo

_CALLS = ("calls", "body", "condition", "true_computation", "false_computation")


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

    @property
    def called(self) -> list[str]:
        """Computations it runs (not the `to_apply` combiners of reductions, which are scalar)."""
        found = [m.group(2) for m in re.finditer(rf"\b({'|'.join(_CALLS)})=%?([\w.\-]+)", self.attrs)]
        if self.opcode == "call":
            found += re.findall(r"\bto_apply=%?([\w.\-]+)", self.attrs)
        for group in re.findall(r"(?:branch_computations|called_computations)=\{([^}]*)\}", self.attrs):
            found += [g.strip().lstrip("%") for g in group.split(",") if g.strip()]
        return found


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
            for c in i.called:
                self.callers.setdefault(c, []).append(i)
        self.functions = _stack_frame_functions(text)

    def root(self, computation: str) -> Instr | None:
        return next((i for i in reversed(self.computations.get(computation, [])) if i.root), None)

    def shape(self, name: str) -> str:
        return self.instr[name].result if name in self.instr else ""


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


def ints(text: str) -> list[int]:
    """Every integer in `text`: "{1,2}" -> [1, 2]."""
    return [int(x) for x in re.findall(r"\d+", text)]


def dims(shape: str) -> tuple[int, ...]:
    """The dims of a shape's first array: "f32[8,128]{1,0}" -> (8, 128); () for a scalar."""
    arrays = hlo._arrays(shape)
    return arrays[0][1] if arrays else ()
