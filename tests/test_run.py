"""`jzero.run.Run`: the validation loss, with and without a stop asked between its batches."""

import dataclasses

import numpy as np

from helpers import init_state, tiny_config
from jzero.train.loop import setup


def test_evaluate_asked_to_stop_between_batches_ends_there_and_otherwise_gives_the_same_loss():
    run = setup(tiny_config("optim_grads", train={"eval_batches": 4}))
    run = dataclasses.replace(run, val_dataset=run.dataset)  # synthetic data has no validation split
    state = init_state(run)
    plain = run.evaluate(state.params)
    asked = []
    asking = run.evaluate(state.params, stop=lambda: asked.append(1) and False)
    assert len(asked) == 4
    np.testing.assert_array_equal(asking["loss"], plain["loss"])
    asked.clear()
    assert run.evaluate(state.params, stop=lambda: asked.append(1) or len(asked) == 3) is None
    assert len(asked) == 3


def test_evaluate_reads_the_next_batch_before_it_asks_to_stop(monkeypatch):
    """The next batch is on the devices before stop is asked (a collective on several processes, queued behind
    the batch in flight): the host's read of it overlaps the device's batch."""
    run = setup(tiny_config("optim_grads", train={"eval_batches": 3}))
    run = dataclasses.replace(run, val_dataset=run.dataset)
    state = init_state(run)
    events = []
    read = run.device_batch
    monkeypatch.setattr(type(run), "device_batch", lambda self, i, d=None: events.append(f"read {i}") or read(i, d))
    run.evaluate(state.params, stop=lambda: events.append("ask") and False)
    assert events == ["read 0", "ask", "read 1", "ask", "read 2", "ask"]
