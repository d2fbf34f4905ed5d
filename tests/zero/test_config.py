"""jzero.zero.config: each type checks itself once, at construction, with one message naming the field;
strings become enums; the strategy says what it shards; the module imports no JAX."""

import math
import subprocess
import sys

import numpy as np
import pytest

from jzero.errors import ConfigError
from jzero.zero.config import (
    DynamicLossScale,
    OuterStrategy,
    ParamGatherDType,
    ParamGroupRule,
    ShardingStrategy,
    StepOptions,
    ZeroConfig,
    ZeroPath,
)


def test_strings_become_enums_and_compare_equal_to_their_values():
    z = ZeroConfig("optim", "flat", outer_strategy="optim", param_gather_dtype="int8")
    assert (z.strategy, z.path, z.outer_strategy) == (ShardingStrategy.OPTIM, ZeroPath.FLAT, OuterStrategy.OPTIM)
    assert z.param_gather_dtype is ParamGatherDType.INT8
    assert z.strategy == "optim" and z == ZeroConfig(
        ShardingStrategy.OPTIM, ZeroPath.FLAT, outer_strategy=OuterStrategy.OPTIM, param_gather_dtype="int8"
    )


@pytest.mark.parametrize(
    "strategy, state, grads, params",
    [
        ("no_shard", False, False, False),
        ("optim", True, False, False),
        ("optim_grads", True, True, False),
        ("optim_grads_params", True, True, True),
    ],
)
def test_each_stage_shards_what_megatrons_table_says(strategy, state, grads, params):
    z = ZeroConfig(strategy)
    assert (z.stage.shards_state, z.stage.shards_grads, z.stage.shards_params) == (state, grads, params)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"strategy": "zero4"},
            "zero.strategy='zero4' is not one of: no_shard, optim, optim_grads, optim_grads_params",
        ),
        ({"path": "tree"}, "zero.path='tree' is not one of: spec, flat, owned"),
        ({"outer_strategy": "optim_grads"}, "zero.outer_strategy='optim_grads' is not one of: no_shard, optim"),
        (
            {"path": "flat", "param_gather_dtype": "fp4"},
            "zero.param_gather_dtype='fp4' is not one of: int8, float8_e4m3fn",
        ),
        ({"bucket_size": 0}, "zero.bucket_size=0 must be positive"),
        ({"offload_fraction": 1.5}, r"zero.offload_fraction=1.5 must be in [0, 1]"),
        ({"offload_fraction": math.nan}, r"zero.offload_fraction=nan must be in [0, 1]"),
        (
            {"param_gather_dtype": "int8"},
            "zero.param_gather_dtype=int8 needs zero.path=flat (the spec path's gathers are XLA's)",
        ),
        (
            {"strategy": "no_shard", "path": "flat", "param_gather_dtype": "int8"},
            "zero.param_gather_dtype=int8: zero.strategy=no_shard gathers no params",
        ),
        (
            {"strategy": "optim_grads_params", "path": "flat", "param_gather_dtype": "int8"},
            "zero.param_gather_dtype=int8 quantizes the gather after the optimizer step; with "
            "zero.strategy=optim_grads_params the params are gathered in the forward instead (in the param dtype)",
        ),
    ],
)
def test_zero_config_refuses_with_one_message_naming_the_key(kwargs, message):
    with pytest.raises(ConfigError) as e:
        ZeroConfig(**kwargs)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"initial_loss_scale": 0.0}, "initial_loss_scale=0.0 must be positive"),
        ({"min_loss_scale": math.inf}, "min_loss_scale=inf must be positive"),
        ({"hysteresis": 0}, "hysteresis=0 must be positive"),
        ({"initial_loss_scale": 2.0, "min_loss_scale": 4.0}, "min_loss_scale=4.0 must be <= initial_loss_scale=2.0"),
        ({"backoff_factor": 1.0}, "need 0 < backoff_factor < 1 < growth_factor, got 1.0 and 2.0"),
        ({"growth_factor": 0.5}, "need 0 < backoff_factor < 1 < growth_factor, got 0.5 and 0.5"),
    ],
)
def test_loss_scale_refuses_with_one_message(kwargs, message):
    with pytest.raises(ConfigError) as e:
        DynamicLossScale(**kwargs)
    assert str(e.value) == message


def test_step_options_normalize_the_dtype_and_refuse_bad_values():
    assert StepOptions(grad_reduce_dtype="bfloat16").grad_reduce_dtype == np.dtype("bfloat16")
    assert StepOptions().grad_reduce_dtype == np.dtype(np.float32)
    with pytest.raises(ConfigError, match=r"^microbatches=0 must be >= 1$"):
        StepOptions(microbatches=0)
    with pytest.raises(ConfigError, match=r"^clip_grad=-1.0 must be positive \(None = no clipping\)$"):
        StepOptions(clip_grad=-1.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"pattern": "blocks/(", "lr_mult": 1.0}, "pattern='blocks/(' is not a regular expression: "),
        ({"pattern": "bias", "lr_mult": math.inf}, "lr_mult=inf must be a finite number"),
        ({"pattern": "bias", "wd_mult": -0.5}, "wd_mult=-0.5 must be >= 0"),
    ],
)
def test_param_group_rule_refuses_with_one_message(kwargs, message):
    with pytest.raises(ConfigError) as e:
        ParamGroupRule(**kwargs)
    assert str(e.value).startswith(message)


def test_the_config_is_read_before_jax_starts():
    """The CLI reads a config before JAX starts (it sets the CPU device count first)."""
    code = "import sys, jzero.zero.config; assert not [m for m in sys.modules if m.split('.')[0] == 'jax']"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
