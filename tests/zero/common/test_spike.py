"""jzero.zero.common.spike: the grad-norm spike guard's history and decision, and `update.finish` with it: a
spike keeps the old params and state bitwise, the history moves on, a guard that never fires changes nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import pytree
from jzero.errors import ConfigError
from jzero.zero.common import loss_scale as scaler
from jzero.zero.common import spike
from jzero.zero.common.state import ZeroState
from jzero.zero.common.update import Update, finish
from jzero.zero.config import DynamicLossScale, SpikeGuard

INNER = optax.adam(1e-2)


def run(cfg: SpikeGuard, norms):
    """The guard over a sequence of grad norms: [(spiked, state after)]."""
    state, out = spike.init(cfg), []
    for n in norms:
        spiked = spike.is_spike(cfg, state, jnp.float32(n))
        state = spike.update(cfg, state, jnp.float32(n), spiked)
        out.append((bool(spiked), state))
    return out


def test_a_spike_is_a_norm_above_factor_times_the_mean_of_a_full_window():
    cfg = SpikeGuard(factor=2.0, window=3)
    got = run(cfg, [1.0, 100.0, 1.0, 2.0, 2.01, 1.9, 10.0])
    # 100 comes before the window is full and enters it: 2.0 and 2.01 are under 2 x mean(1, 100, 1) and
    # 2 x mean(100, 1, 2); 1.9 under 2 x mean(1, 2, 2.01) = 3.34; 10 over 2 x mean(2, 2.01, 1.9) = 3.94.
    assert [s for s, _ in got] == [False, False, False, False, False, False, True]
    last = got[-1][1]
    assert int(last.count) == 7 and int(last.skipped) == 1
    np.testing.assert_array_equal(last.norms, np.float32([10.0, 2.01, 1.9]))  # a ring: norm i in slot i % 3


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nonfinite_norm_is_neither_recorded_nor_a_spike(bad):
    """inf and nan steps are the nan check's or loss scaling's; the spike guard counts finite spikes only."""
    cfg = SpikeGuard(factor=2.0, window=2)
    (_, _), (_, full), (spiked, after) = run(cfg, [1.0, 1.0, bad])
    assert not spiked
    jax.tree.map(np.testing.assert_array_equal, after, full)


def test_the_guards_keys_are_checked_where_it_is_built():
    for factor in (1.0, 0.5, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=r"^grad_norm_spike_factor=.* must be a finite number > 1"):
            SpikeGuard(factor)
    with pytest.raises(ConfigError, match=r"^grad_norm_spike_window=0 must be an integer >= 1"):
        SpikeGuard(3.0, window=0)


def _step(main, g):
    state = ZeroState(None, INNER.init(main))
    updates, inner_state = INNER.update(g, state.inner_state, main)
    norm = optax.tree.norm(g)
    return state, Update(optax.apply_updates(main, updates), inner_state, norm, None)


def test_finish_keeps_the_old_params_and_state_bitwise_on_a_spike():
    main = pytree.init_params()
    g = jax.tree.map(lambda x: jnp.ones_like(x), main)
    state, update = _step(main, g)
    norm = float(update.norm)
    cfg = SpikeGuard(factor=2.0, window=2)
    for history, spiked in (([norm, norm], 0.0), ([norm / 4, norm / 4], 1.0)):
        guard = spike.init(cfg)._replace(norms=jnp.float32(history), count=jnp.int32(2))
        before = state._replace(spike=guard)
        new_state = ZeroState(None, update.inner_state)
        params, got, metrics = finish(None, update, main, before, update.main, new_state, spike_guard=cfg)
        assert float(metrics["spike_skipped"]) == spiked == float(metrics["skipped"])
        want_params, want_inner = (main, state.inner_state) if spiked else (update.main, update.inner_state)
        jax.tree.map(np.testing.assert_array_equal, (params, got.inner_state), (want_params, want_inner))
        assert int(got.spike.count) == 3 and int(got.spike.skipped) == int(spiked)
        assert float(got.spike.norms[0]) == np.float32(norm)  # slot 2 % 2 = 0: the newest norm, spike or not


def test_a_guard_that_never_fires_returns_what_the_unguarded_step_returns():
    main = pytree.init_params()
    state, update = _step(main, jax.tree.map(jnp.ones_like, main))
    new_state = ZeroState(None, update.inner_state)
    plain = finish(None, update, main, state, update.main, new_state)
    cfg = SpikeGuard(factor=1e30, window=1)
    guarded_state = state._replace(spike=spike.init(cfg)._replace(count=jnp.int32(5), norms=jnp.float32([1.0])))
    guarded = finish(None, update, main, guarded_state, update.main, new_state, spike_guard=cfg)
    jax.tree.map(np.testing.assert_array_equal, (guarded[0], guarded[1].inner_state), (plain[0], plain[1].inner_state))
    assert float(guarded[2]["spike_skipped"]) == 0.0 and float(plain[2]["grad_norm"]) == float(guarded[2]["grad_norm"])


def test_under_loss_scaling_a_spike_skips_and_the_scale_still_counts_a_finite_step():
    """fp16: a spike's grads are finite, so the loss scaler counts the step toward its growth window."""
    ls = DynamicLossScale(initial_loss_scale=2.0**5, loss_scale_window=1)
    cfg = SpikeGuard(factor=2.0, window=1)
    main = pytree.init_params()
    state, update = _step(main, jax.tree.map(jnp.ones_like, main))
    before = state._replace(
        grad_scaler=scaler.init(ls), spike=spike.init(cfg)._replace(norms=update.norm[None] / 4, count=jnp.int32(1))
    )
    update = update._replace(skip=jnp.asarray(False))
    params, got, metrics = finish(ls, update, main, before, update.main, ZeroState(None, update.inner_state),
                                  spike_guard=cfg)  # fmt: skip
    assert float(metrics["skipped"]) == 1.0 and float(metrics["spike_skipped"]) == 1.0
    assert float(got.grad_scaler.loss_scale) == 2.0**6 and int(got.grad_scaler.skipped) == 0
    jax.tree.map(np.testing.assert_array_equal, params, main)
