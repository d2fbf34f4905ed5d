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

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jzero.config import ConfigError, MeshConfig

AXES = ("dp_outer", "dp", "ep", "tp")
DENSE_DP_AXES = ("dp_outer", "dp", "ep")
EXPERT_DP_AXES = ("dp_outer", "dp")
BATCH_AXES = DENSE_DP_AXES
TP_AXIS = "tp"
EP_AXIS = "ep"
OUTER_AXIS = "dp_outer"


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    """A mesh of shape (dp_outer, dp, ep, tp) over `devices` (default: all devices of JAX's
    default backend: the GPUs on a GPU host); `cfg.dp=-1` takes the devices the other axes leave.

    Axis types are Auto so sharding constraints inside jit are honoured (docs/xla.md,
    "Auto axes and sharding constraints").
    """
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


def axes_size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    """Number of ranks in the group spanned by `axes`."""
    return math.prod(mesh.shape[a] for a in axes)


def dp_axes(is_expert: bool) -> tuple[str, ...]:
    """The data-parallel domain of a param: expert params use the expert-DP domain."""
    return EXPERT_DP_AXES if is_expert else DENSE_DP_AXES
