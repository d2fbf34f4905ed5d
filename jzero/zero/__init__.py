"""ZeRO stages for any JAX model and optax transformation; `build_zero` is the entry.

Nothing here knows the model, the CLI or files on disk.
"""

from jzero.zero.build import Zero, build_zero
from jzero.zero.groups import ParamGroup, param_groups
from jzero.zero.loss_scale import DynamicLossScale
from jzero.zero.moments import store_state_in

__all__ = ["DynamicLossScale", "ParamGroup", "Zero", "build_zero", "param_groups", "store_state_in"]
