"""jzero.zero.common.loss_scale: Megatron's DynamicGradScaler as pure functions: the scale moves by Megatron's
rules, the scaled loss's grads are the scale times the loss's, and a skipped step keeps the old values bitwise."""

import jax
import jax.numpy as jnp
import numpy as np

from helpers import pytree
from jzero.zero.common import loss_scale as scaler
from jzero.zero.common.state import ZeroState
from jzero.zero.common.update import Update, finish
from jzero.zero.config import DynamicLossScale


class MegatronScaler:
    """`DynamicGradScaler.update` of megatron/core/optimizer/grad_scaler.py, in plain Python."""

    def __init__(self, cfg: DynamicLossScale):
        self.cfg, self.scale, self.growth, self.hysteresis = cfg, cfg.initial_loss_scale, 0, cfg.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth = 0
            self.hysteresis -= 1
            if self.hysteresis <= 0:
                self.scale = max(self.scale * self.cfg.backoff_factor, self.cfg.min_loss_scale)
        else:
            self.growth += 1
            if self.growth == self.cfg.loss_scale_window:
                self.growth = 0
                self.hysteresis = self.cfg.hysteresis
                self.scale = self.scale * self.cfg.growth_factor


def test_the_scale_moves_by_megatrons_rules():
    cfg = DynamicLossScale(initial_loss_scale=2.0**10, min_loss_scale=2.0**8, loss_scale_window=3, hysteresis=2)
    flags = [True, True, True, True, False, False, False, False, False, False, True]
    flags += list(np.random.default_rng(0).random(40) < 0.3)
    update = jax.jit(lambda state, inf: scaler.update(cfg, state, inf))
    state, ref, scales = scaler.init(cfg), MegatronScaler(cfg), []
    for inf in flags:
        state = update(state, jnp.asarray(inf))
        ref.update(bool(inf))
        assert (float(state.loss_scale), int(state.growth_tracker)) == (ref.scale, ref.growth)
        assert int(state.hysteresis_tracker) == ref.hysteresis
        scales.append(float(state.loss_scale))
    # The hand-made start: hysteresis 2 absorbs the first inf, the floor stops the backoff, 3 finite steps grow it.
    assert scales[:11] == [2.0**k for k in (10, 9, 8, 8, 8, 8, 9, 9, 9, 10, 10)]
    assert int(state.skipped) == sum(map(bool, flags))


def test_the_scaled_loss_differentiates_to_the_scale_times_the_grads():
    params, batch = pytree.init_params(), pytree.batch()
    loss_metrics = lambda p, b: (pytree.loss(p, b), {})  # noqa: E731
    scale = jnp.float32(2.0**7)
    (scaled, (loss, _)), g = jax.value_and_grad(scaler.scaled_loss(loss_metrics, scale), has_aux=True)(params, batch)
    want = jax.grad(pytree.loss)(params, batch)
    assert float(scaled) == float(loss) * 2.0**7 and float(loss) == float(pytree.loss(params, batch))
    for k in params:  # a power of 2: exact
        np.testing.assert_array_equal(scaler.unscale(g, scale)[k], want[k])
    (unscaled, _), _ = jax.value_and_grad(scaler.scaled_loss(loss_metrics, None), has_aux=True)(params, batch)
    assert float(unscaled) == float(loss)


def test_found_inf_and_skip_if():
    params = pytree.init_params()
    assert not bool(scaler.found_inf(params)) and not bool(scaler.found_inf({}))
    assert bool(scaler.found_inf(params | {"v": params["v"].at[0, 0].set(jnp.nan)}))
    new = jax.tree.map(lambda x: x + 1.0, params)
    kept = scaler.skip_if(jnp.asarray(True), params, new)
    taken = scaler.skip_if(jnp.asarray(False), params, new)
    for k in params:
        np.testing.assert_array_equal(kept[k], params[k])
        np.testing.assert_array_equal(taken[k], new[k])


def test_finish_reports_the_scale_the_grads_carried():
    cfg = DynamicLossScale(initial_loss_scale=2.0**5, loss_scale_window=1)
    params, state = pytree.init_params(), ZeroState(None, (), scaler.init(cfg))
    new = jax.tree.map(lambda x: 2 * x, params)
    update = Update(None, (), jnp.float32(3.0), jnp.asarray(False))
    out, new_state, m = finish(cfg, update, params, state, new, ZeroState(None, ()))
    assert float(m["loss_scale"]) == 2.0**5 and float(m["skipped"]) == 0.0 and float(m["grad_norm"]) == 3.0
    assert float(new_state.grad_scaler.loss_scale) == 2.0**6  # window 1: grown after this finite step
    np.testing.assert_array_equal(out["w"], new["w"])
