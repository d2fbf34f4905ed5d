"""ZeRO stages for any JAX model and optax transformation; `build_zero` is the entry.

    jzero/zero/config.py   ZeroConfig and its enums, DynamicLossScale, SpikeGuard, StepOptions, ParamGroupRule (no JAX)
    jzero/zero/build.py    build_zero -> Zero: everything a run needs, resolved once
    jzero/zero/memory.py   per-device bytes: Megatron's formula, and what arrays and shardings hold
    jzero/zero/common/     what both paths share: the sharding plan (strategies), the train state,
                           the optimizer update, param groups, loss scaling, FSDP units, offload
    jzero/zero/spec/       the spec path: sharding specs, XLA emits the collectives
    jzero/zero/flat/       the flat path: Megatron's flat buffers, explicit bucketed collectives

Nothing here knows the model, the CLI or files on disk (docs/design.md). The names below are
imported on first use, so `jzero.zero.config` can be read before JAX starts.
"""

import importlib

_PUBLIC = {
    "Zero": "jzero.zero.build",
    "build_zero": "jzero.zero.build",
    "ZeroConfig": "jzero.zero.config",
    "ShardingStrategy": "jzero.zero.config",
    "OuterStrategy": "jzero.zero.config",
    "ZeroPath": "jzero.zero.config",
    "OwnedBalance": "jzero.zero.config",
    "ParamGatherDType": "jzero.zero.config",
    "DynamicLossScale": "jzero.zero.config",
    "SpikeGuard": "jzero.zero.config",
    "ParamGroupRule": "jzero.zero.config",
    "StepOptions": "jzero.zero.config",
    "TrainState": "jzero.zero.common.state",
    "ZeroState": "jzero.zero.common.state",
    "ModelState": "jzero.zero.common.state",
    "ParamGroup": "jzero.zero.common.groups",
    "param_groups": "jzero.zero.common.groups",
    "store_state_in": "jzero.zero.common.moments",
    "unit": "jzero.zero.common.units",
}
_MODULES = {"groups": "jzero.zero.common.groups", "units": "jzero.zero.common.units"}  # jzero.zero.groups.adamw, ...

__all__ = sorted(_PUBLIC) + sorted(_MODULES)


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'jzero.zero' has no attribute {name!r}")


def __dir__():
    return __all__
