"""jzero.zero.common.probe: the build-time checks of the inner optax transformation, on a miniature of the
params: the flat path runs only element-wise transformations, and param groups must be read by the chain."""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import pytree
from jzero.errors import ConfigError
from jzero.zero.common import groups
from jzero.zero.common.probe import check_elementwise, check_groups_read, check_runs, transformation_name
from jzero.zero.common.strategies import make_plan
from jzero.zero.config import ParamGroupRule, ShardingStrategy

PLAN = make_plan(pytree.mesh(dp=4), ShardingStrategy.OPTIM, pytree.abstract(), pytree.NO_TP)
DEFAULTS = groups.param_groups(pytree.abstract())  # bias: wd_mult 0
LARGE = {"w": jax.ShapeDtypeStruct((2048, 1024), jnp.float32), "bias": jax.ShapeDtypeStruct((1024,), jnp.float32)}
LARGE_PLAN = make_plan(pytree.mesh(dp=4), ShardingStrategy.OPTIM, LARGE, {"w": P(), "bias": P()})  # never made


@pytest.mark.parametrize(
    "inner, param_groups",
    [
        (optax.adam(1e-2), None),
        (optax.sgd(0.1, momentum=0.9), None),
        (optax.lion(1e-3), None),
        (groups.adamw(1e-2, weight_decay=0.1), DEFAULTS),
    ],
    ids=["adam", "sgd", "lion", "groups.adamw"],
)
def test_element_wise_transformations_pass(inner, param_groups):
    check_elementwise(inner, PLAN, param_groups)
    check_elementwise(inner, LARGE_PLAN, None if param_groups is None else groups.param_groups(LARGE))


def test_a_per_tensor_transformation_is_refused_by_name():
    with pytest.raises(ConfigError) as e:
        check_elementwise(optax.lamb(1e-3), PLAN)
    message = str(e.value)
    assert message.startswith(
        "zero.path=flat needs an element-wise optimizer, and "
        "chain(scale_by_adam, add_decayed_weights, scale_by_trust_ratio, scale) is not: on flat buffer shards"
    )
    assert "Use zero.path=owned" in message and "or zero.path=spec" in message


def _mask_by_size(threshold):
    return optax.adamw(1e-2, weight_decay=0.5, mask=lambda p: jax.tree.map(lambda x: x.size >= threshold, p))


@pytest.mark.parametrize(
    "inner, plan",
    [
        (optax.chain(optax.clip_by_global_norm(30.0), optax.adam(1e-2)), PLAN),  # N(0, 1) grads never reach 30
        (optax.apply_if_finite(optax.adam(1e-2), 3), PLAN),  # skips the whole tree's update on one NaN
        (_mask_by_size(64), PLAN),  # w, v, s (72-120 elements) decayed, bias (6) not; a shard decides by its own size
        (_mask_by_size(10**6), LARGE_PLAN),  # w (2M) decayed, its shards (~0.8M) would not be
        (optax.sm3(1e-2), PLAN),  # element-wise at its first step; its second reads rows' and columns' maxima
        (optax.chain(optax.scale_by_sm3(), optax.scale_by_adam(), optax.scale(-1e-2)), PLAN),
    ],
    ids=["clip-30", "apply-if-finite", "mask-by-size", "mask-by-size-beyond-the-miniature", "sm3", "sm3-then-adam"],
)
def test_a_chain_that_acts_across_elements_only_on_training_grads_or_sizes_is_refused(inner, plan):
    """Chains that were element-wise on the old probe's small N(0, 1) grads of a miniature whose dims
    were cut to 3, and trained silently wrong on the flat path: each rank clipped by its own shard's
    norm, skipped only its own shard, or decided by a shard's size what the chain decides by a param's."""
    with pytest.raises(ConfigError, match="^zero.path=flat needs an element-wise optimizer"):
        check_elementwise(inner, plan)


def test_a_transformation_built_for_the_params_tree_is_refused():
    masked = optax.masked(optax.adam(1e-2), {"w": True, "bias": False, "v": True, "s": True})
    assert transformation_name(masked) == "masked(chain(scale_by_adam, scale))"
    with pytest.raises(
        ConfigError, match=r"^zero.path=flat cannot run masked\(chain\(scale_by_adam, scale\)\): it fails"
    ):
        check_elementwise(masked, PLAN)


def test_groups_the_chain_never_reads_are_refused():
    check_groups_read(groups.adamw(1e-2), PLAN, DEFAULTS)
    check_groups_read(optax.adam(1e-2), PLAN, None)
    check_groups_read(optax.adam(1e-2), PLAN, groups.param_groups(pytree.abstract(), weight_decay_1d=True))  # all 1
    with pytest.raises(
        ConfigError, match=r"^param groups set wd_mult but chain\(scale_by_adam, scale\) never reads it"
    ):
        check_groups_read(optax.adam(1e-2), PLAN, DEFAULTS)
    lr_only = groups.param_groups(pytree.abstract(), weight_decay_1d=True, rules=[ParamGroupRule("w", 0.5)])
    with pytest.raises(ConfigError, match=r"^param groups set lr_mult but .* never reads it: put .*scale_by_lr_mult"):
        check_groups_read(optax.chain(optax.scale_by_adam(), groups.add_decayed_weights(0.1)), PLAN, lr_only)


def test_an_argument_of_the_wrong_type_is_named_as_such_not_as_the_steps_contract():
    """adamw(b1="abc") (`optimizer.optax.args={b1: abc}`) failed inside its update with a TypeError, which the
    message blamed on how a ZeRO step calls update."""
    with pytest.raises(ConfigError, match=r"fails when it steps the params \(TypeError: unsupported operand.*\): "
                       r"check the arguments it was built with$"):  # fmt: skip
        check_runs(optax.adamw(1e-2, b1="abc"), PLAN, None)


@pytest.mark.parametrize(
    "inner",
    [optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau()), optax.polyak_sgd()],
    ids=["reduce_on_plateau", "polyak_sgd"],
)
def test_a_transformation_that_needs_the_loss_is_refused_when_built(inner):
    """Before, the spec path raised optax's TypeError at the first step, the flat path at its probe."""
    check_runs(optax.adam(1e-2), PLAN, None)
    with pytest.raises(ConfigError, match=r"cannot run in a ZeRO step, which calls update\(grads, state, params\) and "
                       r"nothing more \(.*missing 1 required keyword-only argument: 'value'\)"):  # fmt: skip
        check_runs(inner, PLAN, None)
