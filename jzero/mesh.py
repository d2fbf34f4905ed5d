"""The device mesh and its data-parallel domains.

Axes, outermost first: `dp_outer` (HSDP replicas), `dp`, `ep`, `tp`. As in Megatron:
- dense params are data-parallel over the dense domain `DENSE_DP_AXES`
  (dp_outer x dp x ep: expert-parallel ranks see different tokens, so for a dense
  param they are just more data-parallel ranks);
- expert params are sharded over `ep` and data-parallel over the expert domain
  `EXPERT_DP_AXES` (dp_outer x dp);
- the batch is split over the dense domain.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from jzero.errors import ConfigError

if TYPE_CHECKING:  # JAX is imported where a mesh is made: the CLI reads MeshConfig before JAX starts
    from jax.sharding import Mesh

AXES = ("dp_outer", "dp", "ep", "tp")
DENSE_DP_AXES = ("dp_outer", "dp", "ep")
EXPERT_DP_AXES = ("dp_outer", "dp")
BATCH_AXES = DENSE_DP_AXES
DP_AXIS = "dp"
TP_AXIS = "tp"
EP_AXIS = "ep"
OUTER_AXIS = "dp_outer"
AUTO_DP = -1  # MeshConfig.dp: all the devices the other mesh axes leave


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes; their product must equal the number of devices.

    `dp: -1` (MaxText's convention) takes every device the other axes leave: device count /
    (dp_outer * ep * tp), known only once JAX has started (`resolve`, `jzero.config.resolve_mesh`).
    """

    dp: int = AUTO_DP  # data parallel (dense and expert params); -1 = all remaining devices
    ep: int = 1  # expert parallel; dense params are also data-parallel over it
    tp: int = 1  # tensor parallel (Megatron column/row parallel layers)
    dp_outer: int = 1  # outer data-parallel axis for HSDP (replicas of a sharded group)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value < 1 and not (f.name == "dp" and value == AUTO_DP):
                hint = " or -1 (all remaining devices)" if f.name == "dp" else ""
                raise ConfigError(f"mesh.{f.name}={value} must be >= 1{hint}")

    def resolve(self, n_devices: int) -> MeshConfig:
        """These sizes with `dp=-1` replaced by the devices the other axes leave; unchanged if dp is set.

        Raises:
          ConfigError: `n_devices` is not a multiple of dp_outer * ep * tp.
        """
        if self.dp != AUTO_DP:
            return self
        rest = self.dp_outer * self.ep * self.tp
        if n_devices % rest:
            raise ConfigError(
                f"mesh.dp=-1 (all remaining devices): {n_devices} devices are not a multiple of "
                f"mesh.dp_outer*mesh.ep*mesh.tp = {self.dp_outer}*{self.ep}*{self.tp} = {rest}; set mesh.dp explicitly"
            )
        return dataclasses.replace(self, dp=n_devices // rest)


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    """A mesh of shape (dp_outer, dp, ep, tp) over `devices` (default: all devices of JAX's
    default backend: the GPUs on a GPU host); `cfg.dp=-1` takes the devices the other axes leave.

    Axis types are Auto so sharding constraints inside jit are honoured (docs/xla.md,
    "Auto axes and sharding constraints").
    """
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    devices = jax.devices() if devices is None else devices
    cfg = cfg.resolve(len(devices))
    shape = (cfg.dp_outer, cfg.dp, cfg.ep, cfg.tp)
    if math.prod(shape) != len(devices):
        raise ConfigError(
            f"mesh dp_outer*dp*ep*tp = {cfg.dp_outer}*{cfg.dp}*{cfg.ep}*{cfg.tp} = {math.prod(shape)} "
            f"does not match the {len(devices)} available devices"
        )
    grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes one PartitionSpec entry names: None -> (), "tp" -> ("tp",), ("dp", "tp") as it is."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_axes(spec) -> tuple[str, ...]:
    """The mesh axes a PartitionSpec names, in order."""
    return tuple(a for entry in spec for a in entry_axes(entry))


def axes_size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    """Number of ranks in the group spanned by `axes`."""
    return math.prod(mesh.shape[a] for a in axes)


def dp_axes(is_expert: bool) -> tuple[str, ...]:
    """The data-parallel domain of a param: expert params use the expert-DP domain."""
    return EXPERT_DP_AXES if is_expert else DENSE_DP_AXES
