"""The grad-norm spike guard (`jzero.zero.config.SpikeGuard`), as pure functions on replicated arrays.

The state is the last `window` finite grad norms (a ring, fp32 `[window]`), how many norms it has
taken (int32) and how many steps it skipped (int32), all replicated, kept in `ZeroState.spike` and
saved with the checkpoint so a resumed run judges its next step against the same history.

  spike:  the window is full and the norm is finite and > factor x mean(window)
  then:   the step's update is dropped (`update.finish` selects the old params and state, bitwise)
  always: a finite norm enters the ring, a spike too (OLMo-core's and MaxText's rule: a lasting
          change of scale becomes the baseline instead of stalling the run)

An inf or nan norm is neither recorded nor a spike: such steps are `train.check_for_nan_in_loss_and_grad`'s
(`skip_nonfinite`) or fp16 loss scaling's, so `spike_skipped` counts finite spikes only.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jzero.zero.config import SpikeGuard


class SpikeState(NamedTuple):
    """norms: fp32 [window], the last finite grad norms (slot `count % window` is the next written);
    count: int32, norms recorded so far; skipped: int32, steps this guard skipped. All replicated."""

    norms: jax.Array
    count: jax.Array
    skipped: jax.Array


def shardings(mesh: Mesh) -> SpikeState:
    """Every leaf replicated."""
    return SpikeState(*[NamedSharding(mesh, P())] * len(SpikeState._fields))


def init(cfg: SpikeGuard) -> SpikeState:
    zero = jnp.zeros((), jnp.int32)
    return SpikeState(jnp.zeros((cfg.window,), jnp.float32), zero, zero)


def is_spike(cfg: SpikeGuard, state: SpikeState, norm: jax.Array) -> jax.Array:
    """Whether `norm` (the step's global grad norm, before clipping) is a spike (module docstring)."""
    norm = norm.astype(jnp.float32)
    full = jnp.logical_and(state.count >= cfg.window, jnp.isfinite(norm))
    mean = jnp.sum(state.norms) / cfg.window
    return jnp.logical_and(full, norm > cfg.factor * mean)


def update(cfg: SpikeGuard, state: SpikeState, norm: jax.Array, spiked: jax.Array) -> SpikeState:
    """The state after a step with grad norm `norm` (recorded where finite) that `spiked` or not."""
    norm = norm.astype(jnp.float32)
    finite = jnp.isfinite(norm)
    slot = state.count % cfg.window
    norms = jnp.where(finite, state.norms.at[slot].set(norm), state.norms)
    return SpikeState(norms, state.count + finite.astype(jnp.int32), state.skipped + spiked.astype(jnp.int32))
