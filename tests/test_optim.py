"""jzero/optim.py: the `optimizer:` section as the chain `build_zero` shards; here any optax optimizer by
name (`optimizer.name: optax`), which must step as the same optax optimizer written by hand. The built-in
optimizers' chains are checked against optax in tests/zero/test_fidelity.py and tests/zero/common/test_groups.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import assert_matches_reference, tiny_config
from jzero.config import load_config
from jzero.errors import ConfigError
from jzero.optim import inner_optimizer, lr_schedule

LION = {"name": "lion", "args": {"b1": 0.9, "b2": 0.98, "weight_decay": 0.1}}


def _updates(tx: optax.GradientTransformation, steps: int = 3) -> list:
    """`tx`'s updates of a small pytree over `steps` steps of fixed grads."""
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "b": jnp.array([0.5, -0.25, 0.125])}
    grads = jax.tree.map(lambda p: jnp.cos(3 * p) + 0.1, params)
    state, out = tx.init(params), []
    for _ in range(steps):
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        out.append(updates)
    return out


def _optax(name: str, args: dict) -> list[str]:
    return ["optimizer.name=optax", f"optimizer.optax.name={name}", f"optimizer.optax.args={args}"]


@pytest.mark.parametrize("name", ["lion", "optax.lion", "optax._src.alias:lion"])
def test_an_optax_optimizer_by_name_is_optax_s_with_the_run_s_schedule(name):
    """A bare name is optax's, a dotted or module:function one any module's: optax.lion with the run's warmup
    and cosine as its learning_rate and the args passed through, step for step."""
    cfg = load_config(None, _optax(name, LION["args"]))
    by_hand = optax.lion(lr_schedule(cfg), b1=0.9, b2=0.98, weight_decay=0.1)
    for a, b in zip(_updates(inner_optimizer(cfg)), _updates(by_hand)):
        jax.tree.map(np.testing.assert_array_equal, a, b)


def test_a_transformation_without_a_learning_rate_is_followed_by_the_schedule():
    """optax.scale_by_lion takes no learning_rate: scaled by the run's schedule after it, it is lion without
    weight decay."""
    cfg = load_config(None, _optax("scale_by_lion", {"b1": 0.9, "b2": 0.98}))
    by_hand = optax.lion(lr_schedule(cfg), b1=0.9, b2=0.98, weight_decay=0.0)
    for a, b in zip(_updates(inner_optimizer(cfg)), _updates(by_hand)):
        jax.tree.map(np.testing.assert_array_equal, a, b)


def test_a_function_that_returns_no_transformation_is_one_line():
    cfg = load_config(None, ["optimizer.name=optax", "optimizer.optax.name=time:time"])
    with pytest.raises(ConfigError, match=r"optimizer.optax.name='time:time' returned a float, not an optax"):
        inner_optimizer(cfg)


@pytest.mark.slow
def test_an_optax_optimizer_by_name_trains_as_plain_optax_on_one_device():
    """jzero's step on one device (its Megatron clipping, the schedule, the lr_mult scaling after lion) against
    optax.lion(schedule, **args) in a plain loop (`helpers.plain_optax`), losses, grad norms and params."""
    cfg = tiny_config(mesh=(1, 1, 1), optimizer={"name": "optax", "optax": LION}, model={"n_layers": 1})
    assert_matches_reference(cfg, devices=jax.devices()[:1])
