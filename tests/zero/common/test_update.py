"""jzero.zero.common.update: Megatron's optimizer step on fp32 grads and main params: the global norm, its
clipping, the inner optax transformation, loss scaling's unscale-and-skip, and the cast to the model copy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import pytree
from jzero.zero.common import groups as groups_lib
from jzero.zero.common import loss_scale as scaler
from jzero.zero.common.groups import GroupValues
from jzero.zero.common.state import ZeroState
from jzero.zero.common.update import clip_coefficient, finish, kept_main, model_copy, optimizer_step
from jzero.zero.config import DynamicLossScale

INNER = optax.adam(1e-2)


def grads(seed: int = 1, scale: float = 1.0) -> dict:
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(scale * rng.standard_normal(s), jnp.float32) for k, s in pytree.SHAPES.items()}


def step(g, main, state, clip_grad=None, loss_scale=None, groups=None, inner=INNER):
    return optimizer_step(
        inner, g, main, state, global_norm=optax.tree.norm, nonfinite=scaler.found_inf,
        clip_grad=clip_grad, loss_scale=loss_scale, groups=groups,
    )  # fmt: skip


@pytest.mark.parametrize("clip_grad", [None, 0.5, 1e6])
def test_the_step_is_optax_on_grads_clipped_by_megatrons_coefficient(clip_grad):
    main, g = pytree.init_params(), grads()
    norm = np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in g.values()))  # every element once
    coeff = 1.0 if clip_grad is None else min(1.0, clip_grad / (norm + 1e-6))
    updates, want_state = INNER.update({k: x * coeff for k, x in g.items()}, INNER.init(main), main)
    want = optax.apply_updates(main, updates)
    got = step(g, main, ZeroState(None, INNER.init(main)), clip_grad)
    np.testing.assert_allclose(float(got.norm), norm, rtol=1e-6)  # the norm before clipping
    assert got.skip is None
    for k in pytree.SHAPES:
        np.testing.assert_allclose(got.main[k], want[k], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got.inner_state[0].mu[k], want_state[0].mu[k], rtol=1e-6, atol=1e-9)
    assert (coeff < 1.0) == (clip_grad == 0.5)  # the cases: clipped, and a threshold above the norm
    if clip_grad is not None:
        np.testing.assert_allclose(float(clip_coefficient(got.norm, clip_grad)), coeff, rtol=1e-6)


def test_loss_scaled_grads_step_as_the_unscaled_ones_and_an_inf_skips_everything():
    cfg = DynamicLossScale(initial_loss_scale=2.0**12, hysteresis=1)
    main, g = pytree.init_params(), grads()
    state = ZeroState(None, INNER.init(main), scaler.init(cfg))
    plain = step(g, main, ZeroState(None, INNER.init(main)))
    scaled = step({k: x * 2.0**12 for k, x in g.items()}, main, state, loss_scale=cfg)
    assert not bool(scaled.skip)
    for k in pytree.SHAPES:  # a power-of-2 scale: unscaling is exact
        np.testing.assert_array_equal(scaled.main[k], plain.main[k])
    bad = g | {"s": g["s"].at[1, 2, 3].set(jnp.inf)}
    skipped = step(bad, main, state, loss_scale=cfg)
    assert bool(skipped.skip)
    new_params = model_copy(skipped.main, {k: jnp.float32 for k in main})
    params, new_state, metrics = finish(cfg, skipped, main, state, new_params, ZeroState(None, skipped.inner_state))
    for a, b in zip(jax.tree.leaves((params, new_state.inner_state)), jax.tree.leaves((main, state.inner_state))):
        np.testing.assert_array_equal(a, b)  # params, moments and Adam's count: the old ones
    assert float(metrics["skipped"]) == 1.0 and float(metrics["loss_scale"]) == 2.0**12
    assert float(new_state.grad_scaler.loss_scale) == 2.0**11  # hysteresis 1: backed off at once


def test_param_groups_reach_the_inner_transformation_laid_out_like_the_grads():
    main, g = pytree.init_params(), grads()
    inner = groups_lib.adamw(1e-2, weight_decay=0.1)
    lr = {k: 0.0 if k == "w" else 1.0 for k in pytree.SHAPES}
    wd = {k: 0.0 if k == "bias" else 1.0 for k in pytree.SHAPES}
    got = step(g, main, ZeroState(None, inner.init(main)), groups=GroupValues(lr, wd), inner=inner)
    np.testing.assert_array_equal(got.main["w"], main["w"])  # lr_mult 0: not moved
    for k, decay in (("bias", 0.0), ("v", 0.1)):
        tx = optax.adamw(1e-2, weight_decay=decay)
        u, _ = tx.update(g, tx.init(main), main)
        np.testing.assert_allclose(got.main[k], main[k] + u[k], rtol=1e-6, atol=1e-8)


def test_the_model_copy_is_the_main_params_cast():
    main = pytree.init_params()
    copy = model_copy(main, {k: jnp.bfloat16 for k in main})
    for k in main:
        assert copy[k].dtype == jnp.bfloat16
        np.testing.assert_array_equal(copy[k], main[k].astype(jnp.bfloat16))


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_skip_nonfinite_keeps_the_old_params_and_state_bitwise(bad):
    """Megatron's --check-for-nan-in-loss-and-grad: an inf/nan grad norm keeps the old params and optimizer state
    (metric skipped 1); a finite one returns exactly what the step without the guard returns."""
    main, g = pytree.init_params(), grads()
    state = ZeroState(None, INNER.init(main))
    for grad, skipped in ((g, 0.0), (g | {"s": g["s"].at[0, 1, 2].set(bad)}, 1.0)):
        update = step(grad, main, state)
        new_state = ZeroState(None, update.inner_state)
        params, got_state, metrics = finish(None, update, main, state, update.main, new_state, skip_nonfinite=True)
        assert float(metrics["skipped"]) == skipped
        want_params, want_state = (main, state) if skipped else (update.main, new_state)
        jax.tree.map(np.testing.assert_array_equal, (params, got_state), (want_params, want_state))
    unguarded = finish(None, update, main, state, update.main, new_state)
    assert "skipped" not in unguarded[2]  # off: no select, the step as before


@pytest.mark.parametrize("bad", [None, jnp.nan])
def test_kept_main_is_the_update_or_where_a_guard_skips_the_old_main_bitwise(bad):
    """The main params the state keeps and the params are made from: the update's, or the old ones on a skip;
    without a guard, the update's as they are (no select in the program)."""
    main, g = pytree.init_params(), grads()
    if bad is not None:
        g = g | {"s": g["s"].at[0, 1, 2].set(bad)}
    state = ZeroState(None, INNER.init(main))
    update = step(g, main, state)
    got = kept_main(None, update, state, main, skip_nonfinite=True)
    jax.tree.map(np.testing.assert_array_equal, got, main if bad is not None else update.main)
    assert kept_main(None, update, state, main) is update.main
