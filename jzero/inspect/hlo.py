"""The collectives of a compiled XLA program, and what they cost on the wire.

`parse_collectives(compiled.as_text())` reads the post-optimization HLO (where XLA
has placed the collectives) and returns one `Collective` per collective instruction.
Counting follows MaxText's `hlo_test_utils`: an async pair is counted once, at its
`-start` (`all-reduce-start`, `all-gather-start`, `reduce-scatter-start`,
`collective-permute-start`, `all-to-all-start`); the `-done` is skipped. Newer GPU
programs may instead wrap a collective in a generic `async-start(...), calls=%body`:
the wrapper is not a collective opcode, so the collective is counted once, in its body.
Counts are static: a collective inside a `while` body (a `lax.scan` over layers) is
one instruction however many times the loop runs.

Wire cost is the ring algorithm's bytes sent per device (docs/megatron.md, "Bytes on the wire"), for a
full buffer of B bytes over a group of n ranks:

    all-reduce      2(n-1)/n * B      (= reduce-scatter + all-gather)
    reduce-scatter   (n-1)/n * B      B is the full, pre-scatter input
    all-gather       (n-1)/n * B      B is the full, gathered output
    all-to-all       (n-1)/n * B      B is the local operand
    collective-permute         B
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from jax.sharding import Mesh

from jzero.mesh import DENSE_DP_AXES

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")

# Bits per element; sub-byte types are packed (XLA rounds each array up to whole bytes).
_DTYPE_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "f4e2m1fn": 4,
    "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16,
    "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64,
    "c64": 64, "c128": 128, "token": 0,
}  # fmt: skip

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_HEADER = re.compile(r"^\s*(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_ARRAY = re.compile(r"(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[^\]]*)\]")
_OPCODE = re.compile(r"\s*(?P<opcode>[a-z][\w\-]*)\(")
_BARE_IOTA = re.compile(r"\[(?P<reshape>[\d,]+)\](?:T\((?P<perm>[\d,]*)\))?")
_IOTA = re.compile(r"\[(?P<dims>[\d,]*)\]<=\[(?P<reshape>[\d,]*)\](?:T\((?P<perm>[\d,]*)\))?")
_MESH = re.compile(r"mesh\[(?P<axes>[^\]]*)\]")
_MESH_AXIS = re.compile(r"'?(?P<name>[^'=,\s]+)'?\s*=\s*(?P<size>\d+)")
_MESH_REF = re.compile(r"'?(?P<name>[^':,\s]+)'?(?::\((?P<pre>\d+)\)(?P<size>\d+))?")
_COMMENT = re.compile(r"/\*.*?\*/")

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program (bytes are per device).

    Attributes:
      kind: one of `KINDS` (an async `-start` is reported under its plain kind).
      payload_bytes: the full buffer B of the ring formulas: all-reduce, all-to-all and
        collective-permute: the operand bytes; reduce-scatter: the input (pre-scatter,
        full) bytes; all-gather: the output (gathered, full) bytes. A combined
        collective over several arrays sums them.
      dtype: element type of the operands ("f32"; "bf16,f32" if combined over several).
      shapes: the operand shapes, one per array (what each device puts in).
      group_size: ranks per replica group (2 for a collective-permute: one pair).
      replica_groups: the groups as logical device ids (see `axes_of_groups`); for a
        collective-permute, its (source, target) pairs.
      name: the instruction's name in the HLO text.
      computation: the computation holding it (the entry, a loop body, an async body).
      array_dtypes: the element type of each array of `shapes` (a combined collective's apart).
    """

    kind: str
    payload_bytes: int
    dtype: str
    shapes: tuple[Shape, ...]
    group_size: int
    replica_groups: tuple[tuple[int, ...], ...]
    name: str = ""
    computation: str = ""
    array_dtypes: tuple[str, ...] = ()

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends for this collective under a ring algorithm."""
        return ring_wire_bytes(self.kind, self.payload_bytes, self.group_size)

    def wire_bytes_of(self, dtypes: Iterable[str]) -> float:
        """The part of `wire_bytes` carried by its arrays of element type in `dtypes` (e.g. "s8")."""
        part = sum(_array_bytes(d, dims) for d, dims in zip(self.array_dtypes, self.shapes) if d in set(dtypes))
        if self.kind == "all-gather":  # the gathered (output) bytes, as `payload_bytes`
            part *= self.group_size
        return ring_wire_bytes(self.kind, part, self.group_size)


def ring_wire_bytes(kind: str, buffer_bytes: float, n: int) -> float:
    """Bytes sent per device by a ring `kind` over `n` ranks on a full buffer of `buffer_bytes`."""
    if kind == "collective-permute":
        return float(buffer_bytes)
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {KINDS}")
    if n <= 1:
        return 0.0
    factor = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
    return factor * buffer_bytes


# --------------------------------------------------------------------------- parsing


def parse_collectives(hlo_text: str, *, num_devices: int | None = None) -> list[Collective]:
    """The collectives of an HLO module, in text order.

    Arguments:
      hlo_text: HLO module text, normally `jax.jit(f).lower(...).compile().as_text()`.
      num_devices: size of the group meant by an empty `replica_groups={}`; by default
        it is read from the module header (`num_partitions`, `replica_count`).

    Returns:
      One `Collective` per collective instruction (async pairs once, see module doc).
    """
    replicas, partitions = _module_counts(hlo_text)
    out = []
    for computation, lines in _computations(hlo_text):
        shapes: dict[str, str] = {}
        for line in lines:
            parsed = _parse_instruction(line)
            if parsed is None:
                continue
            name, result, opcode, operands, attrs = parsed
            shapes[name] = result
            kind = opcode.removesuffix("-start")
            if kind not in KINDS:  # includes every `-done`
                continue
            arrays = _operand_arrays(operands, shapes)
            if kind == "collective-permute":
                arrays = arrays[:1]  # in-place permutes also pass output buffers and offsets
            groups = _replica_groups(attrs, kind)
            if groups is None:  # `replica_groups={}`: everyone, per the group mode
                total = num_devices or _empty_group_size(attrs, replicas, partitions)
                groups = (tuple(range(total)),)
            n = 2 if kind == "collective-permute" else max(len(g) for g in groups)
            operand_bytes = sum(_array_bytes(dtype, dims) for dtype, dims in arrays)
            payload = operand_bytes * n if kind == "all-gather" else operand_bytes
            dtypes = ",".join(sorted({dtype for dtype, _ in arrays}))
            out.append(
                Collective(
                    kind=kind,
                    payload_bytes=payload,
                    dtype=dtypes,
                    shapes=tuple(dims for _, dims in arrays),
                    group_size=n,
                    replica_groups=groups,
                    name=name,
                    computation=computation,
                    array_dtypes=tuple(dtype for dtype, _ in arrays),
                )
            )
    return out


def _module_counts(hlo_text: str) -> tuple[int, int]:
    header = next((ln for ln in hlo_text.splitlines() if ln.startswith("HloModule")), "")
    replicas = re.search(r"replica_count=(\d+)", header)
    partitions = re.search(r"num_partitions=(\d+)", header)
    return (int(replicas.group(1)) if replicas else 1, int(partitions.group(1)) if partitions else 1)


def _empty_group_size(attrs: str, replicas: int, partitions: int) -> int:
    # XLA's CollectiveOpGroupMode: global ids span replicas x partitions; a channel id
    # alone means cross-partition; neither means cross-replica.
    if "use_global_device_ids=true" in attrs:
        return replicas * partitions
    return partitions if "channel_id=" in attrs else replicas


def _computations(hlo_text: str) -> list[tuple[str, list[str]]]:
    """[(computation name, instruction lines)]; text without headers is one computation."""
    comps: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    loose: list[str] = []
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and " = " not in line and not line.lstrip().startswith("HloModule"):
            current = []
            comps.append((header.group("name"), current))
        elif line.strip() == "}" and current is not None:
            current = None
        elif current is not None:
            current.append(line)
        else:
            loose.append(line)
    if not comps:
        comps.append(("", loose))
    return comps


def _balanced(text: str, start: int, open_: str, close: str) -> int:
    """Index just past the bracket closing the one at `text[start]`."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced {open_}{close} in HLO: {text[start : start + 120]!r}")


def _parse_instruction(line: str) -> tuple[str, str, str, str, str] | None:
    """(name, result shape, opcode, operand text, attribute text) of an instruction line."""
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    rest = match.group("rest")
    if rest.startswith("("):
        end = _balanced(rest, 0, "(", ")")
    else:
        end = len(rest.split(None, 1)[0]) if rest.strip() else 0
    result, after = rest[:end], rest[end:]
    opcode = _OPCODE.match(after)
    if opcode is None:
        return None
    open_at = opcode.end() - 1
    close_at = _balanced(after, open_at, "(", ")")
    return match.group("name"), result, opcode.group("opcode"), after[open_at + 1 : close_at - 1], after[close_at:]


def _arrays(shape: str) -> list[tuple[str, Shape]]:
    """[(dtype, dims)] of every array in a (possibly tuple) shape string."""
    found = []
    for m in _ARRAY.finditer(shape):
        dims = tuple(int(re.sub(r"\D", "", d)) for d in m.group("dims").split(",") if d.strip())
        found.append((m.group("dtype"), dims))
    return found


def _array_bytes(dtype: str, dims: Shape) -> int:
    bits = 8 if dtype.startswith("f8") else _DTYPE_BITS.get(dtype)
    if bits is None:
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return math.ceil(math.prod(dims) * bits / 8)


def _split_top(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _operand_arrays(operands: str, shapes: dict[str, str]) -> list[tuple[str, Shape]]:
    """Operand arrays, from inline shapes (`f32[8] %x`) or the defining instruction."""
    arrays = []
    for operand in _split_top(_COMMENT.sub("", operands)):
        inline = _arrays(operand.rsplit("%", 1)[0]) if " " in operand else []
        if inline:
            arrays.extend(inline)
            continue
        name = operand.split()[-1].lstrip("%")
        if name not in shapes:
            raise ValueError(f"collective operand {name!r} is not defined before its use")
        arrays.extend(_arrays(shapes[name]))
    return arrays


def _replica_groups(attrs: str, kind: str) -> tuple[tuple[int, ...], ...] | None:
    """The groups of a collective's attributes; None for `replica_groups={}`."""
    key = "source_target_pairs=" if kind == "collective-permute" else "replica_groups="
    at = attrs.find(key)
    if at < 0:
        return None if kind != "collective-permute" else ()
    text = attrs[at + len(key) :]
    if text.startswith("{"):
        body = text[1 : _balanced(text, 0, "{", "}") - 1]
        groups = tuple(tuple(int(x) for x in g.split(",") if x.strip()) for g in re.findall(r"\{([^{}]*)\}", body))
        return groups if groups or kind == "collective-permute" else None
    if text.startswith("["):
        iota = _IOTA.match(text)
        if iota is None:
            raise ValueError(f"cannot parse replica groups {text[:80]!r}")
        return tuple(tuple(int(x) for x in row) for row in _iota_array(iota))
    if text.startswith("mesh["):
        return _mesh_groups(text)
    if text.startswith("maximal_mesh["):
        device = int(re.match(r"maximal_mesh\[device_id=(\d+)\]", text).group(1))
        return ((device,),)
    raise ValueError(f"cannot parse replica groups {text[:80]!r}")


def _ints(text: str | None) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()] if text else []


def _iota_array(iota: re.Match) -> np.ndarray:
    """`[2,4]<=[4,2]T(1,0)`: iota over `reshape`, transposed by `perm`, reshaped to `dims`."""
    reshape = _ints(iota.group("reshape"))
    perm = _ints(iota.group("perm")) or list(range(len(reshape)))
    return np.arange(math.prod(reshape)).reshape(reshape).transpose(perm).reshape(_ints(iota.group("dims")))


def _mesh_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """Expand XLA's mesh-axes form `mesh['a'=4,'b'=2] {'a'}` into explicit groups.

    Follows `MeshAxesReplicaGroupList::flattened_replica_groups`: reshape the mesh's
    device array to its axes (sub-axes `'a':(pre)size` split an axis into
    [pre, size, rest]), move the grouped axes last in the order listed, and read
    consecutive runs of group-size devices.
    """
    mesh = _MESH.match(text)
    axes = [(m.group("name"), int(m.group("size"))) for m in _MESH_AXIS.finditer(mesh.group("axes"))]
    rest = text[mesh.end() :]
    ids = re.match(r",\s*device_ids=\(", rest)
    if ids:
        close = _balanced(rest, ids.end() - 1, "(", ")")
        inner = rest[ids.end() : close - 1]
        iota, bare = _IOTA.search(inner), _BARE_IOTA.fullmatch(inner.strip())
        if iota:
            devices = _iota_array(iota).ravel()
        elif bare:  # `[4,2]T(1,0)`: an iota over [4,2], transposed, flattened
            reshape = _ints(bare.group("reshape"))
            perm = _ints(bare.group("perm")) if bare.group("perm") is not None else list(range(len(reshape)))
            devices = np.arange(math.prod(reshape)).reshape(reshape).transpose(perm).ravel()
        else:
            devices = np.array(_ints(re.sub(r"devices=\[[\d,]*\]", "", inner)))
        rest = rest[close:]
    else:
        devices = np.arange(math.prod(size for _, size in axes))
    brace = rest.index("{")
    names = [name for name, _ in axes]
    refs = []  # (mesh axis, pre-size, size) per grouped (sub-)axis, in listed order
    for m in _MESH_REF.finditer(rest[brace + 1 : _balanced(rest, brace, "{", "}") - 1]):
        axis = names.index(m.group("name"))
        pre, size = (int(m.group("pre")), int(m.group("size"))) if m.group("size") else (1, axes[axis][1])
        refs.append((axis, pre, size))
    # Split each referenced mesh axis at the boundaries of its sub-axes (major to minor).
    split: dict[int, list[int]] = {}
    sub_dim: dict[tuple[int, int], int] = {}
    for axis in {a for a, _, _ in refs}:
        dims, covered = [], 1
        for _, pre, size in sorted(r for r in refs if r[0] == axis):
            if pre > covered:
                dims.append(pre // covered)
                covered = pre
            sub_dim[(axis, pre)] = len(dims)
            dims.append(size)
            covered *= size
        if covered < axes[axis][1]:
            dims.append(axes[axis][1] // covered)
        split[axis] = dims
    flat_dims: list[int] = []
    offset = {}
    for axis, (_, size) in enumerate(axes):
        offset[axis] = len(flat_dims)
        flat_dims.extend(split.get(axis, [size]))
    grouped = [offset[axis] + sub_dim[(axis, pre)] for axis, pre, _ in refs]
    order = [d for d in range(len(flat_dims)) if d not in grouped] + grouped
    group_size = math.prod(flat_dims[d] for d in grouped)
    array = devices.reshape(flat_dims).transpose(order).reshape(-1, group_size)
    return tuple(tuple(int(x) for x in row) for row in array)


# --------------------------------------------------------------------------- meaning


def axes_of_groups(replica_groups: Iterable[Sequence[int]], mesh: Mesh, *, ids: str = "partition") -> tuple[str, ...]:
    """The mesh axes along which the members of a replica group differ.

    Arguments:
      replica_groups: groups of ids as in `Collective.replica_groups`.
      mesh: the mesh the program was compiled for.
      ids: how to read an id. "partition" (default): a logical id, the index into
        `mesh.devices.flat`. This is what SPMD programs print, with or without
        `use_global_device_ids` (seen: a mesh over reversed devices still prints
        `{{0,2,4,6},...}`); for meshes built as `np.asarray(jax.devices()).reshape(...)`
        it equals the device id. "device": a device id `d.id`, looked up in the mesh.

    Returns:
      Axis names in mesh order; () when every group is a single device.
    """
    shape = mesh.devices.shape
    if ids == "device":
        index = {d.id: i for i, d in enumerate(mesh.devices.flat)}
    elif ids != "partition":
        raise ValueError(f"ids must be 'partition' or 'device', got {ids!r}")
    varying = np.zeros(len(shape), dtype=bool)
    for group in replica_groups:
        if ids == "device":
            missing = [g for g in group if g not in index]
            if missing:
                raise ValueError(f"device ids {missing} are not in the mesh")
            group = [index[g] for g in group]
        if any(not 0 <= g < mesh.devices.size for g in group):
            raise ValueError(f"replica group {tuple(group)} indexes outside a mesh of {mesh.devices.size} devices")
        coords = np.array(np.unravel_index(list(group), shape)).reshape(len(shape), -1)
        varying |= (coords != coords[:, :1]).any(axis=1)
    return tuple(name for name, v in zip(mesh.axis_names, varying) if v)


def is_dp_traffic(kind: str, axes: Sequence[str]) -> bool:
    """Whether a collective is data-parallel traffic (grad reductions, param gathers): over DP
    axes only (`DENSE_DP_AXES`, which hold the expert-DP ones) and not an all-to-all, which
    moves a MoE's tokens to their experts and back over ep (activations, not DP)."""
    return kind != "all-to-all" and bool(axes) and set(axes) <= set(DENSE_DP_AXES)


def summarize(collectives: Iterable[Collective], mesh: Mesh) -> list[dict]:
    """One row per (kind, axes): {kind, axes, count, payload_bytes, wire_bytes}.

    Rows are ordered by `KINDS`, then by axes in mesh order; bytes are per device.
    """
    rows: dict[tuple[str, tuple[str, ...]], dict] = {}
    for c in collectives:
        axes = axes_of_groups(c.replica_groups, mesh)
        row = rows.setdefault(
            (c.kind, axes), {"kind": c.kind, "axes": axes, "count": 0, "payload_bytes": 0, "wire_bytes": 0.0}
        )
        row["count"] += 1
        row["payload_bytes"] += c.payload_bytes
        row["wire_bytes"] += c.wire_bytes
    position = {a: i for i, a in enumerate(mesh.axis_names)}
    return sorted(rows.values(), key=lambda r: (KINDS.index(r["kind"]), [position[a] for a in r["axes"]]))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def format_table(rows_by_label: dict[str, list[dict]]) -> str:
    """A plain-text table of `summarize` rows, one block per label (e.g. per strategy)."""
    header = f"{'collective':<20}{'axes':<18}{'count':>6}{'payload':>14}{'wire/device':>14}"
    blocks = []
    for label, rows in rows_by_label.items():
        lines = [f"== {label} ==", header]
        for r in rows:
            axes = ",".join(r["axes"]) or "-"
            lines.append(
                f"{r['kind']:<20}{axes:<18}{r['count']:>6}{_human(r['payload_bytes']):>14}{_human(r['wire_bytes']):>14}"
            )
        total_payload = sum(r["payload_bytes"] for r in rows)
        total_wire = sum(r["wire_bytes"] for r in rows)
        count = sum(r["count"] for r in rows)
        lines.append(f"{'total':<38}{count:>6}{_human(total_payload):>14}{_human(total_wire):>14}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
