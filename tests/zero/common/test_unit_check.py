"""jzero.zero.common.unit_check: the jaxpr check of a ZeRO step's loss refuses one that reads a unit's params
outside `unit`, and names the units whose first call would not run once per step (a loop closing over
them). End to end, through the step, in tests/zero/test_fsdp.py."""

import jax
import jax.numpy as jnp
import pytest

from jzero.errors import ConfigError
from jzero.zero.common.unit_check import check_loss
from jzero.zero.common.units import Hook, UnitParam, unit

HOOK = Hook(dim=None, inner=(), outer=(), outer_scatter=False, gathers=False, to_varying=(), scale=1.0,
            reduce_dtype="float32", reshard=False)  # fmt: skip


def _view(acc=None):
    w = jnp.ones((4,))
    return {"block": {"w": UnitParam(w, jnp.zeros((4,)), HOOK, acc)}, "x": jnp.arange(4.0)}


def _block(p, x):
    return p["w"] * x


def test_a_loss_that_runs_its_units_through_unit_passes():
    def loss(view):
        return unit(_block, view["block"], view["x"]).sum()

    assert check_loss(loss, _view()) == frozenset()


def test_a_loss_that_reads_a_unit_param_outside_unit_is_refused_naming_it():
    def loss(view):
        return unit(_block, view["block"], view["x"]).sum() + jnp.sum(view["block"]["w"].value ** 2)

    with pytest.raises(ConfigError, match=r"reads unit param 'block/w' outside `unit`"):
        check_loss(loss, _view())


def test_a_first_call_in_a_loop_over_a_closed_over_block_is_named():
    """A loop body that closes over a block (its weights shared by every iteration) would add the carry once
    per iteration: the check names it, and the step adds it once, after the backward."""

    def loss(view):
        body = lambda i, x: unit(_block, view["block"], x)  # noqa: E731
        return jax.lax.fori_loop(0, 3, body, view["x"]).sum()

    with pytest.warns(UserWarning, match="block/w"):
        assert check_loss(loss, _view(acc=jnp.zeros((4,)))) == frozenset({"block/w"})


@pytest.mark.parametrize("reads", ["as-arrays", "its-leaves"])
def test_a_loss_that_never_calls_unit_is_refused_naming_units_and_unit(reads):
    """`units=` given and `unit` never called: the model fails on the unit leaves in its own words (a `jnp` op
    on a `UnitParam`, Flax's shape check), or reads their arrays; either way one ConfigError says what to do."""

    def loss(view):
        w = view["block"]["w"] if reads == "as-arrays" else view["block"]["w"].value
        return (jnp.asarray(w) * view["x"]).sum()

    with pytest.raises(ConfigError, match=r"units=.*block/w.*none of them to a unit call.*jzero\.zero\.unit\(fn, "
                                          r"block_params, x\)") as caught:  # fmt: skip
        check_loss(loss, _view())
    assert ("the loss failed with TypeError" in str(caught.value)) == (reads == "as-arrays")
