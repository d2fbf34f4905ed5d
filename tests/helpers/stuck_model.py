"""Toy models (`helpers.toy_model`) whose steps hang in a host call from their third step on, as a stuck
data loader or a hung file system would: `model.impl: helpers.stuck_model:StuckModel` hangs on process 1
of a multi-process run only (process 0 then waits in the step's collective: both stay alive and keep
heartbeating, but no step completes); `SlowStepModel` on every process.
"""

import threading
import time

import jax

from helpers.toy_model import ToyModel

HANG_AFTER_CALLS = 2 * 4  # two steps of 4 devices each


class StuckModel(ToyModel):
    calls = 0
    lock = threading.Lock()

    def loss_and_metrics(self, params, batch, tp_axis=None, ep_axis=None):
        jax.debug.callback(_maybe_hang, batch[0, 0])
        return super().loss_and_metrics(params, batch, tp_axis, ep_axis)


def _maybe_hang(_) -> None:
    if jax.process_index() != 1:
        return
    with StuckModel.lock:
        StuckModel.calls += 1
        hang = StuckModel.calls > HANG_AFTER_CALLS
    if hang:
        time.sleep(3600)


class SlowStepModel(ToyModel):
    """Every process's third step and later take an hour (a host call that does not return)."""

    calls = 0
    lock = threading.Lock()

    def loss_and_metrics(self, params, batch, tp_axis=None, ep_axis=None):
        jax.debug.callback(_slow, batch[0, 0])
        return super().loss_and_metrics(params, batch, tp_axis, ep_axis)


def _slow(_) -> None:
    with SlowStepModel.lock:
        SlowStepModel.calls += 1
        slow = SlowStepModel.calls > 2 * jax.local_device_count()
    if slow:
        time.sleep(3600)
