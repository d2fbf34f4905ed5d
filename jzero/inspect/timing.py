"""Time, not only bytes: what a step's exposed DP collectives cost on a GPU pod's links.

From the compiled step's schedule (`overlap.read_schedule`) and the pod's links: each DP
collective's ring wire bytes per device (docs/megatron.md, "Bytes on the wire") over the bandwidth
of the slowest link its replica group crosses: NVLink when every member sits on one host, the
network when they span hosts (a ring that leaves the host is as fast as its network hop). The
exposed part (collectives with no dot or convolution in their window, `overlap.Overlap.exposed`)
is what the step waits for; beside it, the step's dot/conv flops at the card's peak are a lower
bound on its compute. So a user reads "exposed comm ~ X ms against >= Y ms of compute per step".

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

    exposed_s: the DP collectives with nothing (no dot) to hide behind; wire_s: all DP
    collectives, overlapped or not; compute_s: the step's dot/conv flops at peak (a lower bound);
    network_share: the part of `wire_s` on inter-host links.
    """

    exposed_s: float
    wire_s: float
    compute_s: float
    network_share: float

    def line(self) -> str:
        return (
            f"exposed comm ~ {1e3 * self.exposed_s:.1f} ms against >= {1e3 * self.compute_s:.1f} ms of compute "
            f"per step (all DP comm {1e3 * self.wire_s:.1f} ms, {100 * self.network_share:.0f}% of it across hosts)"
        )


def host_of(mesh: Mesh, gpus_per_host: int) -> np.ndarray:
    """Per mesh position, the host of its device: `mesh.devices.flat` index // gpus per host (the
    deviceless topology numbers its devices host by host)."""
    return np.arange(mesh.devices.size).reshape(mesh.devices.shape) // gpus_per_host


def crosses_hosts(axes: tuple[str, ...], mesh: Mesh, hosts: np.ndarray) -> bool:
    """Whether a group along `axes` (every other axis fixed) spans more than one host."""
    index = tuple(slice(None) if name in axes else 0 for name in mesh.axis_names)
    return len(np.unique(hosts[index])) > 1


def estimate(sch: Schedule, mesh: Mesh, links: Links, gpus_per_host: int) -> Timing:
    """The `Timing` of the schedule `sch` of a step compiled for `mesh` on hosts of `gpus_per_host`."""
    hosts = host_of(mesh, gpus_per_host)
    exposed = wire = network = 0.0
    for o in sch.overlaps:
        axes = hlo.axes_of_groups(o.collective.replica_groups, mesh)
        if not hlo.is_dp_traffic(o.collective.kind, axes):
            continue
        across = crosses_hosts(axes, mesh, hosts)
        seconds = o.collective.wire_bytes * o.runs / (links.network if across else links.nvlink)
        wire += seconds
        network += seconds if across else 0.0
        exposed += seconds if o.exposed else 0.0
    compute = sch.step_flops / links.peak_flops
    return Timing(exposed, wire, compute, network / wire if wire else 0.0)


def gpus_per_host(topology: str) -> int:
    """The `D` of a deviceless topology "S x H x D"."""
    return int(topology.lower().split("x")[-1])


def with_overrides(
    links: Links, nvlink_gbs: float | None, network_gbs: float | None, peak_tflops: float | None
) -> Links:
    """`links` with the command line's overrides (GB/s per direction, TFLOP/s)."""
    return Links(
        nvlink=links.nvlink if nvlink_gbs is None else nvlink_gbs * GB,
        network=links.network if network_gbs is None else network_gbs * GB,
        peak_flops=links.peak_flops if peak_tflops is None else peak_tflops * 1e12,
    )
