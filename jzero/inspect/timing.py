"""Time, not only bytes: what a step's exposed DP collectives cost on a GPU pod's links.

From the compiled step's schedule (`overlap.read_schedule`) and the pod's links: each DP
collective's ring wire bytes per device (docs/megatron.md, "Bytes on the wire") over the bandwidth
of the slowest link its replica group crosses: NVLink when every member sits on one host, the
network when they span hosts (a ring that leaves the host is as fast as its network hop). The
exposed part is what the step waits for: per collective, its time beyond the compute in its window
(the window's dot/conv flops at the card's peak), so all of it for a collective with none
(`overlap.Overlap.exposed`) and the excess where a slow link outlasts the matmuls beside it (a
communication-bound step). Collectives XLA keeps in flight together on one link share it (each
computation's schedule is played through, `_stalls`). Beside it, the step's dot/conv flops at the
card's peak are a lower bound on its compute. So a user reads "exposed comm ~ X ms against >= Y ms of compute per step".

Link figures per target (`LINKS`), per GPU and direction, from the vendors' specifications of
the usual systems; `jzero hlo --nvlink-gbs/--network-gbs/--peak-tflops` overrides them:
  H100 SXM / H200 (HGX/DGX): NVLink 4, 900 GB/s bidirectional -> 450 GB/s; one 400 Gb/s
    ConnectX-7 NIC per GPU -> 50 GB/s; dense bf16 989 TFLOP/s.
  A100 SXM 80GB (DGX A100): NVLink 3, 600 GB/s bidirectional -> 300 GB/s; one 200 Gb/s HDR NIC
    per GPU -> 25 GB/s; dense bf16 312 TFLOP/s.
Real collectives reach less than the link rate (NCCL's ring bus bandwidth on 8 x H100 is about
370 GB/s), so these times are lower bounds too: they rank configurations, they do not predict
a profile.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.sharding import Mesh

from jzero.inspect import hlo
from jzero.inspect.overlap import Schedule

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Links:
    """One GPU's links (bytes/s per direction) and peak dense bf16 flop/s."""

    nvlink: float
    network: float
    peak_flops: float


LINKS = {
    "h100": Links(nvlink=450 * GB, network=50 * GB, peak_flops=989e12),
    "h200": Links(nvlink=450 * GB, network=50 * GB, peak_flops=989e12),
    "a100": Links(nvlink=300 * GB, network=25 * GB, peak_flops=312e12),
}


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per step of one compiled step on a pod.

    exposed_s: the DP collectives' time beyond the compute in their windows (module docstring);
    wire_s: all DP collectives, overlapped or not; compute_s: the step's dot/conv flops at peak (a
    lower bound); network_share: the part of `wire_s` on inter-host links.
    """

    exposed_s: float
    wire_s: float
    compute_s: float
    network_share: float

    def line(self) -> str:
        return (
            f"exposed comm ~ {1e3 * self.exposed_s:.3g} ms against >= {1e3 * self.compute_s:.3g} ms of compute "
            f"per step (all DP comm {1e3 * self.wire_s:.3g} ms, {100 * self.network_share:.0f}% of it across hosts)"
        )


def host_of(mesh: Mesh) -> np.ndarray:
    """Per mesh position, the host (process) of its device; a deviceless topology gives each of
    its hosts a process index as a real pod does."""
    return np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)


def crosses_hosts(axes: tuple[str, ...], mesh: Mesh, hosts: np.ndarray) -> bool:
    """Whether a group along `axes` (every other axis fixed) spans more than one host."""
    index = tuple(slice(None) if name in axes else 0 for name in mesh.axis_names)
    return len(np.unique(hosts[index])) > 1


def estimate(sch: Schedule, mesh: Mesh, links: Links) -> Timing:
    """The `Timing` of the schedule `sch` of a step compiled for `mesh` (its devices' hosts): each
    computation's DP collectives played against its matmuls (`_stalls`)."""
    hosts = host_of(mesh)
    wire = network = 0.0
    held: dict[str, list[_OnWire]] = {}
    runs: dict[str, int] = {}
    for o in sch.overlaps:
        axes = hlo.axes_of_groups(o.collective.replica_groups, mesh)
        if not hlo.is_dp_traffic(o.collective.kind, axes):
            continue
        across = crosses_hosts(axes, mesh, hosts)
        per_run = o.collective.wire_bytes / (links.network if across else links.nvlink)
        wire += per_run * o.runs
        network += per_run * o.runs if across else 0.0
        held.setdefault(o.computation, []).append(_OnWire(o.start, o.end, across, per_run, o.window_flops))
        runs[o.computation] = o.runs
    exposed = sum(_stalls(ons, sch.prefix_flops.get(comp), links.peak_flops) * runs[comp] for comp, ons in held.items())
    compute = sch.step_flops / links.peak_flops
    return Timing(exposed, wire, compute, network / wire if wire else 0.0)


@dataclasses.dataclass
class _OnWire:
    """One DP collective of a computation: its start and done positions, link, and seconds alone on it."""

    start: int
    end: int
    across: bool
    seconds: float
    window_flops: float


def _stalls(ons: list[_OnWire], prefix: tuple[float, ...] | None, peak: float) -> float:
    """Seconds one run of a computation waits at its collectives' dones: its instructions in schedule
    order, each taking its dot/conv flops at `peak`, while the collectives started before it move on
    their link, those on one link sharing it equally. A collective alone on its link waits
    max(0, its time - its window's compute), as before the schedule kept two in flight; without the
    computation's flops per position (`prefix` None), each collective is taken alone that way."""
    if prefix is None:
        return sum(max(0.0, o.seconds - o.window_flops / peak) for o in ons)
    left = {id(o): o.seconds for o in ons}
    flying: list[_OnWire] = []

    def advance(dt: float, until: _OnWire | None = None) -> float:
        """Run the links dt seconds (until `until` is off the wire, if given); the seconds that took."""
        spent = 0.0
        while flying and (dt > 0 if until is None else until in flying):
            share = {a: sum(o.across == a for o in flying) for a in (False, True)}
            step = min(left[id(o)] * share[o.across] for o in flying)
            step = step if until is not None else min(step, dt)
            for o in flying:
                left[id(o)] -= step / share[o.across]
            flying[:] = [o for o in flying if left[id(o)] > 1e-15]
            spent, dt = spent + step, dt - step
        return spent

    starts = {o.start: o for o in ons}
    dones: dict[int, list[_OnWire]] = {}
    for o in ons:
        dones.setdefault(o.end, []).append(o)
    stalled = 0.0
    for n in range(len(prefix)):
        for o in dones.get(n, []):
            stalled += advance(0.0, until=o) if o in flying else 0.0
        if n in starts:
            flying.append(starts[n])
        if n + 1 < len(prefix):
            advance((prefix[n + 1] - prefix[n]) / peak)
    return stalled  # every done is at or before position len(prefix) - 1: none is left flying


@dataclasses.dataclass(frozen=True)
class Overrides:
    """The command line's `--nvlink-gbs`, `--network-gbs` (GB/s per direction) and `--peak-tflops`."""

    nvlink_gbs: float | None = None
    network_gbs: float | None = None
    peak_tflops: float | None = None

    def apply(self, links: Links) -> Links:
        return Links(
            nvlink=links.nvlink if self.nvlink_gbs is None else self.nvlink_gbs * GB,
            network=links.network if self.network_gbs is None else self.network_gbs * GB,
            peak_flops=links.peak_flops if self.peak_tflops is None else self.peak_tflops * 1e12,
        )


DEFAULT = Overrides()  # the target's own figures


def timing_report(target: str, sch: Schedule, mesh: Mesh, overrides: Overrides = DEFAULT) -> dict | None:
    """The `timing` entry of `jzero hlo --json`'s schedule (docs/inspect.md): `Timing`'s fields in
    seconds, the links used (GB/s, TFLOP/s) and the line `jzero hlo` prints; None on a target
    without `LINKS` (cpu: its collectives are memory copies)."""
    if target not in LINKS:
        return None
    links = overrides.apply(LINKS[target])
    t = estimate(sch, mesh, links)
    return {
        **dataclasses.asdict(t),
        "nvlink_gbs": links.nvlink / GB,
        "network_gbs": links.network / GB,
        "peak_tflops": links.peak_flops / 1e12,
        "line": t.line(),
    }
