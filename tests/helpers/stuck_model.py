"""`model.impl: helpers.stuck_model:StuckModel`: the toy model whose forward, on process 1 of a
multi-process run, calls back into Python and never returns from its third step on (a host call that
hangs, as a stuck data loader or a hung file system would). Process 0 then waits in the step's
collective: both processes stay alive and keep heartbeating, but no step completes.
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
